"""A `renderers` renderer for any prefix-stable chat template (our models' ChatML included)
that never re-tokenizes what the model sampled.

verifiers' training client renders each turn's messages to token ids with a renderer, and
for a turn that follows a model turn it first asks the renderer to *bridge*: extend the
previous prompt and the sampled completion, verbatim, with the tokens of the new messages.
A renderer that cannot bridge makes the client re-render the whole conversation from
messages; when the model sampled something its parsed message does not reproduce (a stray
special token, odd spacing), the new prompt no longer extends the stored tokens and the
trace forks into branches. This renderer always bridges, so a conversation of our models is
one branch, and the tokens trained on are the tokens sampled.

It renders the way services/sampler/rollouts/multiturn/render.py does for Tandem's own multi-turn
environments: new messages as the difference they make to a fixed two-message conversation,
with the template's close of an assistant turn (ChatML: `<|im_end|>\\n`) put after the
sampled ids where the model did not sample it itself. Rendering uses the model's tokenizer
and chat template locally (verifiers loads the tokenizer from the sampler setting
`vf_tokenizer`, by default the served model's path).

Tool calls are read in the Hermes format (shared/toolcalls.py), as the CPU inference server
and `vllm serve --tool-call-parser hermes` read them.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

from renderers.base import ParsedResponse, ParsedToolCall, RenderedTokens, ToolCallParseStatus
from renderers.configs import BaseRendererConfig

from services.sampler.rollouts.multiturn.render import ASSISTANT, USER, closing_of, closing_overlap, delta_after
from shared.toolcalls import parse_tool_calls


class TandemRendererConfig(BaseRendererConfig):
    """No knobs: the template and tokenizer are the model's own."""


def _wire(message: dict[str, Any]) -> dict[str, Any]:
    """A message as chat templates read it: tool-call arguments as objects where they parse."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    fixed = []
    for call in calls:
        function = dict(call.get("function") or {})
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except ValueError:
                pass  # the template writes a non-JSON string as it is
        fixed.append({**call, "function": function})
    return {**message, "tool_calls": fixed}


# Token ids of rendered conversations kept (_chat): a group's n episodes render the same
# prompt, and a bridge renders the env's same few replies ("again") every turn.
CACHED_TOKENS = 262_144


class TandemRenderer:
    config_class = TandemRendererConfig

    def __init__(self, tokenizer: Any, config: TandemRendererConfig | None = None):
        self._tokenizer = tokenizer
        self.config = config or TandemRendererConfig()
        self._fixed: dict[str, tuple[list[int], list[int]]] = {}  # tools -> (base, closing)
        # (messages, tools, generation prompt) as JSON -> their ids; oldest first. Locked: verifiers
        # renders on worker threads, and reads stop ids (_fixed_parts) on the event loop.
        self._rendered_ids: OrderedDict[str, list[int]] = OrderedDict()
        self._rendered_tokens = 0
        self._cache_lock = threading.Lock()
        # A template that reads the clock (Llama 3's `strftime_now` date line) renders anew each time.
        self._cacheable = "strftime" not in str(getattr(tokenizer, "chat_template", None) or "")

    # --- what the protocol asks -----------------------------------------------------------

    @property
    def is_prefix_stable(self) -> bool:
        return True  # checked for each tool set: _fixed_parts raises TemplateError otherwise

    @property
    def supports_tools(self) -> bool:
        return True

    def get_stop_token_ids(self) -> list[int]:
        """The special token the template ends an assistant turn with (ChatML: `<|im_end|>`), and
        EOS. (A template whose turns end in plain text, as a byte tokenizer sees ChatML, ends on EOS.)"""
        _, closing = self._fixed_parts(None)
        special = set(getattr(self._tokenizer, "all_special_ids", None) or [])
        stops = [closing[0]] if closing and closing[0] in special else []
        eos = self._tokenizer.eos_token_id
        if eos is not None and eos not in stops:
            stops.append(eos)
        return stops

    def render(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = False, **_: Any) -> RenderedTokens:
        """`messages` rendered, each token attributed to the message that wrote it (the
        template is prefix-stable, so message i's tokens are what rendering it adds)."""
        ids: list[int] = []
        indices: list[int] = []
        for i in range(len(messages)):
            upto = self._chat(messages[: i + 1], tools, False)
            indices += [i] * (len(upto) - len(ids))
            ids = upto
        if add_generation_prompt:
            full = self._chat(messages, tools, True)
            indices += [-1] * (len(full) - len(ids))
            ids = full
        return self._rendered(ids, indices, messages)

    def render_ids(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                   add_generation_prompt: bool = False, **_: Any) -> list[int]:
        return self._chat(messages, tools, add_generation_prompt)

    def bridge_to_next_turn(self, previous_prompt_ids: list[int], previous_completion_ids: list[int],
                            new_messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                            **_: Any) -> RenderedTokens | None:
        """The previous prompt and sampled completion as they are, the rest of the assistant
        turn's close, the new messages and the next generation prompt."""
        if any(m.get("role") == "assistant" for m in new_messages):
            return None  # an assistant message nobody sampled: it must be rendered from text
        base, closing = self._fixed_parts(tools)
        prior = [*previous_prompt_ids, *previous_completion_ids]
        ids = prior + closing[closing_overlap(previous_completion_ids, closing):]
        indices = [-1] * len(ids)
        done = base
        for i in range(len(new_messages)):
            upto = self._chat([USER, ASSISTANT, *new_messages[: i + 1]], tools, False)
            added = delta_after(done, upto)
            ids += added
            indices += [i] * len(added)
            done = upto
        prompt = delta_after(done, self._chat([USER, ASSISTANT, *new_messages], tools, True))
        return self._rendered(ids + prompt, indices + [-1] * len(prompt), new_messages)

    def parse_response(self, token_ids: list[int], *, tools: list[dict[str, Any]] | None = None,
                       prompt_ids: list[int] | None = None, **_: Any) -> ParsedResponse:
        stops = set(self.get_stop_token_ids())
        end = next((i for i, t in enumerate(token_ids) if t in stops), len(token_ids))
        text = self._tokenizer.decode(token_ids[:end], skip_special_tokens=True)
        if not tools:
            return ParsedResponse(content=text)
        content, calls = parse_tool_calls(text)
        parsed = [
            ParsedToolCall(raw=json.dumps({"name": c.name, "arguments": c.arguments}), name=c.name or None,
                           arguments=c.arguments, id=c.id,
                           status=ToolCallParseStatus.OK if c.error is None else ToolCallParseStatus.INVALID_JSON)
            for c in calls
        ]
        return ParsedResponse(content=content, tool_calls=parsed)

    # --- rendering ------------------------------------------------------------------------

    def _chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
              generation_prompt: bool) -> list[int]:
        """`messages` rendered, from the cache when rendered before: rendering is a pure function
        of the messages, tools and flag (one tokenizer and template per renderer), and the chat
        template and tokenizer are most of a verifiers turn's rendering cost."""
        wired = [_wire(m) for m in messages]
        if not self._cacheable:
            return self._render_text(wired, tools, generation_prompt)
        try:
            key = json.dumps([wired, tools, generation_prompt], sort_keys=True)
        except (TypeError, ValueError):
            return self._render_text(wired, tools, generation_prompt)  # not JSON: rendered each time
        with self._cache_lock:
            ids = self._rendered_ids.get(key)
            if ids is not None:
                self._rendered_ids.move_to_end(key)
                return list(ids)
        ids = self._render_text(wired, tools, generation_prompt)
        with self._cache_lock:
            if key not in self._rendered_ids:
                self._rendered_ids[key] = ids
                self._rendered_tokens += len(ids)
                while self._rendered_tokens > CACHED_TOKENS and len(self._rendered_ids) > 1:
                    self._rendered_tokens -= len(self._rendered_ids.popitem(last=False)[1])
        return list(ids)

    def _render_text(self, wired: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                     generation_prompt: bool) -> list[int]:
        # As vLLM's and the CPU server's /tokenize render `messages`: text first, then ids
        # without an extra BOS (the template writes every special token itself).
        kwargs = {"tools": tools} if tools else {}
        text = self._tokenizer.apply_chat_template(wired, tokenize=False, add_generation_prompt=generation_prompt,
                                                   **kwargs)
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def _fixed_parts(self, tools: list[dict[str, Any]] | None) -> tuple[list[int], list[int]]:
        key = json.dumps(tools or [], sort_keys=True)
        fixed = self._fixed.get(key)
        if fixed is None:
            header = self._chat([USER], tools, True)
            base = self._chat([USER, ASSISTANT], tools, False)
            content = list(self._tokenizer.encode(ASSISTANT["content"], add_special_tokens=False))
            fixed = self._fixed[key] = (base, closing_of(header, base, content))
        return fixed

    @staticmethod
    def _rendered(ids: list[int], indices: list[int], messages: list[dict[str, Any]]) -> RenderedTokens:
        return RenderedTokens(
            token_ids=ids, message_indices=indices, message_roles=[m.get("role") or "" for m in messages],
            message_tool_names=[m.get("name") if m.get("role") == "tool" else None for m in messages])

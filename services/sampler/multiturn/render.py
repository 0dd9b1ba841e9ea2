"""Environment messages as token ids, rendered by the served model's own chat template.

The sampler never re-renders a conversation. Each environment turn is rendered as the
*difference* its messages make to a fixed two-message conversation, and those ids are
appended to the ids the model sampled:

    base  = render([u, a])                         (u, a: fixed stand-in messages)
    full  = render([u, a, *new], generation prompt)
    delta = full[len(base):]                        (checked: full starts with base)

`delta` is what the template writes for the new messages plus the next assistant header,
whatever the template (ChatML, Llama 3, Qwen's tool blocks); the sampled ids before it stay
as sampled. The template also closes the assistant turn (ChatML: `<|im_end|>\\n`); the ids it
writes after an assistant message's content (`closing`) are found the same way, once, and
what the model did not itself sample of them (a turn cut off by max_tokens did not sample
its end-of-turn token) is put in front of `delta`.

Rendering happens on the inference server (`POST /tokenize` with `messages`, which vLLM and
the CPU server both serve), so the template and tokenizer are exactly those of the server
that generates, and the sampler needs neither the model's files nor transformers. The fixed
parts are asked for once per tool set; each environment turn then costs one request, and
an opening prompt one per distinct conversation start (cached).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

# The fixed conversation every delta is taken against. Short and plain, so that no template
# treats it specially; "." tokenizes alone in every tokenizer we know.
_USER = {"role": "user", "content": "."}
_ASSISTANT = {"role": "assistant", "content": "."}
PROMPTS_CACHED = 4096

Tokenize = Callable[[dict[str, Any]], Awaitable[list[int]]]


class TemplateError(ValueError):
    """The chat template does not render conversations as prefixes of their continuations."""


class ChatRenderer:
    def __init__(self, tokenize: Tokenize):
        # tokenize(body) -> ids: POST /tokenize with `body` (plus the model name) on a server.
        self._tokenize = tokenize
        self._fixed: dict[bytes, tuple[list[int], list[int]]] = {}  # tools key -> (base, closing)
        self._prompts: OrderedDict[bytes, list[int]] = OrderedDict()

    async def _chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    generation_prompt: bool) -> list[int]:
        body: dict[str, Any] = {"messages": messages, "add_generation_prompt": generation_prompt,
                                "add_special_tokens": False}
        if tools:
            body["tools"] = tools
        return await self._tokenize(body)

    async def _fixed_parts(self, tools: list[dict[str, Any]] | None) -> tuple[bytes, list[int], list[int]]:
        key = orjson.dumps(tools or [])
        parts = self._fixed.get(key)
        if parts is None:
            header = await self._chat([_USER], tools, True)
            base = await self._chat([_USER, _ASSISTANT], tools, False)
            content = await self._tokenize({"prompt": _ASSISTANT["content"], "add_special_tokens": False})
            start = len(header)
            if base[:start] != header or base[start:start + len(content)] != content:
                raise TemplateError(
                    "the chat template does not render an assistant message after its generation prompt "
                    f"(rendered {base!r} after {header!r}); multi-turn rollouts need a template whose "
                    "conversations are prefixes of their continuations")
            parts = self._fixed[key] = (base, base[start + len(content):])
        return key, *parts

    async def prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        """The opening prompt: `messages` and the assistant's generation prompt."""
        key = orjson.dumps([messages, tools or []])
        ids = self._prompts.get(key)
        if ids is None:
            ids = await self._chat(messages, tools, True)
            self._prompts[key] = ids
            if len(self._prompts) > PROMPTS_CACHED:
                self._prompts.popitem(last=False)
        else:
            self._prompts.move_to_end(key)
        return ids

    async def after_turn(self, sampled: list[int], messages: list[dict[str, Any]],
                         tools: list[dict[str, Any]] | None) -> list[int]:
        """The ids that follow a model turn that sampled `sampled`: the rest of the
        assistant turn's closing, `messages`, and the next generation prompt."""
        _, base, closing = await self._fixed_parts(tools)
        full = await self._chat([_USER, _ASSISTANT, *messages], tools, True)
        if full[:len(base)] != base:
            raise TemplateError(
                "the chat template renders a conversation differently once messages follow it "
                f"({full[:len(base)]!r} against {base!r}); multi-turn rollouts need a template whose "
                "conversations are prefixes of their continuations")
        return closing[closing_overlap(sampled, closing):] + full[len(base):]


def closing_overlap(sampled: list[int], closing: list[int]) -> int:
    """How many of `closing`'s first ids the model already sampled at the end of its turn
    (ChatML: 1 when it ended with `<|im_end|>`, 0 when max_tokens cut it off)."""
    for k in range(min(len(closing), len(sampled)), 0, -1):
        if sampled[-k:] == closing[:k]:
            return k
    return 0

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
an opening prompt one per distinct conversation start. Both are cached (rendering is a
pure function of the messages), so an environment that says the same thing again costs no
request.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

# The fixed conversation every delta is taken against. Short and plain, so that no template
# treats it specially; "." tokenizes alone in every tokenizer we know.
USER = {"role": "user", "content": "."}
ASSISTANT = {"role": "assistant", "content": "."}
CACHED = 4096  # opening prompts, and environment turns, each (a few MB at most)

Tokenize = Callable[[dict[str, Any]], Awaitable[list[int]]]


class TemplateError(ValueError):
    """The chat template does not render conversations as prefixes of their continuations."""


class _Memo:
    """An LRU of results by key, where callers asking for a key being computed share that one
    computation (the trajectories of a group ask for the same renders at the same moment). A
    failed computation is forgotten, so the next caller tries again."""

    def __init__(self, size: int):
        self.size = size
        self._items: OrderedDict[bytes, asyncio.Future[Any]] = OrderedDict()

    async def get(self, key: bytes, compute: Callable[[], Awaitable[Any]]) -> Any:
        future = self._items.get(key)
        if future is None:
            future = self._items[key] = asyncio.ensure_future(compute())
            # Its callers may all be gone (cancelled) by the time it fails: the failure is
            # theirs to report, not asyncio's "exception was never retrieved".
            future.add_done_callback(lambda done: done.cancelled() or done.exception())
            if len(self._items) > self.size:
                self._items.popitem(last=False)
        else:
            self._items.move_to_end(key)
        try:
            # shield: one caller cancelled (its trajectory ended) must not cancel the others'.
            return await asyncio.shield(future)
        except Exception:
            if self._items.get(key) is future:
                del self._items[key]
            raise

    def __len__(self) -> int:
        return len(self._items)


class ChatRenderer:
    def __init__(self, tokenize: Tokenize):
        # tokenize(body) -> ids: POST /tokenize with `body` (plus the model name) on a server.
        self._tokenize = tokenize
        self._fixed = _Memo(64)  # tools -> (base, closing)
        self._prompts = _Memo(CACHED)  # (messages, tools) -> opening prompt
        # Rendered environment turns by (messages, tools): environments repeat themselves
        # ("higher", "lower", a number, a fixed instruction), and a hit saves a request.
        self.turns = _Memo(CACHED)

    async def _chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    generation_prompt: bool) -> list[int]:
        body: dict[str, Any] = {"messages": messages, "add_generation_prompt": generation_prompt,
                                "add_special_tokens": False}
        if tools:
            body["tools"] = tools
        return await self._tokenize(body)

    async def _fixed_parts(self, tools: list[dict[str, Any]] | None) -> tuple[bytes, list[int], list[int]]:
        key = orjson.dumps(tools or [])

        async def compute() -> tuple[list[int], list[int]]:
            header = await self._chat([USER], tools, True)
            base = await self._chat([USER, ASSISTANT], tools, False)
            content = await self._tokenize({"prompt": ASSISTANT["content"], "add_special_tokens": False})
            return base, closing_of(header, base, content)

        base, closing = await self._fixed.get(key, compute)
        return key, base, closing

    async def prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        """The opening prompt: `messages` and the assistant's generation prompt."""
        key = orjson.dumps([messages, tools or []])
        ids = await self._prompts.get(key, lambda: self._chat(messages, tools, True))
        return list(ids)  # each sample owns its prompt list

    async def after_turn(self, sampled: list[int], messages: list[dict[str, Any]],
                         tools: list[dict[str, Any]] | None) -> list[int]:
        """The ids that follow a model turn that sampled `sampled`: the rest of the
        assistant turn's closing, `messages`, and the next generation prompt."""
        tools_key, base, closing = await self._fixed_parts(tools)

        async def compute() -> list[int]:
            return delta_after(base, await self._chat([USER, ASSISTANT, *messages], tools, True))

        delta = await self.turns.get(orjson.dumps(messages) + tools_key, compute)
        return closing[closing_overlap(sampled, closing):] + delta


def closing_of(header: list[int], base: list[int], content: list[int]) -> list[int]:
    """The ids a template writes after an assistant message's content (ChatML: `<|im_end|>\\n`),
    from the renders of [u] with a generation prompt (`header`), of [u, a] (`base`) and of a's
    content alone."""
    start = len(header)
    if base[:start] != header or base[start:start + len(content)] != content:
        raise TemplateError(
            "the chat template does not render an assistant message after its generation prompt "
            f"(rendered {base!r} after {header!r}); multi-turn rollouts need a template whose "
            "conversations are prefixes of their continuations")
    return base[start + len(content):]


def delta_after(base: list[int], full: list[int]) -> list[int]:
    """What `full` (the render of [u, a, *new] with a generation prompt) adds to `base` (of [u, a])."""
    if full[:len(base)] != base:
        raise TemplateError(
            "the chat template renders a conversation differently once messages follow it "
            f"({full[:len(base)]!r} against {base!r}); multi-turn rollouts need a template whose "
            "conversations are prefixes of their continuations")
    return full[len(base):]


def closing_overlap(sampled: list[int], closing: list[int]) -> int:
    """How many of `closing`'s first ids the model already sampled at the end of its turn
    (ChatML: 1 when it ended with `<|im_end|>`, 0 when max_tokens cut it off)."""
    for k in range(min(len(closing), len(sampled)), 0, -1):
        if sampled[-k:] == closing[:k]:
            return k
    return 0

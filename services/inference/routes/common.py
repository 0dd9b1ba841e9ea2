"""What the generation routes (completions.py, generate.py) share: cancelling a request whose
client went away, token pieces for logprobs, the decoder that streamed text deltas use, and the
answer as JSON."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request
import orjson
from fastapi.responses import Response

DISCONNECT_POLL_S = 1.0


async def unless_disconnected(request: Request, coro) -> Any:
    """Run `coro`; cancel it (aborting its sequences) if the client goes away meanwhile."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                return Response(status_code=499)
    finally:
        if not task.done():
            task.cancel()


def token_pieces(tokenizer, cache: dict[int, str]):
    """token id -> its text on its own (special tokens included), cached in `cache` (the
    engine's `pieces`, which outlives requests)."""

    def piece(token_id: int) -> str:
        if token_id not in cache:
            cache[token_id] = tokenizer.decode([token_id], skip_special_tokens=False)
        return cache[token_id]

    return piece


def text_decoder(tokenizer, skip_special_tokens: bool):
    # As the engine decodes the final text, so the streamed deltas add up to it.
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def json_answer(body: dict[str, Any]) -> Response:
    """A generation answer, already JSON-native (protocol.py builds plain dicts, lists, strings
    and finite floats), rendered without `jsonable_encoder`'s walk of every value (for a batch
    of short answers that walk was a third of the server's CPU) and by orjson, not the json
    module (a sixth of what remained on the HTTP thread)."""
    return Response(orjson.dumps(body), media_type="application/json")

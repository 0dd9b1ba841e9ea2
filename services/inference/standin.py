"""A model-free stand-in for `vllm serve`, for tests and benchmarks of the sampler.

It speaks the subset of vLLM's HTTP API that Tandem uses (completions with token ids,
logprobs, prompt logprobs and weight-version spans; /inference/v1/generate, vLLM's
token-in/token-out endpoint, answered by the same generator; pause/resume; reload_weights; version
labels; /tokenize, with chat messages rendered by the tiny model's chat template) and
generates pseudo-random characters with a configurable latency per token, so that
generation time can be set exactly. Tokens are bytes: token id = byte value, id 0 = EOS.
It is not a language model: use the CPU inference server for anything that must learn.

Scripted answers (POST /_standin/configure): `reply` makes every completion that text;
`replies` [text0, text1, ...] makes the answer to a prompt holding k assistant headers
(`<|im_start|>assistant`, the tiny model's ChatML) replies[k - 1], clipped to the list, so a
multi-turn rollout gets text0 for its first turn, text1 for its second, and so on. `replies`
wins over `reply`. A scripted answer ends with "stop" when its text is shorter than
max_tokens, else it is cut there with "length" (no room left for the end-of-sequence token).

Run: `python -m services.inference.standin --port 8000 --token-latency 0.001`.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import math
import os
import random
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response

from services.inference import standin_generate
from services.inference.standin_chat import ChatTemplateError, render_chat_text
from services.inference.vllm_ext import RELABELS, RELOAD_METHOD
from shared.token_guard import TOKEN_ENV, TokenGuard

ALPHABET = "0123456789abcdefghij "
EOS = 0
# What the tiny model's chat template writes before every assistant turn, generation prompt included.
ASSISTANT_HEADER = b"<|im_start|>assistant"


def standin_prompt_logprobs(weights: str, token_ids: list[int]) -> list[float | None]:
    """The stand-in's log p(token_ids[i] | token_ids[:i]) under `weights` (a checkpoint path, or
    "base"): a fixed pseudo-random number in [-3, -1] per prefix, null for the first token."""
    out: list[float | None] = [None]
    for i in range(1, len(token_ids)):
        digest = hashlib.blake2b(f"{weights}|{token_ids[:i + 1]}".encode(), digest_size=4).digest()
        out.append(-1.0 - int.from_bytes(digest, "little") % 2001 / 1000)
    return out


@dataclass
class StandInState:
    token_latency: float = 0.0
    version: str = "0"
    paused: bool = False
    resumed: asyncio.Event = field(default_factory=asyncio.Event)
    reloads: list[str] = field(default_factory=list)
    requests: int = 0
    fail_next: int = 0  # answer this many completion requests with 503 (fault drills)
    reload_delay: float = 0.0  # seconds each reload_weights takes (shutdown-during-sync drills)
    resume_delay: float = 0.0  # seconds each /resume takes before it resumes
    reply: str | None = None  # when set, every completion is this text (escaping drills)
    replies: list[str] | None = None  # when set, the answer to turn k is replies[k] (module docstring)
    # The "weights": the last checkpoint path loaded. Prompt logprobs are a function of them
    # (standin_prompt_logprobs), so a probe computed for a checkpoint matches only after it loaded.
    weights: str = "base"
    stale_reloads: bool = False  # test hook: reloads answer 200 but keep the old weights (vLLM CPU's bug)
    # Test hook: set while generation runs; cleared, requests freeze between tokens like a hung
    # engine. Unlike a pause, the sampler's own weight syncs (pause ... resume) do not undo it.
    running: asyncio.Event = field(default_factory=asyncio.Event)
    max_model_len: int = 4096
    relabels_on_reload: bool = False  # answer as Tandem's CPU server does: one reload relabels
    reloading: int = 0  # reloads in progress (drills catch a sync in its reload)
    # X-Session-ID header -> completion requests that carried it (session affinity tests).
    sessions: dict[str, int] = field(default_factory=dict)
    # Test hook: the request that is the `hold_request`-th of its session waits, before its
    # first token, until the hook is cleared (`released`); `held` counts those waiting. A test
    # then knows every conversation stands between two turns (weight syncs between turns).
    hold_request: int | None = None
    released: asyncio.Event = field(default_factory=asyncio.Event)
    held: int = 0
    tokenize_requests: int = 0
    model_id: str = "standin"

    def __post_init__(self) -> None:
        self.resumed.set()
        self.running.set()
        self.released.set()

    def script(self, prompt_ids: list[int]) -> list[int] | None:
        """The token ids of the scripted answer to this prompt, or None when unscripted."""
        if self.replies is not None:
            # Ids above 255 (token-id prompts) are no byte of a header: 0 keeps them from matching.
            turns = bytes(t if 0 <= t < 256 else 0 for t in prompt_ids).count(ASSISTANT_HEADER)
            return list(self.replies[min(max(turns - 1, 0), len(self.replies) - 1)].encode())
        if self.reply is not None:
            return list(self.reply.encode())
        return None


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "BadRequestError", "code": status}}, status_code=status)


async def _json_object(request: Request) -> dict[str, Any] | JSONResponse:
    """The request's JSON object body, or the 400 to answer."""
    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError as exc:
        return _error(400, f"the body is not JSON: {exc}")
    return body if isinstance(body, dict) else _error(400, "the body must be a JSON object")


def st(request: Request) -> StandInState:
    return request.state.standin


def _prompts(prompt: Any) -> list[list[int]]:
    """The prompt(s) of a /v1/completions body as token ids, as vLLM reads them: a string or a
    list of ids is one prompt; a list of strings or of id lists is one prompt each (the
    stand-in's "tokenizer" is the bytes of the text)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return [[int(t) for t in p] if isinstance(p, list) else list(p.encode()) for p in prompt]
    if isinstance(prompt, list):
        return [[int(t) for t in prompt]]
    return [list(str(prompt).encode())]


async def _complete(s: StandInState, body: dict[str, Any], request: Request) -> dict[str, Any] | JSONResponse:
    """A /v1/completions body's answer, or the error response: `n` choices per prompt, in
    prompt order (index = prompt * n + i), as vLLM answers a list prompt."""
    s.requests += 1
    if s.fail_next > 0:
        s.fail_next -= 1
        return _error(503, "stand-in told to fail")
    prompts = _prompts(body.get("prompt", ""))
    n = int(body.get("n", 1))
    max_tokens = body.get("max_tokens", 16)
    if not isinstance(max_tokens, int) or max_tokens < 1:
        return _error(400, f"max_tokens must be at least 1, got {max_tokens}")
    for prompt_ids in prompts:
        if len(prompt_ids) + max_tokens > s.max_model_len:  # as vLLM refuses it
            return _error(400, f"This model's maximum context length is {s.max_model_len} tokens. However, you "
                               f"requested {len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, "
                               f"{max_tokens} for the completion).")
    session = request.headers.get("x-session-id")
    if session is not None:
        s.sessions[session] = s.sessions.get(session, 0) + 1
        if s.sessions[session] == s.hold_request:
            s.held += 1
            try:
                await s.released.wait()
            finally:
                s.held -= 1
    seed = body.get("seed")
    rng = random.Random(seed if seed is not None else time.perf_counter_ns())
    # Every choice's stream drawn from the request's first, in order (a one-prompt request draws
    # as it always did); the prompts then generate together.
    rngs = [[random.Random(rng.random()) for _ in range(n)] for _ in prompts]
    per_prompt = await asyncio.gather(*(_prompt_choices(s, body, ids, k * n, max_tokens, rngs[k])
                                        for k, ids in enumerate(prompts)))
    choices = [c for group in per_prompt for c in group]
    generated = sum(len(c["logprobs"]["token_logprobs"]) for c in choices)
    prompt_tokens = sum(map(len, prompts))
    return {
        "id": f"cmpl-{s.requests}", "object": "text_completion", "created": int(time.time()),
        "model": s.model_id, "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": generated,
                  "total_tokens": prompt_tokens + generated},
    }


async def _prompt_choices(s: StandInState, body: dict[str, Any], prompt_ids: list[int], first: int,
                          max_tokens: int, rngs: list[random.Random]) -> list[dict[str, Any]]:
    """One prompt's choices (one per generator in `rngs`), indexed from `first`."""
    temperature = float(body.get("temperature", 1.0))
    scripted = s.script(prompt_ids)
    if s.token_latency == 0 and s.resumed.is_set() and s.running.is_set():
        # Instantaneous inference (throughput benchmarks): no per-token awaits at all.
        choices = [_choice(first + i, prompt_ids, *(_sample_now(max_tokens, temperature, r)
                                                    if scripted is None else _script_now(scripted, max_tokens)),
                           [], s.version, body) for i, r in enumerate(rngs)]
    else:
        choices = list(await asyncio.gather(*(
            _generate(s, first + i, prompt_ids, max_tokens, temperature, r, body, scripted)
            for i, r in enumerate(rngs)
        )))
    if body.get("prompt_logprobs") is not None:
        rows = standin_prompt_logprobs(s.weights, prompt_ids)
        for choice in choices:
            choice["prompt_logprobs"] = [None] + [
                {str(t): {"logprob": lp, "rank": 1, "decoded_token": chr(t % 256)}}
                for t, lp in zip(prompt_ids[1:], rows[1:])
            ]
    return choices

def _sample_now(max_tokens: int, temperature: float, rng: random.Random) -> tuple[list[int], str]:
    """The token loop of `_generate` without pauses or latency: same distribution."""
    token_ids: list[int] = []
    for _ in range(max_tokens):
        if temperature > 0 and rng.random() < 0.1:
            return token_ids, "stop"
        token_ids.append(ord(rng.choice(ALPHABET)) if temperature > 0 else ord(ALPHABET[len(token_ids) % 10]))
    return token_ids, "length"

def _script_now(scripted: list[int], max_tokens: int) -> tuple[list[int], str]:
    """`_generate`'s scripted answer without pauses or latency: same tokens, same end."""
    return scripted[:max_tokens], "stop" if len(scripted) < max_tokens else "length"

def _choice(index: int, prompt_ids: list[int], token_ids: list[int], finish: str, labels: list[str],
            version: str, body: dict[str, Any]) -> dict[str, Any]:
    """One choice in vLLM's shape; `labels` per token, or all `version` when empty."""
    labels = labels or [version] * len(token_ids)
    choice: dict[str, Any] = {
        "index": index,
        "text": bytes(token_ids).decode(errors="replace"),
        "finish_reason": finish,
        "logprobs": {"token_logprobs": [-math.log(len(ALPHABET))] * len(token_ids),
                     "tokens": [chr(t) for t in token_ids], "top_logprobs": None, "text_offset": []},
    }
    if body.get("return_token_ids"):
        choice["token_ids"] = token_ids
        choice["prompt_token_ids"] = prompt_ids
    if body.get("return_weight_versions"):
        spans: list[dict[str, Any]] = []
        for i, label in enumerate(labels):
            if spans and spans[-1]["version"] == label:
                spans[-1]["end"] = i + 1
            else:
                spans.append({"version": label, "start": i, "end": i + 1})
        choice["weight_versions"] = spans
    return choice

async def _generate(s: StandInState, index: int, prompt_ids: list[int], max_tokens: int,
                    temperature: float, rng: random.Random, body: dict[str, Any],
                    scripted: list[int] | None) -> dict[str, Any]:
    token_ids: list[int] = []
    labels: list[str] = []
    finish = "length"
    for _ in range(max_tokens):
        await s.resumed.wait()  # a paused (keep) server freezes requests between tokens
        await s.running.wait()
        if s.token_latency:
            await asyncio.sleep(s.token_latency)
        if scripted is not None:
            if len(token_ids) == len(scripted):
                finish = "stop"
                break
            token_ids.append(scripted[len(token_ids)])
            labels.append(s.version)
            continue
        if temperature > 0 and rng.random() < 0.1:
            finish = "stop"
            break
        token_ids.append(ord(rng.choice(ALPHABET)) if temperature > 0 else ord(ALPHABET[len(token_ids) % 10]))
        labels.append(s.version)
    return _choice(index, prompt_ids, token_ids, finish, labels, s.version, body)


def _openai_routes(app: FastAPI) -> None:
    """What the stand-in answers as vLLM does: health, models, completions, generate, tokenize."""
    @app.get("/health")
    async def health() -> dict[str, str]:
        return {}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        s = st(request)
        return {"object": "list", "data": [{"id": s.model_id, "object": "model", "max_model_len": s.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _json_object(request)
        if isinstance(body, JSONResponse):
            return body  # not a JSON object: 400, as vLLM answers
        result = await _complete(st(request), body, request)
        return result if isinstance(result, JSONResponse) else Response(orjson.dumps(result), media_type="application/json")

    @app.post("/inference/v1/generate")
    async def generate(request: Request):
        """vLLM's token-in/token-out endpoint, answered through the completion path
        (standin_generate.py)."""
        body = await _json_object(request)
        if isinstance(body, JSONResponse):
            return body
        completion_body = standin_generate.completion_body(body, st(request).max_model_len)
        if isinstance(completion_body, str):
            return _error(400, completion_body)
        result = await _complete(st(request), completion_body, request)
        if isinstance(result, JSONResponse):
            return result
        return Response(orjson.dumps(standin_generate.generate_response(result, body)), media_type="application/json")

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's POST /tokenize: {"prompt": text} or {"messages": [...], "add_generation_prompt"
        (default true), "continue_final_message", "tools", "chat_template_kwargs"} -> {"count",
        "max_model_len", "tokens", "token_strs"}; the tokens are the text's UTF-8 bytes, messages
        rendered by the tiny model's chat template. `add_special_tokens` changes nothing here:
        bytes have no special tokens."""
        s, body = st(request), await _json_object(request)
        if isinstance(body, JSONResponse):
            return body
        s.tokenize_requests += 1
        if body.get("messages") is not None:
            try:
                text = render_chat_text(body["messages"], body.get("tools"), bool(body.get("add_generation_prompt", True)),
                                        bool(body.get("continue_final_message", False)), body.get("chat_template_kwargs"))
            except ChatTemplateError as exc:
                return _error(400, str(exc))
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
        else:
            return _error(400, "give either prompt (a string) or messages")
        ids = list(text.encode())
        strs = [bytes([t]).decode(errors="replace") for t in ids] if body.get("return_token_strs") else None
        return {"count": len(ids), "max_model_len": s.max_model_len, "tokens": ids, "token_strs": strs}


def _control_routes(app: FastAPI) -> None:
    """vLLM's dev-mode control routes a weight sync uses: pause, resume, reload, label, cache reset."""
    @app.post("/pause")
    async def pause(request: Request, mode: str = "keep") -> dict[str, Any]:
        s = st(request)
        s.paused = True
        s.resumed.clear()
        return {"status": "paused", "mode": mode}

    @app.post("/resume")
    async def resume(request: Request) -> dict[str, Any]:
        s = st(request)
        if s.resume_delay:
            await asyncio.sleep(s.resume_delay)
        s.paused = False
        s.resumed.set()
        return {"status": "resumed"}

    @app.get("/is_paused")
    async def is_paused(request: Request) -> dict[str, bool]:
        return {"is_paused": st(request).paused}

    @app.get("/server_info")
    async def server_info(request: Request) -> dict[str, Any]:
        # As Tandem's CPU server answers it in --relabels-on-reload mode; otherwise no such route.
        if not st(request).relabels_on_reload:
            raise HTTPException(404, "Not Found")
        return {"tandem": {"server": "standin", **RELABELS}}

    @app.post("/collective_rpc")
    async def collective_rpc(request: Request) -> dict[str, Any]:
        body, s = await request.json(), st(request)
        method, kwargs = body.get("method"), body.get("kwargs") or {}
        if method != "reload_weights" and not (s.relabels_on_reload and method == RELOAD_METHOD):
            raise HTTPException(400, f"unsupported method {method!r}")
        path = kwargs.get("weights_path")
        if not path or path.endswith("does-not-exist"):
            return _error(400, f"cannot load weights from {path!r}")
        s.reloading += 1
        try:
            if s.reload_delay:
                await asyncio.sleep(s.reload_delay)
        finally:
            s.reloading -= 1
        s.reloads.append(path)
        if not s.stale_reloads:
            s.weights = path
        if method == "reload_weights":
            return {"results": [None]}
        if kwargs.get("weight_version") is not None:  # the label moves with the weights
            s.version = str(kwargs["weight_version"])
        return {"results": [{"weights_path": path, "weight_version": kwargs.get("weight_version")}]}

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> dict[str, Any]:
        body = await request.json()
        st(request).version = str(body["new_version"])
        return {"weight_version": st(request).version}

    @app.get("/weight_info")
    async def weight_info(request: Request) -> dict[str, Any]:
        return {"weight_version": st(request).version}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, Any]:
        return {}


def _hook_routes(app: FastAPI) -> None:
    """The tests' hooks: failures, configuration (delays, replies, holds) and counters."""
    @app.post("/_standin/fail")
    async def fail(request: Request, count: int = 1) -> dict[str, int]:
        st(request).fail_next = count
        return {"fail_next": count}

    @app.post("/_standin/configure")
    async def configure(request: Request) -> dict[str, Any]:
        """Test hooks: {"reload_delay": s, "resume_delay": s, "reply": text or null, "replies":
        [text, ...] or null, "stale_reloads": bool, "hung": bool, "max_model_len": int, "hold_request": N or
        null (StandInState.hold_request; null releases the held requests)}; omitted keys stay."""
        s, body = st(request), await _json_object(request)
        if isinstance(body, JSONResponse):
            return body
        replies = body.get("replies")
        if replies is not None and not (isinstance(replies, list) and replies
                                        and all(isinstance(r, str) for r in replies)):
            return _error(400, "replies must be a non-empty list of strings, or null to clear them")
        for key in ("reload_delay", "resume_delay"):
            if key in body:
                setattr(s, key, float(body[key]))
        if "reply" in body:
            s.reply = body["reply"]
        if "replies" in body:
            s.replies = replies
        if "stale_reloads" in body:
            s.stale_reloads = bool(body["stale_reloads"])
        if "max_model_len" in body:
            s.max_model_len = int(body["max_model_len"])
        if "hold_request" in body:
            s.hold_request = None if body["hold_request"] is None else int(body["hold_request"])
            if s.hold_request is None:
                s.released.set()
            else:
                s.released.clear()
        if body.get("hung") is True:
            s.running.clear()
        elif "hung" in body:
            s.running.set()
        return {"reload_delay": s.reload_delay, "resume_delay": s.resume_delay, "reply": s.reply,
                "replies": s.replies, "stale_reloads": s.stale_reloads, "hung": not s.running.is_set(),
                "hold_request": s.hold_request}

    @app.get("/_standin/stats")
    async def stats(request: Request) -> dict[str, Any]:
        s = st(request)
        return {"requests": s.requests, "reloads": s.reloads, "version": s.version, "paused": s.paused,
                "sessions": s.sessions, "held": s.held, "tokenize_requests": s.tokenize_requests,
                "weights": s.weights, "reloading": s.reloading}


def create_standin_app(token_latency: float = 0.0, version: str = "0", api_token: str | None = None,
                       relabels_on_reload: bool = False) -> FastAPI:
    """`api_token`: guard every route but /health with it, as the real servers do (the
    `/_standin/*` hooks too). `relabels_on_reload`: GET /server_info and tandem_reload_weights
    as Tandem's CPU server has them (its sync is one request, no pause)."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield {"standin": StandInState(token_latency=token_latency, version=version,
                                       relabels_on_reload=relabels_on_reload)}

    app = FastAPI(title="Tandem inference stand-in", lifespan=lifespan)
    _openai_routes(app)
    _control_routes(app)
    _hook_routes(app)
    app.add_middleware(TokenGuard, token=api_token, shape="openai", service="the stand-in")
    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--token-latency", type=float, default=0.0)
    parser.add_argument("--version", default="0")
    parser.add_argument("--api-token", default=os.environ.get(TOKEN_ENV) or None,
                        help=f"guard every route but /health (default: {TOKEN_ENV})")
    parser.add_argument("--relabels-on-reload", action="store_true", help="sync in one request, as the CPU server")
    args = parser.parse_args(argv)
    app = create_standin_app(args.token_latency, args.version, args.api_token, args.relabels_on_reload)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()

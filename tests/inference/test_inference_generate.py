"""POST /inference/v1/generate on the CPU server, over real HTTP: the checks real vLLM passes
too (tests/support/generate_checks.py), what the `renderers` client (verifiers' TrainClient)
needs from the answer, that it is the /v1/completions engine path (same tokens and logprobs,
same pause/keep semantics across a weight sync), streaming, and clear 400s."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from services.inference.testing import ServerHandle
from tests.support import generate_checks as checks
from tests.support.generate_checks import PROMPT

pytestmark = pytest.mark.timeout(120)


def _post(server: ServerHandle, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(server.url + "/inference/v1/generate", json=body, timeout=60, **kwargs)


def test_sampled_choices(server: ServerHandle) -> None:
    checks.check_sampled_choices(server.url, token_strings=True)


def test_greedy_is_deterministic(server: ServerHandle) -> None:
    checks.check_greedy_is_deterministic(server.url)


def test_stop_token_ids(server: ServerHandle) -> None:
    checks.check_stop_token_ids(server.url)


def test_max_tokens_is_length(server: ServerHandle) -> None:
    checks.check_max_tokens_is_length(server.url)


def test_bad_requests_are_400(server: ServerHandle) -> None:
    checks.check_bad_requests_are_400(server.url)


def test_stream_adds_up(server: ServerHandle) -> None:
    checks.check_stream_adds_up(server.url)


def test_same_tokens_and_logprobs_as_a_completion(server: ServerHandle) -> None:
    """One engine path: a token-id completion with the same seed gives the same answer."""
    params = {"n": 2, "temperature": 0.8, "top_p": 0.9, "seed": 21, "max_tokens": 10, "ignore_eos": True}
    generated = checks.generate(server.url, {**params, "logprobs": 0})["choices"]
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "prompt": PROMPT, **params, "logprobs": 0, "return_token_ids": True, "return_weight_versions": True})
    completed = r.json()["choices"]
    for g, c in zip(generated, completed, strict=True):
        assert g["token_ids"] == c["token_ids"]
        assert [e["logprob"] for e in g["logprobs"]["content"]] == c["logprobs"]["token_logprobs"]
        assert g["weight_versions"] == c["weight_versions"]


async def test_the_renderers_client_reads_the_answer(server: ServerHandle) -> None:
    """renderers 0.1.12's own generate() (what verifiers' TrainClient calls) against the
    server: it refuses an answer whose entries lack `token: "token_id:<id>"` or carry -9999."""
    from renderers.base import create_renderer
    from renderers.client import generate

    renderer = create_renderer(server.engine.tokenizer)
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60) as client:
        out = await generate(client=client, renderer=renderer, messages=[{"role": "user", "content": "hi"}],
                             model="tiny", sampling_params={"max_tokens": 6, "temperature": 1.0, "seed": 4})
    assert len(out["completion_ids"]) == len(out["completion_logprobs"]) > 0
    assert all(-30 < lp <= 0 for lp in out["completion_logprobs"])
    # The same request by hand: renderers passed our logprobs through unchanged.
    direct = checks.generate(server.url, {"max_tokens": 6, "temperature": 1.0, "seed": 4, "logprobs": 1,
                                          "stop_token_ids": renderer.get_stop_token_ids(),
                                          "skip_special_tokens": False}, token_ids=out["prompt_ids"])
    choice = direct["choices"][0]
    assert choice["token_ids"] == out["completion_ids"]
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == out["completion_logprobs"]


def test_top_logprobs_and_a_masked_vocabulary(server: ServerHandle) -> None:
    """top_logprobs: the sampled token first, then the top k in rank order. With top_k 1 every
    other token is masked (-inf, sent as vLLM's -9999.0 among the candidates), but the sampled
    token has its real logprob: 0.0, the whole mass."""
    body = checks.generate(server.url, {"temperature": 1.0, "seed": 2, "max_tokens": 6, "ignore_eos": True,
                                        "logprobs": 3})
    for e in body["choices"][0]["logprobs"]["content"]:
        others = e["top_logprobs"][1:]
        ranks = [o["rank"] for o in others]
        assert ranks == sorted(ranks) and set(ranks) <= {1, 2, 3} and len(others) in (2, 3)
        assert [o["logprob"] for o in others] == sorted((o["logprob"] for o in others), reverse=True)
        if e["rank"] is not None:  # known when the sampled token is in the top 3
            assert e["rank"] not in ranks and e["rank"] <= 3
    masked = checks.generate(server.url, {"temperature": 1.0, "top_k": 1, "seed": 2, "max_tokens": 6,
                                          "ignore_eos": True, "logprobs": 3})
    for e in masked["choices"][0]["logprobs"]["content"]:
        assert e["logprob"] == 0.0 and e["rank"] == 1
        assert [o["logprob"] for o in e["top_logprobs"][1:]] == [checks.SENTINEL] * 2


def test_text_mode(server: ServerHandle) -> None:
    tok = server.engine.tokenizer
    body = checks.generate(server.url, {"temperature": 1.0, "seed": 8, "max_tokens": 8, "ignore_eos": True,
                                        "logprobs": 1}, output_mode="text")
    choice = body["choices"][0]
    assert body["output_mode"] == "text"
    assert choice["text"] == tok.decode(choice["token_ids"], skip_special_tokens=True)
    content = choice["logprobs"]["content"]
    assert [e["token"] for e in content] == [tok.decode([t]) for t in choice["token_ids"]]
    assert all(e["bytes"] == list(e["token"].encode()) and e["top_logprobs"][0]["token"] == e["token"]
               for e in content)
    tokens = checks.generate(server.url, {"temperature": 1.0, "seed": 8, "max_tokens": 8, "ignore_eos": True,
                                          "logprobs": 1})["choices"][0]
    assert [e["logprob"] for e in content] == [e["logprob"] for e in tokens["logprobs"]["content"]]


def test_defaults_headers_and_ignored_fields(server: ServerHandle) -> None:
    # Unknown fields and sampling params are ignored (as on /v1/completions); X-Session-ID is
    # accepted and ignored; priority and cache_salt are accepted (no scheduler or prefix cache to use them).
    body = {"token_ids": PROMPT, "sampling_params": {"temperature": 0, "max_tokens": 3, "presence_penalty": 0.5,
                                                     "no_such_param": 1},
            "request_id": "mine", "priority": 0, "cache_salt": "salt", "no_such_field": True}
    r = _post(server, body, headers={"X-Session-ID": "trace-1"})
    assert r.status_code == 200, r.text
    assert r.json()["request_id"] == "generate-tokens-mine"
    r = _post(server, body, headers={"X-Request-Id": "from-header"})
    assert r.json()["request_id"] == "generate-tokens-from-header"
    assert r.json()["prompt_token_ids"] is None and r.json()["choices"][0]["logprobs"] is None
    # prompt_logprobs: vLLM's top-level shape, null first.
    rows = checks.generate(server.url, {"temperature": 0, "max_tokens": 1, "prompt_logprobs": 0})["prompt_logprobs"]
    assert rows[0] is None and len(rows) == len(PROMPT)
    assert all(list(rows[i]) == [str(PROMPT[i])] for i in range(1, len(PROMPT)))


@pytest.mark.parametrize("body, param, fragment", [
    ({"token_ids": [5] * 2048, "sampling_params": {}}, "token_ids", "leaves no room to generate: send at most 2047"),
    ({"token_ids": [5] * 100, "sampling_params": {"max_tokens": 1949}}, "sampling_params.max_tokens",
     "send max_tokens <= 1948"),
    ({"token_ids": [5, 101], "sampling_params": {}}, "token_ids", "token_ids[1] = 101 is out of vocabulary"),
    ({"token_ids": [5], "sampling_params": {}, "cache_salt": "a/b"}, "cache_salt", "cache_salt"),
    ({"token_ids": [5], "sampling_params": {}, "content_parts": [{"type": "image_url"}]}, "features",
     "multimodal"),
    ({"token_ids": [5], "sampling_params": {"detokenize": False}, "output_mode": "text"}, "output_mode",
     "detokenize"),
    ({"token_ids": [5], "sampling_params": {}, "stream_options": {"include_usage": True}}, "stream_options",
     "stream=True"),
    ({"token_ids": [5], "sampling_params": {"logprobs": 21}}, None, "sampling_params.logprobs"),
    ({"token_ids": [5], "sampling_params": {}, "output_mode": "derender"}, None, "output_mode"),
])
def test_what_to_fix_is_said(server: ServerHandle, body, param, fragment) -> None:
    r = _post(server, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert fragment in error["message"] and error["param"] == param and error["type"] == "BadRequestError"


def test_unknown_model_is_404(server: ServerHandle) -> None:
    r = _post(server, {"token_ids": [5], "sampling_params": {}, "model": "gpt-9"})
    assert r.status_code == 404 and "does not exist" in r.json()["error"]["message"]


def _events(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    frames = r.text.split("\n\n")
    assert frames[-2:] == ["data: [DONE]", ""], frames[-3:]
    assert all(f.startswith("data: ") for f in frames[:-1])
    return [json.loads(f[len("data: "):]) for f in frames[:-2]]


@pytest.mark.parametrize("mode", ["tokens", "text"])
def test_stream_adds_up_to_the_answer(server: ServerHandle, mode: str) -> None:
    params = {"n": 2, "temperature": 1.0, "seed": 6, "max_tokens": 7, "ignore_eos": True, "logprobs": 1}
    whole = checks.generate(server.url, params, output_mode=mode)
    events = _events(_post(server, {"token_ids": PROMPT, "sampling_params": params, "output_mode": mode,
                                    "stream": True, "return_token_ids": True,
                                    "stream_options": {"include_usage": True}}))
    assert events[0]["prompt_token_ids"] == PROMPT and all("prompt_token_ids" not in e for e in events[1:])
    *chunks, usage = events
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 14,
                                                         "total_tokens": len(PROMPT) + 14}
    for choice in whole["choices"]:
        mine = [e["choices"][0] for e in chunks if e["choices"][0]["index"] == choice["index"]]
        assert all(len(c["token_ids"]) == 1 for c in mine)
        assert [t for c in mine for t in c["token_ids"]] == choice["token_ids"]
        assert [e for c in mine for e in c["logprobs"]["content"]] == choice["logprobs"]["content"]
        assert [c["finish_reason"] for c in mine] == [None] * 6 + ["length"]
        assert [c["weight_versions"] for c in mine] == [None] * 6 + [choice["weight_versions"]]
        if mode == "text":
            assert "".join(c["text"] for c in mine) == choice["text"]


async def test_keep_pause_across_a_sync_gives_two_spans(fresh_server: ServerHandle) -> None:
    """The sampler's weight sync with a generate request in flight: it freezes, then finishes on
    the new label, as a completion does (test_inference_weights)."""
    url, engine = fresh_server.url, fresh_server.engine
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 200, "ignore_eos": True, "seed": 1,
                                                         "logprobs": 0}}
        flight = asyncio.create_task(c.post("/inference/v1/generate", json=body))
        while engine.stats["generated_tokens"] < 20:
            await asyncio.sleep(0.005)
        await c.post("/pause", params={"mode": "keep"})
        frozen = engine.stats["generated_tokens"]
        assert (await c.post("/update_weight_version", json={"new_version": "1"})).status_code == 200
        await asyncio.sleep(0.2)
        assert engine.stats["generated_tokens"] == frozen and not flight.done()
        await c.post("/resume")
        choice = (await flight).json()["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 200
    spans = choice["weight_versions"]
    assert [s["version"] for s in spans] == ["0", "1"]
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == 200
    assert 20 <= spans[0]["end"] < 200
    assert len(choice["logprobs"]["content"]) == 200


async def test_abort_pause_ends_it_with_partial_output(fresh_server: ServerHandle) -> None:
    async with httpx.AsyncClient(base_url=fresh_server.url, timeout=60) as c:
        body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 1500, "ignore_eos": True, "logprobs": 0}}
        flight = asyncio.create_task(c.post("/inference/v1/generate", json=body))
        while fresh_server.engine.stats["generated_tokens"] < 10:
            await asyncio.sleep(0.005)
        await c.post("/pause", params={"mode": "abort"})
        choice = (await flight).json()["choices"][0]
        await c.post("/resume")
    n = len(choice["token_ids"])
    assert choice["finish_reason"] == "abort" and 0 < n < 1500
    assert len(choice["logprobs"]["content"]) == n
    assert choice["weight_versions"] == [{"version": "0", "start": 0, "end": n}]

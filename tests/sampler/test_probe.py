"""Every sync verified: a server that loaded a checkpoint must compute the trainer's logprobs.

The stand-in's prompt logprobs are a function of the checkpoint it last loaded
(`standin_prompt_logprobs`), and its `stale_reloads` hook makes reloads answer 200 while it
keeps the old weights (what vLLM's CPU build did). The same checks against real vLLM are in
tests/vllm/.
"""

from __future__ import annotations

import time

import httpx
import pytest

from services.inference.standin import standin_prompt_logprobs
from tests.support.servers import start_standin

IDS = [104, 105, 32, 116, 104, 101, 114, 101, 33, 10]


def probe_for(weights: str, **extra) -> dict:
    return {"token_ids": IDS, "logprobs": standin_prompt_logprobs(weights, IDS), **extra}


def _publish(url: str, version: int, path: str, probe: dict | None, **extra) -> httpx.Response:
    body = {"version": version, "checkpoint_path": path, **extra}
    if probe is not None:
        body["probe"] = probe
    return httpx.post(f"{url}/weights_version", json=body, timeout=60)


def _metric(url: str, name: str, server: str) -> float | None:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") and f'server="{server}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def _wait_ok(url: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(s["state"] == "ok" for s in httpx.get(f"{url}/inference_servers").json()["servers"]):
        assert time.monotonic() < deadline, "the inference servers never went into rotation"
        time.sleep(0.05)


def test_a_sync_is_verified_with_the_trainers_probe(make_sampler, standin):
    sampler = make_sampler()
    _wait_ok(sampler.url)
    answer = _publish(sampler.url, 1, "/ckpt/step-0", probe_for("/ckpt/step-0"))
    assert answer.status_code == 200, answer.text
    server = answer.json()["servers"][0]
    assert server["state"] == "ok" and server["version"] == 1
    assert server["probe"]["ok"] is True and server["probe"]["max_abs_diff"] == 0.0, server["probe"]
    assert server["probe"]["positions"] == len(IDS) - 1 and server["probe"]["max_tolerance"] == 1e-3
    assert _metric(sampler.url, "tandem_sampler_probe_max_abs_diff", standin.url) == 0.0
    # Clients that send no probe still work.
    assert _publish(sampler.url, 2, "/ckpt/step-1", None).status_code == 200


def test_a_server_that_keeps_its_old_weights_is_caught_and_nothing_is_published(make_sampler, standin):
    sampler = make_sampler()
    _wait_ok(sampler.url)
    httpx.post(f"{standin.url}/_standin/configure", json={"stale_reloads": True})
    answer = _publish(sampler.url, 1, "/ckpt/step-0", probe_for("/ckpt/step-0"))
    assert answer.status_code == 422, answer.text
    detail = answer.json()["detail"]
    assert "none computes the trainer's logprobs" in detail and standin.url in detail, detail
    assert "differ from the trainer's by up to" in detail and "not published" in detail, detail
    weights = httpx.get(f"{sampler.url}/weights_version").json()
    assert weights["version"] == 0
    server = weights["servers"][0]
    assert server["state"] == "mismatch" and server["version"] is None, server
    assert "does not serve the trainer's weights" in server["reason"], server
    assert server["probe"]["ok"] is False and server["probe"]["max_abs_diff"] > 0.1, server["probe"]
    assert _metric(sampler.url, "tandem_sampler_probe_failures_total", standin.url) == 1
    status = httpx.get(f"{sampler.url}/status").json()
    assert status["inference_servers"][0]["state"] == "mismatch"

    # Fixed (a server that really loads): the next verified sync puts it back into rotation.
    httpx.post(f"{standin.url}/_standin/configure", json={"stale_reloads": False})
    again = _publish(sampler.url, 1, "/ckpt/step-0", probe_for("/ckpt/step-0"))
    assert again.status_code == 200, again.text
    assert again.json()["servers"][0]["state"] == "ok" and again.json()["version"] == 1


def test_a_deliberately_wrong_probe_is_caught(make_sampler, standin):
    sampler = make_sampler()
    _wait_ok(sampler.url)
    answer = _publish(sampler.url, 1, "/ckpt/step-0", probe_for("/ckpt/some-other-checkpoint"))
    assert answer.status_code == 422 and "none computes the trainer's logprobs" in answer.json()["detail"]
    # A probe within the tolerance the trainer states passes.
    shifted = probe_for("/ckpt/step-0")
    shifted["logprobs"] = [None] + [x - 0.05 for x in shifted["logprobs"][1:]]
    assert _publish(sampler.url, 1, "/ckpt/step-0", shifted).status_code == 422
    tolerant = {**shifted, "max_tolerance": 0.06, "mean_tolerance": 0.06}
    ok = _publish(sampler.url, 1, "/ckpt/step-0", tolerant)
    assert ok.status_code == 200 and abs(ok.json()["servers"][0]["probe"]["max_abs_diff"] - 0.05) < 1e-9


def test_only_the_server_that_disagrees_leaves_the_rotation(make_sampler, standin):
    other = start_standin()
    try:
        sampler = make_sampler(inference_urls=[standin.url, other.url], max_staleness=0)
        _wait_ok(sampler.url)
        httpx.post(f"{other.url}/_standin/configure", json={"stale_reloads": True})
        answer = _publish(sampler.url, 1, "/ckpt/step-0", probe_for("/ckpt/step-0"))
        assert answer.status_code == 200, answer.text
        servers = {s["url"]: s for s in answer.json()["servers"]}
        assert servers[standin.url]["state"] == "ok" and servers[standin.url]["probe"]["ok"]
        assert servers[other.url]["state"] == "mismatch" and not servers[other.url]["probe"]["ok"]
        before = httpx.get(f"{other.url}/_standin/stats").json()["requests"]
        batch = httpx.get(f"{sampler.url}/batch", params={"step": 1, "timeout": 30}, timeout=60)
        assert batch.status_code == 200 and {s["policy_version"] for s in batch.json()["samples"]} == {1}
        assert httpx.get(f"{other.url}/_standin/stats").json()["requests"] == before, "a mismatched server got work"
    finally:
        other.stop()


@pytest.mark.parametrize("probe", [
    {"token_ids": IDS, "logprobs": [None, -1.0]},                      # one logprob per token
    {"token_ids": [1], "logprobs": [None]},                             # at least two tokens
    {"token_ids": IDS, "logprobs": [None] + [0.5] * (len(IDS) - 1)},    # logprobs are <= 0
    {"token_ids": IDS, "logprobs": [None] + [None] * (len(IDS) - 1)},   # only the first may be null
    {"token_ids": [-1] + IDS[1:], "logprobs": [None] + [-1.0] * (len(IDS) - 1)},
    {"token_ids": IDS, "logprobs": [None] + [-1.0] * (len(IDS) - 1), "dtype": "int8"},
])
def test_malformed_probes_are_422_and_say_what_to_fix(make_sampler, probe):
    sampler = make_sampler()
    answer = _publish(sampler.url, 1, "/ckpt/step-0", probe)
    assert answer.status_code == 422, answer.text
    assert httpx.get(f"{sampler.url}/weights_version").json()["version"] == 0


def test_the_trainers_metrics_reach_status_and_the_dashboard(make_sampler):
    sampler = make_sampler()
    for version, mismatch in ((1, 0.002), (2, 0.001)):
        answer = httpx.post(f"{sampler.url}/weights_version", json={
            "version": version, "metrics": {"behaviour_mismatch": mismatch, "loss": -0.1}}, timeout=30)
        assert answer.status_code == 200, answer.text
    status = httpx.get(f"{sampler.url}/status").json()
    assert status["trainer"]["version"] == 2 and status["trainer"]["behaviour_mismatch"] == 0.001
    data = httpx.get(f"{sampler.url}/dashboard/data").json()
    assert [m["behaviour_mismatch"] for m in data["trainer"]] == [0.002, 0.001]
    # Python's JSON (the trainer's, if it used json.dumps) writes NaN; it must not get in.
    bad = httpx.post(f"{sampler.url}/weights_version", content='{"version": 3, "metrics": {"loss": NaN}}',
                     timeout=30, headers={"content-type": "application/json"})
    assert bad.status_code == 422 and "finite" in bad.text, bad.text

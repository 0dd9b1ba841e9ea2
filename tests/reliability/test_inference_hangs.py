"""Inference servers that stop answering without dying (issue 42): a process frozen with
SIGSTOP (its sockets accept connections, nothing answers) and a server paused by someone else.

The sampler judges liveness apart from the work a server does (services/sampler/fleet/liveness.py):
a frozen server leaves rotation within `server_check_timeout` whatever it was doing, the
requests in flight to it are re-run on another server (a conversation moves with its next
turn), a publication answers with the servers
that answered, and the frozen one is re-synced when it is thawed. A server paused by someone
else is resumed, and the event is logged and counted.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import httpx
import pytest

from tests.reliability.support import Cleanup, freeze, start_standin_process, wait_for
from tests.support.driver import hold_second_turns

CHECK_TIMEOUT = 2.0  # server_check_timeout of these samplers
MARGIN = 3.0  # what a loaded machine may add to it


def _servers(url: str) -> dict[str, dict]:
    return {s["url"]: s for s in httpx.get(f"{url}/weights_version", timeout=10).json()["servers"]}


def _sampler(make_sampler, urls: list[str], **settings):
    values = dict(server_check_interval=0.5, server_check_timeout=CHECK_TIMEOUT, request_timeout=120,
                  max_staleness=0, prompts_per_step=4, num_generations=2, max_tokens=6)
    return make_sampler(inference_urls=urls, **{**values, **settings})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("relabels", [False, True], ids=["pause-reload-resume", "one-request-swap"])
def test_a_frozen_server_is_cut_off_and_the_publication_answers(tmp_path: Path, make_sampler,
                                                                cleanup: Cleanup, relabels: bool) -> None:
    """Either sync: vLLM's pause -> reload -> label -> resume, or the CPU server's one-request swap."""
    a = start_standin_process(tmp_path, cleanup, token_latency=0.002, relabels_on_reload=relabels)
    b = start_standin_process(tmp_path, cleanup, token_latency=0.002, relabels_on_reload=relabels)
    sampler = _sampler(make_sampler, [a.url, b.url])
    with httpx.Client(base_url=sampler.url, timeout=60) as http:
        for step in (0, 1):
            assert http.get("/batch", params={"step": step, "timeout": 30}).status_code == 200
            published = http.post("/weights_version", json={"version": step + 1, "checkpoint_path": f"/ckpt/{step + 1}"})
            assert published.status_code == 200, published.text

        thaw = freeze(a.pid, cleanup)
        started = time.monotonic()
        # Without the liveness check this waits for the sync's pause step (sync_step_timeout, 30 s).
        published = http.post("/weights_version", json={"version": 3, "checkpoint_path": "/ckpt/3"}, timeout=25)
        took = time.monotonic() - started
        assert published.status_code == 200, published.text
        assert took < CHECK_TIMEOUT + MARGIN, f"POST /weights_version took {took:.1f}s"
        servers = {s["url"]: s for s in published.json()["servers"]}
        assert servers[b.url]["state"] == "ok" and servers[b.url]["version"] == 3, servers[b.url]
        frozen = servers[a.url]
        assert frozen["state"] == "down" and not frozen["in_rotation"], frozen
        assert frozen["reason"].startswith(f"no answer to GET /is_paused for {CHECK_TIMEOUT:g} s while syncing version 3"), frozen

        # Batches keep coming, from the server that answers.
        started = time.monotonic()
        assert http.get("/batch", params={"step": 3, "timeout": 30}).status_code == 200
        assert time.monotonic() - started < MARGIN
        status = http.get("/status").json()
        assert any(s["url"] == a.url and s["state"] == "down" for s in status["inference_servers"]), status

        thaw()
        thawed = wait_for(lambda: (s := _servers(sampler.url)[a.url])["state"] == "ok" and s["version"] == 3 and s,
                          20, "the thawed server to be re-synced to version 3")
        assert any("re-synced to version 3" in e["event"] for e in thawed["events"]), thawed["events"]
        stats = httpx.get(f"{a.url}/_standin/stats").json()
        assert stats["reloads"][-1] == "/ckpt/3" and stats["version"] == "3" and not stats["paused"], stats
        # The pause its abandoned sync left was the re-sync's to undo: nobody else paused it.
        assert thawed["foreign_pauses"] == 0 and _servers(sampler.url)[b.url]["foreign_pauses"] == 0
        published = http.post("/weights_version", json={"version": 4, "checkpoint_path": "/ckpt/4"})
        assert published.status_code == 200, published.text
        assert [(s["state"], s["version"]) for s in published.json()["servers"]] == [("ok", 4), ("ok", 4)]
        assert http.get("/batch", params={"step": 4, "timeout": 30}).status_code == 200


@pytest.mark.timeout(120)
def test_requests_in_flight_to_a_frozen_server_are_rerun_elsewhere(tmp_path: Path, make_sampler,
                                                                  cleanup: Cleanup) -> None:
    # 40 tokens at 50 ms: a request takes 2 s, long enough to freeze its server mid-request.
    a = start_standin_process(tmp_path, cleanup, token_latency=0.05)
    b = start_standin_process(tmp_path, cleanup, token_latency=0.05)
    sampler = _sampler(make_sampler, [a.url, b.url], max_tokens=40)
    wait_for(lambda: _servers(sampler.url)[a.url]["outstanding"] > 0, 20, "a request in flight to server A")
    freeze(a.pid, cleanup)
    started = time.monotonic()
    batch = httpx.get(f"{sampler.url}/batch", params={"step": 0, "timeout": 60}, timeout=70)
    took = time.monotonic() - started
    assert batch.status_code == 200 and len(batch.json()["samples"]) == 8
    # Cut off after server_check_timeout, re-run on B (2 s each), not waited out (request_timeout 120 s).
    assert took < CHECK_TIMEOUT + 2 + MARGIN, f"the batch took {took:.1f}s"
    frozen = _servers(sampler.url)[a.url]
    assert frozen["state"] == "down", frozen
    assert frozen["reason"].startswith(f"no answer to GET /is_paused for {CHECK_TIMEOUT:g} s while generating ("), frozen
    assert httpx.get(f"{b.url}/_standin/stats").json()["requests"] >= 3  # its own two and A's


@pytest.mark.timeout(120)
def test_conversations_on_a_frozen_server_move_to_another(tmp_path: Path, make_sampler, cleanup: Cleanup) -> None:
    a = start_standin_process(tmp_path, cleanup, token_latency=0.002)
    b = start_standin_process(tmp_path, cleanup, token_latency=0.002)
    hold_second_turns(a.url)  # conversations that began on A wait there in their second turn
    sampler = _sampler(make_sampler, [a.url, b.url], env="tests.support.envs:EchoDialogue",
                       env_args='{"max_turns": 3}', max_tokens=4)
    wait_for(lambda: httpx.get(f"{a.url}/_standin/stats").json()["held"] > 0, 20, "a conversation held on A")
    began = set(httpx.get(f"{a.url}/_standin/stats").json()["sessions"])
    freeze(a.pid, cleanup)
    started = time.monotonic()
    batch = httpx.get(f"{sampler.url}/batch", params={"step": 0, "timeout": 60}, timeout=70)
    took = time.monotonic() - started
    assert batch.status_code == 200 and len(batch.json()["samples"]) == 8
    assert took < CHECK_TIMEOUT + MARGIN, f"the batch took {took:.1f}s"
    moved = began & set(httpx.get(f"{b.url}/_standin/stats").json()["sessions"])
    assert moved, "no conversation that began on the frozen server finished on the other"
    assert _servers(sampler.url)[a.url]["state"] == "down"


@pytest.mark.timeout(60)
def test_a_server_paused_by_someone_else_is_resumed_logged_and_counted(make_sampler, standin, caplog) -> None:
    sampler = make_sampler(server_check_interval=0.3, max_staleness=0, paused_grace=1.0)
    with httpx.Client(base_url=sampler.url, timeout=30) as http, caplog.at_level(logging.WARNING):
        assert http.get("/batch", params={"step": 0, "timeout": 20}).status_code == 200
        assert http.post("/weights_version", json={"version": 1, "checkpoint_path": "/ckpt/1"}).status_code == 200
        assert _servers(sampler.url)[standin.url]["foreign_pauses"] == 0  # its own sync paused it: not counted
        httpx.post(f"{standin.url}/pause")  # an operator, or another tool, pauses it
        paused_at = time.monotonic()
        server = wait_for(lambda: (s := _servers(sampler.url)[standin.url])["foreign_pauses"] >= 1
                          and s["state"] == "ok" and s, 10, "the sampler to resume the paused server")
        assert time.monotonic() - paused_at >= 1.0  # not before paused_grace
        assert not httpx.get(f"{standin.url}/_standin/stats").json()["paused"]
        assert any("resumed: it was paused" in e["event"] for e in server["events"]), server["events"]
        assert any("paused (GET /is_paused) for 1 s or more with no weight sync" in r.getMessage()
                   for r in caplog.records)
        assert "tandem_sampler_server_foreign_pauses_total" in http.get("/metrics").text
        assert http.get("/batch", params={"step": 1, "timeout": 20}).status_code == 200

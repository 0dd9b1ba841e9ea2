"""Inference servers join and leave a running run (POST/DELETE /inference_servers).

A joining server is brought to the published version before it gets any work, and the
answer says which version it serves; one that cannot be brought there is refused with the
reason. A leaving server gets no new work, its requests in flight finish (or, if it dies,
are regenerated on the others), and nothing is lost. Membership lives in Redis: a second
sampler replica, and a restarted sampler, see the same servers.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.reliability.support import (
    Cleanup,
    Trainer,
    check_batches,
    kill_embedded_redis,
    start_redis_at,
    start_standin_process,
    stop_process,
    wait_for,
)
from tests.support.servers import free_port, start_sampler_process, start_standin

TOKEN = "membership-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _sampler(run_dir: Path, cleanup: Cleanup, urls: list[str], **settings):
    cleanup.add(lambda: kill_embedded_redis(run_dir))
    sampler = start_sampler_process(run_dir, inference_urls=urls, env="tests.support.envs:CountEnv",
                                    prompts_per_step=4, num_generations=2, max_tokens=6, api_token=TOKEN,
                                    server_check_interval=0.5, **settings)
    cleanup.add(lambda: stop_process(sampler))
    return sampler


def _members(url: str) -> dict[str, dict]:
    return {s["url"]: s for s in httpx.get(f"{url}/inference_servers", timeout=10, headers=AUTH).json()["servers"]}


def _requests(standin) -> int:
    return httpx.get(f"{standin.url}/_standin/stats", timeout=10).json()["requests"]


@pytest.mark.slow
def test_a_server_joins_at_the_published_version_and_every_replica_sees_it(tmp_path: Path, cleanup: Cleanup) -> None:
    first = start_standin(token_latency=0.002)
    cleanup.add(first.stop)
    _, redis_url = start_redis_at(tmp_path / "redis", cleanup=cleanup)
    sampler = _sampler(tmp_path / "a", cleanup, [first.url], redis_url=redis_url)
    url = sampler.url
    Trainer(url, 3, train_seconds=0.1, checkpoints=True, api_token=TOKEN).run_here()  # version 3 from /ckpt/step-3

    second = start_standin(token_latency=0.002)
    cleanup.add(second.stop)
    assert httpx.post(f"{url}/inference_servers", json={"url": second.url}).status_code == 401
    joined = httpx.post(f"{url}/inference_servers", json={"url": second.url}, headers=AUTH, timeout=60)
    assert joined.status_code == 200, joined.text
    body = joined.json()
    assert body["url"] == second.url and body["version"] == 3 and body["state"] == "ok", body
    # It was given the published checkpoint before it got any work.
    stats = httpx.get(f"{second.url}/_standin/stats").json()
    assert stats["reloads"] == ["/ckpt/step-3"] and stats["version"] == "3", stats
    # Adding it again changes nothing.
    again = httpx.post(f"{url}/inference_servers", json={"url": second.url + "/"}, headers=AUTH, timeout=60)
    assert again.status_code == 200 and again.json()["version"] == 3
    assert httpx.get(f"{second.url}/_standin/stats").json()["reloads"] == ["/ckpt/step-3"]

    trainer = Trainer(url, 3, train_seconds=0.1, checkpoints=True, first_step=3, api_token=TOKEN).run_here()
    check_batches(trainer)
    assert _requests(second) > 0, "the new server never got work"
    members = _members(url)
    assert set(members) == {first.url, second.url}
    assert any(e["event"] == "joining -> ok at version 3" for e in members[second.url]["events"]), members

    # Membership is in Redis: a second replica on the same Redis and namespace uses both servers
    # (its `inference_urls` only names the first), and so does this sampler after a restart.
    replica = _sampler(tmp_path / "b", cleanup, [first.url], redis_url=redis_url)
    wait_for(lambda: {u for u, s in _members(replica.url).items() if s["state"] == "ok"} == {first.url, second.url},
             20, "the replica to use both servers")
    assert _members(replica.url)[second.url]["version"] == 6
    stop_process(sampler)
    restarted = _sampler(tmp_path / "a", cleanup, [first.url], redis_url=redis_url)
    wait_for(lambda: set(_members(restarted.url)) == {first.url, second.url}, 20,
             "the restarted sampler to know both servers")


@pytest.mark.slow
def test_servers_that_cannot_serve_the_published_version_are_refused_with_the_reason(
        tmp_path: Path, cleanup: Cleanup) -> None:
    first = start_standin()
    cleanup.add(first.stop)
    sampler = _sampler(tmp_path / "s", cleanup, [first.url])
    url = sampler.url
    Trainer(url, 2, train_seconds=0.0, api_token=TOKEN).run_here()  # version 2, pushed by the trainer: no checkpoint_path

    fresh = start_standin()  # serves its base weights, labelled "0"
    cleanup.add(fresh.stop)
    refused = httpx.post(f"{url}/inference_servers", json={"url": fresh.url}, headers=AUTH, timeout=60)
    assert refused.status_code == 409, refused.text
    detail = refused.json()["detail"]
    assert "serves version 0" in detail and "without a checkpoint_path" in detail and "new_version" in detail, detail
    dead = httpx.post(f"{url}/inference_servers", json={"url": "http://127.0.0.1:9"}, headers=AUTH, timeout=60)
    assert dead.status_code == 422 and "does not answer" in dead.json()["detail"], dead.text
    malformed = httpx.post(f"{url}/inference_servers", json={"url": "ftp://x"}, headers=AUTH, timeout=60)
    assert malformed.status_code == 422
    assert set(_members(url)) == {first.url}, "a refused server must not become a member"

    # Once it serves version 2 (the operator loaded the weights and labelled it), it may join.
    httpx.post(f"{fresh.url}/update_weight_version", json={"new_version": "2"})
    joined = httpx.post(f"{url}/inference_servers", json={"url": fresh.url}, headers=AUTH, timeout=60)
    assert joined.status_code == 200 and joined.json()["version"] == 2, joined.text

    unknown = httpx.request("DELETE", f"{url}/inference_servers", json={"url": "http://127.0.0.1:9"},
                            headers=AUTH, timeout=60)
    assert unknown.status_code == 404 and first.url in unknown.json()["detail"], unknown.text


@pytest.mark.slow
def test_servers_leave_under_load_and_nothing_is_lost(tmp_path: Path, cleanup: Cleanup) -> None:
    # Slow tokens: requests are in flight on every server most of the time.
    steady, leaving, dying = (start_standin(token_latency=0.02), start_standin(token_latency=0.02),
                              start_standin_process(tmp_path, cleanup, token_latency=0.02))
    for server in (steady, leaving):
        cleanup.add(server.stop)
    sampler = _sampler(tmp_path / "s", cleanup, [steady.url, leaving.url, dying.url], max_staleness=1)
    url = sampler.url
    trainer = Trainer(url, 10, train_seconds=0.2, checkpoints=True, api_token=TOKEN)
    trainer.start()
    wait_for(lambda: len(trainer.published) >= 2 or not trainer.is_alive(), 60, "two steps")
    wait_for(lambda: httpx.get(f"{url}/status", timeout=10, headers=AUTH).json()["inference_servers"][1]["outstanding"] > 0,
             30, "requests in flight to the server about to leave")

    # A graceful leave: the answer comes once its requests in flight have finished.
    left = httpx.request("DELETE", f"{url}/inference_servers", json={"url": leaving.url}, headers=AUTH, timeout=60)
    assert left.status_code == 200, left.text
    assert left.json() == {"url": leaving.url, "removed": True, "outstanding": 0, "drained": True}
    after_leave = _requests(leaving)

    # A leave without waiting, then the server dies with requests in flight (hung: they cannot
    # finish): they are regenerated on the remaining server. Not a /pause: the trainer keeps
    # publishing, and each sync's resume would let them finish.
    retries_before = httpx.get(f"{url}/status", timeout=10, headers=AUTH).json()["throughput"]["retries"]
    httpx.post(f"{dying.url}/_standin/configure", json={"hung": True})
    wait_for(lambda: _members(url)[dying.url]["outstanding"] > 0, 30, "requests in flight to the dying server")
    gone = httpx.request("DELETE", f"{url}/inference_servers", json={"url": dying.url}, headers=AUTH,
                         params={"timeout": 0}, timeout=60)
    assert gone.status_code == 200, gone.text
    assert gone.json()["removed"] is True and gone.json()["outstanding"] > 0, gone.json()
    dying.kill()

    trainer.join(120)
    assert not trainer.is_alive() and trainer.error is None, repr(trainer.error)
    check_batches(trainer)
    time.sleep(0.5)
    assert _requests(leaving) == after_leave, "a removed server got new work"
    assert set(_members(url)) == {steady.url}
    assert httpx.get(f"{url}/status", timeout=10, headers=AUTH).json()["throughput"]["retries"] > retries_before


@pytest.mark.timeout(90)
def test_a_server_that_starts_after_the_sampler_is_in_rotation_as_soon_as_it_answers(
        tmp_path: Path, cleanup: Cleanup) -> None:
    """As in `tandem demo` and compose, where the inference server starts beside the sampler
    and answers seconds after it: a down server is checked every quarter second, whatever
    `server_check_interval` says (30 s here: the server would otherwise wait that long)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cleanup.add(lambda: kill_embedded_redis(tmp_path / "s"))
    sampler = start_sampler_process(tmp_path / "s", inference_urls=[url], env="tests.support.envs:CountEnv",
                                    prompts_per_step=4, num_generations=2, max_tokens=6, api_token=TOKEN,
                                    server_check_interval=30.0)
    cleanup.add(lambda: stop_process(sampler))
    wait_for(lambda: _members(sampler.url)[url]["state"] == "down", 30, "the sampler to find nothing at the port")
    standin = start_standin_process(tmp_path, cleanup, port=port, api_token=TOKEN)  # returns once /health answers
    answered = time.monotonic()
    wait_for(lambda: _members(sampler.url)[url]["state"] == "ok", 10, "the sampler to put the server in rotation")
    assert time.monotonic() - answered < 2.0
    assert standin.url == url  # the server the sampler was told of

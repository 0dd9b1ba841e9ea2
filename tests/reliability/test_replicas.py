"""Two sampler processes on one Redis and one namespace: they split the steps without
generating any group twice, and when one is killed -9 the other takes over its lapsed
step claims (after `claim_ttl`) and serves the whole run.

tests/sampler/test_reliability.py has the in-process versions; this is the process drill.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from shared.client import SamplerClient
from tests.reliability.support import Cleanup, batch_bytes, redis_keys, stop_process, wait_for
from tests.support.servers import start_sampler_process, start_standin

PROMPTS = 2


async def _train(urls: list[str], steps: range) -> list[dict]:
    """Like a trainer, but each step asks a different replica (they serve one run)."""
    batches = []
    clients = [SamplerClient(u, poll_timeout=5, retry_for=30) for u in urls]
    try:
        for step in steps:
            client = clients[step % len(clients)]
            batches.append(await client.get_batch_raw(step, timeout=60))
            await asyncio.sleep(0.2)  # "training"
            await client.publish_weights(step + 1)
    finally:
        for client in clients:
            await client.aclose()
    return batches


def quiet(redis_url: str, namespace: str, urls: list[str]) -> None:
    """Wait until no step is claimed or building (a k = 1 build may still be in flight)."""

    def idle() -> bool:
        busy = [httpx.get(f"{u}/status", timeout=10).json()["steps"]["in_progress"] for u in urls]
        return not redis_keys(redis_url, namespace)["claims"] and not any(busy)

    wait_for(idle, 20, "the replicas to finish the builds in flight")


@pytest.mark.slow
def test_replica_processes_split_work_and_survive_a_kill9(tmp_path: Path, redis_url: str, namespace: str,
                                                          cleanup: Cleanup) -> None:
    standin = start_standin(token_latency=0.01)
    cleanup.add(standin.stop)
    settings = {"redis_url": redis_url, "namespace": namespace, "inference_urls": [standin.url],
                "env": "tests.support.envs:CountEnv", "prompts_per_step": PROMPTS, "num_generations": 2,
                "max_tokens": 8, "max_staleness": 1, "claim_ttl": 2, "keep_batches": 64}
    replicas = []
    for name in ("a", "b"):
        proc = start_sampler_process(tmp_path / name, **settings)
        cleanup.add(lambda proc=proc: stop_process(proc))
        replicas.append(proc)
    urls = [r.url for r in replicas]

    # Both alive: every step generated exactly once, by one replica or the other.
    batches = asyncio.run(_train(urls, range(8)))
    quiet(redis_url, namespace, urls)
    statuses = [httpx.get(f"{u}/status", timeout=10).json() for u in urls]
    sealed = redis_keys(redis_url, namespace)["sealed"]
    assert sealed == list(range(len(sealed))), sealed
    requests = httpx.get(f"{standin.url}/_standin/stats").json()["requests"]
    assert requests == PROMPTS * len(sealed), f"{requests} requests for {len(sealed)} steps: a step was generated twice"
    per_replica = [s["steps"]["sealed_since_start"] for s in statuses]
    assert sum(per_replica) == len(sealed), per_replica
    print("steps sealed per replica:", per_replica)
    assert all(n > 0 for n in per_replica), f"one replica did all the work: {per_replica}"
    for step in range(8):  # both replicas serve the same bytes for every step
        assert batch_bytes(urls[0], step) == batch_bytes(urls[1], step)

    # Freeze generation so that the next step is claimed and stuck, then kill its owner.
    httpx.post(f"{standin.url}/pause")
    cleanup.add(lambda: httpx.post(f"{standin.url}/resume"))
    httpx.post(f"{urls[0]}/weights_version", json={"version": 9})  # steps 9 and 10 may now start
    owners = {s["steps"]["replica"]: i for i, s in enumerate(statuses)}

    def claimed() -> dict[str, bytes] | None:
        claims = redis_keys(redis_url, namespace)["claims"]
        return claims if any(k.endswith(":10") for k in claims) else None

    # Step 9 sealed before the pause (k = 1: it needed version 8); step 10 is now claimed and stuck.
    claims = wait_for(claimed, 10, "a replica to claim step 10",
                      detail=lambda: f"{redis_keys(redis_url, namespace)} "
                      f"{[httpx.get(f'{u}/status').json()['steps'] for u in urls]}")
    victim = owners[next(iter(claims.values())).decode()]
    survivor = 1 - victim
    held = sorted(int(k.rsplit(":", 1)[1]) for k, v in claims.items() if owners[v.decode()] == victim)
    replicas[victim].kill()
    killed_at = time.monotonic()
    httpx.post(f"{standin.url}/resume")

    # The survivor serves the rest of the run, the victim's steps included.
    rest = asyncio.run(_train([urls[survivor]], range(9, 13)))
    batches += rest
    took = time.monotonic() - killed_at
    assert took < 30, f"the survivor needed {took:.0f}s to take over steps {held}"
    quiet(redis_url, namespace, [urls[survivor]])
    state = redis_keys(redis_url, namespace)
    assert state["sealed"] == list(range(len(state["sealed"]))) and state["sealed"][-1] >= 12, state["sealed"]
    assert state["batches"] == state["sealed"], "a batch key without its sealed index entry (or the reverse)"
    group_ids = [s["group_id"] for b in batches for s in b["samples"]]
    assert len(set(group_ids)) == len(group_ids) // 2, "a group appears in two batches"
    assert [b["step"] for b in batches] == list(range(8)) + list(range(9, 13))
    survivor_status = httpx.get(f"{urls[survivor]}/status", timeout=10).json()
    assert survivor_status["steps"]["claimed_elsewhere"] == [], survivor_status["steps"]
    # Only the killed replica's unsealed steps may have been generated twice.
    requests = httpx.get(f"{standin.url}/_standin/stats").json()["requests"]
    assert requests <= PROMPTS * (len(state["sealed"]) + len(held)), (requests, state["sealed"], held)

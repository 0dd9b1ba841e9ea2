"""Redis killed -9 at each dangerous moment of a step: nothing skipped, nothing changed.

The sampler runs with its drill pause points (services/sampler/building/drill.py): it stops exactly at
a moment (a step's claim taken, its batch built but not sealed, its first chunk file written
and the rest not yet, its chunks written but not sealed, its seal acknowledged, a
version about to be written, a version written but not yet answered), the drill kills Redis
there, lets the sampler run on into the outage, and starts Redis again on the same port. A
trainer on `SamplerClient` reads batch N, "trains", publishes N+1 throughout, retrying 503s.

Durable runs use `appendfsync always` (the embedded Redis's and compose's setting): nothing
acknowledged is lost. Lossy runs use `appendfsync everysec` and cut the AOF back to where it
was a moment before the kill, as a Redis that had not yet written its last second would come
back: a seal (or a publication) the sampler acknowledged is gone, and the sampler must write
it back from memory so that a re-read returns the bytes served before.

Every run checks: all steps arrived in order, each exactly once, within the staleness bound;
every batch the trainer got is what the sampler serves afterwards, byte for byte on repeated
reads; no step is missing; no step waited over 60 s on the sampler (fetch and publish); the
heals are the ones the moment implies;
the sampler logged no traceback. The stack is closed with a run token of its own (the
stand-in, the sampler through its environment, the trainer; every read sends it), and the
drill checks the sampler and the stand-in refuse a request without it. `make stress` runs it
with the moment and outage varied.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from shared import codec
from shared.token_guard import TOKEN_ENV, bearer_headers
from tests.reliability.support import (
    Cleanup,
    Trainer,
    assert_guarded,
    batch_bytes,
    check_batches,
    finish_after_restart,
    run_token,
    start_redis_at,
    stop_process,
    wait_for,
)
from tests.support.servers import start_sampler_process, start_standin

STEPS = 8
AT = 3  # the step (or version) at which Redis is killed
# moment -> the drill point, and (lossy runs) the earlier point whose AOF size Redis comes back with.
MOMENTS = {
    "claimed": ("claimed", None),
    "built": ("built", None),
    # During the chunk write: the first chunk file is durable, the others (if any) and the
    # directory's fsync not yet; the sampler finishes them during the outage and seals once
    # Redis is back.
    "writing": ("writing", None),
    # The chunks are stored, the seal not yet run. Lossy runs keep the chunks in Redis
    # (batch_store = redis, the fallback): Redis comes back without them and the seal must
    # find them missing and write them again, never seal a hole.
    "staged": ("staged", "built"),
    "sealed": ("sealed", "built"),
    "publishing": ("publishing", None),
    "published": ("published", "publishing"),
}
LOSSY = ("staged", "sealed", "published")
# Lossy moments run with the chunks in Redis: with files nothing of a batch reaches Redis
# between `built` and `staged`, and there would be nothing to lose.
REDIS_CHUNKS = ("staged",)
MAX_WAIT = 60.0


def _marker(directory: Path, point: str, sampler: Any) -> Path:
    path = directory / f"{point}-{AT}"
    wait_for(path.exists, 60, f"the sampler to pause at {point} {AT}", detail=sampler.log_tail)
    return path


def moment_drill(tmp: Path, cleanup: Cleanup, moment: str, *, lossy: bool = False, outage: float = 1.0,
                 release_during_outage: bool | None = None) -> dict[str, Any]:
    """One run; returns what happened (seconds from the restart to the last step, the longest
    a step waited on the sampler, the heals). `release_during_outage`: let the sampler run on while Redis
    is down (default for durable runs) or only once it is back (lossy runs: the acknowledged
    write must reach the client before Redis comes back without it)."""
    point, earlier = MOMENTS[moment]
    if lossy and earlier is None:
        raise ValueError(f"moment {moment!r} has no lossy variant (those are {LOSSY})")
    if release_during_outage is None:
        release_during_outage = not lossy
    fsync = "everysec" if lossy else "always"
    token = run_token()
    standin = start_standin(token_latency=0.002, api_token=token)
    cleanup.add(standin.stop)
    data = tmp / "redis"
    redis_proc, redis_url = start_redis_at(data, cleanup=cleanup, appendfsync=fsync)
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    drill_dir = tmp / "drill"
    pauses = [f"{point}:{AT}"] + ([f"{earlier}:{AT}"] if lossy else [])
    sampler = start_sampler_process(
        tmp / "sampler",
        process_env={"TANDEM_DRILL_PAUSE": ",".join(pauses), "TANDEM_DRILL_DIR": str(drill_dir), TOKEN_ENV: token},
        redis_url=redis_url, inference_urls=[standin.url], env="tests.support.envs:CountEnv", prompts_per_step=4,
        num_generations=4, max_tokens=6, max_staleness=1, keep_batches=32,
        batch_store="redis" if lossy and moment in REDIS_CHUNKS else "files")
    cleanup.add(lambda: stop_process(sampler))
    assert_guarded(sampler.url, "/status", "the sampler")
    assert_guarded(standin.url, "/v1/models", "the stand-in")
    trainer = Trainer(sampler.url, STEPS, train_seconds=0.2, api_token=token)
    trainer.start()
    aof = data / "appendonly.aof"
    kept = None
    if lossy:
        marker = _marker(drill_dir, earlier, sampler)
        kept = aof.stat().st_size  # Redis comes back as it was here
        marker.unlink()
    marker = _marker(drill_dir, point, sampler)
    redis_proc.kill()
    if lossy:
        assert aof.stat().st_size > kept, "nothing was written between the two points: the drill would lose nothing"
        with open(aof, "r+b") as f:
            f.truncate(kept)

    def restart() -> None:
        start_redis_at(data, port=port, cleanup=cleanup, appendfsync=fsync)

    if release_during_outage:
        marker.unlink()
        time.sleep(outage)
        restart()
    else:
        time.sleep(outage)
        restart()
        marker.unlink()
    recovered = finish_after_restart(trainer, sampler.url, sampler.log_tail)
    assert trainer.error is None, f"the trainer gave up: {trainer.error!r}\n{sampler.log_tail()}"
    check_batches(trainer, max_staleness=1)

    # Every batch the trainer got is what the sampler serves now, and every read is the same bytes.
    with httpx.Client(base_url=sampler.url, timeout=30, headers=bearer_headers(token)) as http:
        for batch in trainer.batches:
            first = batch_bytes(sampler.url, batch["step"], token=token)
            assert first is not None and batch_bytes(sampler.url, batch["step"], token=token) == first
            assert codec.unpack(first) == codec.plain(batch), f"batch {batch['step']} changed after the crash"
        status = http.get("/status").json()
    steps = status["steps"]
    assert steps["sealed_steps"][:STEPS] == list(range(STEPS)), steps["sealed_steps"]
    assert steps["missing"] == [], steps
    assert status["versions"]["published"] == STEPS
    heals = steps["healed"]["counts"]
    log = (tmp / "sampler" / "sampler.log").read_text(errors="replace")
    if lossy and moment == "staged":
        assert "a chunk was missing from Redis at the seal" in log, "the lost chunks were not written again"
    if lossy and moment == "sealed":
        assert heals["restored"] >= 1, f"the lost seal of batch {AT} was not written back: {steps['healed']}"
    elif lossy and moment == "published":
        assert heals["version_restored"] >= 1, f"the lost version {AT} was not published again: {steps['healed']}"
    else:
        assert heals["rebuilt"] == heals["restored"] == 0, f"nothing was lost, yet: {steps['healed']}"
    waited = max(trainer.waits)
    assert waited < MAX_WAIT, f"a step waited {waited:.0f}s on the sampler: {trainer.waits}"
    assert "Traceback" not in log, sampler.log_tail(8000)
    assert status["redis"]["restarts"] >= 1, status["redis"]
    return {"recovered": recovered, "max_wait": waited, "heals": heals}


@pytest.mark.parametrize("moment", list(MOMENTS))
def test_redis_killed_at_a_moment_loses_and_skips_nothing(tmp_path: Path, cleanup: Cleanup, moment: str) -> None:
    moment_drill(tmp_path, cleanup, moment)


@pytest.mark.parametrize("moment", LOSSY)
def test_acknowledged_writes_a_restarted_redis_lost_are_written_back(tmp_path: Path, cleanup: Cleanup,
                                                                    moment: str) -> None:
    moment_drill(tmp_path, cleanup, moment, lossy=True, outage=0.3)

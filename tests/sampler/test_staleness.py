"""The staleness contract over many steps, driven by a client that knows only docs/sampler-api.md."""

from __future__ import annotations

import httpx
import pytest

from tests.support.driver import drive

STEPS = 20


@pytest.mark.parametrize("k", [0, 1, 2])
async def test_every_sample_respects_the_staleness_bound(make_sampler, standin, k):
    sampler = make_sampler(max_staleness=k)
    # With a checkpoint path the sampler drives the full weight sync on the server.
    batches = await drive(sampler.url, STEPS, checkpoint="/tmp/ckpt", train_seconds=0.05)
    staleness = []
    for step, batch in enumerate(batches):
        assert batch["step"] == step
        for sample in batch["samples"]:
            assert step - k <= sample["policy_version"] <= step, (step, sample["policy_version"])
            staleness.append(step - sample["policy_version"])
        assert batch["stats"]["staleness_max"] <= k
    if k == 0:
        assert set(staleness) == {0}
    else:
        # Generation really ran ahead of training: some samples are k versions old.
        assert max(staleness) == k
    stats = httpx.get(standin.url + "/_standin/stats").json()
    assert stats["version"] == str(STEPS)
    assert len(stats["reloads"]) == STEPS
    assert stats["paused"] is False


async def test_on_policy_flag_means_max_staleness_zero(make_sampler):
    sampler = make_sampler(on_policy=True, max_staleness=3)
    batches = await drive(sampler.url, 4, checkpoint=None, train_seconds=0.02)
    for step, batch in enumerate(batches):
        assert {s["policy_version"] for s in batch["samples"]} == {step}
    status = httpx.get(sampler.url + "/status").json()
    assert status["config"]["max_staleness"] == 0 and status["config"]["on_policy"] is True

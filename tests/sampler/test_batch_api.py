"""GET /batch: every status code, identical re-reads, msgpack, rank slicing, wake-up latency."""

from __future__ import annotations

import asyncio
import time

import httpx
import msgpack
import numpy as np
import pytest

from shared import codec
from shared.wire import BatchStats, Sample, new_sample


async def test_batch_200_is_identical_on_every_read(make_sampler):
    sampler = make_sampler()
    async with httpx.AsyncClient(base_url=sampler.url, timeout=30) as http:
        first = await http.get("/batch", params={"step": 0, "timeout": 20})
        assert first.status_code == 200, first.text
        body = first.json()
        assert body["step"] == 0
        assert len(body["samples"]) == 16
        for sample in body["samples"]:
            for key in ("prompt_id", "group_id", "prompt_token_ids", "completion_token_ids",
                        "completion_logprobs", "loss_mask", "reward", "rewards", "advantage",
                        "policy_version", "finish_reason"):
                assert key in sample
            assert len(sample["completion_logprobs"]) == len(sample["completion_token_ids"])
            assert len(sample["loss_mask"]) == len(sample["completion_token_ids"])
        again = await http.get("/batch", params={"step": 0, "timeout": 1})
        assert again.content == first.content


async def test_produced_samples_and_stats_are_the_shared_definitions(make_sampler):
    """What the sampler seals is what the trainer reads: every sample validates as
    `shared.wire.Sample` and carries no key that Sample does not declare (so the sampler cannot
    grow a second, private idea of a sample); the stats validate as `BatchStats`."""
    sampler = make_sampler(curriculum='[{"lessons": {"toy": 1}}]')
    async with httpx.AsyncClient(base_url=sampler.url, timeout=30) as http:
        body = (await http.get("/batch", params={"step": 0, "timeout": 20})).json()
    declared = set(Sample.model_fields)
    for raw in body["samples"]:
        assert set(raw) <= declared, sorted(set(raw) - declared)
        sample = Sample.model_validate(raw)
        assert sample.env == sample.lesson == "toy" and sample.use_count == 1
        assert sample.versions == [sample.policy_version] and sample.created_at is not None
    stats = BatchStats.model_validate(body["stats"])
    assert (stats.step, stats.num_samples) == (0, len(body["samples"]))
    assert set(BatchStats.model_fields) <= set(body["stats"])
    with pytest.raises(TypeError, match="advantage"):
        new_sample(**{k: v for k, v in body["samples"][0].items() if k != "advantage"})


async def test_msgpack_carries_the_same_structure_as_json(make_sampler):
    sampler = make_sampler()
    async with httpx.AsyncClient(base_url=sampler.url, timeout=30) as http:
        as_json = (await http.get("/batch", params={"step": 0, "timeout": 20})).json()
        packed = await http.get("/batch", params={"step": 0}, headers={"Accept": "application/msgpack"})
        assert packed.headers["content-type"].startswith("application/msgpack")
        assert msgpack.unpackb(packed.content, raw=False) == as_json


async def test_arrays_form_carries_the_same_values_for_the_whole_batch_and_rank_shares(make_sampler):
    sampler = make_sampler(prompts_per_step=4, num_generations=4)
    arrays = {"Accept": codec.ARRAYS}
    async with httpx.AsyncClient(base_url=sampler.url, timeout=30) as http:
        as_json = (await http.get("/batch", params={"step": 0, "timeout": 20})).json()
        whole = await http.get("/batch", params={"step": 0}, headers=arrays)
        assert whole.headers["content-type"] == codec.ARRAYS
        decoded = codec.unpack(whole.content)
        assert isinstance(decoded["samples"][0]["completion_token_ids"], np.ndarray)
        assert codec.plain(decoded) == as_json
        again = await http.get("/batch", params={"step": 0}, headers=arrays)
        assert again.content == whole.content
        for rank in range(2):
            params = {"step": 0, "rank": rank, "world_size": 2}
            share = await http.get("/batch", params=params, headers=arrays)
            assert share.headers["content-type"] == codec.ARRAYS
            assert codec.plain(codec.unpack(share.content)) == (await http.get("/batch", params=params)).json()


async def test_204_when_timeout_passes_and_timeout_is_bounded(make_sampler):
    # k=0: batch 1 needs version 1, which nobody publishes here; ask with a long timeout
    # and check the server caps it at max_poll_timeout.
    sampler = make_sampler(max_staleness=0, max_poll_timeout=0.5)
    async with httpx.AsyncClient(base_url=sampler.url, timeout=30) as http:
        assert (await http.get("/batch", params={"step": 0, "timeout": 20})).status_code == 200
        assert (await http.post("/weights_version", json={"version": 1})).status_code == 200
        # Batch 1 can exist now, batch 2 cannot; batch 1 may or may not be sealed yet.
        started = time.monotonic()
        response = await http.get("/batch", params={"step": 3, "timeout": 30})
        assert response.status_code == 409
        # A batch that could become ready but is not: use a sampler whose inference is slow.
    slow = make_sampler(namespace="slow" + sampler.settings.namespace, max_poll_timeout=0.5,
                        inference_urls=["http://127.0.0.1:9"], request_retries=0, request_timeout=1)
    async with httpx.AsyncClient(base_url=slow.url, timeout=30) as http:
        started = time.monotonic()
        response = await http.get("/batch", params={"step": 0, "timeout": 30})
        elapsed = time.monotonic() - started
        assert response.status_code == 204
        assert 0.4 <= elapsed < 5


async def test_409_names_the_version_to_post(make_sampler):
    sampler = make_sampler(max_staleness=1)
    async with httpx.AsyncClient(base_url=sampler.url, timeout=30) as http:
        response = await http.get("/batch", params={"step": 5, "timeout": 1})
        assert response.status_code == 409
        detail = response.json()["detail"]
        assert detail["required_version"] == 4
        assert detail["published_version"] == 0
        assert "POST /weights_version" in detail["message"]


@pytest.mark.parametrize("params", [
    {"step": -1}, {"step": "abc"}, {}, {"step": 0, "timeout": -1}, {"step": 0, "timeout": "x"},
    {"step": 0, "rank": 2, "world_size": 2}, {"step": 0, "world_size": 0}, {"step": 0, "rank": -1},
])
async def test_422_for_malformed_parameters(make_sampler, params):
    sampler = make_sampler()
    async with httpx.AsyncClient(base_url=sampler.url, timeout=30) as http:
        response = await http.get("/batch", params=params)
        assert response.status_code == 422, response.text
        assert response.json()["detail"]


async def test_410_after_trim_and_memory_stays_bounded(make_sampler, redis_url):
    import redis.asyncio as aioredis

    sampler = make_sampler(keep_batches=2)
    ns = sampler.settings.namespace
    async with httpx.AsyncClient(base_url=sampler.url, timeout=30) as http:
        for step in range(8):
            assert (await http.get("/batch", params={"step": step, "timeout": 20})).status_code == 200
            assert (await http.post("/weights_version", json={"version": step + 1})).status_code == 200
        # Published version 8, keep 2 behind: steps < 6 are gone.
        response = await http.get("/batch", params={"step": 5, "timeout": 1})
        assert response.status_code == 410
        assert "trimmed" in response.json()["detail"]
        assert (await http.get("/batch", params={"step": 6, "timeout": 1})).status_code == 200
    client = aioredis.from_url(redis_url)
    batch_keys = [k async for k in client.scan_iter(f"tandem:{ns}:batch:*")]
    await client.aclose()
    # Steps 6, 7 kept; 8 and 9 may be sealed ahead (k = 1); nothing older survives.
    # Manifests are batch:<step>, chunks batch:<step>:<build>:<i>: trimmed together.
    steps = sorted({int(k.split(b":")[3]) for k in batch_keys})
    assert steps and min(steps) >= 6 and max(steps) <= 9


async def test_the_trainers_resume_step_holds_its_batches_past_keep_batches(make_sampler):
    """Versions 1..8 published with keep_batches 2, by a trainer whose newest checkpoint is
    step 3: batches 4.. are still there (a trainer killed now restarts at 4); the 410 for an
    older one says which checkpoint can continue the run, not to change keep_batches."""
    sampler = make_sampler(keep_batches=2)
    async with httpx.AsyncClient(base_url=sampler.url, timeout=30) as http:
        for step in range(8):
            assert (await http.get("/batch", params={"step": step, "timeout": 20})).status_code == 200
            resume = 0 if step < 3 else 4  # checkpoint step-3 committed while training step 3
            body = {"version": step + 1, "resume_step": resume}
            assert (await http.post("/weights_version", json=body)).status_code == 200
        for step in range(4, 8):
            assert (await http.get("/batch", params={"step": step, "timeout": 1})).status_code == 200, step
        response = await http.get("/batch", params={"step": 3, "timeout": 1})
        assert response.status_code == 410
        detail = response.json()["detail"]
        assert "below step 4 are deleted" in detail and "restart at step 4" in detail
        assert "checkpoint of step 3 or later" in detail and "keep_batches" not in detail.split(")")[-1]
        status = (await http.get("/status")).json()
        assert status["steps"]["resume_step"] == 4 and status["steps"]["trimmed_below"] == 4
        assert status["config"]["holds_resume_step"] is True
        assert (await http.post("/weights_version", json={"version": 9, "resume_step": -1})).status_code == 422


async def test_rank_slices_partition_the_batch_without_splitting_groups(make_sampler):
    sampler = make_sampler(prompts_per_step=4, num_generations=4)
    async with httpx.AsyncClient(base_url=sampler.url, timeout=30) as http:
        whole = (await http.get("/batch", params={"step": 0, "timeout": 20})).json()["samples"]
        shares = []
        for rank in range(2):
            body = (await http.get("/batch", params={"step": 0, "rank": rank, "world_size": 2})).json()
            assert body["rank"] == rank and body["world_size"] == 2
            shares.append(body["samples"])
        assert shares[0] + shares[1] == whole
        groups = [{s["group_id"] for s in share} for share in shares]
        assert groups[0].isdisjoint(groups[1])
        # 16 samples over 3 ranks cannot be split evenly
        response = await http.get("/batch", params={"step": 0, "rank": 0, "world_size": 3})
        assert response.status_code == 422


async def test_long_poll_wakes_within_milliseconds_of_the_seal(make_sampler, standin):
    # A paused inference server holds generation, so the poll is surely waiting.
    httpx.post(standin.url + "/pause", params={"mode": "keep"})
    sampler = make_sampler()
    async with httpx.AsyncClient(base_url=sampler.url, timeout=30) as http:
        poll = asyncio.create_task(http.get("/batch", params={"step": 0, "timeout": 20}))
        await asyncio.sleep(0.5)
        assert not poll.done()
        httpx.post(standin.url + "/resume")
        response = await poll
        received = time.time()
        assert response.status_code == 200
        sealed_at = response.json()["stats"]["sealed_at"]
        # Generous bound for a loaded 2-core CI box; a fixed 1 s polling loop would fail it often.
        assert received - sealed_at < 0.25, f"woke {received - sealed_at:.3f}s after the seal"


async def test_a_cancelled_long_poll_loses_nothing(make_sampler, standin):
    httpx.post(standin.url + "/pause", params={"mode": "keep"})
    sampler = make_sampler()
    async with httpx.AsyncClient(base_url=sampler.url, timeout=30) as http:
        # The client gives up (disconnects) before the batch is sealed...
        with pytest.raises(httpx.ReadTimeout):
            await http.get("/batch", params={"step": 0, "timeout": 20}, timeout=httpx.Timeout(5, read=0.3))
        httpx.post(standin.url + "/resume")
        # ...and the batch is still there for the next request, twice.
        first = await http.get("/batch", params={"step": 0, "timeout": 20})
        second = await http.get("/batch", params={"step": 0, "timeout": 1})
        assert first.status_code == second.status_code == 200
        assert first.content == second.content

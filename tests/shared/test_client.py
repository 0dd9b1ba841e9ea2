"""SamplerClient against a real sampler: long-polls through 204s, errors, retries."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest

from services.sampler.app import create_app
from shared.client import (
    BatchNotReady,
    BatchTrimmed,
    SamplerClient,
    SamplerUnavailable,
    Unauthorized,
    VersionConflict,
)
from tests.support.servers import UvicornThread, free_port, refused_port


@pytest.fixture
def sampler(make_sampler):
    return make_sampler(max_poll_timeout=0.3, keep_batches=1)


async def test_get_batch_polls_through_204s(make_sampler, standin):
    httpx.post(standin.url + "/pause")
    sampler = make_sampler(max_poll_timeout=0.3)
    async with SamplerClient(sampler.url, poll_timeout=0.2) as client:
        task = asyncio.create_task(client.get_batch(0))
        await asyncio.sleep(1.0)  # several 204s go by
        assert not task.done()
        httpx.post(standin.url + "/resume")
        batch = await asyncio.wait_for(task, 30)
        assert batch.step == 0 and len(batch.samples) == 16
        raw = await client.get_batch_raw(0)
        assert raw["samples"][0]["prompt_id"] == batch.samples[0].prompt_id


async def test_every_encoding_gives_the_same_batch(sampler):
    clients = [SamplerClient(sampler.url, encoding=e) for e in ("arrays", "msgpack", "json")]
    try:
        arrays, msgpack, json = [await c.get_batch(0) for c in clients]
    finally:
        for c in clients:
            await c.aclose()
    # The arrays form hands numpy arrays to the trainer; the others hand lists.
    assert isinstance(arrays.samples[0].completion_token_ids, np.ndarray)
    assert isinstance(json.samples[0].completion_token_ids, list)
    assert arrays.model_dump(mode="json") == msgpack.model_dump(mode="json") == json.model_dump(mode="json")
    assert all(len(s.completion_logprobs) == len(s.completion_token_ids) for s in arrays.samples)
    assert sum(len(s.completion_token_ids) for s in arrays.samples) > 0


def test_unknown_encoding_is_refused():
    with pytest.raises(ValueError, match="encoding must be one of"):
        SamplerClient("http://127.0.0.1:1", encoding="xml")


async def test_409_410_and_version_conflict_are_exceptions(sampler):
    async with SamplerClient(sampler.url) as client:
        with pytest.raises(BatchNotReady) as info:
            await client.get_batch(5)
        assert info.value.required_version == 4
        await client.get_batch(0)
        for version in (1, 2, 3):
            await client.publish_weights(version)
        with pytest.raises(BatchTrimmed):
            await client.get_batch(0)
        with pytest.raises(VersionConflict):
            await client.publish_weights(1)
        assert (await client.weights_version()).version == 3


async def test_get_batch_timeout_is_honoured(make_sampler, standin):
    httpx.post(standin.url + "/pause")
    sampler = make_sampler(max_poll_timeout=0.3)
    async with SamplerClient(sampler.url, poll_timeout=0.2) as client:
        with pytest.raises(TimeoutError, match="not sealed within"):
            await client.get_batch(0, timeout=0.6)
    httpx.post(standin.url + "/resume")


async def test_eval_round_trip(sampler):
    async with SamplerClient(sampler.url) as client:
        eval_id = await client.start_eval(num_examples=3)
        result = await client.wait_eval(eval_id, timeout=30)
        assert result.status == "done" and result.result["num_examples"] == 3


async def test_transport_errors_are_retried_until_the_sampler_comes_up(make_sampler, redis_url, namespace, run_dir, standin):
    port = free_port()
    async with SamplerClient(f"http://127.0.0.1:{port}", retry_for=30) as client:
        task = asyncio.create_task(client.get_batch(0))
        await asyncio.sleep(0.5)  # connection refused, retried with backoff
        assert not task.done()
        from services.sampler.config import SamplerSettings

        server = UvicornThread(create_app(SamplerSettings(
            redis_url=redis_url, namespace=namespace, run_dir=run_dir, inference_urls=[standin.url],
            env="tests.support.envs:CountEnv", prompts_per_step=2, num_generations=2)), port=port).start()
        try:
            batch = await asyncio.wait_for(task, 30)
            assert len(batch.samples) == 4
        finally:
            server.stop()


async def test_gives_up_with_a_clear_error():
    with refused_port() as port:  # nothing can answer there meanwhile
        async with SamplerClient(f"http://127.0.0.1:{port}", retry_for=0.5) as client:
            with pytest.raises(SamplerUnavailable, match="kept failing"):
                await client.get_batch(0)


async def test_unauthorized(make_sampler):
    sampler = make_sampler(api_token="t0ken")
    async with SamplerClient(sampler.url) as client:
        with pytest.raises(Unauthorized):
            await client.publish_weights(1)
    async with SamplerClient(sampler.url, api_token="t0ken") as client:
        assert (await client.publish_weights(1)).version == 1

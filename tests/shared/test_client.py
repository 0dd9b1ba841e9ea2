"""SamplerClient against a real sampler: long-polls through 204s, errors, retries."""

from __future__ import annotations

import asyncio

import httpx
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
from tests.support.servers import UvicornThread, free_port


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


async def test_json_and_msgpack_clients_agree(sampler):
    async with SamplerClient(sampler.url, msgpack=True) as a, SamplerClient(sampler.url, msgpack=False) as b:
        assert (await a.get_batch(0)) == (await b.get_batch(0))


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
    async with SamplerClient(f"http://127.0.0.1:{free_port()}", retry_for=0.5) as client:
        with pytest.raises(SamplerUnavailable, match="kept failing"):
            await client.get_batch(0)


async def test_unauthorized(make_sampler):
    sampler = make_sampler(api_token="t0ken")
    async with SamplerClient(sampler.url) as client:
        with pytest.raises(Unauthorized):
            await client.publish_weights(1)
    async with SamplerClient(sampler.url, api_token="t0ken") as client:
        assert (await client.publish_weights(1)).version == 1

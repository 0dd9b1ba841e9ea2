"""verifiers' training client in-process (services/sampler/rollouts/vf/local_client.py), and the
harness's calls to the interception server (vf/local_interception.py): the same samples, token
for token, as over HTTP; the same errors as over the sampler's HTTP route; the
interception server builds it only for its own config; the model contexts a verifiers
environment reuses are rebuilt when what they hold changes."""

from __future__ import annotations

import math
import uuid

import httpx
import openai
import pytest
from verifiers.v1.clients.base import build_async_openai
from verifiers.v1.clients.train import TrainClient
from verifiers.v1.configs.client import TrainClientConfig
from verifiers.v1.interception import server as server_module
from verifiers.v1.interception.server import InterceptionServer

from services.inference.testing import running_server
from services.sampler.rollouts.envs import load_environment
from services.sampler.fleet.inference_pool import OK, InferencePool
from services.sampler.rollouts.multiturn.stats import EnvStats
from services.sampler.rollouts.multiturn.workers import Workers
from services.sampler.rollouts.rollout import Rollouts
from services.sampler.rollouts.vf import harness, local_client, local_interception
from services.sampler.rollouts.vf.environment import VerifiersLink
from services.sampler.rollouts.vf.sessions import Sessions
from shared.http_client import HttpClient
from shared.wire import Sample

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cpu_server(tiny_model):
    with running_server(tiny_model, served_model_name="tiny") as handle:
        yield handle


async def first_batch(sampler) -> list[Sample]:
    async with httpx.AsyncClient(base_url=sampler.url, timeout=120) as http:
        response = await http.get("/batch", params={"step": 0, "timeout": 120})
        assert response.status_code == 200, response.text
        return [Sample.model_validate(s) for s in response.json()["samples"]]


def by_prompt(samples: list[Sample]) -> dict[str, list[tuple]]:
    # Greedy: every trajectory of a prompt is the same conversation; sorted, as groups seal in any order.
    out: dict[str, list[tuple]] = {}
    for s in samples:
        out.setdefault(s.prompt_id, []).append((tuple(s.prompt_token_ids), tuple(s.completion_token_ids),
                                                tuple(s.loss_mask), s.finish_reason, s.reward, tuple(s.versions)))
    return {k: sorted(v) for k, v in out.items()}


async def test_in_process_and_http_clients_give_the_same_multi_turn_samples(make_sampler, namespace, cpu_server,
                                                                             monkeypatch):
    # Which way the harness reached the interception server: each route's real post, counted.
    posts = {"in_process": 0, "http": 0}

    def counted(route_class, name):
        post = route_class.post

        async def counting(self, url, body):
            posts[name] += 1
            return await post(self, url, body)

        monkeypatch.setattr(route_class, "post", counting)

    counted(local_interception.LocalRoute, "in_process")
    counted(harness._HttpRoute, "http")
    endpoints_before = set(local_client._endpoints)
    runs = {}
    for client in ("in_process", "http"):
        before = dict(posts)
        sampler = make_sampler(env="verifiers:tandem-vf-dialogue", env_args='{"turns": 3}', vf_client=client,
                               namespace=f"{namespace}-{client}", inference_urls=[cpu_server.base_url.removesuffix("/v1")],
                               prompts_per_step=2, num_generations=2, max_tokens=4, temperature=0.0, drain_deadline=0)
        runs[client] = await first_batch(sampler)
        sampler.stop()
        # Every model call of the run went the client's way (3 turns for each of 2 x 2 trajectories, at least).
        other = "http" if client == "in_process" else "in_process"
        assert posts[client] - before[client] >= 12 and posts[other] == before[other], posts
        if client == "in_process":
            # It ran through an in-process endpoint of this process (the sampler is a thread here).
            assert set(local_client._endpoints) - endpoints_before
            endpoints_before = set(local_client._endpoints)
    assert set(local_client._endpoints) <= endpoints_before  # the HTTP run made none
    assert by_prompt(runs["in_process"]) == by_prompt(runs["http"])
    for s in runs["in_process"]:
        assert sum(1 for a, b in zip([0, *s.loss_mask], s.loss_mask) if b and not a) == 3  # three model turns
    for a, b in zip(sorted(runs["in_process"], key=lambda s: (s.prompt_id, s.completion_token_ids)),
                    sorted(runs["http"], key=lambda s: (s.prompt_id, s.completion_token_ids))):
        assert all(math.isclose(x, y, abs_tol=1e-5) for x, y in zip(a.completion_logprobs, b.completion_logprobs))


@pytest.mark.parametrize("body", [
    {"model": "m", "token_ids": [1, 2], "sampling_params": {"n": 2}},
    {"model": "m", "token_ids": [], "sampling_params": {}},
    {"model": "m", "token_ids": [1], "sampling_params": {}, "stream": True},
])
async def test_a_refused_call_raises_what_the_sdk_raises_for_the_route(make_sampler, body):
    sampler = make_sampler()
    config = TrainClientConfig(base_url=f"{sampler.url}/v1", api_key_var="TANDEM_SAMPLER_TOKEN")
    sdk = build_async_openai(config)
    # The check comes before any use of the rollouts: none needed for these.
    local = local_client.InProcessGenerate(local_client.Endpoint(None, Sessions()), config.base_url, 60.0)  # type: ignore[arg-type]
    errors = []
    for client in (sdk, local):
        with pytest.raises(openai.APIStatusError) as caught:
            await client.post(f"{sampler.url}/inference/v1/generate", cast_to=httpx.Response, body=body,
                              options={"headers": {"X-Session-ID": "s"}})
        errors.append(caught.value)
    await sdk.close()
    over_http, in_process = errors
    assert type(in_process) is type(over_http) is openai.BadRequestError
    assert str(in_process) == str(over_http) and in_process.body == over_http.body
    assert in_process.status_code == over_http.status_code == 400


def config_of(cls, **extra):
    return cls(base_url="http://127.0.0.1:1/v1", api_key_var="TANDEM_SAMPLER_TOKEN", **extra)


async def test_the_interception_server_builds_the_in_process_client_for_its_config_only():
    local_client.install()
    wrapped = server_module.resolve_client
    local_client.install()  # idempotent: not wrapped twice
    assert server_module.resolve_client is wrapped and wrapped.tandem_in_process
    endpoint = local_client.Endpoint(None, Sessions())  # type: ignore[arg-type]
    server = InterceptionServer()
    async with server:
        built = server._client(config_of(local_client.LocalTrainClientConfig, in_process=endpoint.id))
        assert isinstance(built, local_client.LocalTrainClient)
        assert isinstance(built.client, local_client.InProcessGenerate)
        plain = server._client(config_of(TrainClientConfig))
        assert type(plain) is TrainClient and isinstance(plain.client, openai.AsyncOpenAI)
    with pytest.raises(RuntimeError, match="no in-process generate endpoint"):
        local_client.LocalTrainClient(config_of(local_client.LocalTrainClientConfig, in_process=uuid.uuid4().hex))


@pytest.fixture
async def vf_rollouts(standin, byte_tokenizer):
    env = load_environment("verifiers:tandem-vf-parity")
    http = HttpClient(max_connections=8, timeout=30)
    pool = InferencePool([standin.url], max_concurrency=8, request_timeout=30, retries=0, http=http)
    for server in pool.servers:
        server.state, server.version = OK, 0
    workers = Workers(1)
    rollouts = Rollouts(env, pool, prompts_per_step=1, num_generations=2, sampling={"temperature": 1.0}, seed=0,
                        advantage="grpo", model_name=None, workers=workers, env_stats=EnvStats(), env_timeout=10,
                        env_retries=0)
    yield env, rollouts
    await http.aclose()
    workers.shutdown()


async def test_a_model_context_is_reused_until_what_it_holds_changes(vf_rollouts, byte_tokenizer):
    env, rollouts = vf_rollouts
    link = VerifiersLink(base_url="http://127.0.0.1:1", sessions=Sessions(), tokenizer=str(byte_tokenizer))
    sampling = {"temperature": 1.0, "max_tokens": 8}
    ctx = await env._context(rollouts, link, sampling)
    assert await env._context(rollouts, link, dict(sampling)) is ctx
    assert isinstance(ctx.client, local_client.LocalTrainClientConfig)
    assert ctx.sampling.temperature == 1.0 and ctx.sampling.max_tokens == 8
    # Another temperature, another max_tokens, another tokenizer, HTTP: each a context of its own.
    hotter = await env._context(rollouts, link, {**sampling, "temperature": 0.5})
    assert hotter is not ctx and hotter.sampling.temperature == 0.5
    shorter = await env._context(rollouts, link, {**sampling, "max_tokens": 4})
    assert shorter.sampling.max_tokens == 4
    other = VerifiersLink(base_url=link.base_url, sessions=link.sessions, tokenizer=str(byte_tokenizer) + "-x")
    assert (await env._context(rollouts, other, sampling)).client.renderer_model_name.endswith("-x")
    over_http = VerifiersLink(base_url=link.base_url, sessions=link.sessions, tokenizer=str(byte_tokenizer),
                              in_process=False)
    http_ctx = await env._context(rollouts, over_http, sampling)
    assert type(http_ctx.client) is TrainClientConfig and http_ctx.client.base_url == ctx.client.base_url
    # Other sessions (a new sampler state): a new endpoint, so calls never reach the old ones.
    fresh = VerifiersLink(base_url=link.base_url, sessions=Sessions(), tokenizer=str(byte_tokenizer))
    moved = await env._context(rollouts, fresh, sampling)
    assert moved is not ctx and moved.client.in_process != ctx.client.in_process
    assert local_client._endpoints[moved.client.in_process].sessions is fresh.sessions
    await env.aclose()

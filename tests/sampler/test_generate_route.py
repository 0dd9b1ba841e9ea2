"""The sampler's POST /inference/v1/generate: forwarded through the inference pool, answered in
vLLM's shape with the token strings `renderers` needs, sentinels masked, bad requests a 400."""

from __future__ import annotations

import httpx
import pytest

from services.sampler.rollouts.completions import parse_generate
from services.sampler.fleet.inference_pool import InferenceRequestError, WentBackwards

pytestmark = pytest.mark.timeout(60)


def answer(logprobs: list, spans=None) -> dict:
    ids = list(range(40, 40 + len(logprobs)))
    return {"request_id": "r", "choices": [{
        "index": 0, "finish_reason": "length", "token_ids": ids, "weight_versions": spans,
        "logprobs": {"content": [{"token_id": t, "logprob": lp} for t, lp in zip(ids, logprobs)]}}]}


def test_vllms_answer_gets_token_strings_and_its_sentinels_are_masked() -> None:
    served, versions, masked = parse_generate(answer([-0.5, -9999.0, None, float("nan"), -1.0]), 3)
    content = served["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in range(40, 45)]
    assert [e["logprob"] for e in content] == [-0.5, 0.0, 0.0, 0.0, -1.0]
    assert masked == [1, 2, 3] and versions == [3]  # no spans: the version served when sent
    assert parse_generate(answer([-1.0], [{"version": "4", "start": 0, "end": 1}]), 3)[1] == [4]


def test_an_answer_from_older_weights_or_without_logprobs_is_refused() -> None:
    with pytest.raises(WentBackwards):
        parse_generate(answer([-1.0], [{"version": "2", "start": 0, "end": 1}]), 3)
    no_logprobs = answer([-1.0])
    no_logprobs["choices"][0]["logprobs"] = None
    with pytest.raises(InferenceRequestError, match="logprobs"):
        parse_generate(no_logprobs, 0)


async def test_the_route_forwards_and_refuses_what_it_cannot_serve(make_sampler, standin) -> None:
    sampler = make_sampler()
    async with httpx.AsyncClient(base_url=sampler.url, timeout=30) as http:
        ok = await http.post("/inference/v1/generate", json={
            "token_ids": [104, 105], "sampling_params": {"max_tokens": 3, "temperature": 1.0, "seed": 1}},
            headers={"X-Session-ID": "someone-elses"})
        assert ok.status_code == 200, ok.text
        choice = ok.json()["choices"][0]
        assert len(choice["token_ids"]) == len(choice["logprobs"]["content"]) <= 3
        assert all(e["token"] == f"token_id:{e['token_id']}" for e in choice["logprobs"]["content"])
        for body, words in [({"token_ids": [], "sampling_params": {}}, "token_ids"),
                            ({"token_ids": [1], "sampling_params": {"n": 2}}, "n must be 1"),
                            ({"token_ids": [1], "sampling_params": {}, "stream": True}, "stream"),
                            ({"token_ids": [-1], "sampling_params": {}}, "token_ids")]:
            refused = await http.post("/inference/v1/generate", json=body)
            assert refused.status_code == 400 and words in refused.json()["error"]["message"], refused.text

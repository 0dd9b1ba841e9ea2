"""Environment faults and limits: a failing environment turn or reward is retried (the
trajectory, from the start), then its group is dropped and counted; a conversation that
outgrows the context ends with finish_reason "length"; synchronous environment code runs in
worker threads, never stalling the event loop; bad environment settings are refused."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from services.sampler.rollouts.envs import load_environment
from services.sampler.rollouts.envs.base import Completion, Example, Reward
from tests.support.driver import fill_the_context_on_the_second_turn
from tests.support.envs import CountEnv, EchoDialogue

pytestmark = pytest.mark.timeout(60)


async def test_an_env_turn_that_fails_once_is_retried_and_the_group_is_whole(standin, make_rollouts):
    env = EchoDialogue(fail="first")
    rollouts = make_rollouts(env, [standin.url])
    group = await rollouts.group(env.examples("train")[0], "g0", min_version=0, seed=0)
    assert group.invalid is None and len(group.completions) == 4
    assert all(len(c.conversation.turns) == 3 for c in group.completions)
    counts = rollouts.env_stats.of("echo_dialogue")
    assert counts.env_errors == 1 and counts.trajectory_retries == 1 and counts.groups_dropped == 0
    assert "env broke once" in counts.last_error


async def test_an_env_turn_that_always_fails_drops_its_group_after_the_retries(standin, make_rollouts, caplog):
    env = EchoDialogue(fail="always")
    rollouts = make_rollouts(env, [standin.url], env_retries=2)
    group = await rollouts.group(env.examples("train")[0], "g0", min_version=0, seed=0, n=1)
    assert group.invalid is not None and "failed 3 times" in group.invalid and "env broke" in group.invalid
    with pytest.raises(ValueError, match="cannot become samples"):
        group.samples(env.name)
    counts = rollouts.env_stats.of("echo_dialogue")
    assert counts.groups_dropped == 1 and counts.trajectory_retries == 2 and counts.env_errors == 3
    assert "the group is dropped and its slot refilled" in caplog.text
    assert not rollouts.pool.sessions  # every trajectory's session was released


async def test_an_env_turn_past_env_timeout_is_a_fault(standin, make_rollouts):
    env = EchoDialogue(sleep=1.0)
    rollouts = make_rollouts(env, [standin.url], env_timeout=0.1, env_retries=1)
    started = time.monotonic()
    group = await rollouts.group(env.examples("train")[0], "g0", min_version=0, seed=0)
    assert time.monotonic() - started < 1.0
    assert group.invalid is not None and "did not answer within 0.1 s (setting env_timeout)" in group.invalid


async def _raises(example: Example, completion: Completion) -> float:
    raise ValueError("reward broke")


# What the slow reward saw: the thread it ran on and the event loop's ticks while it ran.
_TICKS = [0]
_SEEN: list[tuple[str, int]] = []


def _sleeps(example: Example, completion: Completion) -> float:
    ticks = _TICKS[0]
    time.sleep(0.3)  # synchronous: runs in a worker thread
    _SEEN.append((threading.current_thread().name, _TICKS[0] - ticks))
    return 1.0


class BrokenRewardEnv(CountEnv):
    rewards = (Reward("broken", _raises),)


class SlowSyncRewardEnv(CountEnv):
    rewards = (Reward("slow", _sleeps),)


async def test_a_single_turn_reward_that_raises_is_retried_then_the_group_dropped(standin, make_rollouts):
    env = BrokenRewardEnv()
    rollouts = make_rollouts(env, [standin.url], env_retries=1)
    group = await rollouts.group(env.examples("train")[0], "g0", min_version=0, seed=0, n=3)
    assert group.invalid is not None and "ValueError: reward broke" in group.invalid
    counts = rollouts.env_stats.of("count")
    assert counts.env_errors == 2 and counts.trajectory_retries == 1 and counts.groups_dropped == 1


async def test_synchronous_rewards_run_in_worker_threads_off_the_event_loop(standin, make_rollouts):
    env = SlowSyncRewardEnv()
    rollouts = make_rollouts(env, [standin.url], env_timeout=5)
    _TICKS[0], _SEEN[:] = 0, []
    done = asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            await asyncio.sleep(0.01)
            _TICKS[0] += 1

    tick = asyncio.create_task(ticker())
    group = await rollouts.group(env.examples("train")[0], "g0", min_version=0, seed=0)
    done.set()
    await tick
    assert group.invalid is None and group.rewards == [1.0] * 4
    # Each reward ran on a worker thread, and the loop kept ticking while they slept. Run on
    # the loop, a reward would see no tick at all. (Not a bound on the loop's longest gap:
    # that measured the machine as well, and a 0.6 s stall of the whole process on a loaded
    # CI machine once failed it with the rewards in their threads.)
    assert len(_SEEN) == 4 and all(name.startswith("tandem-env") for name, _ in _SEEN), _SEEN
    assert sum(ticks for _, ticks in _SEEN) > 0, _SEEN


async def test_a_conversation_that_outgrows_the_context_ends_with_length(standin, make_rollouts):
    env = EchoDialogue(max_turns=6)
    context = fill_the_context_on_the_second_turn(standin.url)
    rollouts = make_rollouts(env, [standin.url], max_tokens=16)
    group = await rollouts.group(env.examples("train")[0], "g0", min_version=0, seed=0, n=2)
    assert group.invalid is None
    for c in group.completions:
        assert c.finish_reason == "length" and c.conversation.ended_by == "length"
        assert len(c.conversation.turns) == 2 and c.conversation.turns[1].text == "abcd"
        assert len(c.prompt_token_ids) + len(c.token_ids) == context
    samples = group.samples(env.name)
    assert {s["finish_reason"] for s in samples} == {"length"}


@pytest.mark.parametrize("name, args, setting", [
    ("parity_dialogue", {"turns": 0}, "turns"),
    ("parity_dialogue", {"max_tokens": 0}, "max_tokens"),
    ("parity_dialogue", {"max_digits": 9}, "max_digits"),
    ("calculator", {"max_turns": 1}, "max_turns"),
])
def test_bad_environment_settings_are_refused_naming_the_setting(name, args, setting):
    with pytest.raises(ValueError, match=setting):
        load_environment(name, **args)


def test_a_multi_turn_environment_with_bad_max_turns_is_refused():
    class Broken(EchoDialogue):
        pass

    env = Broken()
    env.max_turns = 0
    with pytest.raises(ValueError, match="max_turns must be an integer >= 1"):
        env.check()

"""Session affinity: every turn of a trajectory goes to one inference server (its prefix cache
holds the conversation) and carries the trajectory's id in vLLM's X-Session-ID header;
trajectories spread over servers by outstanding requests; a server that leaves mid-conversation
hands its trajectories to another; a weight update mid-conversation shows in the versions."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from services.sampler.fleet.inference_pool import LEAVING
from tests.support.driver import hold_second_turns, release_held_turns
from tests.support.envs import EchoDialogue

pytestmark = pytest.mark.timeout(60)


def stats(server) -> dict:
    return httpx.get(server.url + "/_standin/stats").json()


def sessions(server) -> dict[str, int]:
    return stats(server)["sessions"]


async def test_every_turn_of_a_trajectory_goes_to_one_server_and_trajectories_spread(two_standins, make_rollouts):
    env = EchoDialogue(max_turns=3)
    rollouts = make_rollouts(env, [s.url for s in two_standins], max_tokens=6)
    groups = await asyncio.gather(*(rollouts.group(ex, f"g{i}", min_version=0, seed=i, n=4)
                                    for i, ex in enumerate(env.examples("train")[:4])))
    assert all(g.invalid is None for g in groups)
    seen = [sessions(s) for s in two_standins]
    # 16 trajectories x 3 turns, each trajectory's id on exactly one server, 3 requests there.
    assert set(seen[0]).isdisjoint(seen[1])
    assert len(seen[0]) + len(seen[1]) == 16
    assert all(count == 3 for by_server in seen for count in by_server.values())
    assert min(len(seen[0]), len(seen[1])) >= 4  # balanced by outstanding requests, not all on one
    assert not rollouts.pool.sessions  # released when each trajectory ended


async def _conversations_under_way(standins, make_rollouts):
    """Six 4-turn trajectories over both stand-ins, once one of them has had its first turn on
    the first stand-in and waits there in its second (the first holds every second call): the
    fault then comes mid-conversation whatever the machine's load. A 'first request seen' wait
    raced the conversations, which may all end in under a second. Returns (the pool's record of
    the first server, the group's task)."""
    env = EchoDialogue(max_turns=4)
    first, second = standins
    rollouts = make_rollouts(env, [first.url, second.url], max_tokens=40)
    hold_second_turns(first.url)
    task = asyncio.create_task(rollouts.group(env.examples("train")[0], "g0", min_version=0, seed=0, n=6))
    while not (await asyncio.to_thread(stats, first))["held"]:
        assert not task.done(), task.result()
        await asyncio.sleep(0.01)
    return rollouts.pool, rollouts.pool.find(first.url), task


async def _handed_over(task, first, second) -> None:
    group = await task
    assert group.invalid is None and all(len(c.conversation.turns) == 4 for c in group.completions)
    assert set(first) & set(sessions(second))  # a trajectory began on the first server and finished on the second


async def test_a_server_leaving_mid_conversation_hands_its_trajectories_over(two_standins, make_rollouts):
    pool, leaving, task = await _conversations_under_way(two_standins, make_rollouts)
    pool.set_state(leaving, LEAVING, "removed by the test")
    release_held_turns(two_standins[0].url)  # the held second turns end there; the third ones must go elsewhere
    await _handed_over(task, sessions(two_standins[0]), two_standins[1])


async def test_a_weight_update_mid_conversation_shows_in_the_versions(standin, make_rollouts):
    env = EchoDialogue(max_turns=3)
    rollouts = make_rollouts(env, [standin.url], max_tokens=4)
    server = rollouts.pool.servers[0]
    calls = 0
    original = rollouts.generate

    async def generate(prompt, **kw):
        nonlocal calls
        calls += 1
        if calls == 2:  # between the first and the second turn: the server moves to version 1
            httpx.post(standin.url + "/update_weight_version", json={"new_version": "1"}).raise_for_status()
            rollouts.pool.set_version(server.url, 1)
        return await original(prompt, **kw)

    rollouts.generate = generate
    group = await rollouts.group(env.examples("train")[0], "g0", min_version=0, seed=0, n=1)
    (c,) = group.completions
    assert c.versions == [0, 1] and group.policy_versions == [0]
    assert group.samples(env.name)[0]["versions"] == [0, 1]


async def test_a_server_dying_mid_conversation_hands_its_trajectories_over(two_standins, make_rollouts):
    _, _, task = await _conversations_under_way(two_standins, make_rollouts)
    began = sessions(two_standins[0])
    # Its held requests are cut when the graceful shutdown runs out; new connections are refused.
    await asyncio.to_thread(two_standins[0].stop)
    await _handed_over(task, began, two_standins[1])

"""How a native multi-turn episode ended (docs/environments.md, "How an episode ended"): a last
reply cut by `max_tokens` that the environment (or `max_turns`) then ended is "stop" and keeps
its loss under the trainer's `mask_truncated_completions`; a full context is "length" and
does not. Each call's own reason stays in the sample's `metrics`."""

from __future__ import annotations

import httpx
import pytest

from services.sampler.rollouts.envs.multiturn import Conversation
from services.trainer.collate import collate
from shared.wire import Sample
from tests.support.driver import fill_the_context_on_the_second_turn
from tests.support.envs import EchoDialogue

pytestmark = pytest.mark.timeout(60)


class GameOver(EchoDialogue):
    """The environment ends the episode itself after the model's second turn (a game that is
    over), whatever that turn said; `max_turns` is far away."""

    name = "game_over"

    async def env_response(self, convo: Conversation):
        return None if len(convo.turns) == 2 else [{"role": "user", "content": "next"}]


def trained_tokens(samples: list[dict]) -> list[int]:
    """Loss tokens per sample as the trainer counts them with `mask_truncated_completions`."""
    batch = collate([Sample.model_validate(s) for s in samples], mask_truncated=True)
    return [int(n) for n in batch.tokens_per_sequence.tolist()]


@pytest.mark.parametrize("env, ended_by", [(GameOver(max_turns=6), "env"), (EchoDialogue(max_turns=2), "max_turns")])
async def test_a_cut_last_reply_in_an_episode_ended_otherwise_is_stop_and_keeps_its_loss(standin, make_rollouts,
                                                                                        env, ended_by):
    # Every reply is 8 bytes, cut at max_tokens = 4: each call ends "length".
    httpx.post(standin.url + "/_standin/configure", json={"replies": ["abcdefgh"]}).raise_for_status()
    rollouts = make_rollouts(env, [standin.url], max_tokens=4)
    group = await rollouts.group(env.examples("train")[0], "g0", min_version=0, seed=0, n=2)
    assert group.invalid is None
    for c in group.completions:
        turns = c.conversation.turns
        assert len(turns) == 2 and [t.finish_reason for t in turns] == ["length", "length"]
        assert [t.text for t in turns] == ["abcd", "abcd"] and c.conversation.ended_by == ended_by
        assert c.finish_reason == "stop"
    samples = group.samples(env.name)
    assert [s["finish_reason"] for s in samples] == ["stop", "stop"]
    assert all(s["metrics"] == {"turn_finish/length": 2.0, "last_turn_finish/length": 1.0} for s in samples)
    assert trained_tokens(samples) == [8, 8]  # both sampled turns, not masked as truncated


async def test_a_full_context_is_length_and_carries_no_loss_when_truncated_ones_are_masked(standin, make_rollouts):
    env = EchoDialogue(max_turns=6)
    fill_the_context_on_the_second_turn(standin.url)
    rollouts = make_rollouts(env, [standin.url], max_tokens=16)
    group = await rollouts.group(env.examples("train")[0], "g0", min_version=0, seed=0, n=2)
    assert group.invalid is None
    samples = group.samples(env.name)
    assert [s["finish_reason"] for s in samples] == ["length", "length"]
    # The first reply stopped by itself; the second was cut where the context ended.
    assert all(s["metrics"] == {"turn_finish/stop": 1.0, "turn_finish/length": 1.0, "last_turn_finish/length": 1.0}
               for s in samples)
    assert trained_tokens(samples) == [0, 0]

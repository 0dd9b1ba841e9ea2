"""Multi-turn trajectories on the real CPU server of the tiny model: the ids trained on are the
ids sampled plus the ids the chat template renders for the environment, id for id, and the
behaviour logprobs are the server's own logprobs of the whole trajectory."""

from __future__ import annotations

import math

import pytest

from services.sampler.rollouts.envs import load_environment
from services.sampler.rollouts.envs.multiturn import Conversation
from tests.multiturn.conftest import server_root

pytestmark = pytest.mark.timeout(120)


def oracle_messages(convo: Conversation, text_of=lambda turn: turn.text) -> list[dict]:
    """The conversation with each assistant message as the raw text the model sampled."""
    out, turn = [], iter(convo.turns)
    for message in convo.messages:
        out.append({"role": "assistant", "content": text_of(next(turn))} if message["role"] == "assistant" else message)
    return out


def sampled_text(tok):
    """A turn's sampled ids as text with special tokens kept (an untrained model samples
    `<|unk|>` or `<|im_start|>` now and then; `text` leaves them out), less a final
    `<|im_end|>`, which the template writes itself."""
    def text_of(turn) -> str:
        return tok.decode(turn.token_ids, skip_special_tokens=False).removesuffix("<|im_end|>")
    return text_of


async def test_trajectory_ids_are_the_sampled_ids_plus_the_rendered_environment(cpu_server, make_rollouts):
    env = load_environment("parity_dialogue", turns=3, max_tokens=2)
    rollouts = make_rollouts(env, [cpu_server.base_url])
    example = env.examples("train")[0]
    group = await rollouts.group(example, "g0", min_version=0, seed=7)
    assert group.invalid is None and len(group.completions) == 4
    tok = cpu_server.engine.tokenizer
    for c in group.completions:
        convo = c.conversation
        assert len(convo.turns) == 3 and convo.ended_by == "max_turns" and c.finish_reason == "stop"
        # What the model sampled, in order, is exactly where the loss mask is 1.
        sampled = [t for turn in convo.turns for t in turn.token_ids]
        assert [t for t, m in zip(c.token_ids, c.loss_mask) if m] == sampled
        assert all(lp == 0.0 for lp, m in zip(c.logprobs, c.loss_mask) if not m)
        # Independent oracle: the template rendering the whole conversation (assistant turns as
        # the text sampled) gives our ids, then the final assistant turn's closing.
        rendered = tok.apply_chat_template(oracle_messages(convo, sampled_text(tok)), tokenize=False,
                                           add_generation_prompt=False)
        oracle = tok.encode(rendered, add_special_tokens=False)
        ours = c.prompt_token_ids + c.token_ids
        assert oracle[:len(ours)] == ours, (tok.decode(oracle), tok.decode(ours))
        assert tok.decode(oracle[len(ours):]) in ("<|im_end|>\n", "\n")
        # The environment's numbers reached the prompts as user turns.
        numbers = example.info["numbers"]
        assert tok.decode(ours).count("<|im_start|>user\n") == 3
        assert all(f"user\n{n}<|im_end|>" in tok.decode(ours) for n in numbers)


async def test_behaviour_logprobs_equal_the_servers_logprobs_of_the_whole_trajectory(cpu_server, make_rollouts):
    env = load_environment("parity_dialogue", turns=3, max_tokens=3)
    rollouts = make_rollouts(env, [cpu_server.base_url])
    group = await rollouts.group(env.examples("train")[1], "g1", min_version=0, seed=3)
    for c in group.completions:
        ids = c.prompt_token_ids + c.token_ids
        answer = await rollouts.pool.http.post(server_root(cpu_server.base_url) + "/v1/completions", json={
            "model": "tiny", "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0})
        rows = answer.json()["choices"][0]["prompt_logprobs"]
        start = len(c.prompt_token_ids)
        checked = 0
        for i, (token, lp, m) in enumerate(zip(c.token_ids, c.logprobs, c.loss_mask)):
            if m:
                expected = rows[start + i][str(token)]["logprob"]
                assert math.isclose(lp, expected, abs_tol=1e-5), (i, lp, expected)
                checked += 1
        assert checked == sum(len(t.token_ids) for t in c.conversation.turns) > 0


async def test_group_samples_carry_masks_versions_and_reward(cpu_server, make_rollouts):
    env = load_environment("parity_dialogue", turns=2, max_digits=2)
    rollouts = make_rollouts(env, [cpu_server.base_url])
    example = env.examples("train")[2]
    group = await rollouts.group(example, "g2", min_version=0, seed=1)
    samples = group.samples(env.name)
    for sample, c in zip(samples, group.completions):
        assert sample["completion_token_ids"] == c.token_ids and sample["loss_mask"] == c.loss_mask
        assert sample["policy_version"] == 0 and sample["versions"] == [0]
        letters = [turn.text.strip()[:1] for turn in c.conversation.turns]
        assert sample["reward"] == sum(a == b for a, b in zip(letters, example.answer)) / 2
    stats = rollouts.env_stats.of("parity_dialogue")
    assert stats.trajectories == 4 and stats.turns == 8 and stats.env_errors == 0

"""How a verifiers episode ended (docs/environments.md, "How an episode ended"), through a whole
sampler on the stand-in: a last reply cut by `max_tokens` after which the environment closed
the exchange is "stop" and keeps its loss under the trainer's `mask_truncated_completions`; a
cut reply that was the agent's last word (a single-turn taskset) is "length" and does not.
Each call's own reason stays in the sample's `metrics`."""

from __future__ import annotations

import httpx
import pytest

from services.trainer.collate import collate
from shared.wire import Sample
from tests.support.driver import batch_samples

pytestmark = pytest.mark.timeout(120)




def trained_tokens(samples: list[Sample]) -> list[int]:
    return [int(n) for n in collate(samples, mask_truncated=True).tokens_per_sequence.tolist()]


async def test_an_episode_the_env_ended_after_a_cut_reply_is_stop_and_keeps_its_loss(make_sampler, standin,
                                                                                    byte_tokenizer):
    # Both replies are 8 bytes, cut at max_tokens = 4; the dialogue env closes after the second.
    httpx.post(standin.url + "/_standin/configure", json={"replies": ["abcdefgh"]}).raise_for_status()
    sampler = make_sampler(env="verifiers:tandem-vf-dialogue", env_args='{"turns": 2}', vf_tokenizer=str(byte_tokenizer),
                           prompts_per_step=1, num_generations=2, max_tokens=4)
    samples = await batch_samples(sampler.url)
    assert len(samples) == 2
    for s in samples:
        trained = bytes(t for t, m in zip(s.completion_token_ids, s.loss_mask) if m)
        assert trained == b"abcdabcd", trained  # two model turns, both cut
        assert s.finish_reason == "stop"
        assert s.model_extra["metrics"]["turn_finish/length"] == 2.0
        assert s.model_extra["metrics"]["last_turn_finish/length"] == 1.0
    assert trained_tokens(samples) == [8, 8]


async def test_a_single_turn_episode_cut_by_max_tokens_is_length_and_masked(make_sampler, standin, byte_tokenizer):
    httpx.post(standin.url + "/_standin/configure", json={"replies": ["abcdefgh"]}).raise_for_status()
    sampler = make_sampler(env="verifiers:tandem-vf-parity", vf_tokenizer=str(byte_tokenizer), prompts_per_step=1,
                           num_generations=2, max_tokens=4)
    samples = await batch_samples(sampler.url)
    assert len(samples) == 2
    for s in samples:
        assert bytes(s.completion_token_ids) == b"abcd" and s.finish_reason == "length"
        assert s.model_extra["metrics"] == {"reply_chars": 4.0, "turn_finish/length": 1.0,
                                            "last_turn_finish/length": 1.0}
    assert trained_tokens(samples) == [0, 0]

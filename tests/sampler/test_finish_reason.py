"""How a single-turn episode ended (docs/environments.md, "How an episode ended"), through a
whole sampler on the stand-in: one model call is the episode, so a reply cut by `max_tokens` is
"length" and carries no loss under the trainer's `mask_truncated_completions`, and a reply
that ended by itself is "stop" and keeps it. The multi-turn paths' cases, where a cut last
reply can be "stop", are in tests/multiturn/test_episode_end.py and
tests/vf/test_vf_finish_reason.py."""

from __future__ import annotations

import httpx
import pytest

from services.trainer.collate import collate
from tests.support.driver import batch_samples

pytestmark = pytest.mark.timeout(60)




@pytest.mark.parametrize("max_tokens, text, finish, trained", [
    (4, b"abcd", "length", 0),       # cut by max_tokens: nothing else ended the episode
    (16, b"abcdefgh", "stop", 8),    # the reply ended by itself
])
async def test_a_single_turn_sample_is_length_exactly_when_its_reply_was_cut(make_sampler, standin, max_tokens,
                                                                              text, finish, trained):
    httpx.post(standin.url + "/_standin/configure", json={"reply": "abcdefgh"}).raise_for_status()
    sampler = make_sampler(prompts_per_step=1, num_generations=2, max_tokens=max_tokens)
    samples = await batch_samples(sampler.url)
    assert len(samples) == 2
    for s in samples:
        assert bytes(s.completion_token_ids) == text and s.finish_reason == finish
        assert "metrics" not in s.model_extra  # one call: its own reason is the sample's
    per_sample = collate(samples, mask_truncated=True).tokens_per_sequence.tolist()
    assert per_sample == [trained, trained]
    assert collate(samples).tokens_per_sequence.tolist() == [len(text)] * 2  # masked only when asked

"""Collation: right padding, the completion window, and micro-batch splitting."""

from __future__ import annotations

import pytest
import torch

from services.trainer.collate import BatchFormatError, collate, split_micro_batches
from shared.wire import Sample
from tests.trainer.conftest import make_samples


def _sample(prompt: list[int], completion: list[int], mask: list[int] | None = None, adv: float = 1.0) -> Sample:
    return Sample(prompt_id="p", group_id="g", prompt_token_ids=prompt, completion_token_ids=completion,
                  completion_logprobs=[-0.1 * (k + 1) for k in range(len(completion))],
                  loss_mask=mask or [1] * len(completion), reward=0.0, advantage=adv,
                  policy_version=0, finish_reason="stop")


def test_layout_by_hand() -> None:
    a = _sample([5, 6, 7], [10, 11], mask=[1, 0], adv=0.5)  # P=3, C=2
    b = _sample([8, 9], [12, 13, 14], adv=-1.0)  # P=2, C=3
    mb = collate([a, b], pad_token_id=0)
    assert mb.input_ids.tolist() == [[5, 6, 7, 10, 11], [8, 9, 12, 13, 14]]
    assert mb.attention_mask.tolist() == [[1] * 5, [1] * 5]
    # Window starts at shortest prompt - 1 = 1: positions 1..3 predict tokens 2..4.
    assert mb.start == 1
    assert mb.targets.tolist() == [[0, 10, 11], [12, 13, 14]]
    assert mb.loss_mask.tolist() == [[0, 1, 0], [1, 1, 1]]
    torch.testing.assert_close(mb.behaviour_logprobs, torch.tensor([[0.0, -0.1, -0.2], [-0.1, -0.2, -0.3]]))
    assert mb.advantages.tolist() == [0.5, -1.0]
    assert mb.tokens_per_sequence.tolist() == [1.0, 3.0]


def test_right_padding() -> None:
    mb = collate([_sample([5, 6], [10]), _sample([8, 9, 4, 4], [12, 13])], pad_token_id=3)
    assert mb.input_ids.tolist() == [[5, 6, 10, 3, 3, 3], [8, 9, 4, 4, 12, 13]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 0, 0, 0], [1] * 6]
    # Window = positions 1..4 (start = 2 - 1); row 1's tokens at 4, 5 are predicted at 3, 4.
    assert mb.start == 1
    assert mb.loss_mask.tolist() == [[1, 0, 0, 0], [0, 0, 1, 1]]
    assert mb.targets.tolist() == [[10, 3, 3, 3], [3, 3, 12, 13]]


def test_inconsistent_sample_is_rejected_with_its_numbers() -> None:
    bad = _sample([1, 2], [3, 4, 5])
    bad.completion_logprobs = [-1.0]
    with pytest.raises(BatchFormatError, match="3 completion tokens but 1 completion_logprobs"):
        collate([bad])
    with pytest.raises(BatchFormatError, match="empty prompt"):
        collate([_sample([], [3])])


def test_split_covers_every_sample_once() -> None:
    samples = make_samples(10)
    mbs = split_micro_batches(samples, 4)
    assert [mb.size for mb in mbs] == [3, 3, 2, 2]
    assert sorted(i for mb in mbs for i in mb.indices) == list(range(10))
    total = sum(float(mb.loss_mask.sum()) for mb in mbs)
    assert total == sum(sum(s.loss_mask) for s in samples)
    with pytest.raises(ValueError, match="cannot fill"):
        split_micro_batches(samples[:2], 3)


def test_mask_truncated_clears_length_finished_samples() -> None:
    stopped = _sample([5, 6], [10, 11], adv=0.5)
    cut = _sample([7, 8, 9], [12, 13, 14], mask=[1, 0, 1], adv=-1.0)
    cut.finish_reason = "length"
    plain = collate([stopped, cut])
    masked = collate([stopped, cut], mask_truncated=True)
    assert plain.loss_mask.tolist() == [[1, 1, 0, 0], [0, 1, 0, 1]]
    assert masked.loss_mask.tolist() == [[1, 1, 0, 0], [0, 0, 0, 0]]
    assert masked.tokens_per_sequence.tolist() == [2.0, 0.0]
    # Still in the batch, with everything else as before.
    for name in ("input_ids", "attention_mask", "targets", "behaviour_logprobs", "advantages"):
        assert torch.equal(getattr(masked, name), getattr(plain, name)), name


def test_split_passes_mask_truncated_on() -> None:
    samples = make_samples(6)
    for k in (1, 4):
        samples[k].finish_reason = "length"
    for flag in (False, True):
        mbs = split_micro_batches(samples, 3, mask_truncated=flag)
        for mb in mbs:
            for row, i in enumerate(mb.indices):
                expected = 0 if flag and i in (1, 4) else sum(samples[i].loss_mask)
                assert mb.tokens_per_sequence[row].item() == expected, (flag, i)


def test_non_finite_behaviour_logprob_is_masked_and_zeroed() -> None:
    s = _sample([5, 6], [10, 11, 12, 13])
    s.completion_logprobs = [-0.5, float("nan"), float("-inf"), float("inf")]
    mb = collate([s])
    # One sample with a 2-token prompt: its 4 completion tokens fill window columns 0..3.
    assert mb.loss_mask.tolist() == [[1, 0, 0, 0]]
    assert mb.behaviour_logprobs.tolist() == [[-0.5, 0.0, 0.0, 0.0]]
    assert mb.tokens_per_sequence.tolist() == [1.0]

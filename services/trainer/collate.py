"""Turn a batch's samples into right-padded tensors, split into micro-batches.

Layout of one micro-batch of B samples, L = longest prompt + completion:

* `input_ids`, `attention_mask` [B, L]: prompt then completion, right-padded.
* The completion is scored from the logits of the positions that predict it: token
  j of sequence i is predicted by position j - 1. Only the window of positions
  `[start, L - 1)` with `start` = (shortest prompt) - 1 can predict a completion token,
  so the per-token tensors cover that window only ([B, T], T = L - 1 - start):
  `targets` (the next token), `loss_mask` (1 where the token is a completion token whose
  `loss_mask` is 1), `behaviour_logprobs` (the sampler's `completion_logprobs`).
* `advantages` [B], `tokens_per_sequence` [B] (loss tokens per sample).

Two kinds of token carry no loss even where the sample's `loss_mask` says 1:

* with `mask_truncated`, every token of a sample whose episode ran out of room
  (`finish_reason == "length"`, TRL's `mask_truncated_completions`): its reward judges an
  unfinished answer. The sampler says "length" by one rule on every path (a full context, or
  a last reply cut at max_tokens that nothing else ended: docs/environments.md, "How an
  episode ended"), so an episode its environment ended after a cut reply keeps its loss.
  The sample stays in the batch with zero loss tokens, and the `grpo` normaliser, which
  counts only sequences that have loss tokens, leaves it out;
* a token whose behaviour logprob is not finite (NaN or inf). The sampler never sends one;
  if it did, no importance ratio could be formed for it. Its value is stored as 0.0 so that
  nothing downstream meets a NaN.

Samples are sorted by length before splitting so micro-batches pad little; the order
does not change the accumulated gradient (a sum over samples).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from shared.wire import Sample


class BatchFormatError(ValueError):
    """A sample whose fields disagree (lengths of logprobs/mask vs completion)."""


@dataclass
class MicroBatch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    start: int
    targets: torch.Tensor
    loss_mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor
    tokens_per_sequence: torch.Tensor
    indices: list[int]  # positions of these samples in the original batch
    # False for rows that cannot move the weights (learner.py, `carrying_split`): forwarded
    # for the metrics without building a graph, never backpropagated.
    carries_gradient: bool = True

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_tokens(self) -> int:
        """Real (non-pad) tokens, prompt included: what the forward pass processes."""
        return int(self.attention_mask.sum())

    def to(self, device: torch.device | str) -> MicroBatch:
        moved = {
            name: (value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value)
            for name, value in self.__dict__.items()
        }
        return MicroBatch(**moved)

    def rows(self, keep: Sequence[int], carries_gradient: bool) -> MicroBatch:
        """The micro-batch of rows `keep` (positions in this one), on the same window."""
        at = torch.tensor(list(keep), dtype=torch.long)
        fields = {name: (value.index_select(0, at) if isinstance(value, torch.Tensor) else value)
                  for name, value in self.__dict__.items()}
        fields.update(indices=[self.indices[k] for k in keep], carries_gradient=carries_gradient)
        return MicroBatch(**fields)


def validate_sample(sample: Sample, index: int) -> None:
    n = len(sample.completion_token_ids)
    if len(sample.completion_logprobs) != n or len(sample.loss_mask) != n:
        raise BatchFormatError(
            f"sample {index} (prompt_id {sample.prompt_id!r}) has {n} completion tokens but "
            f"{len(sample.completion_logprobs)} completion_logprobs and {len(sample.loss_mask)} loss_mask entries"
        )
    if len(sample.prompt_token_ids) == 0:
        # The first completion token needs a preceding position to be predicted from.
        raise BatchFormatError(f"sample {index} (prompt_id {sample.prompt_id!r}) has an empty prompt")


def collate(
    samples: Sequence[Sample],
    indices: Sequence[int] | None = None,
    pad_token_id: int = 0,
    *,
    mask_truncated: bool = False,
) -> MicroBatch:
    """Collate samples into one right-padded micro-batch (see the module docstring).

    With `mask_truncated`, samples with `finish_reason == "length"` get an all-zero loss mask.
    """
    if not samples:
        raise ValueError("cannot collate an empty list of samples")
    indices = list(range(len(samples))) if indices is None else list(indices)
    for i, s in zip(indices, samples):
        validate_sample(s, i)
    lengths = [len(s.prompt_token_ids) + len(s.completion_token_ids) for s in samples]
    B, L = len(samples), max(lengths)
    start = min(len(s.prompt_token_ids) for s in samples) - 1
    T = max(L - 1 - start, 1)

    # Filled in numpy and handed to torch once: a numpy slice assignment costs a microsecond,
    # a torch one several, and a batch of short samples spent a tenth of its step here.
    input_ids = np.full((B, L), pad_token_id, dtype=np.int64)
    attention_mask = np.zeros((B, L), dtype=np.int64)
    targets = np.full((B, T), pad_token_id, dtype=np.int64)
    loss_mask = np.zeros((B, T), dtype=np.float32)
    behaviour = np.zeros((B, T), dtype=np.float32)
    for row, s in enumerate(samples):
        # Lists or numpy arrays (the arrays wire form).
        P, C = len(s.prompt_token_ids), len(s.completion_token_ids)
        input_ids[row, :P] = s.prompt_token_ids
        attention_mask[row, : P + C] = 1
        # Completion token k sits at position P + k and is predicted at P + k - 1,
        # i.e. window column P + k - 1 - start.
        if C:
            input_ids[row, P : P + C] = s.completion_token_ids
            col = P - 1 - start
            targets[row, col : col + C] = s.completion_token_ids
            logprobs = np.asarray(s.completion_logprobs, dtype=np.float32)
            finite = np.isfinite(logprobs)
            if not (mask_truncated and s.finish_reason == "length"):
                mask = np.asarray(s.loss_mask, dtype=np.float32)
                loss_mask[row, col : col + C] = np.where(finite, mask, 0.0)
            behaviour[row, col : col + C] = np.where(finite, logprobs, 0.0)
    loss_mask_t = torch.from_numpy(loss_mask)
    return MicroBatch(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=torch.from_numpy(attention_mask),
        start=start,
        targets=torch.from_numpy(targets),
        loss_mask=loss_mask_t,
        behaviour_logprobs=torch.from_numpy(behaviour),
        advantages=torch.tensor([float(s.advantage) for s in samples], dtype=torch.float32),
        tokens_per_sequence=loss_mask_t.sum(-1),
        indices=indices,
    )


def split_micro_batches(
    samples: Sequence[Sample],
    num_micro_batches: int,
    pad_token_id: int = 0,
    sort: bool = True,
    *,
    mask_truncated: bool = False,
) -> list[MicroBatch]:
    """Split `samples` into `num_micro_batches` micro-batches of equal size (the last ones
    one smaller when the count does not divide), sorted by length when `sort`.
    `mask_truncated` is passed on to `collate`."""
    if num_micro_batches < 1:
        raise ValueError("num_micro_batches must be >= 1")
    if len(samples) < num_micro_batches:
        raise ValueError(f"{len(samples)} samples cannot fill {num_micro_batches} micro-batches")
    order = list(range(len(samples)))
    if sort:
        order.sort(key=lambda i: len(samples[i].prompt_token_ids) + len(samples[i].completion_token_ids))
    base, extra = divmod(len(samples), num_micro_batches)
    out, at = [], 0
    for k in range(num_micro_batches):
        size = base + (1 if k < extra else 0)
        chunk = order[at : at + size]
        at += size
        out.append(collate([samples[i] for i in chunk], chunk, pad_token_id, mask_truncated=mask_truncated))
    return out

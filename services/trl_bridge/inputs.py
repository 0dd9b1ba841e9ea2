"""A rank's share of a sampler batch -> the padded tensors TRL's GRPO loss reads.

TRL's layout (GRPOTrainer `_compute_loss`): prompts left-padded, completions right-padded, so
that `cat([prompt_ids, completion_ids])` puts every completion at the same columns and the loss
reads the last `completion_ids.size(1)` positions. Two masks:

* `completion_mask`: which completion positions are real tokens (attention and padding);
* `tool_mask`: which of them carry loss. TRL multiplies it in for tool outputs; here it is the
  sampler's `loss_mask` (0 where the server reported no finite logprob), with every token of a
  truncated completion zeroed when `mask_truncated` (as the native collate does), and any token
  whose behaviour logprob is not finite (the sampler never sends one; if it did, no importance
  ratio could be formed).

`behaviour_logprobs` are the sampler's `completion_logprobs` (0.0 where masked) and
`advantages` the sampler's per-sample advantages, used as they are: the sampler's `advantage`
setting, not TRL's `scale_rewards`, decides how they are normalised.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from shared.wire import Sample


@dataclass
class SampleTensors:
    prompt_ids: torch.Tensor          # [B, P] left-padded
    prompt_mask: torch.Tensor         # [B, P]
    completion_ids: torch.Tensor      # [B, C] right-padded, C >= 1
    completion_mask: torch.Tensor     # [B, C]
    loss_mask: torch.Tensor           # [B, C] 1 = trained on
    behaviour_logprobs: torch.Tensor  # [B, C] float32
    advantages: torch.Tensor          # [B] float32


def to_tensors(samples: Sequence[Sample], pad_token_id: int, *, mask_truncated: bool = False,
               device: torch.device | str = "cpu") -> SampleTensors:
    if not samples:
        raise ValueError("no samples to train on: the sampler sent an empty share")
    prompts = [np.asarray(s.prompt_token_ids, dtype=np.int64) for s in samples]
    completions = [np.asarray(s.completion_token_ids, dtype=np.int64) for s in samples]
    B = len(samples)
    P = max(len(p) for p in prompts)
    # At least one column: TRL keeps the last completion_ids.size(1) logits, and 0 would mean "all".
    C = max(1, max(len(c) for c in completions))
    prompt_ids = np.full((B, P), pad_token_id, dtype=np.int64)
    prompt_mask = np.zeros((B, P), dtype=np.int64)
    completion_ids = np.full((B, C), pad_token_id, dtype=np.int64)
    completion_mask = np.zeros((B, C), dtype=np.int64)
    loss_mask = np.zeros((B, C), dtype=np.int64)
    behaviour = np.zeros((B, C), dtype=np.float32)
    for i, (smp, prompt, completion) in enumerate(zip(samples, prompts, completions)):
        n = len(completion)
        logprobs = np.asarray(smp.completion_logprobs, dtype=np.float64)
        mask = np.asarray(smp.loss_mask, dtype=np.int64)
        if len(logprobs) != n or len(mask) != n:
            raise ValueError(
                f"sample {i} (group {smp.group_id}) has {n} completion tokens but {len(logprobs)} logprobs and "
                f"{len(mask)} loss_mask entries; the sampler must send one of each per token"
            )
        prompt_ids[i, P - len(prompt):] = prompt
        prompt_mask[i, P - len(prompt):] = 1
        completion_ids[i, :n] = completion
        completion_mask[i, :n] = 1
        finite = np.isfinite(logprobs)
        trained = (mask != 0) & finite
        if mask_truncated and smp.finish_reason == "length":
            trained[:] = False
        loss_mask[i, :n] = trained
        behaviour[i, :n] = np.where(trained, logprobs, 0.0)
    advantages = np.asarray([s.advantage for s in samples], dtype=np.float32)

    def t(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(device)

    return SampleTensors(t(prompt_ids), t(prompt_mask), t(completion_ids), t(completion_mask), t(loss_mask),
                         t(behaviour), t(advantages))

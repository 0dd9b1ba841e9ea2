"""The trainer's model and optimizer, ready for step `start_step`.

* **dtype**: `dtype = "auto"` is bfloat16 on a CUDA device that supports it, float32
  otherwise; any other value names a torch dtype.
* **model**: loaded from `settings.model` (a Hugging Face directory or hub name), or, with
  `resume` and a complete checkpoint in `run_dir/checkpoints`, from the newest one
  (services/trainer/checkpoint.py). Checkpoint `step-N` holds version N + 1, so training
  continues at step N + 1: batches are keyed by step on the sampler, so a resumed run
  receives exactly the batches an uninterrupted run would have.
* **optimizer**: AdamW with the settings' hyper-parameters; on resume its state comes from
  the checkpoint's `optimizer.pt` when one was saved (`save_optimizer`), for an exact resume.
* **reference model** (only when `beta > 0`): a frozen copy of the starting model for the
  KL term; it is the starting model also after a resume.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.trainer.config import TrainerSettings


def torch_dtype(name: str, device: Any) -> Any:
    """The torch dtype for the `dtype` setting on `device`."""
    import torch

    if name == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    return getattr(torch, name)


def load_model(path: str | Path, dtype: Any, device: Any) -> Any:
    """A causal LM from a Hugging Face directory (a checkpoint is one) or hub name, on `device`."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return model.to(device)


@dataclass
class TrainingModel:
    """What `set_up_model` returns: everything the learner needs, and where it starts."""

    model: Any
    optimizer: Any
    ref_model: Any | None  # frozen starting model, for the KL term (beta > 0); None otherwise
    dtype: Any
    start_step: int  # the first step to train: 0, or the resumed checkpoint's version
    resumed_from: Path | None  # the checkpoint directory loaded, if any


def set_up_model(settings: TrainerSettings, device: Any) -> TrainingModel:
    """Load the model (resumed from the newest checkpoint when there is one and `resume`
    is set), build its optimizer with any saved state, and the reference model for beta > 0."""
    import torch

    from services.trainer import checkpoint as ckpt

    s = settings
    dtype = torch_dtype(s.dtype, device)
    latest = ckpt.latest_checkpoint(s.run_dir) if s.resume else None
    start_step = 0
    load_from: str | Path = s.model
    if latest is not None:
        start_step = latest[0] + 1
        load_from = latest[1]
    model = load_model(load_from, dtype, device)
    if s.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    optimizer = torch.optim.AdamW(model.parameters(), lr=s.learning_rate, weight_decay=s.weight_decay,
                                  betas=(s.adam_beta1, s.adam_beta2), eps=s.adam_eps)
    if latest is not None and (latest[1] / ckpt.OPTIMIZER_FILE).is_file():
        optimizer.load_state_dict(torch.load(latest[1] / ckpt.OPTIMIZER_FILE, map_location=device))
    ref_model = None
    if s.beta:
        # The KL anchor is the starting model, also after a resume.
        ref_model = load_model(s.model, dtype, device).eval().requires_grad_(False)
    return TrainingModel(model=model, optimizer=optimizer, ref_model=ref_model, dtype=dtype,
                         start_step=start_step, resumed_from=latest[1] if latest else None)

"""The trainer's model and optimizer, ready for step `start_step`.

* **precision**: parameters, gradients and AdamW state are float32 (master weights), whatever
  `dtype` says. `dtype` is the compute dtype: `auto` is bfloat16 on a CUDA device that
  supports it, float32 otherwise; bfloat16 runs forward and backward under autocast (or
  FSDP's mixed-precision policy). Stepping bf16 weights directly rounds most small updates
  away (at lr 1e-5 only ~15% of the weights moved in 10 steps); float32 masters keep them.
  Inference gets the weights in `publish_dtype` (default: the compute dtype).
* **model**: loaded from `settings.model` (a Hugging Face directory, or a hub name the local
  cache holds: services/trainer/preflight.py refuses anything else before torch loads), or, with
  `resume` and a complete checkpoint in `run_dir/checkpoints`, from the newest one
  (services/trainer/checkpoint.py). Checkpoint `step-N` holds version N + 1, so training
  continues at step N + 1: batches are keyed by step on the sampler, so a resumed run
  receives exactly the batches an uninterrupted run would have.
* **sharding** (services/trainer/sharding.py): under `fsdp` the model is loaded on the CPU and
  sharded onto the device, so no rank ever holds the whole model there.
* **optimizer**: AdamW with the settings' hyper-parameters; on resume its state comes from
  the checkpoint when one was saved (`save_optimizer`), for an exact resume.
* **reference model** (only when `beta > 0`): a frozen copy of the starting model for the
  KL term, in the compute dtype (it is never stepped); it is the starting model also after
  a resume.
* **LoRA** (`lora_rank > 0`, services/trainer/lora.py): the base always loads from
  `settings.model`, frozen, with a fresh adapter, whose saved state a resume then loads from the
  checkpoint (refused when the checkpoint's LoRA settings or base differ); the optimizer holds
  the adapter's parameters only, and the reference model is the same model with the adapter
  disabled (`TrainingModel.reference`), no second copy.
"""

from __future__ import annotations

from collections.abc import Callable
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


def publish_dtype(name: str, compute_dtype: Any) -> Any:
    """The torch dtype for the `publish_dtype` setting: `auto` = the compute dtype."""
    import torch

    return compute_dtype if name == "auto" else getattr(torch, name)


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

    model: Any  # float32 parameters, sharded under fsdp
    optimizer: Any
    ref_model: Any | None  # frozen starting model, for the KL term (beta > 0); None otherwise
    reference: Callable[[], Any] | None  # context turning ref_model into the reference (LoRA: adapter off)
    lora: Any | None  # the run's adapter (services/trainer/lora.py LoraRun); None: full fine-tuning
    dtype: Any  # the compute dtype
    publish_dtype: Any  # the dtype inference gets
    start_step: int  # the first step to train: 0, or the resumed checkpoint's version
    resumed_from: Path | None  # the checkpoint directory loaded, if any


def set_up_model(settings: TrainerSettings, device: Any, sharding: Any) -> TrainingModel:
    """Load the model (resumed from the newest checkpoint when there is one and `resume`
    is set) in float32, shard it, build its optimizer with any saved state, and the reference
    model for beta > 0."""
    import torch

    from services.trainer import checkpoint as ckpt
    from services.trainer import lora as lora_

    s = settings
    dtype = torch_dtype(s.dtype, device)
    spec = lora_.LoraSpec.of(s)
    latest = ckpt.latest_checkpoint(s.run_dir) if s.resume else None
    start_step = 0
    load_from: str | Path = s.model
    if latest is not None:
        # Before anything loads: a checkpoint of another kind of run is refused in one line.
        lora_.check_resume(ckpt.read_state(latest[1]), spec, s.model, latest[1])
        start_step = latest[0] + 1
        load_from = latest[1] if spec is None else s.model  # a LoRA checkpoint holds the adapter only
    load_device = torch.device("cpu") if sharding.kind == "fsdp" else device
    model = load_model(load_from, torch.float32, load_device)
    lora = None
    if spec is not None:
        with torch.random.fork_rng(devices=[]):
            # The adapter's initialisation depends on the seed alone: every rank draws the same
            # one (ddp replicas and fsdp shards must agree), whatever ran before.
            torch.manual_seed(s.seed)
            lora = lora_.attach(model, spec, lora_.base_name(s.model))
        model = lora.model
        if latest is not None:
            lora.load(latest[1])
    if s.gradient_checkpointing:
        # transformers 5 renamed it; the old name still works there, with a warning.
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
        if lora is not None:
            # The frozen embeddings' output needs no gradient, so with reentrant checkpointing no
            # layer input would either, and the adapter inside would get none.
            model.enable_input_require_grads()
    ref_model = None
    if s.beta and lora is None:
        # The KL anchor is the starting model, also after a resume.
        ref_model = load_model(s.model, dtype, load_device).eval().requires_grad_(False)
    model, ref_model = sharding.prepare(model, compute_dtype=dtype, ref_model=ref_model)
    if s.beta and lora is not None:
        ref_model = model  # the base is the model with the adapter off
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=s.learning_rate,
                                  weight_decay=s.weight_decay, betas=(s.adam_beta1, s.adam_beta2), eps=s.adam_eps)
    if latest is not None:
        sharding.load_optimizer(model, optimizer, latest[1])
    return TrainingModel(model=model, optimizer=optimizer, ref_model=ref_model,
                         reference=lora.reference if lora is not None and s.beta else None, lora=lora, dtype=dtype,
                         publish_dtype=publish_dtype(s.publish_dtype, dtype),
                         start_step=start_step, resumed_from=latest[1] if latest else None)

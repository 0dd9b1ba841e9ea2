"""Real PEFT LoRA adapters for the tiny model, built in the test (no hub), and what
transformers + peft compute with them: the reference every served number is held to."""

from __future__ import annotations

import math
from pathlib import Path

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def adapter_of(model, out: Path, *, seed: int, rank: int = 8, targets: tuple[str, ...] = TARGETS,
               scale: float = 0.5) -> Path:
    """A LoRA adapter of `model` (a transformers model, which peft wraps) saved as safetensors,
    with lora_B random: PEFT starts it at zero, which would make the adapter the base model; at
    `scale` it moves logprobs by nats, so a server that ignores it shows."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets)))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, scale)
    peft_model.save_pretrained(str(out), safe_serialization=True)
    return out


def build_adapter(base: Path, out: Path, *, seed: int, rank: int = 8, targets: tuple[str, ...] = TARGETS,
                  scale: float = 0.5) -> Path:
    """`adapter_of` the model in directory `base` (float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    return adapter_of(model, out, seed=seed, rank=rank, targets=targets, scale=scale)


def reference_logprobs(base: Path, adapter: Path | None, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1 under base (+ adapter), float32."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits.float()
    logp = torch.log_softmax(logits[0, :-1], dim=-1)
    return [float(x) for x in logp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)]


def probe_of(base: Path, adapter: Path | None, ids: list[int]) -> dict:
    """The probe a trainer would send with `adapter` (shared/probe.py)."""
    logprobs = reference_logprobs(base, adapter, ids)
    assert all(math.isfinite(x) for x in logprobs)
    return {"token_ids": ids, "logprobs": [None, *logprobs], "dtype": "float32"}

"""TandemGRPOTrainer with TRL's `peft_config` (services/trl_bridge): only the adapter trains, the
reference is the base (the adapter disabled), each version is written as the adapter alone in
PEFT's format with a base + adapter probe, and configs the servers could not serve are refused.

At the trainer's level: a real sampler (the toy stack) supplies the batch, but no version is
posted, since serving an adapter is the sampler's and the inference servers' part.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("trl", reason="the TRL integration needs the `trl` extra: pip install -e '.[trl]'")
pytest.importorskip("peft", reason="LoRA needs peft (the cpu extra pins it)")

from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from services.trainer import checkpoint as ckpt  # noqa: E402
from services.trainer.probe import compute_probe  # noqa: E402
from services.trl_bridge.agreement import grpo_config_values  # noqa: E402
from services.trl_bridge.sampler_link import SamplerLink  # noqa: E402
from services.trl_bridge.trainer import TandemGRPOTrainer  # noqa: E402
from shared.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, is_adapter_dir  # noqa: E402
from tests.trl.conftest import TOKEN  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PEFT_KEY = re.compile(r"^base_model\.model\.model\.layers\.\d+\.(self_attn|mlp)\.[a-z]+_proj\.lora_[AB]\.weight$")
NOWHERE = "http://127.0.0.1:9"  # refusals come before the sampler is asked anything


def _config(out: Path, sampler_url: str | None, **overrides: Any) -> GRPOConfig:
    values: dict[str, Any] = {
        "output_dir": str(out), "max_steps": 2, "learning_rate": 1e-3, "loss_type": "grpo", "beta": 0.0,
        "save_strategy": "no", "report_to": "none", "use_cpu": True, "bf16": False, "disable_tqdm": True, "seed": 0,
    }
    if sampler_url is None:
        values.update(num_generations=4, per_device_train_batch_size=4, gradient_accumulation_steps=4)
    else:
        link = SamplerLink(sampler_url, api_token=TOKEN)
        try:
            values.update(grpo_config_values(link.status(), 1, 128))
        finally:
            link.close()
    values.update(overrides)
    return GRPOConfig(**values)


def _base(model_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def test_peft_configs_the_servers_could_not_serve_are_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    args = _config(tmp_path / "out", None)
    cases = {
        "not on the output layer or the embeddings": LoraConfig(r=4, target_modules=["q_proj", "lm_head"]),
        "modules_to_save": LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]),
        "DoRA": LoraConfig(r=4, target_modules=["q_proj"], use_dora=True),
        "biases": LoraConfig(r=4, target_modules=["q_proj"], bias="all"),
        "is a pattern": LoraConfig(r=4, target_modules=r".*proj"),
    }
    for message, config in cases.items():
        with pytest.raises(ValueError, match=message):
            TandemGRPOTrainer(str(tiny_model_dir), args=args, sampler_url=NOWHERE, peft_config=config)
    wrapped = get_peft_model(_base(tiny_model_dir), LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match=r"peft_config=LoraConfig\(\.\.\.\), not a PeftModel"):
        TandemGRPOTrainer(wrapped, args=args, sampler_url=NOWHERE)


def test_a_lora_run_trains_the_adapter_against_the_base_and_writes_adapter_versions(
        make_toy_stack, tiny_model_dir: Path, tmp_path: Path) -> None:
    sampler, _ = make_toy_stack(max_staleness=0)
    args = _config(tmp_path / "out", sampler.url, beta=0.04)
    trainer = TandemGRPOTrainer(str(tiny_model_dir), args=args, sampler_url=sampler.url, api_token=TOKEN,
                                peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS),
                                publish_dir=tmp_path / "published")
    try:
        model = trainer.accelerator.unwrap_model(trainer.model)
        trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
        assert trainable and all("lora_A" in n or "lora_B" in n for n in trainable)
        assert trainer.publisher.adapter
        # A trained adapter (PEFT starts lora_B at 0, which would make it the base).
        torch.manual_seed(0)
        with torch.no_grad():
            for name, param in trainable.items():
                if "lora_B" in name:
                    param.normal_(0.0, 0.05)

        # Batch 0 from the sampler, scored as TRL's loss will read it.
        trainer.model.train()
        out = trainer._generate_and_score_completions([])
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        attention = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        keep = out["completion_ids"].size(1)
        with torch.no_grad():  # the base model's logprobs of the completions, computed here
            logits = _base(tiny_model_dir)(input_ids=ids, attention_mask=attention).logits[:, -keep - 1 : -1]
            base = torch.log_softmax(logits.float() / args.temperature, dim=-1).gather(
                -1, out["completion_ids"].unsqueeze(-1)).squeeze(-1)
        mask = out["completion_mask"].bool()
        torch.testing.assert_close(out["ref_per_token_logps"][mask], base[mask], rtol=0.0, atol=1e-5)
        assert (out["old_per_token_logps"][mask] - base[mask]).abs().max() > 1e-3  # the policy is base + adapter
        assert all(p.requires_grad for p in trainable.values())  # the adapter trains again after the reference

        # Version 1 as the publisher writes it, before it would be posted.
        info = trainer.publisher.write(1, 0, model, trainer.accelerator.get_state_dict(trainer.model),
                                       trainer._probe_sample)
    finally:
        trainer.close()
    from safetensors.torch import load_file

    path = Path(info["path"])
    assert is_adapter_dir(path)
    assert sorted(p.name for p in path.iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS, ckpt.PUBLISHED_FILE]
    assert json.loads((path / ckpt.PUBLISHED_FILE).read_text())["adapter"] is True
    tensors = load_file(path / ADAPTER_WEIGHTS)
    assert len(tensors) == len(trainable) and all(PEFT_KEY.match(k) for k in tensors), sorted(tensors)[:3]
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 8, sorted(TARGETS))

    # peft loads it and computes the probe the trainer sent: base + adapter, not the base.
    probe = info["probe"]
    served = PeftModel.from_pretrained(_base(tiny_model_dir), str(path)).eval()
    assert compute_probe(served, probe["token_ids"])["logprobs"][1:] == pytest.approx(probe["logprobs"][1:], abs=1e-5)
    base_probe = compute_probe(_base(tiny_model_dir), probe["token_ids"])["logprobs"][1:]
    assert base_probe != pytest.approx(probe["logprobs"][1:], abs=1e-3)

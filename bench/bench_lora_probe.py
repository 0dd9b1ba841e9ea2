"""Why a LoRA adapter finds the demo's random model hard (issue 44.4, docs/lora.md): three
measurements on the model directories `init_model` writes, in-process, no servers.

* **headroom**: the most probability a frozen LM head lets the answer letters ("e", "o") reach,
  over every direction of the final hidden state (gradient ascent on a unit vector scaled to the
  final RMSNorm's norm, sqrt(hidden), from 3 random starts). Whatever an adapter on the
  projections learns, the final hidden state is such a vector, so this bounds the sampled reward.
* **cosine**: the mean cosine between the final hidden states (last position) of 30 toy prompts:
  how much of the state every prompt shares.
* **transfer**: two sign-of-gradient steps of 2e-3 (Adam's first steps) that raise logit("e")
  minus the mean logit on 64 even numbers, then the same margin's change on 64 odd numbers, as a
  fraction of the change on the even ones. 0: the step learnt parity; 1: it learnt "say e"
  for every number, which GRPO cannot undo once no sample of an odd prompt says "o".

    .venv/bin/python -m bench lora_probe
"""

from __future__ import annotations

import random
import tempfile
import warnings
from pathlib import Path
from typing import Any

from bench._common import host, write_results

PRESETS = ("tiny", "tiny-lora")
HEADROOM_SEEDS = (0, 1, 2, 3, 4)
TRANSFER_SEEDS = (0, 1, 2)
GROUPS = {"full fine-tuning": None,
          "every projection": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
          "attention (q, k, v, o)": ["q_proj", "k_proj", "v_proj", "o_proj"],
          "MLP (gate, up, down)": ["gate_proj", "up_proj", "down_proj"]}


def _prompts(tok: Any, numbers: list[int]) -> tuple[Any, Any]:
    import torch

    ids = [tok.encode(f"even or odd? {n}", add_special_tokens=False) for n in numbers]
    width, pad = max(map(len, ids)), tok.pad_token_id
    x = torch.tensor([[pad] * (width - len(i)) + i for i in ids])  # left-padded: the last position is real
    return x, (x != pad).long()


def headroom(head: Any, token: int, starts: int = 3, iters: int = 500) -> float:
    """max over unit u of softmax(head @ (sqrt(d) u))[token]."""
    import torch

    d = head.shape[1]
    best = float("-inf")
    for _ in range(starts):
        u = torch.randn(d, requires_grad=True)
        opt = torch.optim.Adam([u], lr=0.05)
        for _ in range(iters):
            lp = torch.log_softmax(head @ (d ** 0.5 * u / u.norm()), -1)[token]
            opt.zero_grad()
            (-lp).backward()
            opt.step()
        best = max(best, lp.item())
    return float(torch.tensor(best).exp())


def transfer(model_dir: Path, targets: list[str] | None, tok: Any, even: Any, odd: Any, seed: int,
             lr: float = 2e-3) -> float:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    letter = tok.convert_tokens_to_ids("e")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    if targets is not None:
        torch.manual_seed(seed)
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets))
    params = [p for p in model.parameters() if p.requires_grad]

    def margin(batch: Any) -> Any:
        logits = model(input_ids=batch[0], attention_mask=batch[1]).logits[:, -1]
        return (logits[:, letter] - logits.mean(1)).mean()

    with torch.no_grad():
        even0, odd0 = margin(even).item(), margin(odd).item()
    for _ in range(2):  # the first step moves only lora_B (lora_A's gradient is 0 while B = 0)
        model.zero_grad()
        margin(even).backward()
        with torch.no_grad():
            for p in params:
                p.add_(lr * p.grad.sign())
    with torch.no_grad():
        return (margin(odd).item() - odd0) / (margin(even).item() - even0)


def run(results_dir: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from services.inference.init_model import init_model
    from services.inference.tokenizer import build_tokenizer

    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    tok = build_tokenizer()
    letters = {c: tok.convert_tokens_to_ids(c) for c in "eo"}
    numbers = list(range(1000, 10000))
    random.Random(0).shuffle(numbers)
    even = _prompts(tok, [n for n in numbers if n % 2 == 0][:64])
    odd = _prompts(tok, [n for n in numbers if n % 2][:64])
    sample = _prompts(tok, numbers[:30])
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="tandem-lora-probe-") as tmp:
        for preset in PRESETS:
            rows[preset] = {"headroom": [], "cosine": [], "transfer": {g: [] for g in GROUPS}}
            for seed in HEADROOM_SEEDS:
                model_dir = init_model(Path(tmp) / f"{preset}-{seed}", preset=preset, seed=seed)
                model = AutoModelForCausalLM.from_pretrained(str(model_dir))
                head = model.get_output_embeddings().weight.detach()
                rows[preset]["headroom"].append({c: round(headroom(head, t), 3) for c, t in letters.items()})
                with torch.no_grad():
                    h = model(input_ids=sample[0], attention_mask=sample[1],
                              output_hidden_states=True).hidden_states[-1][:, -1]
                h = h / h.norm(dim=1, keepdim=True)
                cos = h @ h.T
                off = cos[~torch.eye(len(h), dtype=torch.bool)]
                rows[preset]["cosine"].append(round(off.mean().item(), 3))
                if seed in TRANSFER_SEEDS:
                    for group, targets in GROUPS.items():
                        rows[preset]["transfer"][group].append(
                            round(transfer(model_dir, targets, tok, even, odd, seed), 2))
                print(preset, seed, rows[preset]["headroom"][-1], rows[preset]["cosine"][-1], flush=True)
    result = {"presets": rows, "headroom_seeds": HEADROOM_SEEDS, "transfer_seeds": TRANSFER_SEEDS, "host": host()}

    def span(values: list[float]) -> str:
        return f"{min(values)} - {max(values)}"

    lines = ["# Why LoRA finds the demo's random model hard", "",
             "`.venv/bin/python -m bench lora_probe` (bench/bench_lora_probe.py says what each column measures). "
             f"Headroom and cosine over seeds {list(HEADROOM_SEEDS)}, transfer over seeds {list(TRANSFER_SEEDS)}.", "",
             "| preset | headroom p(e) | headroom p(o) | cosine between prompts | " +
             " | ".join(f"transfer: {g}" for g in GROUPS) + " |",
             "|---|---|---|---|" + "---|" * len(GROUPS)]
    for preset, r in rows.items():
        lines.append(f"| {preset} | {span([h['e'] for h in r['headroom']])} | {span([h['o'] for h in r['headroom']])} | "
                     f"{span(r['cosine'])} | " + " | ".join(span(r["transfer"][g]) for g in GROUPS) + " |")
    write_results(results_dir, "lora_probe", result, "\n".join(lines))
    return result

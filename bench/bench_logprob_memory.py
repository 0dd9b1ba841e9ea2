"""Peak memory of the trainer's logprob computation: the previous per-row implementation
against the chunked `token_logprobs` that replaced it.

The case is the learner's, scaled down to a CPU: hidden states [B, T + 1, H] go through an
LM head over a large vocabulary (Qwen's 151,936 by default) and `token_logprobs` scores the
slice `logits[:, :-1]` at temperature tau; a stand-in loss (advantage-weighted sum of the
logprobs) is backpropagated. Logits in bfloat16 (what a bf16 model's head returns) and in
float32. Two measured windows:

* `logprob`: the logprob computation alone. The logits are made (without gradient) before
  the window and the slice is the leaf that receives the gradient, so the window holds the
  forward and backward of `token_logprobs` and the gradient it returns (B x T x V in the
  logits' dtype, which any implementation must produce).
* `lm_head`: the LM head's forward too, and the backward through the head to the hidden
  states and the head's weight: what the learner's step holds. Before, the learner ran the
  head over every position and sliced the logits `[:, :-1]`, whose backward materialises a
  full-size gradient of the unsliced logits beside the slice's; after, it selects the
  positions that predict before the head (`logits_to_keep` as indices), so there is no slice.

Each variant runs in a fresh Python process, so no allocation of one run can be reused by,
or hide in the high-water mark of, another. In that process, after the inputs exist and a
small warm-up has run, the kernel's peak-RSS counter (VmHWM in /proc/self/status) is reset
to the current RSS by writing 5 to /proc/self/clear_refs; the result is VmHWM after the
backward minus VmRSS before the forward: the most memory the step held at once, above what
was already there. Tensors this large are allocated with mmap and returned to the kernel on
free, so RSS follows live tensors. Where clear_refs is not writable, ru_maxrss after the
setup stands in for the baseline (a lower bound on the peak: flagged in the results).

Writes bench/results/logprob_memory.json and logprob_memory.md;
`.venv/bin/python -m bench logprob_memory`.
"""

from __future__ import annotations

import gc
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

COMMAND = ".venv/bin/python -m bench logprob_memory"
REPO = Path(__file__).resolve().parents[1]
MIB = 1024 * 1024
# Sampler settings a user might train with; top_p's sort is the cost, whatever the values.
TRUNCATION = {"top_k": 50, "top_p": 0.95}


def previous_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The implementation `token_logprobs` had before the chunked one, kept as the baseline.

    One row at a time in float32; autograd keeps a float32 copy of every row (the
    temperature-scaled one when tau != 1: the division's backward needs no input, so the
    unscaled copy is freed) for logsumexp's backward.
    """
    out = []
    for row_logits, row_targets in zip(logits, targets):
        row = row_logits.float()
        if temperature != 1.0:
            row = row / temperature
        picked = row.gather(-1, row_targets.unsqueeze(-1)).squeeze(-1)
        out.append(picked - torch.logsumexp(row, dim=-1))
    return torch.stack(out)


# -- the child process: one variant, one measurement -------------------------------------


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where that is not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one variant's forward + backward in `spec["window"]` and return its peak memory
    (in this process)."""
    from services.trainer.logprobs import token_logprobs
    from shared.contract import Truncation

    window, variant, dtype = spec["window"], spec["variant"], getattr(torch, spec["dtype"])
    B, T, V, H = spec["batch"], spec["seq"], spec["vocab"], spec["hidden"]
    temperature, chunk_size = spec["temperature"], spec["chunk_size"]
    truncation = Truncation(**spec["truncation"]) if spec.get("truncation") else None
    if variant == "before":
        def logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return previous_token_logprobs(logits, targets, temperature)
    else:
        def logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return token_logprobs(logits, targets, temperature, chunk_size=chunk_size, truncation=truncation)

    def inputs(b: int, t: int, v: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(0)
        hidden = torch.randn(b, t + 1, H, generator=gen).to(dtype)
        head = (torch.randn(v, H, generator=gen) / H**0.5).to(dtype)
        made = {"targets": torch.randint(0, v, (b, t), generator=gen), "adv": torch.randn(b, generator=gen)}
        if window == "lm_head":
            made.update(hidden=hidden.requires_grad_(True), head=head.requires_grad_(True))
        else:
            with torch.no_grad():  # in float32: CPU bf16 matmuls are slow, and this is setup
                logits = (hidden.float() @ head.float().T).to(dtype)
            # A leaf view: the gradient token_logprobs returns becomes its .grad as it is.
            made["scored"] = logits[:, :-1].requires_grad_(True)
        return made

    def step(x: dict[str, torch.Tensor]) -> tuple[float, torch.Tensor]:
        if window == "lm_head" and variant == "before":
            # The previous learner: the head over every position, then the slice of those that predict.
            scored = (x["hidden"] @ x["head"].T)[:, :-1]
        elif window == "lm_head":
            # The learner now: the head over the positions that predict only (transformers'
            # logits_to_keep as indices), so no slice of the logits sits in the graph.
            scored = x["hidden"][:, :-1] @ x["head"].T
        else:
            scored = x["scored"]
        loss = (logprobs(scored, x["targets"]) * x["adv"].unsqueeze(-1)).sum()
        loss.backward()
        return float(loss), (x["head"] if window == "lm_head" else x["scored"]).grad

    # Warm-up on a tiny case: kernels, thread pools and the autograd engine start outside the window.
    step(inputs(2, 4, 64))
    x = inputs(B, T, V)
    gc.collect()
    reset = _reset_peak()
    baseline_kib = _status_kib("VmRSS") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    loss, grad = step(x)
    seconds = time.perf_counter() - started
    peak_kib = _status_kib("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "peak_mib": round((peak_kib - baseline_kib) / 1024, 1),
        "seconds": round(seconds, 2),
        "method": "VmHWM after clear_refs" if reset else "ru_maxrss (lower bound)",
        "loss": loss,
        "grad_norm": float(grad.float().norm()),
        "threads": torch.get_num_threads(),
    }


def measure_in_subprocess(spec: dict[str, Any], timeout: float = 900.0) -> dict[str, Any]:
    """`measure(spec)` in a fresh interpreter; its result is the last line it prints."""
    done = subprocess.run([sys.executable, "-m", "bench.bench_logprob_memory", json.dumps(spec)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"measurement {spec} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- the parent: every variant, the result files -----------------------------------------


def run(results_dir: Path, *, batch: int = 4, seq: int = 512, vocab: int = 151_936, hidden: int = 64,
        dtypes: tuple[str, ...] = ("bfloat16", "float32"), temperatures: tuple[float, ...] = (1.0, 0.7),
        chunk_sizes: tuple[int, ...] = (1024, 256), windows: tuple[str, ...] = ("logprob", "lm_head"),
        truncation: dict[str, Any] | None = TRUNCATION) -> dict:
    """Measure before, and after at each chunk size, for every window x dtype x temperature.

    The first chunk size is the default one; the others show what the knob buys. The
    `lm_head` window runs at the first temperature and chunk size only: bfloat16 matmuls are
    slow on a CPU (minutes per run at the default size), and the floor it adds is the same
    whatever the temperature or chunk size.

    With `truncation` (the sampler's top_k / top_p), the `logprob` window at the first
    temperature is measured once more with it, at every chunk size: what scoring a truncated
    distribution adds (a sort of each chunk's vocabulary, in slices) to time and memory.
    """
    # Imported here, not at the top: the child processes import this module and need none of it.
    from bench._common import host, write_results

    shape = {"batch": batch, "seq": seq, "vocab": vocab, "hidden": hidden}
    rows = []
    for window in windows:
        for dtype in dtypes:
            itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
            for temperature in temperatures if window == "logprob" else temperatures[:1]:
                case = {**shape, "window": window, "dtype": dtype, "temperature": temperature}
                before = measure_in_subprocess({**case, "variant": "before", "chunk_size": None})
                for chunk_size in chunk_sizes if window == "logprob" else chunk_sizes[:1]:
                    after = measure_in_subprocess({**case, "variant": "after", "chunk_size": chunk_size})
                    rows.append({
                        "window": window, "dtype": dtype, "temperature": temperature, "chunk_size": chunk_size,
                        "logits_mib": round(batch * (seq + 1) * vocab * itemsize / MIB, 1),
                        "gradient_mib": round(batch * seq * vocab * itemsize / MIB, 1),
                        "chunk_buffer_mib": round(min(chunk_size, batch * seq) * vocab * 4 / MIB, 1),
                        "before": before, "after": after,
                        "after_over_before": round(after["peak_mib"] / max(before["peak_mib"], 1e-9), 3),
                        # Same inputs, same math: the two must agree.
                        "loss_rel_diff": abs(after["loss"] - before["loss"]) / max(abs(before["loss"]), 1e-12),
                        "grad_norm_rel_diff": (abs(after["grad_norm"] - before["grad_norm"])
                                               / max(before["grad_norm"], 1e-12)),
                    })
    truncated_rows = []
    if truncation and "logprob" in windows:
        for dtype in dtypes:
            case = {**shape, "window": "logprob", "dtype": dtype, "temperature": temperatures[0], "variant": "after"}
            for chunk_size in chunk_sizes:
                plain = next(r["after"] for r in rows if r["window"] == "logprob" and r["dtype"] == dtype
                             and r["temperature"] == temperatures[0] and r["chunk_size"] == chunk_size)
                truncated = measure_in_subprocess({**case, "chunk_size": chunk_size, "truncation": truncation})
                truncated_rows.append({"dtype": dtype, "chunk_size": chunk_size, "untruncated": plain,
                                       "truncated": truncated})
    result = {"benchmark": "logprob_memory", "setup": {**shape, "positions": batch * seq,
                                                       "float32_copy_mib": round(batch * seq * vocab * 4 / MIB, 1)},
              "rows": rows, "truncation": truncation, "truncated_rows": truncated_rows,
              "host": host(), "command": COMMAND}
    write_results(results_dir, "logprob_memory", result, _markdown(result))
    return result


def _markdown(result: dict[str, Any]) -> str:
    s = result["setup"]
    lines = [
        "# Logprob memory: per-row float32 (before) vs chunked (after)",
        "",
        f"hidden [{s['batch']}, {s['seq']} + 1, {s['hidden']}] -> LM head over a vocabulary of {s['vocab']:,} -> "
        f"`token_logprobs(logits[:, :-1], targets, tau)` -> advantage-weighted sum -> backward, on the CPU "
        f"({s['positions']} scored positions; a float32 copy of their logits is {s['float32_copy_mib']:.0f} MiB). "
        f"Before: the previous implementation (rows one at a time in float32, autograd keeping each row's float32 "
        f"copy until the backward), kept in the benchmark as `previous_token_logprobs`. After: "
        f"`services.trainer.logprobs.token_logprobs` (one float32 buffer of chunk_size x vocabulary).",
        "",
        "Windows: `logprob` = the forward and backward of the logprob computation alone (the logits exist before "
        "it; the gradient it returns, B x T x V in the logits' dtype, is inside it). `lm_head` = the LM head's "
        "forward as well, and its backward: before, the previous learner's head over every position and the "
        "slice `[:, :-1]`; after, the head over the predicting positions only (`logits_to_keep` as indices).",
        "",
        "Peak = the most resident memory the window held at once above what was there before it, each variant in "
        "a fresh process: VmHWM reset through /proc/self/clear_refs after setup and warm-up, read after the "
        "backward, minus VmRSS before the forward.",
        "",
        "| window | logits dtype | tau | chunk | logits MiB | gradient MiB | chunk buffer MiB | before peak MiB | "
        "after peak MiB | after / before | before s | after s | loss rel. diff | grad norm rel. diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['window']} | {r['dtype']} | {r['temperature']} | {r['chunk_size']} | {r['logits_mib']:.0f} | "
            f"{r['gradient_mib']:.0f} | {r['chunk_buffer_mib']:.0f} | {r['before']['peak_mib']:.0f} | "
            f"{r['after']['peak_mib']:.0f} | {r['after_over_before']:.2f} | {r['before']['seconds']:.1f} | "
            f"{r['after']['seconds']:.1f} | {r['loss_rel_diff']:.1e} | {r['grad_norm_rel_diff']:.1e} |"
        )
    if result.get("truncated_rows"):
        t = result["truncation"]
        lines += [
            "",
            f"Scoring a truncated distribution (`truncation=Truncation({', '.join(f'{k}={v}' for k, v in t.items())})`, "
            "the sampler's settings; shared/truncation.py finds each position's cut among its best `CANDIDATES` "
            "tokens, sorting a whole row only where those hold less than top_p of the mass, once in the forward; "
            "the backward reuses the cut), `logprob` window. The synthetic logits here are nearly flat, so "
            "top_k decides the set:",
            "",
            "| logits dtype | chunk | untruncated peak MiB | truncated peak MiB | untruncated s | truncated s |",
            "|---|---|---|---|---|---|",
        ]
        for r in result["truncated_rows"]:
            lines.append(f"| {r['dtype']} | {r['chunk_size']} | {r['untruncated']['peak_mib']:.0f} | "
                         f"{r['truncated']['peak_mib']:.0f} | {r['untruncated']['seconds']:.1f} | "
                         f"{r['truncated']['seconds']:.1f} |")
    methods = sorted({r[v]["method"] for r in result["rows"] for v in ("before", "after")})
    threads = result["rows"][0]["after"]["threads"] if result["rows"] else "?"
    first_chunk = result["rows"][0]["chunk_size"] if result["rows"] else 0
    first_chunk_share = min(first_chunk, s["positions"]) / max(s["positions"], 1)
    lines += [
        "",
        "Reading it: in the `logprob` window the chunked peak is the gradient it must return plus one chunk "
        "buffer, whatever the number of positions; the previous one grows with a float32 copy of every scored "
        f"logit. Chunk {first_chunk} is {first_chunk_share:.0%} of the {s['positions']} positions here, so its buffer "
        f"is that share of the float32 copy; at a trainer's 8 x 2048 positions it would be {first_chunk / 16384:.1%}. "
        "In the `lm_head` window both also hold the logits and their gradient; before, the backward of the "
        "slice `[:, :-1]` also built a full-size gradient of the unsliced logits beside the slice's own, which "
        "the learner no longer makes.",
        "",
        f"Measured with: {', '.join(methods)}; {threads} torch threads; host {result['host']}. The seconds "
        "are one run each on a shared machine: indicative only.",
        "",
        f"`{COMMAND}`",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(json.dumps(measure(json.loads(sys.argv[1]))))

"""Does `make demo ARGS="--lora-rank 8"` solve the toy task on every seed? The same runs and
table as `bench convergence` (issue 16), training a rank-8 LoRA adapter (issue 30: greedy eval
>= 0.95 at the end, within 5 minutes on the 2-core machine; issue 44.4: and the sampled reward,
mean of the last 10 steps, >= 0.8; docs/lora.md).

    .venv/bin/python -m bench convergence_lora
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench import bench_convergence


def run(results_dir: Path) -> dict[str, Any]:
    return bench_convergence.run(results_dir, name="convergence_lora", sampled_target=0.8, lora_rank=8)

"""Tracking for a TRL run fed by the sampler: `report_to` handed to TRL (docs/tracking.md).

TRL reports through transformers' own callbacks, with TRL's metric names (`reward`, `loss`,
`tandem/staleness_mean`, ...), so this side only chooses: `GRPOConfig(report_to=...,
run_name=...)`, plus what those callbacks read from the environment. The names and places
match the native trainer's, so a TRL run lands next to its sampler: the W&B run
`<run_name>-trainer` (job type trainer) in the group `<run_name>` (WANDB_RUN_GROUP), the project
`wandb_project` (WANDB_PROJECT, else tandem), W&B's files under the output directory
(WANDB_DIR), TensorBoard events in `<tensorboard_dir>/trainer` (TENSORBOARD_LOGGING_DIR).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from shared.tracking import BACKENDS, backend_names, require_installed


def grpo_reporting(report_to: str | Iterable[str] | None, *, run_name: str, output_dir: str | Path,
                   wandb_project: str | None = None, tensorboard_dir: str | Path | None = None) -> dict[str, Any]:
    """GRPOConfig's `report_to` and `run_name` for `report_to` ("wandb,tensorboard", a list, none);
    sets the environment transformers' W&B and TensorBoard callbacks read (an explicit W&B group
    or TensorBoard directory in the environment wins over these defaults, the project only
    when `wandb_project` is not given). Raises ValueError naming the extra when a chosen
    backend is not installed."""
    names = backend_names(report_to.split(",") if isinstance(report_to, str) else report_to or [])
    require_installed(names)
    if "wandb" in names:
        if wandb_project:
            os.environ["WANDB_PROJECT"] = wandb_project
        os.environ.setdefault("WANDB_PROJECT", "tandem")
        os.environ.setdefault("WANDB_RUN_GROUP", run_name)
        os.environ.setdefault("WANDB_JOB_TYPE", "trainer")
        # W&B's files under the run's directory, as the native trainer keeps them.
        os.environ.setdefault("WANDB_DIR", str(Path(output_dir)))
        Path(os.environ["WANDB_DIR"]).mkdir(parents=True, exist_ok=True)
    if "tensorboard" in names:
        root = Path(tensorboard_dir) if tensorboard_dir is not None else Path(output_dir) / "tensorboard"
        os.environ.setdefault("TENSORBOARD_LOGGING_DIR", str(root / "trainer"))
    return {"report_to": names or "none", "run_name": f"{run_name}-trainer"}


def check_report_to(report_to: Iterable[str] | str | None) -> None:
    """Refuse, naming the extra to install, a GRPOConfig whose `report_to` names wandb or
    tensorboard without the package (transformers would say so only after the model loaded)."""
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    require_installed([n for n in names if n in BACKENDS])

"""The corrections bench's bookkeeping on fake runs (no demo is started: the real runs take
minutes each), and the demo's `trainer_args`, through which the bench sets trainer settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import bench_corrections as bc
from shared.settings import SettingsError, load


def _summary(evals: list[tuple[int, float]]) -> dict:
    return {"steps": 30, "eval_reward_after": evals[-1][1], "staleness_mean": 3.9, "staleness_max": 4,
            "evals": [{"label": "periodic", "version": v, "reward": r} for v, r in evals]}


def _steps(mismatch: list[float], **extra: list[float]) -> list[dict]:
    return [{"event": "start"}] + [
        {"event": "step", "step": i, "behaviour_mismatch": m, **{k: v[i] for k, v in extra.items()}}
        for i, m in enumerate(mismatch)]


def test_a_row_reads_the_first_eval_at_target_the_dip_after_it_and_the_per_step_means() -> None:
    row = bc.row_of(_summary([(0, 0.0), (10, 0.5), (20, 0.95), (30, 0.7)]),
                    _steps([0.1, 0.3], mismatch_k3=[0.01, 0.03], is_masked_fraction=[0.0, 0.5]))
    assert row["first_version_at_target"] == 20 and row["lowest_eval_after_target"] == 0.7
    assert row["eval_reward_after"] == 0.7 and row["eval_max"] == 0.95
    assert row["behaviour_mismatch_mean"] == pytest.approx(0.2) and row["behaviour_mismatch_max"] == 0.3
    assert row["mismatch_k3_mean"] == pytest.approx(0.02) and row["masked_fraction"] == pytest.approx(0.25)
    # Metrics the trainer did not write (an older trainer, or another mode) stay unknown.
    assert row["rejected_fraction"] is None
    never = bc.row_of(_summary([(0, 0.0), (10, 0.5)]), _steps([0.1]))
    assert never["first_version_at_target"] is None and never["lowest_eval_after_target"] is None


def test_the_tables_average_over_seeds_and_show_failed_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_run_one(config: str, seed: int, run_dir: Path, *, lr: float, steps: int) -> dict:
        if config == "mask" and seed == 1:
            return {"config": config, "seed": seed, "lr": lr, "ok": False, "exit": 2, "wall_seconds": 1.0,
                    "error": "tandem demo: unknown flag --is-mode"}
        evals = [(0, 0.0), (10, 1.0 if seed else 0.5), (20, 1.0)]
        row = bc.row_of(_summary(evals), _steps([0.1 * (seed + 1)], is_truncated_fraction=[0.02]))
        return {"config": config, "seed": seed, "lr": lr, **row, "wall_seconds": 50.0 + seed}

    monkeypatch.setattr(bc, "run_one", fake_run_one)
    result = bc.run(tmp_path, seeds=(0, 1), configs=("none", "mask"), steps=20, lr=5e-3)
    assert (tmp_path / "corrections-subset.json").exists()  # a subset never overwrites the full results
    none = result["by_config"]["none"]
    assert none["reached_target"] == 2 and none["first_version_at_target"] == 15.0
    assert none["behaviour_mismatch_mean"] == pytest.approx(0.15) and none["wall_seconds"] == 50.5
    assert result["by_config"]["mask"]["ok"] == 1
    md = (tmp_path / "corrections-subset.md").read_text()
    assert md.startswith("# Off-policy corrections") and "FAILED (exit 2): tandem demo: unknown flag" in md
    assert "| none | 1.000 ± 0.000 | 2/2 | 15.0 |" in md

    search = bc.run(tmp_path, seeds=(0,), steps=20, search=(2e-3, 1e-2))
    assert {(r["config"], r["lr"]) for r in search["rows"]} == {
        (c, x) for c in bc.SEARCH_CONFIGS for x in (2e-3, 1e-2)}
    assert json.loads((tmp_path / "corrections_lr_search.json").read_text())["rows"] == search["rows"]


def test_the_options_parse_into_run_arguments() -> None:
    kwargs = bc.parse_args(["--seeds", "0,2", "--configs", "none,seq_reject", "--lr", "1e-2", "--steps", "80"])
    assert kwargs["seeds"] == (0, 2) and kwargs["configs"] == ("none", "seq_reject")
    assert kwargs["lr"] == 1e-2 and kwargs["steps"] == 80 and kwargs["search"] == ()


def test_the_demo_passes_trainer_args_to_the_native_trainer_only() -> None:
    from services.demo.config import DemoSettings
    from services.demo.demo import Demo

    settings = load(DemoSettings, ["--trainer-args", '{"tis_cap": 0, "max_behaviour_mismatch": 0}'], "tandem demo")
    argv = Demo(settings)._trainer_argv(Path("/model"))
    assert argv[-4:] == ["--tis-cap", "0", "--max-behaviour-mismatch", "0"]
    with pytest.raises(SettingsError, match="the demo sets these itself"):
        load(DemoSettings, ["--trainer-args", '{"learning_rate": 1}'], "tandem demo")

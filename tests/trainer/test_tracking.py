"""`report_to` (shared/tracking.py, docs/tracking.md): the native trainer and the sampler mirror
their metrics to W&B (offline) and TensorBoard, and what they wrote is read back with the
backends' own readers: the names are trainer_metrics.jsonl's and the sampler's batch stats',
at the trainer's steps; both services of one run land in one W&B group and one TensorBoard
tree. A backend that is not installed is refused up front, naming the pip extra."""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from services.demo.config import DemoSettings
from services.demo.demo import Demo
from services.sampler.config import SamplerSettings
from services.sampler.entrypoint import main as sampler_main
from services.trainer.config import TrainerSettings
from services.trainer.entrypoint import main as trainer_main
from services.trainer.trainer import train
from shared.settings import SettingsError, build, load
from shared.tracking import Reporter, TrackingSettings
from tests.reliability.support import wait_for
from tests.support.servers import UvicornThread, kill_embedded_redis, start_sampler_process
from tests.support.tracking import tensorboard_scalars, wandb_runs

pytest.importorskip("wandb", reason="the tracking tests need the wandb extra: pip install -e '.[wandb]'")
pytest.importorskip("tensorboard", reason="the tracking tests need the tensorboard extra: pip install -e '.[tensorboard]'")

ENV = "tests.trainer.letter_env:LetterEnv"
TOKEN = "tracking-test-token"
STEPS = 3


@pytest.fixture
def wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """W&B offline, its per-user files in tmp_path: nothing leaves the machine or the test."""
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"), "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
           "WANDB_DATA_DIR": str(tmp_path / "wandb-data")}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    for key in ("WANDB_DIR", "WANDB_PROJECT", "WANDB_RUN_GROUP", "WANDB_API_KEY"):
        monkeypatch.delenv(key, raising=False)
    return env


def _jsonl(run_dir: Path, event: str) -> list[dict]:
    records = map(json.loads, (run_dir / "trainer_metrics.jsonl").read_text().splitlines())
    return [r for r in records if r["event"] == event]


def _numbers(record: dict, prefix: str = "") -> dict[str, float]:
    """The record's finite numbers as the reporter names them (nested dicts as a/b)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update(_numbers(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[prefix + key] = value
    return out


@pytest.mark.timeout(180)
async def test_trainer_and_sampler_report_to_wandb_and_tensorboard(tiny_model_dir: Path, tmp_path: Path,
                                                                   wandb_offline: dict[str, str]) -> None:
    from services.inference.config import InferenceSettings
    from services.inference.server import create_app

    # One run directory for both, as `tandem demo` runs them: one W&B group, one TensorBoard tree.
    run_dir = tmp_path / "letters"
    inference = UvicornThread(create_app(InferenceSettings(model=str(tiny_model_dir)))).start()
    sampler = None
    try:
        sampler = start_sampler_process(
            run_dir, process_env=wandb_offline, inference_urls=[inference.url], env=ENV, prompts_per_step=2,
            num_generations=4, max_tokens=8, max_staleness=1, eval_examples=4, api_token=TOKEN,
            drain_deadline=1, report_to="wandb,tensorboard")
        settings = build(TrainerSettings, {
            "model": str(tiny_model_dir), "sampler_url": sampler.url, "run_dir": str(run_dir), "api_token": TOKEN,
            "per_device_batch_size": "4", "grad_accum_steps": "2", "max_steps": str(STEPS),
            "learning_rate": "1e-3", "progress": "false", "report_to": "wandb,tensorboard"})
        await train(settings)
        assert sampler.terminate() in (0, -15), sampler.log_tail()  # SIGTERM: the sampler finishes its W&B run
    finally:
        if sampler is not None:
            sampler.kill()
        kill_embedded_redis(run_dir)
        inference.stop()

    steps, evals = _jsonl(run_dir, "step"), _jsonl(run_dir, "eval")
    assert [r["step"] for r in steps] == list(range(STEPS)) and {e["label"] for e in evals} == {"before", "after"}
    # What each step record reports: its numbers under its own names, but the axis and the clock.
    expected = {r["step"]: {k: v for k, v in _numbers(r).items() if k not in ("step", "time")} for r in steps}
    assert {"loss", "reward_mean", "staleness_mean", "lr", "grad_norm", "train_s"} <= set(expected[0])

    # TensorBoard, trainer: one tag per name of the jsonl, at the trainer's steps, the same values.
    trainer_tb = tensorboard_scalars(run_dir / "tensorboard" / "trainer")
    step_names = set().union(*expected.values())
    assert step_names <= set(trainer_tb)
    assert set(trainer_tb) - step_names == {t for t in trainer_tb if t.startswith("eval/")}
    for name in step_names:
        points = dict(trainer_tb[name])
        for step, values in expected.items():
            if name in values:
                assert points[step] == pytest.approx(values[name], rel=1e-6, abs=1e-6), (name, step)
    for e in evals:  # each eval at its own step, under eval/
        assert dict(trainer_tb["eval/reward"])[e["step"]] == pytest.approx(e["reward"], rel=1e-6)
        assert dict(trainer_tb["eval/result/reward_mean"])[e["step"]] == pytest.approx(e["result"]["reward_mean"])

    # TensorBoard, sampler: the batch stats' names, at the batch's step = the step that trained on
    # it: its reward_mean is the trainer's reward_mean of that step (one rank: the whole batch).
    sampler_tb = tensorboard_scalars(run_dir / "tensorboard" / "sampler")
    assert {"reward_mean", "reward_std", "staleness_mean", "staleness_max", "num_samples", "generation_seconds",
            "completion_tokens_mean", "rewards_mean/letter"} <= set(sampler_tb), sorted(sampler_tb)
    assert not {"step", "sealed_at", "generation_started_at"} & set(sampler_tb)
    sampler_reward = dict(sampler_tb["reward_mean"])
    assert set(range(STEPS)) <= set(sampler_reward)
    for r in steps:
        assert sampler_reward[r["step"]] == pytest.approx(r["reward_mean"], abs=1e-6)
        assert dict(sampler_tb["staleness_mean"])[r["step"]] == pytest.approx(r["batch_staleness_mean"], abs=1e-6)
    assert all(v == 8 for _, v in sampler_tb["num_samples"])

    # W&B (offline, under run_dir/wandb): two finished runs in one group named after the run dir.
    runs = {r.job_type: r for r in wandb_runs(run_dir / "wandb")}
    assert set(runs) == {"trainer", "sampler"}
    # Each kept its W&B id where its restart looks for it (the sampler's by its port).
    sampler_port = sampler.url.rsplit(":", 1)[1]
    assert (run_dir / "wandb" / "trainer.run-id").read_text().strip() == runs["trainer"].run_id
    assert (run_dir / "wandb" / f"sampler-{sampler_port}.run-id").read_text().strip() == runs["sampler"].run_id
    for service, run in runs.items():
        assert (run.name, run.group, run.project, run.exit_code) == (f"letters-{service}", "letters", "tandem", 0)
    trainer_run = runs["trainer"]
    assert trainer_run.config["max_steps"] == STEPS and "api_token" not in trainer_run.config
    rows = {row["step"]: row for row in trainer_run.rows_with("loss")}
    assert sorted(rows) == list(range(STEPS))
    for step, values in expected.items():
        for name, value in values.items():
            assert rows[step][name] == pytest.approx(value, rel=1e-9, abs=1e-12), (name, step)
    assert {row["step"]: row["eval/reward"] for row in trainer_run.rows_with("eval/reward")} == {
        e["step"]: pytest.approx(e["reward"]) for e in evals}
    sampler_rows = {row["step"]: row for row in runs["sampler"].rows_with("reward_mean")}
    for r in steps:
        assert sampler_rows[r["step"]]["reward_mean"] == pytest.approx(r["reward_mean"], abs=1e-9)
        assert sampler_rows[r["step"]]["num_samples"] == 8


def test_a_backend_that_is_not_installed_is_refused_naming_the_extra(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # A module set to None in sys.modules is one Python cannot import or find: as if uninstalled.
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    # Before anything starts: `tandem trainer` and `tandem sampler` exit 2 with one line.
    assert trainer_main(["--model", str(tmp_path), "--report-to", "wandb"], prog="tandem trainer") == 2
    err = capsys.readouterr().err
    assert "--report-to / TANDEM_REPORT_TO" in err and "needs the wandb package" in err
    assert "pip install 'tandem[wandb]'" in err
    assert sampler_main(["--report-to", "tensorboard"]) == 2
    assert "pip install 'tandem[tensorboard]'" in capsys.readouterr().err
    with pytest.raises(SettingsError, match=r"tandem\[tensorboard\]"):
        load(TrainerSettings, ["--model", str(tmp_path), "--tensorboard"])  # the older flag, same check
    with pytest.raises(SettingsError, match=r"tandem\[wandb\]"):
        load(DemoSettings, ["--report-to", "wandb,tensorboard"])
    from services.trl_bridge.tracking import check_report_to, grpo_reporting

    with pytest.raises(ValueError, match=r"tandem\[wandb\]"):
        grpo_reporting("wandb", run_name="r", output_dir=tmp_path)
    with pytest.raises(ValueError, match=r"tandem\[tensorboard\]"):
        check_report_to(["tensorboard"])
    # Nothing chosen, nothing needed.
    assert load(SamplerSettings, []).report_to == []
    # A name that is no backend, whatever is installed.
    with pytest.raises(SettingsError, match="'mlflow' is not a tracking backend: choose from wandb, tensorboard"):
        load(SamplerSettings, ["--report-to", "mlflow"])


def test_report_to_spellings() -> None:
    def parsed(*argv: str) -> list[str]:
        return load(TrainerSettings, ["--model", "m", *argv]).report_to

    assert parsed("--report-to", "wandb,tensorboard") == ["wandb", "tensorboard"]
    assert parsed("--report-to", "TensorBoard", "--report-to", "wandb") == ["tensorboard", "wandb"]
    assert parsed("--report-to", '["wandb"]') == ["wandb"]
    assert parsed("--report-to", "none") == parsed() == []
    assert parsed("--tensorboard") == ["tensorboard"]
    assert parsed("--report-to", "wandb", "--tensorboard") == ["wandb", "tensorboard"]


def test_a_restarted_service_continues_its_wandb_run_and_a_fresh_one_starts_another(
        tmp_path: Path, wandb_offline: dict[str, str]) -> None:
    settings = TrackingSettings(run_dir=tmp_path, report_to="wandb", run_name="r")

    def run(steps: range, instance: str = "trainer", **start: Any) -> str:
        """One process's life: its W&B id, as kept for its restart."""
        reporter = Reporter.start(settings, "trainer", {"k": 1}, instance=instance, **start)
        for step in steps:
            reporter.log({"loss": float(step)}, step)
        reporter.close()
        return (tmp_path / "wandb" / f"{instance}.run-id").read_text().strip()

    first = run(range(0, 3), resume=True)  # nothing kept yet: a new run
    restarted = run(range(2, 5), resume=True)  # a restart (steps 2.. trained again): that run goes on
    fresh = run(range(0, 2), resume=False)  # a fresh start in the same run_dir (--no-resume): a new run
    other = run(range(0, 2), "trainer-b", resume=True)  # another instance of the service: its own run
    assert restarted == first and len({first, fresh, other}) == 3

    # Offline, W&B writes one directory per process; its transaction log may still be filling
    # after finish() returns, so read once all four have their exit record.
    def finished() -> list | None:
        runs = wandb_runs(tmp_path / "wandb")
        return runs if len(runs) == 4 and all(r.exit_code == 0 for r in runs) else None
    runs = wait_for(finished, 30, "four finished offline W&B runs", interval=0.2)
    steps: dict[str, list[list[int]]] = {}
    for r in runs:
        assert (r.name, r.group) == ("r-trainer", "r")
        steps.setdefault(r.run_id, []).append([row["step"] for row in r.rows_with("loss")])
    assert {k: sorted(v) for k, v in steps.items()} == {first: [[0, 1, 2], [2, 3, 4]], fresh: [[0, 1]], other: [[0, 1]]}


def test_a_failing_backend_is_logged_and_the_others_go_on(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    class Broken:
        def log(self, metrics: dict, step: int) -> None:
            raise OSError("disk gone")

        def close(self, exit_code: int = 0) -> None:
            raise OSError("still gone")

    settings = TrackingSettings(run_dir=tmp_path, report_to="tensorboard")
    reporter = Reporter.start(settings, "sampler")
    reporter.backends = {"broken": Broken(), **reporter.backends}
    with caplog.at_level(logging.WARNING, logger="tandem.tracking"):
        for step in range(3):
            reporter.log({"reward_mean": step / 2, "note": "text", "flag": True, "missing": None,
                          "nan": float("nan"), "rewards_mean": {"correct": step}}, step)
        reporter.close()
    assert [r.getMessage() for r in caplog.records if "failed to log" in r.getMessage()] == [
        "tracking: broken failed to log step 0; the run goes on (later failures of broken are logged at debug level)"]
    scalars = tensorboard_scalars(tmp_path / "tensorboard" / "sampler")
    assert scalars == {"reward_mean": [(0, 0.0), (1, 0.5), (2, 1.0)], "rewards_mean/correct": [(0, 0), (1, 1), (2, 2)]}


def test_demo_hands_report_to_to_the_sampler_and_either_trainer(tmp_path: Path) -> None:
    run_dir = tmp_path / "demo-run"
    flags = {"--report-to": "wandb,tensorboard", "--run-name": "demo-run",
             "--tensorboard-dir": str(run_dir.resolve() / "tensorboard")}
    native = Demo(load(DemoSettings, ["--run-dir", str(run_dir), "--report-to", "wandb,tensorboard"]))
    argv = native._trainer_argv(tmp_path / "model")
    for flag, value in flags.items():
        assert argv[argv.index(flag) + 1] == value
    # The trainer reads them as the same run as the sampler's flags (the same function makes both).
    assert native._tracking_flags()["run_name"] == "demo-run"
    trainer = load(TrainerSettings, argv[argv.index("trainer") + 1:])
    assert (trainer.report_to, trainer.tracking_name(), trainer.tracking_dir()) == (
        ["wandb", "tensorboard"], "demo-run", run_dir.resolve() / "tensorboard")

    trl = Demo(load(DemoSettings, ["--run-dir", str(run_dir), "--report-to", "tensorboard", "--trainer", "trl",
                                   "--run-name", "mine", "--wandb-project", "p"]))
    argv = trl._trainer_argv(tmp_path / "model")
    assert argv[argv.index("--report-to") + 1] == "tensorboard" and argv[argv.index("--run-name") + 1] == "mine"
    assert argv[argv.index("--wandb-project") + 1] == "p"
    assert Demo(load(DemoSettings, ["--run-dir", str(run_dir)]))._tracking_flags() == {}


def test_the_trl_example_passes_its_choice_to_trl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("trl", reason="the TRL integration needs the `trl` extra: pip install -e '.[trl]'")
    from trl import GRPOConfig

    from services.trl_bridge.tracking import grpo_reporting

    for key in ("WANDB_PROJECT", "WANDB_RUN_GROUP", "WANDB_JOB_TYPE", "WANDB_DIR", "TENSORBOARD_LOGGING_DIR"):
        monkeypatch.delenv(key, raising=False)
    reporting = grpo_reporting("wandb,tensorboard", run_name="r1", output_dir=tmp_path / "out",
                               wandb_project="proj", tensorboard_dir=tmp_path / "tb")
    assert reporting == {"report_to": ["wandb", "tensorboard"], "run_name": "r1-trainer"}
    config = GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, **reporting)
    assert (config.report_to, config.run_name) == (["wandb", "tensorboard"], "r1-trainer")
    import os

    assert (os.environ["WANDB_PROJECT"], os.environ["WANDB_RUN_GROUP"], os.environ["WANDB_JOB_TYPE"]) == (
        "proj", "r1", "trainer")
    assert os.environ["WANDB_DIR"] == str(tmp_path / "out")
    assert os.environ["TENSORBOARD_LOGGING_DIR"] == str(tmp_path / "tb" / "trainer")
    assert grpo_reporting("none", run_name="r", output_dir=tmp_path) == {"report_to": "none", "run_name": "r-trainer"}


def test_sampler_batches_sealed_out_of_order_are_reported_in_step_order(tmp_path: Path) -> None:
    """TensorBoard takes a step below one it has seen for a restart and drops the later points, so
    a batch waits for the lower steps still being built, and goes out once they seal or are dropped."""
    from services.sampler.observability.tracking import BatchReporter

    reporter = Reporter.start(TrackingSettings(run_dir=tmp_path, report_to="tensorboard"), "sampler")
    building = {0, 1, 2}  # the producer's steps in flight

    def seal(step: int) -> None:
        batch.on_sealed({"step": step, "stats": {"step": step, "reward_mean": step / 10, "sealed_at": 1e9,
                                                 "policy_versions": {"0": 8}, "finish_reasons": {"stop": 8}}})
        building.discard(step)  # the producer forgets a step once its hooks have run

    batch = BatchReporter(reporter, building=lambda: building)
    seal(1)
    assert sorted(batch.held) == [1]  # batch 0 is still being built
    seal(0)
    assert batch.held == {}
    building.discard(2)  # dropped (trimmed before it sealed): nothing waits for it
    building.update({3, 4})
    seal(4)
    assert sorted(batch.held) == [4]
    building.discard(3)
    building.add(5)
    seal(5)
    building.add(6)
    batch.on_sealed({"step": 7, "stats": {"reward_mean": 0.7}})
    batch.flush()  # shutdown: whatever still waits goes out, in order
    reporter.close()
    scalars = tensorboard_scalars(tmp_path / "tensorboard" / "sampler")
    assert [step for step, _ in scalars["reward_mean"]] == [0, 1, 4, 5, 7]
    assert set(scalars) == {"reward_mean", "finish_reasons/stop"}  # not the axis, the clock or the versions


@pytest.mark.timeout(120)
def test_a_backend_that_cannot_start_stops_the_start_with_what_to_do(
        tmp_path: Path, wandb_offline: dict[str, str]) -> None:
    """`tandem sampler` whose W&B cannot start (here a mode W&B refuses, as it refuses a missing
    login) exits 2 at start-up with one line naming the backend and what to do. A process of its
    own: W&B reads its environment once per process."""
    import os
    import subprocess

    run_dir = tmp_path / "refused"
    env = {**os.environ, **wandb_offline, "WANDB_MODE": "no-such-mode"}
    try:
        done = subprocess.run([sys.executable, "-m", "services.cli", "sampler", "--port", "0", "--run-dir",
                               str(run_dir), "--report-to", "tensorboard,wandb"],
                              capture_output=True, text=True, env=env, timeout=90, cwd=Path(__file__).parents[2])
    finally:
        kill_embedded_redis(run_dir)
    assert done.returncode == 2, done.stderr[-3000:]
    refusal = [line for line in done.stderr.splitlines() if line.startswith("tandem sampler:")]
    assert len(refusal) == 1 and "report_to wandb: could not start" in refusal[0], done.stderr[-3000:]
    assert "WANDB_MODE=offline" in refusal[0] and "wandb login" in refusal[0]
    assert Reporter.start(TrackingSettings(run_dir=tmp_path), "trainer") is None  # nothing chosen, nothing started

"""The metrics file across restarts: one step record per trained step, whatever the kill moment."""

from __future__ import annotations

import json
from pathlib import Path

from services.trainer import metrics_history
from services.trainer.metrics import METRICS_FILE


def _write(path: Path, lines: list[str]) -> None:
    path.write_text("".join(line + "\n" for line in lines))


def _step(n: int, **extra) -> str:
    return json.dumps({"event": "step", "step": n, "version": n + 1, "loss": 0.1 * n, **extra})


def _steps(path: Path) -> list[dict]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in records if r["event"] == "step"]


def test_steps_after_the_checkpoint_move_out_and_a_cut_line_is_dropped(tmp_path: Path) -> None:
    path = tmp_path / METRICS_FILE
    _write(path, ['{"event": "start", "start_step": 0}', _step(0), _step(1), _step(2),
                  '{"event": "eval", "step": 2, "reward": 0.5}', _step(3), '{"event": "step", "st'])
    history = metrics_history.prepare(path, resumed=True, checkpoint_step=1)
    assert history.superseded == {2, 3} and history.dropped_lines == 1 and history.restored_step is None
    assert [r["step"] for r in _steps(path)] == [0, 1]
    assert '"event": "eval"' in path.read_text()  # an eval measured served weights: it stays
    moved = [json.loads(line) for line in (tmp_path / metrics_history.SUPERSEDED_FILE).read_text().splitlines()]
    assert [r["step"] for r in moved] == [2, 3]


def test_the_checkpoint_step_without_its_line_gets_it_back_from_the_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / METRICS_FILE
    _write(path, [_step(0), _step(1)])
    record = {"event": "step", "step": 2, "version": 3, "loss": float("nan"), "reward_mean": 0.25}
    history = metrics_history.prepare(path, resumed=True, checkpoint_step=2, checkpoint_record=record)
    assert history.restored_step == 2 and history.superseded == set()
    steps = _steps(path)
    assert [r["step"] for r in steps] == [0, 1, 2]
    assert steps[2]["restored"] is True and steps[2]["loss"] is None and steps[2]["reward_mean"] == 0.25


def test_a_complete_history_is_left_alone(tmp_path: Path) -> None:
    path = tmp_path / METRICS_FILE
    _write(path, [_step(0), _step(1)])
    before = path.read_bytes()
    history = metrics_history.prepare(path, resumed=True, checkpoint_step=1,
                                      checkpoint_record=json.loads(_step(1)))
    assert history.superseded == set() and history.restored_step is None and history.dropped_lines == 0
    assert path.read_bytes() == before
    assert not (tmp_path / metrics_history.SUPERSEDED_FILE).exists()


def test_no_checkpoint_means_every_step_is_trained_again(tmp_path: Path) -> None:
    path = tmp_path / METRICS_FILE
    _write(path, [_step(0), _step(1)])
    assert metrics_history.prepare(path, resumed=True, checkpoint_step=-1).superseded == {0, 1}
    assert _steps(path) == []


def test_a_run_that_does_not_resume_moves_the_old_file_aside(tmp_path: Path) -> None:
    path = tmp_path / METRICS_FILE
    _write(path, [_step(0), _step(1)])
    history = metrics_history.prepare(path, resumed=False, checkpoint_step=-1)
    assert not path.exists()
    assert history.archived_to is not None and history.archived_to.parent == tmp_path
    assert [r["step"] for r in _steps(history.archived_to)] == [0, 1]

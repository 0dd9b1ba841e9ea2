"""Bad sampler settings are refused at start-up with a message that says what to fix."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.servers import REPO


def run_sampler(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "services.cli", "sampler", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("args, expected", [
    (["--prompts-per-step", "0"], "--prompts-per-step"),
    (["--max-staleness", "-1"], "--max-staleness"),
    (["--inference-urls", "localhost:8000"], "not an http(s) URL"),
    (["--advantage", "magic"], "--advantage"),
    (["--env", "no_such_env"], "unknown environment 'no_such_env'"),
    (["--strategy", "nope"], "unknown strategy 'nope'"),
    (["--temperature", "warm"], "--temperature"),
    (["--env", "parity_dialogue", "--env-args", '{"turns": 0}'], "parity_dialogue: turns must be between 1 and 64"),
    (["--env", "parity_dialogue", "--env-args", '{"trns": 3}'], "'trns'; its arguments (--env-args) are turns, num_train"),
    (["--env-timeout", "0"], "--env-timeout"),
    (["--env-workers", "0"], "--env-workers"),
])
def test_bad_settings_exit_2_with_a_clear_message(args, expected):
    result = run_sampler(*args)
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr


def test_bad_environment_variable_is_named():
    result = run_sampler(env={"TANDEM_NUM_GENERATIONS": "many"})
    assert result.returncode == 2
    assert "TANDEM_NUM_GENERATIONS" in result.stderr

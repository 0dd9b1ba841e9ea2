"""An environment that fails to load stops `tandem sampler` in one line, exit status 2 (issue
43): the environment's id, the exception and what to do when that is known; never a
traceback. Run as the real command, as a user meets it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def start_sampler(tmp_path: Path, env: str, env_args: dict | None = None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "services.cli", "sampler", "--env", env, "--run-dir", str(tmp_path / "run"),
            "--inference-urls", "http://127.0.0.1:9"]
    if env_args is not None:
        argv += ["--env-args", json.dumps(env_args)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=dict(os.environ))


def assert_one_line_refusal(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_a_taskset_missing_an_nltk_resource_names_it_and_nltk_data(tmp_path: Path) -> None:
    line = assert_one_line_refusal(start_sampler(tmp_path, "verifiers:tandem-vf-broken", {"taskset": {}}))
    assert line.startswith("tandem sampler: environment 'verifiers:tandem-vf-broken' failed to load: LookupError:")
    assert "averaged_perceptron_tagger_eng" in line and "NLTK_DATA" in line, line
    assert "***" not in line, line  # nltk's banner is not carried over
    assert not (tmp_path / "run").exists(), "nothing is started for an environment that cannot load"


def test_a_taskset_raising_on_load_is_one_line_with_its_exception(tmp_path: Path) -> None:
    line = assert_one_line_refusal(
        start_sampler(tmp_path, "verifiers:tandem-vf-broken", {"taskset": {"error": "runtime"}}))
    assert line == ("tandem sampler: environment 'verifiers:tandem-vf-broken' failed to load: RuntimeError: "
                    "the word list server did not answer"), line


@pytest.mark.parametrize(("args", "needles"), [
    ({}, ["RuntimeError: the prompt file could not be parsed at line 3"]),
    ({"missing": "tandem_no_such_package"}, ["ModuleNotFoundError", "install the package that provides the module "
                                                                    "'tandem_no_such_package'"]),
])
def test_a_native_factory_that_raises_is_one_line(tmp_path: Path, args: dict, needles: list[str]) -> None:
    line = assert_one_line_refusal(start_sampler(tmp_path, "tests.support.envs:broken_env", args))
    assert line.startswith("tandem sampler: environment 'tests.support.envs:broken_env' failed to load: "), line
    for needle in needles:
        assert needle in line, line

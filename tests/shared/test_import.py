"""Importing `shared` (and its client) must never import torch or vllm."""

import subprocess
import sys


def test_shared_does_not_import_torch_or_vllm():
    code = (
        "import sys, shared, shared.client, shared.codec, shared.settings, shared.wire\n"
        "heavy = sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules)\n"
        "print(','.join(heavy))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""


def test_the_cli_dispatcher_imports_nothing_heavy():
    code = "import sys, services.cli; print('torch' in sys.modules, 'fastapi' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "False False"

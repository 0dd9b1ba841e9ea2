"""Loading user extensions (environments, strategies) by 'package.module:attribute' path."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any


def load_by_path(path: str, kind: str, builtins: list[str]) -> Any:
    """The attribute `path` names; a ValueError that says what to write otherwise."""
    if ":" not in path:
        raise ValueError(f"unknown {kind} {path!r}: use one of {sorted(builtins)} or 'package.module:attribute'")
    module_name, _, attr = path.partition(":")
    # As uvicorn does for apps: a module next to where the user runs `tandem` is importable
    # (the console script's sys.path holds its own directory, not the working directory).
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load {kind} {path!r}: {exc}") from None

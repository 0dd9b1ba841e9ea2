"""`tandem inference`: parse InferenceSettings, then start the chosen backend.

`--backend cpu` (default) serves the model with the built-in CPU server under uvicorn;
`--backend vllm` runs `vllm serve` as a child process (vllm_launcher.py). Settings are
validated before torch, transformers or vllm is imported, so a typo fails in milliseconds.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from services.inference.config import InferenceSettings
from shared.settings import SettingsError, load


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    try:
        settings = load(InferenceSettings, argv, prog)
    except SettingsError as exc:
        print(f"{prog or 'tandem inference'}: {exc}", file=sys.stderr)
        return 2
    refused = settings.listen_refusal("the inference server")
    if refused:
        print(f"{prog or 'tandem inference'}: {refused}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if settings.backend == "vllm":
        from services.inference.vllm_launcher import run

        return run(settings)
    if not (Path(settings.model) / "config.json").is_file():
        print(f"{prog or 'tandem inference'}: --model {settings.model} is not a Hugging Face model directory "
              "(no config.json); write one with `tandem init-model --out DIR`", file=sys.stderr)
        return 2
    import uvicorn

    from services.inference.server import create_app

    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level)
    return 0

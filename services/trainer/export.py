"""`tandem export SOURCE --out DIR [--merge [--base BASE]] [--dtype D]`: a model directory to serve
or share, from what the trainer wrote.

* `--merge`: SOURCE is a LoRA adapter (a published `version-V` or a checkpoint `step-N` of a
  LoRA run); DIR gets base + adapter merged into one ordinary Hugging Face model (config,
  safetensors, the base's tokenizer files). The base is `--base`, else the one the adapter
  records (the checkpoint's trainer_state.json, the adapter_config.json).
* without it: SOURCE is a full checkpoint `step-N`, already a Hugging Face model; DIR gets its
  model files without the optimizer state and trainer_state.json.

DIR is written atomically (a staging directory renamed into place); an existing DIR is refused
unless `--overwrite`. Exit status 2, with a line saying what to fix, for a SOURCE that is not
what the flags say or a base the adapter does not fit.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from shared.adapters import is_adapter_dir
from shared.settings import SettingsError

DTYPES = ("auto", "float32", "bfloat16", "float16")
# What a full checkpoint holds besides the model: not part of an exported model.
_TRAINER_FILES = ("optimizer.pt", "optimizer", "trainer_state.json")


def parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("source", help="a checkpoint step-N directory, or (with --merge) a published LoRA version-V")
    p.add_argument("--out", required=True, help="the model directory to write")
    p.add_argument("--merge", action="store_true", help="merge the LoRA adapter in SOURCE into its base model")
    p.add_argument("--base", help="with --merge: the base model directory (default: the one the adapter records)")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="with --merge: dtype of the written weights (auto: the base model's)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    return p


def export(source: Path | str, out: Path | str, *, merge: bool = False, base: str | None = None,
           dtype: str = "auto", overwrite: bool = False) -> Path:
    """What `tandem export` does; SettingsError with what to fix."""
    from services.trainer import checkpoint as ckpt

    source, out = Path(source), Path(out)
    if not source.is_dir():
        raise SettingsError(f"{source} is no directory: give a checkpoint step-N or a published version-V")
    if out.exists() and not overwrite:
        raise SettingsError(f"{out} exists: choose another --out, or --overwrite to replace it")
    if merge:
        from services.trainer import lora

        try:
            return lora.merge(source, out, base=base, dtype=dtype)
        except ImportError as exc:
            raise SettingsError(lora.PEFT_MISSING) from exc
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
    if is_adapter_dir(source):
        raise SettingsError(f"{source} is a LoRA adapter, not a model: add --merge to write base + adapter as one "
                            "model (--base if it does not record its base)")
    if base is not None or dtype != "auto":
        raise SettingsError("--base and --dtype go with --merge; a full checkpoint is exported as it is")
    if not (source / "config.json").is_file():
        raise SettingsError(f"{source} is no model directory (no config.json): give a full checkpoint step-N")

    def write(tmp: Path) -> None:
        for entry in source.iterdir():
            if entry.name in _TRAINER_FILES or entry.name.startswith("."):
                continue
            if entry.is_dir():
                shutil.copytree(entry, tmp / entry.name)
            else:
                shutil.copy2(entry, tmp / entry.name)

    return ckpt.write_dir(out, write)


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    args = parser(prog or "tandem export").parse_args(argv)
    path = export(args.source, args.out, merge=args.merge, base=args.base, dtype=args.dtype,
                  overwrite=args.overwrite)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

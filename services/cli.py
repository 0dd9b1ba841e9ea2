"""`tandem` command line: one subcommand per service.

The dispatcher imports nothing heavy: each subcommand's entrypoint parses its own
settings first and imports torch, vllm or FastAPI only once they are valid.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "demo": ("services.demo.entrypoint", "run the whole stack on CPU and train the toy task"),
    "sampler": ("services.sampler.entrypoint", "the sampler service (port 8100)"),
    "trainer": ("services.trainer.entrypoint", "the GRPO trainer"),
    "inference": ("services.inference.entrypoint", "an inference server: CPU or vLLM (port 8000)"),
    "init-model": ("services.inference.init_model", "write a small random HF model directory"),
    "export": ("services.trainer.export", "a model directory from a checkpoint (--merge: base + LoRA adapter)"),
    "status": ("services.status", "pretty-print a sampler's /status"),
}


def usage() -> str:
    lines = ["usage: tandem <command> [--help] [flags]", "", "commands:"]
    lines += [f"  {name:<11} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"tandem: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module_name = COMMANDS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            print(f"tandem {name}: not available in this build ({exc})", file=sys.stderr)
            return 2
        raise
    from shared.settings import SettingsError

    try:
        return int(module.main(rest, prog=f"tandem {name}") or 0)
    except SettingsError as exc:
        # A SystemExit with an int code prints nothing by itself: say what to fix.
        print(f"tandem {name}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

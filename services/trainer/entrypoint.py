"""`tandem trainer`: parse the settings, then import torch and train.

Exit status 0 after `max_steps`; 2 for invalid settings, a `--model` that is no model
directory, an API token the sampler refuses, or a batch-shape mismatch with the sampler (the
message names the numbers; services/trainer/preflight.py); 3 when the run stopped because the
inference servers' logprobs kept disagreeing with the trainer's (`max_behaviour_mismatch`;
the message says what to check, and the last step's checkpoint is written); 4 when the
sampler could not be reached, or kept failing, for `retry_for` seconds (one line with the
last error); 5 when the disk holding the run directory (or publish_dir) is full (one line: the
directory, the space needed and free; nothing committed is lost, so freeing space and running
the same command again continues the run). Under `torchrun` every rank runs this same command; rank 0 prints the summary.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Sequence

from services.trainer.checkpoint import DiskFullError
from services.trainer.config import TrainerSettings
from services.trainer.mismatch import BehaviourMismatchError
from services.trainer.preflight import check_model
from shared.client import BatchDamaged, SamplerError, SamplerUnavailable
from shared.settings import SettingsError, load


# Refusals and diagnoses, not crashes: the message alone, then this exit status.
#   2 settings (SystemExit with an int code prints nothing by itself: say why first);
#   3 the inference servers' logprobs kept disagreeing; 4 the sampler stayed unreachable (the
#   client logged the wait every wait_log_interval); 5 a full disk (checked before each
#   checkpoint and version is written: nothing committed was lost); 6 a batch the sampler holds
#   damaged (its stored bytes changed outside it: no retry can help; the message names the file);
#   7 the sampler refused what this trainer asks (a batch trimmed or superseded, a version another
#   trainer moved past): the message says what to change. First match wins: SamplerError last.
EXIT_STATUS = ((SettingsError, 2), (BehaviourMismatchError, 3), (SamplerUnavailable, 4), (DiskFullError, 5),
               (BatchDamaged, 6), (SamplerError, 7))


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    try:
        return _main(argv, prog)
    except tuple(kind for kind, _ in EXIT_STATUS) as exc:
        print(f"{prog or 'tandem trainer'}: {exc}", file=sys.stderr)
        return next(code for kind, code in EXIT_STATUS if isinstance(exc, kind))


def _main(argv: Sequence[str] | None, prog: str | None) -> int:
    settings = load(TrainerSettings, argv, prog or "tandem trainer")
    check_model(settings.model)  # before torch loads and before the sampler is asked anything
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=settings.log_level.upper(),
        format=f"%(asctime)s %(levelname)s [trainer{'' if rank == 0 else f' rank {rank}'}] %(name)s: %(message)s",
    )
    # One line per long-poll request would drown the per-step lines.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from services.trainer.trainer import run  # torch and transformers load only now

    summary = run(settings)
    if rank == 0:
        print(json.dumps({k: v for k, v in summary.items() if k != "evals"}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

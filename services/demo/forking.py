"""The demo's torch children, forked from one interpreter that imported torch once.

The CPU inference server and the native trainer each spend ~4.5 s of CPU before their first
step importing torch and transformers and running transformers' first `from_pretrained` (which
imports ~1,000 more modules: accelerate, sympy, ...); the second `from_pretrained` in a process
takes 0.03 s. On 2 cores, two such start-ups and the sampler's run side by side and the demo's
first step waited ~9.7 s for them. `preload` does that work once, in the demo, while the
sampler (a fresh interpreter: it needs no torch) starts on the other core; `ForkedChild` then
forks the demo and runs `services.cli.main` with the child's argv, environment and log, as
`Child` runs `python -m services.cli ...`.

Forking is only safe from a process with one thread: `preload` reports whether that holds
(progress bars off, one torch thread), and the demo falls back to fresh interpreters when it
does not. A forked child is the demo's own child like any other (same pid handling, own
session, SIGTERM then SIGKILL), and its command line is the demo's: its log's first line
names the command it runs.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from services.demo.processes import Child

PRELOAD_MAX_BYTES = 64 << 20


def single_threaded() -> bool:
    """No thread but this one, Python's or native (torch's, a progress bar's monitor...)."""
    try:
        native = len(os.listdir("/proc/self/task"))
    except OSError:
        return False  # cannot tell: do not fork
    return threading.active_count() == 1 and native == 1


def limit_threads(threads: int) -> None:
    """Thread pools of this process sized as the children's, before anything loads them: OpenBLAS
    starts its workers when numpy is imported (init_model imports it), libgomp reads its size when
    torch loads it, and the forked children inherit both. With one thread each, none is started."""
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[name] = str(threads)


def preload(model_dir: Path, threads: int) -> bool:
    """Import torch and transformers and load `model_dir` once in this process, so that children
    forked from it start without either (call `limit_threads` first). True when this process
    may fork (it has one thread)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(threads)
    hf_logging.disable_progress_bar()  # its monitor thread would make forking unsafe
    # Loaded for the modules its first load imports; a big model's own load is left to the children.
    if sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors")) <= PRELOAD_MAX_BYTES:
        AutoModelForCausalLM.from_pretrained(model_dir)
    AutoTokenizer.from_pretrained(model_dir)
    gc.collect()
    # What is here now stays as it is in the children: keep their collections from walking
    # (and copy-on-write touching) every object torch and transformers made.
    gc.freeze()
    return single_threaded()


class ForkedChild(Child):
    """`argv` = [python, -m, services.cli, command, ...] run in a fork of this process."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, env: dict[str, str]):
        if list(argv[1:3]) != ["-m", "services.cli"]:
            raise ValueError(f"a forked child runs `python -m services.cli ...`, not {list(argv)}")
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            log.write(f"$ {' '.join(self.argv)}  (forked from the demo, pid {os.getpid()})\n".encode())
        self._code: int | None = None
        self._pid = os.fork()
        if self._pid == 0:
            _run_child(self.argv[3:], log_path, env)

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def returncode(self) -> int | None:
        if self._code is None:
            try:
                pid, status = os.waitpid(self._pid, os.WNOHANG)
            except ChildProcessError:
                return self._code
            if pid:
                self._code = os.waitstatus_to_exitcode(status)
        return self._code

    def terminate(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self._pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def wait_stopped(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.returncode is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.returncode is None:
            try:
                os.kill(self._pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _, status = os.waitpid(self._pid, 0)
            self._code = os.waitstatus_to_exitcode(status)
        assert self._code is not None
        return self._code


def _run_child(args: list[str], log_path: Path, env: dict[str, str]) -> NoReturn:
    """The child's side: become what `python -m services.cli *args` would be, run it, exit. Never
    returns into the demo's code (its `finally` blocks would stop the demo's other children)."""
    code = 1
    try:
        os.setsid()  # as Child's start_new_session: a Ctrl-C in the terminal reaches only the demo
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        # Line-buffered, as PYTHONUNBUFFERED gives a fresh interpreter: the log shows each line.
        sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115
        os.environ.clear()
        os.environ.update(env)
        logging.root.handlers.clear()  # the service configures its own logging
        from services.cli import main

        code = main(args) or 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported in the child's log, as a fresh interpreter would
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()  # what the interpreter's exit would run (logging, trackers)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)

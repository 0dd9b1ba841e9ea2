"""Experiment tracking: a service's metrics mirrored to Weights & Biases and/or TensorBoard.

`report_to` (a setting of the trainer, the sampler and the demo; docs/tracking.md) names the
backends. A service starts one `Reporter` before it does any work and calls
`log(metrics, step)`; the reporter keeps the numbers (nested dicts flattened to `a/b`) and hands
them to every chosen backend:

* **wandb**: one W&B run per service, `<run_name>-<service>`, in the group `<run_name>`, so a
  run's trainer and sampler sit side by side. A service that continues its run after a restart
  (the trainer resuming, the sampler without --fresh) continues its W&B run too: the run's id
  is kept in `run_dir/wandb/<instance>.run-id` (`wandb_run_id`); a fresh start gets a new one.
  Every value is logged with the key `step` as its x-axis (`define_metric`), not as W&B's own
  step: W&B drops a row whose step is below one it already has, and evals finish late, a
  resumed trainer logs its retrained steps again, and batches may be sealed out of order. WANDB_MODE=offline, WANDB_DIR,
  WANDB_ENTITY, WANDB_API_KEY... mean what W&B says; files go under run_dir unless WANDB_DIR is set.
* **tensorboard**: event files in `<tensorboard_dir>/<service>` (default `run_dir/tensorboard`),
  one scalar per name at the given step, written without torch (the sampler has none).

Both packages are optional extras (`pip install 'tandem[wandb]'`, `'tandem[tensorboard]'`). A
chosen backend that is not installed is refused when the settings are read (`require_installed`,
which only looks the package up); one that cannot start (not logged in to W&B, an unwritable
directory) is refused by `Reporter.start`, before the service works. After that, tracking never
stops a service: the backends are called from one thread of their own, so `log` never blocks
the caller, and a backend call that fails is logged and the run goes on.

Importing this module imports neither backend.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import queue
import secrets
import string
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from shared.settings import CommaList, SettingsError, TandemSettings, json_if_str

log = logging.getLogger("tandem.tracking")

# Backend name -> (the module it imports, the pip extra that installs it).
BACKENDS: dict[str, tuple[str, str]] = {"wandb": ("wandb", "wandb"), "tensorboard": ("tensorboard", "tensorboard")}

# Seconds between TensorBoard's flushes to disk: what `tensorboard --logdir` sees lags by at most this.
TENSORBOARD_FLUSH_S = 10
# Seconds `Reporter.close` waits for the queued values to reach the backends.
CLOSE_TIMEOUT_S = 60.0


class TrackingSettings(TandemSettings):
    """The tracking settings of every service that reports (the trainer, the sampler, the demo)."""

    report_to: CommaList = Field(
        default_factory=list,
        description="mirror the metrics to these backends: wandb and/or tensorboard (none: only the run's own "
        "files); each is an optional extra, e.g. pip install 'tandem[wandb]'",
    )
    run_name: str | None = Field(
        default=None,
        description="the run's name in W&B: the group holding its trainer's and sampler's W&B runs "
        "(<run_name>-trainer, <run_name>-sampler); unset = the run_dir's name",
    )
    wandb_project: str | None = Field(default=None, description="W&B project; unset = $WANDB_PROJECT, else tandem")
    tensorboard_dir: Path | None = Field(
        default=None,
        description="TensorBoard log directory; each service writes to its own subdirectory (trainer/, sampler/); "
        "unset = run_dir/tensorboard",
    )

    @field_validator("report_to", mode="before")
    @classmethod
    def _json_list(cls, value: Any) -> Any:
        # '["wandb", "tensorboard"]' from a flag (each repeat) or the environment, as well as "a,b".
        if not isinstance(value, (str, list)):
            return value
        out: list[Any] = []
        for item in [value] if isinstance(value, str) else value:
            is_json = isinstance(item, str) and item.lstrip().startswith("[")
            out.extend(json_if_str(item) if is_json else [item])
        return out

    @field_validator("report_to")
    @classmethod
    def _installed_backends(cls, value: list[str]) -> list[str]:
        names = backend_names(value)
        require_installed(names)
        return names

    def tracking_name(self) -> str:
        return self.run_name or Path(self.run_dir).resolve().name or "tandem"

    def tracking_dir(self) -> Path:
        return Path(self.tensorboard_dir) if self.tensorboard_dir is not None else Path(self.run_dir) / "tensorboard"


def backend_names(names: Iterable[str]) -> list[str]:
    """The backends named, in order, once each; `none` (as TRL spells "no backend") names none."""
    out: list[str] = []
    for name in (n.strip().lower() for n in names):
        if name in ("", "none") or name in out:
            continue
        if name not in BACKENDS:
            raise ValueError(f"{name!r} is not a tracking backend: choose from {', '.join(BACKENDS)} "
                             "(comma-separated for both), or none")
        out.append(name)
    return out


def install_hint(name: str) -> str:
    module, extra = BACKENDS[name]
    return f"pip install 'tandem[{extra}]' (in a checkout: pip install -e '.[{extra}]'; make install does)"


def backend_problem(names: Iterable[str]) -> str | None:
    """What stops a chosen backend from loading (its package is not installed), or None. Only
    looks the packages up: nothing is imported."""
    for name in names:
        module, _ = BACKENDS[name]
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a broken or half-removed install
            found = False
        if not found:
            return f"report_to {name} needs the {module} package, which is not installed: {install_hint(name)}"
    return None


def require_installed(names: Iterable[str], what: str = "") -> None:
    """Raise ValueError (prefixed with `what`, when given) naming the extra to install for the
    first chosen backend whose package is missing."""
    problem = backend_problem(names)
    if problem:
        raise ValueError(f"{what}: {problem}" if what else problem)


def scalars(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The finite numbers of `metrics`, nested dicts flattened (`{"a": {"b": 1}}` -> `a/b`);
    strings, lists, None, booleans and NaN/inf are left out."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(scalars(value, name + "/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[name] = value
    return out


def _new_wandb_id() -> str:
    # As W&B makes them: 8 of [a-z0-9] (its own helper is private and has moved between releases).
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def wandb_run_id(path: Path, resume: bool) -> str:
    """The W&B run id of a service's run: the one kept in `path` when the service continues
    its run (`resume`) and one is kept, else a new one, written to `path` (atomically) for the
    service's next restart."""
    if resume:
        try:
            kept = path.read_text().strip()
        except FileNotFoundError:
            kept = ""
        if kept:
            return kept
    run_id = _new_wandb_id()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(run_id + "\n")
    os.replace(partial, path)
    return run_id


class _Wandb:
    def __init__(self, settings: TrackingSettings, service: str, config: dict[str, Any], resume: bool,
                 instance: str):
        import wandb

        name = settings.tracking_name()
        directory = None if os.environ.get("WANDB_DIR") else Path(settings.run_dir)
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
        run_id = wandb_run_id(Path(settings.run_dir) / "wandb" / f"{instance}.run-id", resume)
        self.run = wandb.init(
            project=settings.wandb_project or os.environ.get("WANDB_PROJECT") or "tandem",
            group=name, name=f"{name}-{service}", job_type=service, config=config,
            dir=str(directory) if directory is not None else None,
            # "allow": continue the run of that id if W&B has it (a restart), create it otherwise.
            id=run_id, resume="allow",
            # Several runs may live in one process (tests, an in-process sampler); each is
            # addressed through its own object, never through wandb.log.
            reinit="create_new",
            # The services' logs go to their own files; W&B must not wrap stdout/stderr.
            settings=wandb.Settings(console="off"),
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log({**metrics, "step": step})

    def close(self, exit_code: int = 0) -> None:
        self.run.finish(exit_code=exit_code)


class _TensorBoard:
    def __init__(self, settings: TrackingSettings, service: str, config: dict[str, Any], resume: bool,
                 instance: str):
        # A restarted service appends to the same directory whatever `resume` says: TensorBoard
        # shows the later points of a step written twice.
        # tensorboard's own writer and protos: torch's SummaryWriter writes the same events, but
        # the sampler does not import torch.
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.directory = settings.tracking_dir() / service
        self.directory.mkdir(parents=True, exist_ok=True)
        self._event, self._summary = Event, Summary
        self.writer = EventFileWriter(str(self.directory), flush_secs=TENSORBOARD_FLUSH_S)

    def log(self, metrics: dict[str, float], step: int) -> None:
        values = [self._summary.Value(tag=name, simple_value=float(value)) for name, value in metrics.items()]
        self.writer.add_event(self._event(wall_time=time.time(), step=step, summary=self._summary(value=values)))

    def close(self, exit_code: int = 0) -> None:
        self.writer.close()


_OPENERS = {"wandb": _Wandb, "tensorboard": _TensorBoard}
_STOP = object()


class Reporter:
    """`log(metrics, step)` fanned out to the chosen backends, from a thread of its own."""

    def __init__(self, backends: dict[str, Any]):
        self.backends = backends
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._failed: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="tandem-tracking", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, settings: TrackingSettings, service: str, config: dict[str, Any] | None = None, *,
              resume: bool = False, instance: str | None = None) -> Reporter | None:
        """A reporter to `settings.report_to` for `service` ("trainer", "sampler"), or None when
        none is chosen. `resume`: this process continues its run (a restart), so W&B continues
        the W&B run of `instance` (default: `service`; one name per process of the run that may
        restart, e.g. a sampler replica's port) instead of starting a new one. Raises
        SettingsError, naming the fix, when a backend cannot start; blocks for as long as the
        backends take to start (W&B: a second or two), so call it off an event loop."""
        if not settings.report_to:
            return None
        backends: dict[str, Any] = {}
        try:
            for name in settings.report_to:
                try:
                    backends[name] = _OPENERS[name](settings, service, config or {}, resume, instance or service)
                except ImportError as exc:
                    raise SettingsError(f"report_to {name}: the {BACKENDS[name][0]} package cannot be imported "
                                        f"({exc}): {install_hint(name)}") from None
                except SettingsError:
                    raise
                except Exception as exc:  # noqa: BLE001 -- whatever the backend raises, said in one line
                    hint = (" (`wandb login`, or WANDB_API_KEY; WANDB_MODE=offline keeps the run on disk)"
                            if name == "wandb" else "")
                    said = " ".join(str(exc).split())  # one line, as every start-up refusal
                    raise SettingsError(f"report_to {name}: could not start: {type(exc).__name__}: {said}{hint}") from None
        except BaseException:
            for backend in backends.values():
                _quietly(backend.close)
            raise
        where = ", ".join(f"{n} ({b.directory})" if n == "tensorboard" else n for n, b in backends.items())
        log.info("%s reports to %s as %s", service, where, settings.tracking_name())
        return cls(backends)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Queue the numbers of `metrics` at `step`; returns at once and never raises."""
        numbers = scalars(metrics)
        if numbers:
            self._queue.put((numbers, int(step)))

    def close(self, exit_code: int = 0, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Hand over what is queued, then close every backend (W&B: finish the run, failed when
        `exit_code` is not 0). Blocking."""
        if not self._thread.is_alive():
            return
        self._queue.put(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("tracking: the backends took over %.0fs to take the last values; closing anyway", timeout)
        for name, backend in self.backends.items():
            _quietly(lambda: backend.close(exit_code), f"tracking: closing {name} failed")

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            numbers, step = item
            for name, backend in self.backends.items():
                try:
                    backend.log(numbers, step)
                except Exception:  # noqa: BLE001 -- tracking must never stop a run
                    if name not in self._failed:
                        log.warning("tracking: %s failed to log step %d; the run goes on (later failures of "
                                    "%s are logged at debug level)", name, step, name, exc_info=True)
                        self._failed.add(name)
                    else:
                        log.debug("tracking: %s failed to log step %d", name, step, exc_info=True)


def _quietly(fn: Any, message: str = "tracking: closing a backend failed") -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 -- shutting down: say so and go on
        log.warning(message, exc_info=True)

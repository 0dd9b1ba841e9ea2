"""Waits on the sampler that say what they wait for (used by `shared/client.py`).

A trainer waits on the sampler in two ways: for an answer at all (the sampler not up yet,
restarting, or answering 5xx, such as the 503 of a generation stuck past its
`generation_deadline`), and for a batch (the sampler answering 204 while it generates). Both
log one line every `report_every` seconds (30 by default) rather than nothing or a line per
retry:

* `Retrying` (an unanswered request): the first failure at once, then one line per period
  with how long it has failed, the last error, and how long it will go on (the bound and
  the setting that sets it);
* `describe_status` (a batch wait): what the sampler's `GET /status` says the batch waits for:
  inference servers in rotation out of all (with why the others are out), the weights
  version generation waits for, the batch's build (phase, attempts, last error), and the
  published version.
"""

from __future__ import annotations

import logging
import time
from typing import Any

REPORT_EVERY = 30.0
"""Seconds between two lines about one wait (the trainer's `wait_log_interval`)."""

_MAX_REASON = 200


def _clip(text: Any, limit: int = _MAX_REASON) -> str:
    text = str(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Retrying:
    """The log lines of one request retried until `bound` seconds have passed."""

    def __init__(self, what: str, url: str, bound: float, bound_name: str, report_every: float,
                 log: logging.Logger):
        self.what, self.url, self.bound, self.bound_name = what, url, bound, bound_name
        self.report_every, self.log = report_every, log
        self.started = time.monotonic()
        self.next_report: float | None = None

    @property
    def deadline(self) -> float:
        return self.started + self.bound

    def failed(self, failure: str) -> None:
        """Log the failure when a line is due (the first one at once)."""
        now = time.monotonic()
        if self.next_report is not None and now < self.next_report:
            return
        failing = now - self.started
        left = max(0.0, self.deadline - now)
        if self.next_report is None:
            self.log.warning("%s to the sampler at %s failed (%s); retrying for up to %.0fs (%s), "
                             "a line every %gs", self.what, self.url, _clip(failure, 500), left,
                             self.bound_name, self.report_every)
        else:
            self.log.warning("%s: still waiting for the sampler at %s after %.0fs (last error: %s); giving up "
                             "in %.0fs (%s)", self.what, self.url, failing, _clip(failure, 500), left,
                             self.bound_name)
        self.next_report = now + self.report_every

    def give_up_message(self, failure: str) -> str:
        return (f"{self.what}: the sampler at {self.url} kept failing for {time.monotonic() - self.started:.0f}s "
                f"({self.bound_name} = {self.bound:g}s; raise it to wait longer); last error: {failure}")


def describe_status(status: Any, step: int | None = None) -> str:
    """What a `GET /status` body says generation (of batch `step`) is waiting for, in one line."""
    if not isinstance(status, dict):
        return "the sampler's /status answered no object"
    parts: list[str] = []
    servers = [s for s in status.get("inference_servers") or [] if isinstance(s, dict)]
    if servers:
        out = [s for s in servers if not s.get("in_rotation")]
        text = f"{len(servers) - len(out)} of {len(servers)} inference server(s) in rotation"
        if out:
            why = [f"{s.get('url')} {s.get('state')}" + (f": {_clip(s['reason'])}" if s.get("reason") else
                                                          f", last error: {_clip(s['error'])}" if s.get("error") else "")
                   for s in out[:3]]
            text += " (" + "; ".join(why) + ("; ..." if len(out) > 3 else "") + ")"
        parts.append(text)
    elif "inference_servers" in status:
        parts.append("the sampler has no inference servers (add one with POST /inference_servers)")
    steps = status.get("steps") if isinstance(status.get("steps"), dict) else {}
    waiting, next_step = steps.get("waiting_for_version"), steps.get("next_step")
    blocked = waiting is not None and (step is None or not isinstance(next_step, int) or step >= next_step)
    if blocked:
        parts.append(f"batch {next_step} cannot start until a server in rotation has weights version >= {waiting}")
    building = [p for p in steps.get("in_progress") or [] if isinstance(p, dict)]
    mine = next((p for p in building if p.get("step") == step), None)
    if mine is not None:
        text = f"batch {step} {mine.get('phase', 'building')}, attempt {mine.get('attempts')}"
        if mine.get("error"):
            text += f", last error: {_clip(mine['error'])}"
        parts.append(text)
    elif step is not None and building:
        parts.append(f"building batch(es) {', '.join(str(p.get('step')) for p in building[:4])}")
    elif step is not None and next_step is not None and not blocked:
        parts.append(f"batch {step} not started (next to build: {next_step})")
    versions = status.get("versions") if isinstance(status.get("versions"), dict) else {}
    if "published" in versions:
        parts.append(f"published weights version {versions.get('published')}")
    return "; ".join(parts) or "the sampler's /status says nothing about generation"

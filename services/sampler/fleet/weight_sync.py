"""Weight sync: load a checkpoint into every inference server and record what each serves.

For one server: pause(keep) -> collective_rpc reload (vLLM's `reload_weights`, or
`tandem_reload_weights` with Tandem's worker extension, which the launcher loads on both
builds; only it can apply a delta version, shared/weights_delta.py: a vLLM server without it is
refused a delta version before it is paused, saying how to fix that) ->
update_weight_version -> reset_prefix_cache -> resume -> probe check (when the trainer sent
a probe, the server must compute the trainer's logprobs before it gets work: shared/probe.py).
Requests frozen by the pause continue on the new weights after resume, and vLLM's
`weight_versions` spans tell which tokens came from which version. Resume runs whatever
happened before it, and is retried until it succeeds: a server must never be left paused.
While a server syncs, new requests go elsewhere.

A server whose reload relabels too (Tandem's CPU server says so at GET /server_info) swaps
weights and label between two of its steps: its sync is that one request, which also carries
the probe's token ids and answers with their logprobs (shared/probe.py, `reload_probe`; a
server whose answer lacks them is probed apart). Its requests in flight continue on the new
weights exactly as after a pause(keep) and resume.

Versions are labelled with the decimal string of the integer version.

A LoRA adapter (`adapter=True`, shared/adapters.py) is loaded with vLLM's
`POST /v1/load_lora_adapter` in place of the collective_rpc reload, always under the same
name (`adapter_name`) and in place, so requests frozen by the pause continue on the new adapter
as they would on new full weights; the probe then asks for the adapter by name. The first
adapter a server gets is the exception: its requests in flight name the base model and would
go on computing with it under the new label, so that pause waits for them to finish
(`mode=wait`) instead of freezing them.

Every step has a bound sized for what it does: `step_timeout` (setting `sync_step_timeout`) for
the pause, label, cache reset, resume and probe, which are quick on a live server;
`reload_timeout` for reading the checkpoint (a big model from a slow disk takes minutes); a
`mode=wait` pause waits for requests in flight, so up to the pool's `request_timeout`. A server
that stops answering mid-sync is not waited for that long: the fleet's liveness check
(liveness.py) abandons its sync (`abandon`), which then reports it unreachable.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.inference.vllm_ext import EXTENSION_CLS, RELOAD_METHOD
from services.sampler.fleet.inference_pool import MISMATCH, OK, RESYNCING, STALE, InferencePool, Server
from services.sampler.storage.store import Store
from shared.adapters import DEFAULT_ADAPTER_NAME, LOAD_PATH, load_request
from shared.aio import Abandoned, Cuttable, gather_first_error
from shared.http_client import Reply, TransportError
from shared.probe import Probe, ProbeResult, compare, probe_request, reload_probe, served_logprobs
from shared.probe import failed as probe_failed
from shared.weights_delta import DeltaError, is_delta

log = logging.getLogger("tandem.sampler.weights")


class SyncStepError(RuntimeError):
    def __init__(self, step: str, status: int | None, message: str):
        self.step = step
        self.status = status
        self.message = message
        super().__init__(f"{step}: {message}")


@dataclass
class SyncResult:
    url: str
    ok: bool
    version: int | None
    seconds: float
    error: str | None = None
    client_error: bool = False  # the server refused the checkpoint (4xx): our caller's input is bad
    unreachable: bool = False  # no HTTP answer at some step: the server is down (or died mid-sync)
    mismatch: bool = False  # loaded, but the probe showed it does not compute the trainer's numbers
    probe: ProbeResult | None = None


def parse_version_label(body: Any) -> int | None:
    """An integer version out of /weight_info's answer, or None when unlabelled."""
    if isinstance(body, dict):
        for key in ("weight_version", "version", "current_version"):
            if key in body:
                return parse_version_label(body[key])
        return None
    if isinstance(body, (int, float)) and not isinstance(body, bool):
        return int(body)
    if isinstance(body, str) and body.strip().lstrip("-").isdigit():
        return int(body.strip())
    return None


class WeightSync:
    def __init__(self, pool: InferencePool, store: Store, *, step_timeout: float = 30.0,
                 reload_timeout: float = 600.0, resume_deadline: float = 60.0,
                 adapter_name: str = DEFAULT_ADAPTER_NAME):
        self.pool = pool
        self.adapter_name = adapter_name
        self.store = store
        self.step_timeout = step_timeout
        self.reload_timeout = reload_timeout
        self.resume_deadline = resume_deadline
        # url -> (the task syncing it, the version); `abandon` cuts it short through `_cuts`.
        self._running: dict[str, tuple[asyncio.Task, int]] = {}
        self._cuts = Cuttable()
        # Called with a server whose sync starts (the fleet checks it is alive at once).
        self.on_start: Callable[[Server], None] | None = None
        self.lock = asyncio.Lock()
        self._syncing: set[asyncio.Task | None] = set()  # tasks now inside sync_server
        self._resuming: set[asyncio.Task] = set()  # the resume at the end of each sync
        self._background: set[asyncio.Task] = set()  # retries for servers that would not resume
        # Called with every SyncResult (metrics); must not raise.
        self.on_synced: list[Callable[[SyncResult], None]] = []

    async def _call(self, server: Server, step: str, method: str, path: str, *, timeout: float | None = None,
                    **kwargs: Any) -> Reply:
        try:
            response = await self.pool.http.request(method, server.url + path, timeout=timeout or self.step_timeout,
                                                     **kwargs)
        except TransportError as exc:
            raise SyncStepError(step, None, str(exc)) from None
        if response.status_code >= 400:
            raise SyncStepError(step, response.status_code, f"HTTP {response.status_code}: {response.text[:300]}")
        return response

    async def resume(self, server: Server) -> bool:
        """Resume, retrying until it works or `resume_deadline` passes; then keep trying in the background."""
        deadline = time.monotonic() + self.resume_deadline
        delay = 0.1
        while True:
            try:
                await self._call(server, "resume", "POST", "/resume")
                return True
            except SyncStepError as exc:
                if time.monotonic() > deadline:
                    log.error("resume of %s still failing after %.0fs (%s); retrying in the background",
                              server.url, self.resume_deadline, exc)
                    self._track(self._background, asyncio.create_task(self._resume_forever(server),
                                                                       name=f"resume-{server.url}"))
                    return False
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def resume_once(self, server: Server) -> None:
        """One POST /resume (SyncStepError when it fails): for a server someone else paused."""
        await self._call(server, "resume", "POST", "/resume")

    @staticmethod
    def _track(tasks: set[asyncio.Task], task: asyncio.Task) -> asyncio.Task:
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return task

    async def shutdown(self, deadline: float) -> None:
        """Give syncs in flight and their resumes `deadline` seconds (a server must not stay
        paused because the sampler stopped: uvicorn cancels a request that outlasts its
        graceful shutdown, and the cancelled sync still resumes), then cancel the resumes left
        and the background retries of servers that would not resume. Call before closing the
        HTTP client."""
        give_up = time.monotonic() + deadline
        # A sync that is being cancelled starts its resume (in _resuming) on its way out.
        while self._syncing and time.monotonic() < give_up:
            await asyncio.sleep(0.01)
        if self._resuming:
            await asyncio.wait(list(self._resuming), timeout=max(0.0, give_up - time.monotonic()))
        left = self._resuming | self._background
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)

    async def _resume_forever(self, server: Server) -> None:
        while True:
            try:
                await self._call(server, "resume", "POST", "/resume")
                log.info("resumed %s after a failed sync", server.url)
                return
            except SyncStepError:
                await asyncio.sleep(5.0)

    async def sync_server(self, server: Server, version: int, checkpoint_path: str,
                          probe: Probe | None = None, *, adapter: bool = False) -> SyncResult:
        """Sync one server, in a task of its own so that `abandon` can cut it short without
        cancelling the caller: the result then says the server is unreachable."""
        started = time.monotonic()
        task = asyncio.create_task(self._sync_server(server, version, checkpoint_path, probe, adapter),
                                   name=f"sync-{server.url}")
        self._syncing.add(task)
        self._running[server.url] = (task, version)
        if self.on_start is not None:
            self.on_start(server)
        try:
            return await self._cuts.run(server.url, task)
        except Abandoned as exc:
            message = f"abandoned: {exc.why}"
            server.last_error = f"weight sync to version {version} {message}"
            server.note(server.last_error)
            log.error("weight sync of %s to version %d %s", server.url, version, message)
            await self.record(server)  # no sync holds it now (its record said until when one might)
            return self._report(SyncResult(server.url, False, server.version, time.monotonic() - started, message,
                                           unreachable=True))
        finally:
            self._syncing.discard(task)
            if self._running.get(server.url, (None,))[0] is task:
                del self._running[server.url]

    def syncing_version(self, server: Server) -> int | None:
        """The version a sync of ours is loading into `server` now, or None."""
        running = self._running.get(server.url)
        return running[1] if running is not None else None

    def abandon(self, server: Server, why: str) -> bool:
        """Cut the sync to `server` short (it stopped answering): no resume is sent (it would
        not get through either), and the server is re-synced when it answers again
        (`Server.needs_resync`). True when there was one."""
        if not self._cuts.abandon(server.url, why):
            return False
        server.needs_resync = why
        return True

    def holds_pause(self, server: Server) -> bool:
        """Whether a sync of ours may be what keeps `server` paused: one in flight, its resume
        still being retried, or one abandoned (the re-sync due when it answers resumes it)."""
        return (server.syncing or server.url in self._running or server.needs_resync is not None
                or any(t.get_name().endswith(server.url) for t in self._resuming | self._background))

    async def reload_method(self, server: Server) -> str:
        """The collective_rpc method that reloads weights on `server`, asked without side effects:
        vLLM in dev mode describes its configuration at GET /server_info, and one started with
        Tandem's worker extension (the CPU build, see services/inference/vllm_ext.py) must be
        reloaded through it; vLLM without it takes vLLM's `reload_weights`. Tandem's CPU server
        answers with its own `tandem` entry (routes/weights.py): `tandem_reload_weights`, which
        relabels as it reloads. A server without /server_info takes `reload_weights`.
        Remembered until the server restarts."""
        if server.reload_method is None:
            method = "reload_weights"
            plain_vllm = relabels = False
            try:
                reply = await self.pool.http.get(server.url + "/server_info?config_format=json",
                                                 timeout=self.step_timeout)
                if reply.status_code == 200:
                    info = reply.json() or {}
                    tandem = info.get("tandem") or {}
                    parallel = (info.get("vllm_config") or {}).get("parallel_config") or {}
                    if tandem.get("reload_method") == RELOAD_METHOD:
                        method, relabels = RELOAD_METHOD, tandem.get("relabels_on_reload") is True
                    elif parallel.get("worker_extension_cls") == EXTENSION_CLS:
                        method = RELOAD_METHOD
                    else:
                        plain_vllm = True
            except (TransportError, ValueError, AttributeError):
                pass  # asked again at the next sync: the reload itself will say what is wrong
            else:
                server.reload_method, server.plain_vllm, server.relabels_on_reload = method, plain_vllm, relabels
            return method
        return server.reload_method

    async def check_delta(self, server: Server, checkpoint_path: str) -> None:
        """SyncStepError (status 409: this server cannot take this input; it stays in rotation on
        its weights) when `checkpoint_path` is a delta version and `server` is vLLM without
        Tandem's worker extension: vLLM's own reload would read delta.safetensors as weights."""
        try:
            delta = is_delta(checkpoint_path)
        except DeltaError:
            return  # unreadable manifest: the server's own load says what is wrong
        if not delta:
            return
        await self.reload_method(server)
        if server.plain_vllm and server.reload_method is not None:
            raise SyncStepError("reload_weights", 409, (
                f"server {server.url} cannot apply delta versions ({checkpoint_path} is one): start it with "
                f"--worker-extension-cls {EXTENSION_CLS} (tandem's launcher does) or publish full versions "
                "(trainer --full-every 1)"))

    def served_through(self, version: int, adapter: bool) -> str | None:
        """The adapter a server at `version` serves it through: the run's adapter in a LoRA run,
        none for full weights or version 0 (the base model)."""
        return self.adapter_name if adapter and version > 0 else None

    async def verify(self, server: Server, probe: Probe, model: str | None = None) -> ProbeResult:
        """Ask `server` for the probe's prompt logprobs (of `model`, an adapter's name, or the
        served base model when None) and compare them with the trainer's."""
        body = probe_request(probe.token_ids)
        if model is not None:
            body["model"] = model
        try:
            reply = await self.pool.http.post(server.url + "/v1/completions", json=body, timeout=self.step_timeout)
        except TransportError as exc:
            return probe_failed(probe, str(exc))
        if reply.status_code >= 400:
            return probe_failed(probe, f"HTTP {reply.status_code}: {reply.text[:300]}")
        try:
            return compare(probe, served_logprobs(reply.json(), probe.token_ids))
        except ValueError as exc:
            return probe_failed(probe, str(exc))

    async def _load(self, server: Server, checkpoint_path: str, adapter: bool, label: int | None = None,
                    probe_ids: list[int] | None = None) -> Reply | None:
        """The reload step proper: the adapter under the run's name, or full weights (with
        `label` and `probe_ids`, relabelled and probed by the same request: only where
        `relabels_on_reload`). Returns the full-weights reload's answer."""
        if not adapter:
            method = await self.reload_method(server)
            kwargs: dict[str, Any] = {"weights_path": checkpoint_path}
            if label is not None:
                kwargs["weight_version"] = str(label)
            if probe_ids is not None:
                kwargs["probe_token_ids"] = list(probe_ids)
            return await self._call(server, "reload_weights", "POST", "/collective_rpc", timeout=self.reload_timeout,
                                    json={"method": method, "kwargs": kwargs})
        try:
            await self._call(server, "load_lora_adapter", "POST", LOAD_PATH, timeout=self.reload_timeout,
                             json=load_request(self.adapter_name, checkpoint_path))
        except SyncStepError as exc:
            # The route itself is missing (FastAPI's bare 404/405), not "no adapter at that path".
            if exc.status in (404, 405) and ('"Not Found"' in exc.message or '"Method Not Allowed"' in exc.message):
                raise SyncStepError(exc.step, exc.status, (
                    f"{exc.message}: this server does not serve LoRA adapters. Start vLLM with --enable-lora "
                    "--max-lora-rank <the trainer's lora_rank or more> and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 "
                    "(`tandem inference --backend vllm --enable-lora` sets both), or Tandem's CPU server "
                    "with --enable-lora")) from None
            raise

    async def _pause_load_label(self, server: Server, version: int, checkpoint_path: str, adapter: bool,
                                pause_mode: str) -> None:
        """pause -> reload -> label and cache reset (a SyncStepError says at which step it
        stopped; the caller resumes in any case)."""
        # The record says until when the pause is ours (liveness.py, other replicas). Written
        # beside the pause, not before it: another replica resumes a pause only after
        # paused_grace without such a record, and an fsynced write on every version's
        # path costs what the demo's whole step can spare.
        # A "wait" pause lasts until the requests in flight finish: each is bounded by request_timeout.
        await gather_first_error(
            self.record(server),
            self._call(server, "pause", "POST", "/pause", params={"mode": pause_mode},
                       timeout=max(self.step_timeout, self.pool.request_timeout) if pause_mode == "wait"
                       else self.step_timeout))
        await self._load(server, checkpoint_path, adapter)
        await self._label_and_reset(server, version)

    async def _sync_server(self, server: Server, version: int, checkpoint_path: str,
                           probe: Probe | None, adapter: bool) -> SyncResult:
        started = time.monotonic()
        server.hold(True)
        error: SyncStepError | None = None
        checked: ProbeResult | None = None
        probing: asyncio.Task | None = None
        # Requests in flight on a server that has no adapter yet name the base model: let them
        # finish on it rather than continue on the base under the adapter's version label.
        pause_mode = "wait" if adapter and server.adapter is None else "keep"
        swap = False  # one request loads and relabels: nothing paused, nothing to resume
        try:
            try:
                if not adapter:
                    await self.check_delta(server, checkpoint_path)  # before pausing it for nothing
                    # Asked once per server start. The flag counts only with the method it came with:
                    # after a restart whose /server_info went unanswered the method is vLLM's again.
                    swap = await self.reload_method(server) == RELOAD_METHOD and server.relabels_on_reload
                inline = None
                if swap:
                    # Weights and label change between two of its steps, in one request, which
                    # also brings the probe's logprobs back where the server computes them.
                    reply = await self._load(server, checkpoint_path, adapter, label=version,
                                             probe_ids=probe.token_ids if probe is not None else None)
                    inline = reload_probe(probe, reply)
                else:
                    await self._pause_load_label(server, version, checkpoint_path, adapter, pause_mode)
                probing = self._start_probe(server, probe, adapter, inline)
            except SyncStepError as exc:
                error = exc
            finally:
                # Even when pause itself failed, the server may have paused: resume regardless,
                # in a task of its own, so a cancelled sync (a request cut off by shutdown) still
                # resumes, and shutdown() can wait for it. Not a sync abandoned because the server
                # stopped answering: its re-sync resumes it once it answers. (A swap paused nothing.)
                resumed = False
                if swap:
                    resumed = not self._cuts.cut(asyncio.current_task())
                elif not self._cuts.cut(asyncio.current_task()):
                    resuming = self._track(self._resuming, asyncio.create_task(
                        self.resume(server), name=f"resume-after-sync-{server.url}"))
                    resumed = await asyncio.shield(resuming)
            if probing is not None and resumed:
                checked = server.last_probe = await probing
        finally:
            if probing is not None and not probing.done():
                probing.cancel()  # the resume failed (or the sync was cancelled): nothing to verify
            server.hold(False)
        seconds = time.monotonic() - started
        if error is None and resumed and (checked is None or checked.ok):
            server.last_sync_seconds = seconds
            server.last_error = None
            server.needs_resync = None
            server.note(f"synced to version {version} in {seconds:.2f}s"
                        + (f", probe max diff {checked.max_abs_diff:.2g}" if checked else ""))
            server.adapter = self.served_through(version, adapter)
            self.pool.set_version(server.url, version)
            if server.state in (RESYNCING, STALE, MISMATCH):
                self.pool.set_state(server, OK)  # it serves the published weights again
            await self.record(server)
            log.info("server %s now serves version %d (sync %.2fs%s)", server.url, version, seconds,
                     f", verified: max diff {checked.max_abs_diff:.2g}" if checked else "")
            return self._report(SyncResult(server.url, True, version, seconds, probe=checked))
        if checked is not None and error is None and resumed:
            # Loaded and labelled, but it does not compute what the trainer computes: no work for it.
            server.probe_failures += 1
            server.last_error = f"version {version} from {checkpoint_path}: {checked.describe()}"
            server.version = None
            self.pool.set_state(server, MISMATCH, f"after loading version {version}, {checked.describe()}: "
                                "it does not serve the trainer's weights")
            await self.record(server)
            log.error("server %s loaded version %d but %s; out of rotation", server.url, version, checked.describe())
            return self._report(SyncResult(server.url, False, None, seconds, server.last_error,
                                           mismatch=True, probe=checked))
        message = str(error) if error else "resume failed"
        server.last_error = f"weight sync to version {version} failed at {message}"
        server.note(server.last_error)
        await self.record(server)
        log.error("weight sync of %s failed: %s", server.url, message)
        client_error = bool(error and error.status is not None and 400 <= error.status < 500
                            and error.step in ("reload_weights", "load_lora_adapter"))
        unreachable = error is not None and error.status is None
        if unreachable:
            self.pool.suspect(server, message)  # out of rotation; the fleet re-syncs it once it answers
        return self._report(SyncResult(server.url, False, server.version, seconds, message, client_error, unreachable))

    def _start_probe(self, server: Server, probe: Probe | None, adapter: bool,
                     inline: ProbeResult | None) -> asyncio.Task | None:
        """Still no work for it (syncing): first show that it computes the trainer's numbers
        (`inline`: what its reload answered). Sent before the resume, which a paused server
        queues it behind (vLLM and the CPU server alike), so its round trip overlaps the resume's."""
        if probe is None:
            return None
        return asyncio.create_task(
            asyncio.sleep(0, inline) if inline is not None  # already answered: that result, as a task
            else self.verify(server, probe, self.adapter_name if adapter else None),
            name=f"probe-{server.url}")

    async def _label_and_reset(self, server: Server, version: int) -> None:
        """The new version's label and an empty prefix cache, asked together: neither depends on
        the other, and both come after the load (a label never names weights not yet loaded)."""
        await gather_first_error(
            self._call(server, "update_weight_version", "POST", "/update_weight_version",
                       json={"new_version": str(version)}),
            self._call(server, "reset_prefix_cache", "POST", "/reset_prefix_cache"))

    def _report(self, result: SyncResult) -> SyncResult:
        for hook in self.on_synced:
            try:
                hook(result)
            except Exception:  # noqa: BLE001 - an observer must never break a sync
                log.exception("on_synced hook %r failed", hook)
        return result

    async def sync_all(self, version: int, checkpoint_path: str, servers: list[Server] | None = None,
                       probe: Probe | None = None, *, adapter: bool = False) -> list[SyncResult]:
        targets = servers if servers is not None else self.pool.servers
        return list(await asyncio.gather(*(self.sync_server(s, version, checkpoint_path, probe, adapter=adapter)
                                           for s in targets)))

    async def relabel(self, server: Server, version: int) -> None:
        await self._call(server, "update_weight_version", "POST", "/update_weight_version",
                         json={"new_version": str(version)})

    async def record_pushed(self, version: int) -> None:
        """The trainer pushed weights itself: every server in rotation now serves `version`.

        The servers' version labels are updated too (best effort), so that the
        `weight_versions` spans of new tokens name the version that produced them. Servers
        out of rotation (down, stale, ...) did not get the weights as far as we know: the
        fleet finds them behind when they are checked, and says so.
        """

        async def relabel(server: Server) -> None:
            try:
                await self.relabel(server, version)
            except SyncStepError as exc:
                log.warning("could not relabel %s as version %d: %s", server.url, version, exc)
            self.pool.set_version(server.url, version)
            await self.record(server)

        await asyncio.gather(*(relabel(s) for s in self.pool.servers if s.state == OK))

    def sync_budget(self) -> float:
        """Seconds a sync can hold a server paused at most: its pause, reload, label and resume."""
        return self.reload_timeout + 3 * self.step_timeout + self.resume_deadline

    async def record(self, server: Server) -> None:
        """What a server serves, as Redis keeps it for other replicas and restarts; while a sync
        of ours holds it paused, until when (another replica's liveness check leaves it paused)."""
        await self.store.set_server(server.url, {
            "version": server.version, "state": server.state, "reason": server.reason,
            "error": server.last_error, "last_sync_seconds": server.last_sync_seconds,
            "updated_at": time.time(),
            "syncing_until": time.time() + self.sync_budget() if server.syncing else None,
        })

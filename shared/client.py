"""Async client for the sampler API, for trainers and scripts.

`get_batch` long-polls through 204s, so a caller simply awaits the batch; it retries
transport errors and 5xx answers with capped exponential backoff (for `retry_for` seconds,
then `SamplerUnavailable`), and turns the statuses that need a decision into exceptions:
409 `BatchNotReady` (post a newer version first), 410 `BatchTrimmed`, 401 `Unauthorized`,
4xx `SamplerRequestError`, and the one 5xx no retry can help, a damaged batch, `BatchDamaged`
at once. Waits speak (shared/waiting.py): a request that keeps failing logs
its first failure and then one line every `report_every` seconds; a batch wait logs one line
per `report_every` with what the sampler's `GET /status` says the batch waits for.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from shared import codec
from shared.chunks import FRAMES, BatchArrays, decode_frame, is_frames
from shared.http_client import HttpClient, Reply, TransportError
from shared.recv_buffers import RecvBuffers
from shared.token_guard import bearer_headers
from shared.waiting import REPORT_EVERY, Retrying, describe_status
from shared.wire import Batch, EvalAccepted, EvalResult, WeightsVersion

log = logging.getLogger("tandem.client")

# Seconds a long poll's answer may come after its `timeout` before its silence is reported: the
# sampler answers at `timeout` (a Redis that stops answering: a 503 two seconds later).
ANSWER_GRACE_S = 5.0


class SamplerError(RuntimeError):
    """Base class of every error the client raises."""


class SamplerRequestError(SamplerError):
    def __init__(self, status: int, detail: Any, what: str):
        self.status = status
        self.detail = detail
        super().__init__(f"{what}: HTTP {status}: {detail}")


class BatchNotReady(SamplerRequestError):
    """409: batch N cannot become ready until a newer weights version is published."""

    @property
    def required_version(self) -> int | None:
        if isinstance(self.detail, dict):
            return self.detail.get("required_version")
        return None


class BatchTrimmed(SamplerRequestError):
    """410: the batch was trimmed from the sampler's retention window, or (`superseded`) it was
    never sealed and the published version is already past it."""

    @property
    def superseded(self) -> bool:
        return isinstance(self.detail, dict) and self.detail.get("reason") == "superseded"


class VersionConflict(SamplerRequestError):
    """409 on POST /weights_version: versions only move forward."""


class Unauthorized(SamplerRequestError):
    """401: the sampler requires `Authorization: Bearer <api_token>`."""


class BatchDamaged(SamplerRequestError):
    """500 with reason `damaged`: the sealed batch's stored bytes were changed or lost outside
    the sampler; no retry can help (the detail names the file and what to do)."""

    def __init__(self, status: int, detail: Any, what: str):
        super().__init__(status, detail, what)
        self.args = (f"{what}: {detail['message']}",)


class SamplerUnavailable(SamplerError):
    """The sampler could not be reached (or kept failing) for longer than `retry_for` seconds."""


def _detail(response: Reply) -> Any:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    return body.get("detail", body) if isinstance(body, dict) else body


def _permanent(response: Reply) -> bool:
    """A 5xx that says no retry can help (a damaged batch): raised at once, not retried."""
    if response.status_code != 500:
        return False
    detail = _detail(response)
    return isinstance(detail, dict) and detail.get("reason") == "damaged" and "message" in detail


# How batches travel: "frames" (the stored chunks as they are, shared/chunks.py: received
# into one buffer and decoded to numpy views of it; the default), "arrays" (msgpack with
# typed token arrays, transcoded by the sampler), "msgpack" or "json" (every number a Python
# number). "frames" also accepts the arrays form, which a sampler older than chunks answers.
_ENCODINGS = {"frames": f"{FRAMES}, {codec.ARRAYS};q=0.9", "arrays": codec.ARRAYS, "msgpack": codec.MSGPACK,
              "json": codec.JSON}


class SamplerClient:
    """`async with SamplerClient("http://127.0.0.1:8100") as client: batch = await client.get_batch(0)`

    With the default `encoding="frames"` (or `"arrays"`) a sample's token ids, logprobs and loss
    mask are numpy arrays; `encoding="json"` or `"msgpack"` gives lists. `get_batch_arrays`
    gives the batch in columns (`BatchArrays`), with no Python object per sample or token.

    `report_every`: seconds between two log lines about one wait. `retry_for_name` and
    `timeout_name`: how the messages name the bounds (a trainer gives its flags)."""

    def __init__(
        self,
        base_url: str,
        *,
        api_token: str | None = None,
        poll_timeout: float = 30.0,
        retry_for: float = 120.0,
        encoding: str = "frames",
        report_every: float = REPORT_EVERY,
        retry_for_name: str = "retry_for",
        timeout_name: str = "timeout",
    ):
        self.base_url = base_url.rstrip("/")
        self.poll_timeout = poll_timeout
        self.retry_for = retry_for
        self.report_every = report_every
        self.retry_for_name = retry_for_name
        self.timeout_name = timeout_name
        if encoding not in _ENCODINGS:
            raise ValueError(f"encoding must be one of {sorted(_ENCODINGS)}, not {encoding!r}")
        self.accept = _ENCODINGS[encoding]
        self._frames = encoding == "frames"
        # Bodies are received into buffers that come back here once the batch is dropped: a
        # resident buffer instead of fresh memory each step (shared/recv_buffers.py).
        self._buffers = RecvBuffers()
        # The timeout must outlast the server-side long-poll, or every poll would fail.
        self._http = HttpClient(max_connections=16, timeout=poll_timeout + 30.0, headers=bearer_headers(api_token))

    async def __aenter__(self) -> SamplerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()
        self._buffers.clear()

    async def _request(self, method: str, path: str, what: str, *, answer_within: float | None = None,
                       **kwargs: Any) -> Reply:
        """Send one request, retrying transport errors and 5xx until `retry_for` runs out.
        `answer_within`: seconds after which no answer is worth a log line (`report_every`)."""
        retrying = Retrying(what, self.base_url, self.retry_for, self.retry_for_name, self.report_every, log)
        delay = 0.1
        while True:
            try:
                response = await self._watched(method, path, what, answer_within or self.report_every, **kwargs)
            except TransportError as exc:
                failure = str(exc)
            else:
                if response.status_code < 500 or _permanent(response):
                    return response
                failure = f"HTTP {response.status_code}: {_detail(response)}"
            left = retrying.deadline - time.monotonic()
            if left <= 0:
                raise SamplerUnavailable(retrying.give_up_message(failure))
            retrying.failed(failure)
            await asyncio.sleep(min(delay, left))  # the last try at the deadline itself
            delay = min(delay * 2, 5.0)

    async def _watched(self, method: str, path: str, what: str, answer_within: float, **kwargs: Any) -> Reply:
        """One request's answer. A sampler that is frozen (not dead: its socket accepts, nothing
        answers) is not silent until the request's own timeout: a line once `answer_within`
        seconds pass without an answer, then one every `report_every`."""
        call = asyncio.ensure_future(self._http.request(method, self.base_url + path, **kwargs))
        started = time.monotonic()
        wait = answer_within
        try:
            while True:
                done, _ = await asyncio.wait({call}, timeout=wait)
                if done:
                    return call.result()
                log.warning("%s: no answer from the sampler at %s for %.0fs (a frozen or overloaded sampler, or a "
                            "weight sync of a large model); still waiting for this request, then retrying for up "
                            "to %gs (%s)", what, self.base_url, time.monotonic() - started, self.retry_for,
                            self.retry_for_name)
                wait = self.report_every
        finally:
            if not call.done():
                call.cancel()

    async def get_batch(
        self, step: int, rank: int = 0, world_size: int = 1, *, timeout: float | None = None
    ) -> Batch:
        """Wait for batch `step` (this rank's share); `timeout` bounds the total wait."""
        data = await self.get_batch_raw(step, rank, world_size, timeout=timeout)
        return Batch.model_validate(data)

    async def get_batch_for_training(
        self, step: int, rank: int = 0, world_size: int = 1, *, timeout: float | None = None,
        not_ready_grace: float = 60.0, published_version: int | None = None,
    ) -> Batch:
        """A trainer's fetch of batch `step`: a 409 (the version the batch needs is not out yet)
        is retried for `not_ready_grace` seconds, since another rank's publication may still be in
        flight; after that, and on a 410, a SamplerError that says what to change."""
        give_up = time.monotonic() + not_ready_grace
        delay = 0.05
        while True:
            try:
                return await self.get_batch(step, rank, world_size, timeout=timeout)
            except BatchNotReady as exc:
                if time.monotonic() > give_up:
                    have = "" if published_version is None else f"The trainer has published version {published_version}; "
                    raise SamplerError(
                        f"batch {step} cannot become ready: {exc.detail}. {have}the sampler needs a newer "
                        "version than the trainer publishes (is another trainer, or an old sampler run_dir, "
                        "involved?)"
                    ) from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
            except BatchTrimmed as exc:
                if exc.superseded:
                    raise SamplerError(f"batch {step} is not available: {exc.detail['message']}") from exc
                raise SamplerError(f"cannot train step {step}: {exc.detail}") from exc

    async def get_batch_raw(
        self, step: int, rank: int = 0, world_size: int = 1, *, timeout: float | None = None
    ) -> dict[str, Any]:
        """Like `get_batch`, but returns the decoded body without model validation (faster)."""
        content_type, body = await self.get_batch_body(step, rank, world_size, timeout=timeout)
        if is_frames(content_type):
            return decode_frame(body).as_dict()
        return codec.decode(content_type, body)

    async def get_batch_arrays(
        self, step: int, rank: int = 0, world_size: int = 1, *, timeout: float | None = None
    ) -> BatchArrays:
        """Batch `step` (this rank's share) in columns: numpy views of the received body, made
        without a Python object per token or per sample (`BatchArrays.samples()` makes dicts,
        `BatchArrays.column(field)` one array per token field; `torch.from_numpy` shares them)."""
        if not self._frames:
            raise ValueError(f"get_batch_arrays needs encoding='frames', not the client's {self.accept!r}")
        content_type, body = await self.get_batch_body(step, rank, world_size, timeout=timeout)
        if not is_frames(content_type):
            raise SamplerError(f"the sampler at {self.base_url} answered {content_type}, not {FRAMES}: it predates "
                               "chunked batches; use get_batch or get_batch_raw with it")
        return decode_frame(body)

    async def get_batch_body(
        self, step: int, rank: int = 0, world_size: int = 1, *, timeout: float | None = None
    ) -> tuple[str | None, bytes]:
        """The batch's body as received, with its content type: `get_batch_raw` before decoding."""
        what = f"GET /batch step={step} rank={rank}/{world_size}"
        headers = {"Accept": self.accept}
        started = time.monotonic()
        give_up = None if timeout is None else started + timeout
        next_report = started + self.report_every
        while True:
            if time.monotonic() >= next_report:
                if rank == 0:  # rank 0 speaks for the job: every rank waits for the same batch
                    await self._report_batch_wait(step, time.monotonic() - started, timeout)
                next_report = time.monotonic() + self.report_every
            poll = min(self.poll_timeout, max(0.05, next_report - time.monotonic()))
            if give_up is not None:
                poll = min(poll, max(0.0, give_up - time.monotonic()))
            params = {"step": step, "timeout": poll, "rank": rank, "world_size": world_size}
            # A poll the sampler does not answer is reported (`_watched`) ANSWER_GRACE_S after it
            # should have been answered: at most report_every + ANSWER_GRACE_S into a freeze.
            response = await self._request("GET", "/batch", what, params=params, headers=headers,
                                           into=self._buffers.take if self._frames else None,
                                           answer_within=poll + min(ANSWER_GRACE_S, self.report_every))
            status = response.status_code
            if status == 200:
                return response.content_type, response.content
            if status == 204:
                if give_up is not None and time.monotonic() >= give_up:
                    raise TimeoutError(f"{what}: batch not sealed within {timeout:g}s ({self.timeout_name}); "
                                       f"the sampler: {await self._generation_state(step)}")
                continue
            self._raise(response, what)

    async def _generation_state(self, step: int) -> str:
        """What the sampler's GET /status says batch `step` waits for (one attempt, no retries)."""
        try:
            response = await self._http.request("GET", self.base_url + "/status", timeout=10.0)
        except TransportError as exc:
            return f"GET /status did not answer ({exc})"
        if response.status_code != 200:
            return f"GET /status answered HTTP {response.status_code}: {_detail(response)}"
        try:
            return describe_status(response.json(), step)
        except ValueError:
            return "GET /status answered no JSON"

    async def _report_batch_wait(self, step: int, waited: float, timeout: float | None) -> None:
        bound = "" if timeout is None else f", giving up after {timeout:g}s ({self.timeout_name})"
        log.info("waiting for batch %d: %.0fs so far%s; the sampler: %s", step, waited, bound,
                 await self._generation_state(step))

    async def publish_weights(self, version: int, checkpoint_path: str | None = None, *,
                              probe: dict[str, Any] | None = None,
                              metrics: dict[str, float] | None = None,
                              resume_step: int | None = None, adapter: bool = False) -> WeightsVersion:
        """Publish `version`; with a `probe` (shared/probe.py) every server the sampler loads the
        checkpoint into must compute the trainer's logprobs, and `metrics` show on the dashboard.
        `resume_step`: the step this trainer would restart from; the sampler keeps its batches.
        `adapter`: the checkpoint is a LoRA adapter (shared/adapters.py), not full weights."""
        what = f"POST /weights_version version={version}"
        body: dict[str, Any] = {"version": version, "checkpoint_path": checkpoint_path}
        if adapter:
            body["adapter"] = True
        if resume_step is not None:
            body["resume_step"] = resume_step
        if probe is not None:
            body["probe"] = probe
        if metrics:
            body["metrics"] = metrics
        response = await self._request("POST", "/weights_version", what, json=body)
        if response.status_code == 409:
            raise VersionConflict(409, _detail(response), what)
        if response.status_code != 200:
            self._raise(response, what)
        return WeightsVersion.model_validate(response.json())

    async def weights_version(self) -> WeightsVersion:
        response = await self._request("GET", "/weights_version", "GET /weights_version")
        if response.status_code != 200:
            self._raise(response, "GET /weights_version")
        return WeightsVersion.model_validate(response.json())

    async def start_eval(self, num_examples: int | None = None, env: str | None = None, **extra: Any) -> str:
        body = {"num_examples": num_examples, "env": env, **extra}
        response = await self._request("POST", "/eval", "POST /eval", json=body)
        if response.status_code != 202:
            self._raise(response, "POST /eval")
        return EvalAccepted.model_validate(response.json()).eval_id

    async def wait_eval(self, eval_id: str, timeout: float | None = None) -> EvalResult:
        """Long-poll until the eval is done or failed; `timeout` bounds the total wait."""
        what = f"GET /eval/{eval_id}"
        give_up = None if timeout is None else time.monotonic() + timeout
        while True:
            poll = self.poll_timeout
            if give_up is not None:
                poll = min(poll, max(0.0, give_up - time.monotonic()))
            response = await self._request("GET", f"/eval/{eval_id}", what, params={"timeout": poll},
                                           answer_within=poll + ANSWER_GRACE_S)
            if response.status_code != 200:
                self._raise(response, what)
            result = EvalResult.model_validate(response.json())
            if result.status in ("done", "failed"):
                return result
            if give_up is not None and time.monotonic() >= give_up:
                raise TimeoutError(f"{what}: eval still {result.status} after {timeout}s")

    async def check_token(self) -> bool:
        """GET /auth: True when the sampler accepts this client's token (or needs none); False
        when the sampler is too old to say (no GET /auth); `Unauthorized` when it refuses it."""
        response = await self._request("GET", "/auth", "GET /auth")
        if response.status_code == 204:
            return True
        if response.status_code in (404, 405):
            return False
        self._raise(response, "GET /auth")
        return False

    async def status(self) -> dict[str, Any]:
        response = await self._request("GET", "/status", "GET /status")
        if response.status_code != 200:
            self._raise(response, "GET /status")
        return response.json()

    @staticmethod
    def _raise(response: Reply, what: str) -> None:
        status, detail = response.status_code, _detail(response)
        kind = {409: BatchNotReady, 410: BatchTrimmed, 401: Unauthorized}.get(status, SamplerRequestError)
        if _permanent(response):
            kind = BatchDamaged
        raise kind(status, detail, what)

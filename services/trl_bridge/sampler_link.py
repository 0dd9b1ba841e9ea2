"""A synchronous face on the async `SamplerClient`, for TRL's synchronous training loop.

Why a loop thread rather than `asyncio.run` per call: the client's connection pool belongs to
the event loop it was made in, and a prefetch (batch N+1 fetched while step N trains) must keep
running between calls. So one daemon thread runs one loop for the link's whole life; every
call is a coroutine submitted to it, and `prefetch` leaves one running there.

The 409 / 410 handling is the native trainer's (`SamplerClient.get_batch_for_training`): a 409
is retried for a grace period (a publication may be in flight on another rank), a 410 stops
the run with the setting to change.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any

from shared.client import BatchNotReady, SamplerClient, SamplerError, Unauthorized, VersionConflict
from shared.wire import Batch, EvalResult


class SamplerLink:
    """`link.batch(step, rank, world_size)`, `link.publish(...)`, `link.evaluate(...)`; `close()` at the end."""

    def __init__(self, url: str, *, api_token: str | None = None, poll_timeout: float = 30.0,
                 batch_timeout: float | None = None, not_ready_grace: float = 60.0):
        self.url = url
        self.api_token = api_token
        # The checkpoint the sampler serves, as its last answer to `publish` said: what pruning
        # must spare (a server that restarts loads it).
        self.served_path: str | None = None
        self.batch_timeout = batch_timeout
        self.not_ready_grace = not_ready_grace
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tandem-sampler-link", daemon=True)
        self._thread.start()
        self._client = self._run(self._make_client(url, api_token, poll_timeout))
        self._prefetch: tuple[tuple[int, int, int], concurrent.futures.Future] | None = None

    @staticmethod
    async def _make_client(url: str, api_token: str | None, poll_timeout: float) -> SamplerClient:
        return SamplerClient(url, api_token=api_token, poll_timeout=poll_timeout)

    def _submit(self, coro: Any) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _run(self, coro: Any) -> Any:
        return self._submit(coro).result()

    # -- reading -----------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return self._run(self._client.status())

    def check_token(self) -> None:
        """GET /auth: a SamplerError naming `api_token` when the sampler refuses this link's token."""
        try:
            self._run(self._client.check_token())
        except Unauthorized:
            problem = "refused the api_token given" if self.api_token else "needs an api_token and none was given"
            raise SamplerError(f"the sampler at {self.url} {problem}: pass the sampler's api_token "
                               "(the trainer's api_token argument; the example's --api-token / TANDEM_API_TOKEN)"
                               ) from None

    def batch(self, step: int, rank: int = 0, world_size: int = 1) -> Batch:
        """Batch `step`, this rank's share: the prefetched one when it is that batch."""
        key = (step, rank, world_size)
        if self._prefetch is not None:
            fetched_key, future = self._prefetch
            self._prefetch = None
            if fetched_key == key:
                try:
                    return future.result()
                except BatchNotReady:
                    pass  # asked before the version it needs was out: ask again below
            else:
                future.cancel()
        return self._run(self._fetch(step, rank, world_size))

    def prefetch(self, step: int, rank: int = 0, world_size: int = 1) -> None:
        """Start fetching batch `step` now; `batch(step, ...)` collects it."""
        if self._prefetch is not None:
            self._prefetch[1].cancel()
        self._prefetch = ((step, rank, world_size), self._submit(self._fetch(step, rank, world_size)))

    async def _fetch(self, step: int, rank: int, world_size: int) -> Batch:
        return await self._client.get_batch_for_training(step, rank, world_size, timeout=self.batch_timeout,
                                                         not_ready_grace=self.not_ready_grace)

    # -- writing -----------------------------------------------------------------------------

    def publish(self, version: int, path: str | None, *, probe: dict[str, Any] | None = None,
                metrics: dict[str, float] | None = None, resume_step: int | None = None,
                adapter: bool = False) -> bool:
        """POST /weights_version; False when the sampler already had this version (a resumed run).
        `resume_step`: the batch a restart from TRL's newest checkpoint trains first (kept for it).
        `adapter`: `path` holds a LoRA adapter (shared/adapters.py), not full weights."""
        try:
            served = self._run(self._client.publish_weights(version, path, probe=probe, metrics=metrics,
                                                            resume_step=resume_step, adapter=adapter))
        except VersionConflict:
            # A resumed run re-announcing an older version: the sampler keeps serving its own.
            self.served_path = self._run(self._client.weights_version()).checkpoint_path
            return False
        self.served_path = served.checkpoint_path
        return True

    def published_version(self) -> int:
        return self._run(self._client.weights_version()).version

    def evaluate(self, num_examples: int | None, timeout: float) -> EvalResult:
        """POST /eval and wait for its result (one generation per held-out prompt, rewards only)."""
        async def start_and_wait() -> EvalResult:
            eval_id = await self._client.start_eval(num_examples=num_examples)
            return await self._client.wait_eval(eval_id, timeout=timeout)

        return self._run(start_and_wait())

    def close(self) -> None:
        if self._prefetch is not None:
            self._prefetch[1].cancel()
            self._prefetch = None
        if self._loop.is_running():
            self._run(self._client.aclose())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)

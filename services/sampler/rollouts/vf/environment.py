"""A verifiers environment as a sampler environment: its tasks are the examples, an episode
is a trajectory.

Each trajectory runs one verifiers episode (`Env.run_episode`) in the sampler's event loop:
the env's own `run()` drives its agents (one agent for a plain taskset; multi-turn through
`interaction()`), the harness sends each model call to verifiers' interception server, whose
training client renders it with the Tandem renderer and sends it to the sampler's own
`POST /inference/v1/generate` (routes/generate.py), which forwards it through the inference
pool. Both calls stay in-process unless `vf_client = http` (vf/local_interception.py,
vf/local_client.py). The trace ids verifiers mints are opened as sessions (vf/sessions.py) before the first
call, so each call is gated at the trajectory's version and recorded for its sample.

Choices verifiers leaves open, made for a trainer on a couple of GPUs (docs/environments.md):
* **One answer per call (n=1).** A group's `n` trajectories are `n` episodes run at once;
  the server's prefix cache shares the prompt they have in common.
* **Everything local.** The sampler's event loop runs the agents (the `tandem-chat`
  harness), the `subprocess` runtime a scratch directory per rollout; a stock harness or a
  sandbox runtime is the user's to pin in `--env-args`.
* **Tool servers.** verifiers starts a taskset's shared toolsets once (one process each, for
  the sampler's lifetime: `Env.serving()`), and a task's own toolsets once per rollout. Put
  tools on the taskset when they keep no per-rollout state: a process per trajectory costs
  more than the trajectory at GRPO's rates.

Faults are the sampler's usual ones: an episode that failed (a harness that crashed, a
reward that raised or passed `env_timeout`) is run again from the start, at most
`env_retries` times (multiturn/trajectories.py); a model call the inference pool could not
serve is the pool's failure, not the environment's, and propagates as it does elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from services.sampler.rollouts.envs.base import Completion, Environment, Example, Split
from services.sampler.rollouts.vf.loader import PREFIX, env_config, import_verifiers, split_blocks, split_limits
from services.sampler.rollouts.vf.sessions import Session, Sessions
from services.sampler.rollouts.vf.traces import Scored, completion_of, trainable_trace
from shared.token_guard import bearer_headers

if TYPE_CHECKING:
    from services.sampler.rollouts.rollout import Rollouts
    from services.sampler.rollouts.vf.local_client import Endpoint

log = logging.getLogger("tandem.sampler.verifiers")

RENDERER = "services.sampler.rollouts.vf.renderer.TandemRenderer"
# Sampling parameters the trainer computes its probabilities with: the sampler's win over a
# role's own (max_tokens stays the role's to set, as a turn budget).
CONTRACT = ("temperature", "top_p", "top_k", "min_p")
# Model contexts kept per environment: one per (rollouts, model, sampling) in use.
CONTEXTS_KEPT = 16


@dataclass
class VerifiersLink:
    """What a verifiers trajectory needs from the sampler: where the sampler's generate endpoint
    is, the open sessions, and how to load the model's tokenizer and renderer."""

    base_url: str
    sessions: Sessions
    tokenizer: str | None = None  # None: the served model's path (/v1/models `root`)
    api_token: str | None = None  # the sampler's, for its POST /inference/v1/generate
    renderer: str = "tandem"      # "tandem", a `renderers` name ("auto", "qwen3", ...), or "custom:<import path>"
    request_timeout: float = 600.0
    # True: verifiers' training client calls the generate route's code in-process
    # (vf/local_client.py), and the harness its interception server's handlers
    # (vf/local_interception.py); False: both over HTTP, as clients outside the sampler would.
    in_process: bool = True
    # Called once, when an environment's first episode has ended (app.py: the sampler
    # process's garbage-collector settings for verifiers episodes, observability/gc_tuning.py).
    settle: Callable[[], None] | None = None


def renderer_config(name: str) -> dict[str, Any]:
    if name == "tandem":
        return {"name": "custom", "import_path": RENDERER}
    if name.startswith("custom:"):
        return {"name": "custom", "import_path": name.removeprefix("custom:")}
    return {"name": name}


def absolute_pythonpath() -> None:
    """Make PYTHONPATH's entries absolute: verifiers starts tool servers as `python -m <module>`
    in a scratch directory, where `PYTHONPATH=examples/verifiers` would name nothing (and the
    server would never come up: verifiers waits 180 s for it before it says so)."""
    entries = os.environ.get("PYTHONPATH")
    if entries:
        os.environ["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) if p else p for p in entries.split(os.pathsep))


def fresh_renderers_lock() -> None:
    """`renderers` (0.1.12) guards its context-length lookup with one module-level asyncio.Lock,
    which binds to the first event loop that waits on it: a second sampler app in the same
    process (tests start one after another) would then fail every model call with "bound to a
    different event loop". A fresh lock for the loop that starts serving now."""
    import renderers.client

    renderers.client._max_prompt_len_lock = asyncio.Lock()


class VerifiersEnvironment(Environment):
    def __init__(self, taskset_id: str, **env_args: Any):
        self.vf = import_verifiers()
        # Imported here, as verifiers is (app.py imports this module for VerifiersLink).
        from services.sampler.rollouts.vf import local_client, pydantic_defaults

        self._local = local_client
        local_client.install()  # verifiers' interception server builds in-process clients
        pydantic_defaults.install()  # verifiers' trace graph: model_construct without inspect.signature
        absolute_pythonpath()
        self.taskset_id = taskset_id
        self.name = PREFIX + taskset_id
        env_args, self.limits = split_limits(env_args)
        train_block, eval_block = split_blocks(env_args)
        train = self.vf.load_environment(env_config(taskset_id, train_block))
        evaluate = self.vf.load_environment(env_config(taskset_id, eval_block)) if eval_block is not None else train
        self._envs = {"train": train, "eval": evaluate}
        self._tasks: dict[str, Any] = {}
        self._examples = {split: self._load(split, env) for split, env in self._envs.items()}
        self._servers: dict[int, tuple[asyncio.Task[None], asyncio.Event, asyncio.Future[None]]] = {}
        self._lock = asyncio.Lock()
        # Per Rollouts: the in-process endpoint its trajectories' model calls go to, and the
        # model contexts built for it (_context).
        self._endpoints: dict[int, Endpoint] = {}
        self._contexts: dict[tuple, Any] = {}
        self._settled = False

    def _load(self, split: str, env: Any) -> list[Example]:
        # The first `limit` tasks, in the taskset's own (seeded) order: a restarted sampler
        # indexes the same ones, so batch N is built from the same examples again.
        taskset = env.taskset
        limit = self.limits[split]
        if limit is not None:
            taskset = taskset.take(limit)
        elif not taskset.bounded:
            raise ValueError(f"verifiers taskset {self.taskset_id!r} is infinite; the sampler needs a dataset it "
                             f"can order and index: bound its {split} split with the Tandem key 'limit' in env-args, "
                             '{"limit": N} for both splits or {"limit": {"train": N, "eval": M}}')
        examples = []
        for task in taskset:
            prompt_id = f"{split}:{task.data.id if task.data.id is not None else task.data.idx}"
            if prompt_id in self._tasks:
                raise ValueError(f"verifiers taskset {self.taskset_id!r} has two tasks with id {prompt_id!r}: "
                                 "task ids must be unique")
            self._tasks[prompt_id] = task
            examples.append(Example(prompt_id=prompt_id, prompt=task.data.prompt_text))
        if not examples:
            raise ValueError(f"verifiers taskset {self.taskset_id!r} has no {split} tasks")
        return examples

    def examples(self, split: Split) -> list[Example]:
        return self._examples[split]

    # --- one trajectory -------------------------------------------------------------------

    async def run_trajectory(self, rollouts: Rollouts, example: Example, label: str, *, min_version: int,
                             seed: int, sampling: dict[str, Any]) -> tuple[Completion, Scored]:
        link: VerifiersLink = rollouts.vf
        env = self._envs["eval" if example.prompt_id.startswith("eval:") else "train"]
        await self._serving(env)
        task = self._tasks[example.prompt_id]
        if task.data.timeout.scoring is None:  # a reward is bounded by env_timeout, as everywhere
            task = task.with_data(timeout=task.data.timeout.model_copy(update={"scoring": rollouts.env_timeout}))
        effective = {**rollouts.request_sampling, **sampling}
        contract = {k: effective[k] for k in CONTRACT if effective.get(k) is not None}
        ctx = await self._context(rollouts, link, effective)
        opened: list[str] = []

        def on_trace(trace: Any) -> None:
            # Minted before its first model call: from here on its calls are this trajectory's.
            link.sessions.open(trace.id, Session(min_version=min_version, seed=seed, label=label, sampling=contract))
            opened.append(trace.id)

        try:
            episode = await env.run_episode(task, ctx, on_trace=on_trace)
            sessions = {trace_id: link.sessions.get(trace_id) for trace_id in opened}
        finally:
            for trace_id in opened:
                link.sessions.close(trace_id)
                rollouts.pool.release(trace_id)
        if not episode.ok:
            # A model call the pool could not serve is the pool's failure, not the environment's
            # (one that failed and then succeeded on the client's retry left the episode ok).
            for session in sessions.values():
                if session is not None and session.inference_error is not None:
                    raise session.inference_error
        trace = trainable_trace(episode)
        completion, scored, forks = completion_of(trace, sessions.get(trace.id), min_version)
        counts = rollouts.env_stats.of(self.name)
        counts.trajectories += 1
        counts.turns += trace.num_turns
        counts.tool_calls += len(trace.tool_messages)
        counts.forks += forks
        if not self._settled:
            # The first episode has loaded what episodes load lazily (the tokenizer and
            # renderer, verifiers' modules, the interception servers): out of the collector's way.
            self._settled = True
            if link.settle is not None:
                link.settle()
        return completion, scored

    async def _context(self, rollouts: Rollouts, link: VerifiersLink, sampling: dict[str, Any]) -> Any:
        """The rollout's `ModelContext`: one per (rollouts, served model, sampling, link), reused
        by every trajectory instead of validating three configs again for each (~70 us, and
        garbage). A frozen dataclass of configs verifiers copies rather than changes, so sharing
        it is safe; a change of the served model, tokenizer or sampling makes a new one."""
        tokenizer = link.tokenizer or (await rollouts.served_model()).get("root")
        model = await rollouts.model()
        endpoint = self._endpoint(rollouts, link) if link.in_process else None
        key = (id(rollouts), endpoint.id if endpoint else None, tokenizer, model, link.base_url, link.renderer,
               link.request_timeout, link.api_token, tuple(sorted((k, repr(v)) for k, v in sampling.items())))
        ctx = self._contexts.get(key)
        if ctx is None:
            if len(self._contexts) >= CONTEXTS_KEPT:
                self._contexts.pop(next(iter(self._contexts)))
            ctx = self._contexts[key] = self._new_context(link, endpoint, tokenizer, model, sampling)
        return ctx

    def _new_context(self, link: VerifiersLink, endpoint: Endpoint | None, tokenizer: str | None, model: str,
                     sampling: dict[str, Any]) -> Any:
        vf = self.vf
        # The token as a header of the client's own (it overrides the API-key header the OpenAI
        # SDK writes), not through an environment variable of this process. The in-process
        # client keeps URL and token: verifiers relays a harness's GET /v1/models there.
        fields = dict(
            base_url=f"{link.base_url}/v1", api_key_var="TANDEM_SAMPLER_TOKEN", renderer=renderer_config(link.renderer),
            renderer_model_name=tokenizer, timeout={"read": link.request_timeout + 60},
            headers=bearer_headers(link.api_token))
        client = (self._local.LocalTrainClientConfig(in_process=endpoint.id, **fields) if endpoint
                  else vf.TrainClientConfig(**fields))
        return vf.ModelContext(
            model=model, client=client,
            sampling=vf.SamplingConfig(max_tokens=sampling.get("max_tokens"),
                                       **{k: sampling[k] for k in CONTRACT if sampling.get(k) is not None}))

    def _endpoint(self, rollouts: Rollouts, link: VerifiersLink) -> Endpoint:
        endpoint = self._endpoints.get(id(rollouts))
        if endpoint is None or endpoint.rollouts is not rollouts or endpoint.sessions is not link.sessions:
            endpoint = self._endpoints[id(rollouts)] = self._local.Endpoint(rollouts, link.sessions)
        return endpoint

    # --- the env's shared resources (tool servers, interception), held for the sampler's life

    async def _serving(self, env: Any) -> None:
        async with self._lock:
            held = self._servers.get(id(env))
            if held is None:
                fresh_renderers_lock()
                stop, ready = asyncio.Event(), asyncio.get_running_loop().create_future()
                task = asyncio.create_task(self._hold(env, stop, ready), name=f"verifiers {self.name} serving")
                held = self._servers[id(env)] = (task, stop, ready)
        try:
            await asyncio.shield(held[2])
        except Exception:
            # Tool servers that would not start: the next trajectory tries again.
            if self._servers.get(id(env)) is held:
                del self._servers[id(env)]
            raise

    @staticmethod
    async def _hold(env: Any, stop: asyncio.Event, ready: asyncio.Future[None]) -> None:
        # One task enters and leaves `serving()`: its servers' cancel scopes belong to the task
        # that opened them.
        from services.sampler.rollouts.vf import local_interception

        try:
            async with env.serving():
                # The interception `serving()` holds (verifiers 0.4.0 keeps it on the env):
                # the harness calls its servers in-process (vf/local_interception.py).
                with local_interception.held(getattr(env, "_interception", None)):
                    ready.set_result(None)
                    await stop.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc if isinstance(exc, Exception) else RuntimeError("stopped"))
            raise

    async def aclose(self) -> None:
        from services.sampler.rollouts.vf.harness import TandemChatHarness

        await TandemChatHarness.close_clients()
        for task, stop, _ in self._servers.values():
            stop.set()
            try:
                await asyncio.wait_for(task, 10.0)
            except BaseException as exc:  # noqa: BLE001 - shutting down: say it, go on
                log.warning("verifiers %s: closing its servers: %r", self.name, exc)
        self._servers.clear()

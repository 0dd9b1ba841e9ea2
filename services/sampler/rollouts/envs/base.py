"""The environment interface: what the sampler needs to turn prompts into scored rollouts.

An environment owns a dataset of examples with stable global `prompt_id`s, formats
prompts, runs a rollout (single-turn by default: one prompt, `n` completions) and scores
completions with weighted async reward functions. The sampler owns everything else:
dataset order, group expansion, advantages, staleness.

Scoring is on the sampler's hot path (one score per completion), and most reward functions
are `async def` only by signature: they compute and return without awaiting anything.
`run_now` runs such a coroutine to completion on the spot, and only a coroutine that really
suspends (I/O, a sandbox, a thread) is handed on to be awaited, so a cheap reward costs a
function call rather than an asyncio task. A coroutine's first step then runs in the
caller's task (and contextvars context) instead of a task of its own; results, exceptions
and the concurrency of rewards that do suspend are as with `asyncio.gather`. (This is what
Python 3.12's eager task factory does; the project supports 3.11, which lacks it.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from services.sampler.rollouts.multiturn.workers import is_async

Split = Literal["train", "eval"]


@dataclass(frozen=True)
class Example:
    """One prompt. `prompt_id` is unique across splits and stable across runs."""

    prompt_id: str
    prompt: str
    answer: Any = None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Completion:
    """One generated completion, as the inference server returned it."""

    text: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    # Weight versions that produced the tokens, oldest first (from `weight_versions` spans).
    versions: list[int] = field(default_factory=list)
    # 1 where the trainer learns from the token; None means every completion token. The
    # sampler sets 0 where the server reported no finite logprob (null, NaN, inf); an
    # environment that builds its own Completion from generated ones must carry those zeros.
    loss_mask: list[int] | None = None
    # A multi-turn trajectory's `Conversation` (envs/multiturn.py): its turns and messages.
    conversation: Any = None
    # Named numbers the environment measured but does not reward (verifiers' `@vf.metric`s):
    # they travel with the sample (its `metrics`) into the rollout log.
    metrics: dict[str, float] | None = None


class Generate(Protocol):
    """What the sampler hands to `rollout`: completions for one prompt."""

    def __call__(self, prompt: str, *, n: int, **sampling: Any) -> Awaitable[list[Completion]]: ...


# `async def f(example, completion) -> float`, or a plain function (run in a worker thread).
RewardFn = Callable[[Example, Completion], Awaitable[float] | float]


@dataclass(frozen=True)
class Reward:
    name: str
    fn: RewardFn
    weight: float = 1.0
    # Set from `fn`: a plain (synchronous) function runs in the sampler's worker threads.
    is_async: bool = field(init=False, default=True)

    def __post_init__(self) -> None:
        object.__setattr__(self, "is_async", is_async(self.fn))


class _Resume:
    """Awaitable that finishes a coroutine already advanced to its first suspension by
    `run_now`: the rest of `yield from coro` (PEP 380), from the value it yielded."""

    __slots__ = ("coro", "yielded")

    def __init__(self, coro: Coroutine[Any, Any, Any], yielded: Any):
        self.coro = coro
        self.yielded = yielded

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, value = self.coro, self.yielded
        while True:
            try:
                sent = yield value
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # noqa: BLE001 - forwarded, as `yield from` does
                try:
                    value = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    value = coro.send(sent)
                except StopIteration as stop:
                    return stop.value


def run_now(awaitable: Awaitable[Any]) -> tuple[bool, Any]:
    """(True, result) if `awaitable` is a coroutine that finishes without suspending (it has
    then run); otherwise (False, an awaitable of its result), to be awaited exactly once.
    An exception raised before the first suspension propagates from here."""
    if not asyncio.iscoroutine(awaitable) or not hasattr(awaitable, "send"):
        return False, awaitable
    try:
        yielded = awaitable.send(None)
    except StopIteration as stop:
        return True, stop.value
    return False, _Resume(awaitable, yielded)


async def gather_now(awaitables: Sequence[Awaitable[Any]], timeout: float | None = None) -> list[Any]:
    """`asyncio.gather(*awaitables)` (results in order, first exception raised), without a
    task for each awaitable that `run_now` can finish on the spot. `timeout` bounds the wait
    for those that suspend (`asyncio.TimeoutError`; they are cancelled)."""
    results, pending = _start_all(awaitables)
    if pending:
        await _finish_pending(results, pending, timeout)
    return results


def _start_all(awaitables: Sequence[Awaitable[Any]]) -> tuple[list[Any], list[tuple[int, Awaitable[Any]]]]:
    """`gather_now`'s first part, without a coroutine of its own: each awaitable `run_now`
    finishes gives its result in place; the rest are returned (position, awaitable) to be
    awaited by `_finish_pending`."""
    started = 0

    def each() -> Iterator[tuple[bool, Any]]:
        nonlocal started
        for aw in awaitables:
            started += 1
            yield run_now(aw)

    try:
        return _split(each(), len(awaitables))
    except BaseException:
        for aw in awaitables[started:]:  # nothing created may be left dangling
            _close(aw)
        raise


def _split(steps: Iterable[tuple[bool, Any]], count: int) -> tuple[list[Any], list[tuple[int, Awaitable[Any]]]]:
    """`count` (done, result-or-awaitable) steps as results in place and (position, awaitable)
    pairs still to await. The first exception wins, as with gather: the later steps are not
    taken and the awaitables already pending are closed."""
    results: list[Any] = [None] * count
    pending: list[tuple[int, Awaitable[Any]]] = []
    try:
        for i, (done, value) in enumerate(steps):
            if done:
                results[i] = value
            else:
                pending.append((i, value))
    except BaseException:
        for _, aw in pending:
            _close(aw)
        raise
    return results, pending


async def _finish_pending(results: list[Any], pending: list[tuple[int, Awaitable[Any]]], timeout: float | None) -> None:
    gathered = asyncio.gather(*(aw for _, aw in pending))
    values = await (gathered if timeout is None else asyncio.wait_for(gathered, timeout))
    for (i, _), value in zip(pending, values):
        results[i] = value


def _weighted(rewards: Sequence[Reward], values: list[Any]) -> tuple[float, dict[str, float]]:
    by_name = {r.name: float(v) for r, v in zip(rewards, values)}
    total = sum(r.weight * by_name[r.name] for r in rewards)
    return float(total), by_name


async def score_all(env: Environment, example: Example, completions: Sequence[Completion],
                    timeout: float | None = None) -> list[tuple[float, dict[str, float]]]:
    """`gather_now([env.score(example, c) for c in completions], timeout)`. For an environment
    that keeps the base class's `score`, each completion is scored by a plain call as far as
    its rewards go without suspending (no coroutine per completion); only the rest is awaited."""
    if type(env).score is not Environment.score:
        return await gather_now([env.score(example, c) for c in completions], timeout=timeout)
    # As gather_now: the first exception wins, and the later completions are not scored.
    results, pending = _split((env._score_start(example, c) for c in completions), len(completions))
    if pending:
        await _finish_pending(results, pending, timeout)
    return results


def _close(aw: Any) -> None:
    target = aw.coro if isinstance(aw, _Resume) else aw
    if asyncio.iscoroutine(target) and hasattr(target, "close"):
        target.close()


class Environment:
    """Base class; subclasses set `name` and `rewards` and implement `examples`."""

    name: str = "env"
    rewards: Sequence[Reward] = ()
    # Sampling defaults the environment needs (e.g. stop strings); the sampler's settings win.
    sampling: dict[str, Any] = {}
    # Runs synchronous reward functions off the event loop; the sampler sets it
    # (multiturn/workers.py). Unset, they run inline.
    workers: Any = None

    def examples(self, split: Split) -> Sequence[Example]:
        raise NotImplementedError

    def format_prompt(self, example: Example) -> str:
        return example.prompt

    async def rollout(self, generate: Generate, example: Example, n: int, **sampling: Any) -> list[Completion]:
        return await generate(self.format_prompt(example), n=n, **sampling)

    async def score(self, example: Example, completion: Completion) -> tuple[float, dict[str, float]]:
        """Weighted sum of the reward functions, and each one's raw value by name."""
        done, value = self._score_start(example, completion)
        return value if done else await value

    def _score_start(self, example: Example, completion: Completion) -> tuple[bool, Any]:
        """`score` run as far as it goes without suspending: (True, its result) when every
        reward finished on the spot, else (False, an awaitable of the result). `score_all`
        calls it directly, without a coroutine per completion."""
        rewards = self.rewards
        values, pending = _start_all([r.fn(example, completion) if r.is_async else self._call_sync(r.fn, example, completion)
                                      for r in rewards])
        if pending:
            return False, self._score_rest(rewards, values, pending)
        return True, _weighted(rewards, values)

    async def _score_rest(self, rewards: Sequence[Reward], values: list[Any],
                          pending: list[tuple[int, Awaitable[Any]]]) -> tuple[float, dict[str, float]]:
        await _finish_pending(values, pending, None)
        return _weighted(rewards, values)

    async def _call_sync(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self.workers is None:
            return fn(*args)
        return await self.workers.call(fn, *args)

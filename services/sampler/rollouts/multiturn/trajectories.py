"""A group's trajectories: `n` conversations of one prompt, run concurrently, each scored,
each retried on its own when the environment fails.

An environment turn or a reward that raises or passes `env_timeout` fails its trajectory,
which is run again from the start (a fresh seed), at most `env_retries` times. Retrying,
not skipping: a batch that skipped failing trajectories would lean towards the prompts that
do not fail, often the easy ones. A trajectory that fails every retry fails its group
(`GroupFailed`); the group's slot is refilled like a group with non-finite rewards
(sources.py). Inference failures are not the environment's: they propagate as they do for
single-turn groups.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from services.sampler.rollouts.envs.base import Completion, Environment, Example
from services.sampler.fleet.inference_pool import InferenceError, InferencePool
from services.sampler.rollouts.multiturn.conversation import EnvFault, Limits, run_conversation
from services.sampler.rollouts.multiturn.render import ChatRenderer
from services.sampler.rollouts.multiturn.stats import EnvStats
from services.sampler.rollouts.multiturn.workers import Workers
from services.sampler.rollouts.seeds import derive_seed

log = logging.getLogger("tandem.sampler.multiturn")


class Rollouts(Protocol):
    """What a trajectory needs from the rollouts that run it (services/sampler/rollouts/rollout.py's
    `Rollouts` is one): the environment and its bounds, the model's limits, and a way to
    generate. Declared here, so that trajectories need not import the rollout that uses them."""

    env: Environment
    env_stats: EnvStats
    env_retries: int
    env_timeout: float
    max_tokens: int
    renderer: ChatRenderer
    workers: Workers
    pool: InferencePool

    async def context_length(self) -> int | None: ...

    async def generate(self, prompt: str | list[int], *, n: int, min_version: int = 0, session: str | None = None,
                       **sampling: Any) -> list[Completion]: ...

Scored = tuple[float, dict[str, float]]


class GroupFailed(RuntimeError):
    """A trajectory (or a single-turn group) failed every retry."""


def note_fault(rollouts: Rollouts, what: str, exc: BaseException, attempt: int) -> str:
    """Count and log one environment failure; the error in words."""
    counts = rollouts.env_stats.of(rollouts.env.name)
    counts.env_errors += 1
    error = str(exc) if isinstance(exc, EnvFault) else f"{type(exc).__name__}: {exc}"
    counts.last_error = f"{what}: {error}"
    retrying = attempt < rollouts.env_retries
    counts.trajectory_retries += int(retrying)
    log.warning("environment %r, %s failed (attempt %d of %d): %s%s", rollouts.env.name, what, attempt + 1,
                rollouts.env_retries + 1, error, "; retrying" if retrying else "",
                exc_info=not isinstance(exc, (EnvFault, asyncio.TimeoutError)))
    return error


def reward_timeout(seconds: float) -> EnvFault:
    return EnvFault(f"a reward function did not answer within {seconds:g} s (setting env_timeout)")


async def score(rollouts: Rollouts, example: Example, completion: Completion) -> Scored:
    try:
        return await asyncio.wait_for(rollouts.env.score(example, completion), rollouts.env_timeout)
    except asyncio.TimeoutError:
        raise reward_timeout(rollouts.env_timeout) from None


async def trajectory(rollouts: Rollouts, example: Example, label: str, *, min_version: int, seed: int,
                     sampling: dict[str, Any]) -> tuple[Completion, Scored]:
    """One trajectory `label`, retried; its completion and its score."""
    env = rollouts.env
    episodic = getattr(env, "run_trajectory", None)  # an environment that runs its own episodes (vf/)
    if episodic is None:
        max_model_len = await rollouts.context_length()
        limits = Limits(max_tokens=int(sampling.get("max_tokens") or rollouts.max_tokens),
                        max_model_len=max_model_len, env_timeout=rollouts.env_timeout)
    error = ""
    for attempt in range(rollouts.env_retries + 1):
        session = f"{label}/{attempt}"
        turns = 0
        if episodic is not None:
            try:
                return await episodic(rollouts, example, session, min_version=min_version,
                                      seed=derive_seed(seed, label, attempt), sampling=sampling)
            except (InferenceError, asyncio.CancelledError):
                raise
            except Exception as exc:  # noqa: BLE001 - the environment's fault: retried
                error = note_fault(rollouts, f"trajectory {label} of prompt {example.prompt_id}", exc, attempt)
                continue

        async def generate(prompt_ids: list[int], max_tokens: int) -> Completion:
            # A seed per turn: one seed for every turn would draw the same random numbers each
            # turn, so the answers of a trajectory's turns would move together.
            nonlocal turns
            request = {"seed": derive_seed(seed, label, attempt, turns), **sampling, "max_tokens": max_tokens}
            turns += 1
            completions = await rollouts.generate(prompt_ids, n=1, min_version=min_version, session=session,
                                                  **request)
            return completions[0]

        try:
            completion = await run_conversation(
                env, example, generate=generate, renderer=rollouts.renderer, workers=rollouts.workers,
                counts=rollouts.env_stats.of(env.name), limits=limits)
            return completion, await score(rollouts, example, completion)
        except (InferenceError, asyncio.CancelledError):
            raise
        except Exception as exc:  # noqa: BLE001 - the environment's fault: retried
            error = note_fault(rollouts, f"trajectory {label} of prompt {example.prompt_id}", exc, attempt)
        finally:
            rollouts.pool.release(session)
    raise GroupFailed(f"trajectory {label} failed {rollouts.env_retries + 1} times; last error: {error}")


async def group_trajectories(rollouts: Rollouts, example: Example, group_id: str, n: int, *, min_version: int,
                             seed: int, sampling: dict[str, Any]) -> tuple[list[Completion], list[Scored]]:
    """`n` scored trajectories; when one fails for good the others are cancelled."""
    try:
        async with asyncio.TaskGroup() as tasks:
            running = [tasks.create_task(trajectory(rollouts, example, f"{group_id}/{i}", min_version=min_version,
                                                    seed=seed, sampling=sampling)) for i in range(n)]
    except BaseExceptionGroup as group:
        raise group.exceptions[0] from None
    results = [task.result() for task in running]
    return [c for c, _ in results], [s for _, s in results]

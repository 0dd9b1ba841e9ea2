"""From prompts to scored groups: requests, rewards, advantages (answers are parsed in
completions.py; multi-turn trajectories run in multiturn/; the dataset order and every seed
come from seeds.py).

Non-finite numbers never travel. A token whose behaviour logprob the server sent as null,
NaN or infinite is masked out of the loss (`loss_mask` 0, stored logprob 0.0) in
`completions.parse_completions`, the one place logprobs enter the sampler. A group with a non-finite
reward (its total or any reward function's value) gets `Group.invalid` set and can never
become samples: the fresh-group source drops it and refills the slot (sources.py). Both
are counted in `NonFiniteCounts` (/metrics, /status) and logged.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

import numpy as np

from services.sampler.rollouts.advantages import NonFiniteAdvantages, group_advantages
from services.sampler.rollouts.completions import parse_completions
from services.sampler.rollouts.envs.base import Completion, Environment, Example, score_all
from services.sampler.rollouts.envs.multiturn import MultiTurnEnvironment
from services.sampler.fleet.inference_pool import InferenceError, InferencePool, InferenceRequestError
from services.sampler.rollouts.multiturn.render import ChatRenderer
from services.sampler.rollouts.multiturn.stats import EnvStats
from services.sampler.rollouts.multiturn.trajectories import (
    GroupFailed, group_trajectories, note_fault, reward_timeout, score, trajectory,
)
from services.sampler.rollouts.multiturn.workers import Workers
from services.sampler.rollouts.seeds import DatasetOrder, derive_seed
from shared import codec
from shared.contract import staleness
from shared.wire import BatchStats, new_sample

log = logging.getLogger("tandem.sampler.rollout")

# How `Group.invalid` starts for a group whose environment failed every retry (sources.py).
ENV_FAILED = "the environment failed"
# A server that keeps sending bad logprobs is warned about at most this often.
_LOGPROB_WARN_SECONDS = 60.0
# At most this many offending completions (or examples) are spelled out in one warning.
_SHOWN = 4


# The keys `Group._rows` writes besides the group's info and a completion's metrics.
_SAMPLE_KEYS = frozenset((
    "prompt_id", "group_id", "prompt_token_ids", "completion_token_ids", "completion_logprobs", "loss_mask",
    "reward", "rewards", "advantage", "policy_version", "finish_reason", "use_count", "env", "sample_index",
    "versions", "prompt_text", "completion_text",
))


@dataclass
class NonFiniteCounts:
    """What the sampler kept out of batches and eval means since it started (one object
    shared by every environment's `Rollouts`; read by /metrics and /status)."""

    # (env, split) -> completions whose reward, or a reward function's value, was NaN or inf.
    rewards: dict[tuple[str, str], int] = field(default_factory=dict)
    # env -> training groups dropped because of them.
    groups: dict[str, int] = field(default_factory=dict)
    # server url -> completion tokens whose logprob was null or non-finite (masked out).
    logprobs: dict[str, int] = field(default_factory=dict)

    def add(self, table: dict[Any, int], key: Any, count: int = 1) -> None:
        table[key] = table.get(key, 0) + count

    def snapshot(self) -> dict[str, Any]:
        rewards: dict[str, dict[str, int]] = {}
        for (env, split), count in sorted(self.rewards.items()):
            rewards.setdefault(env, {})[split] = count
        return {"rewards": rewards, "groups_dropped": dict(sorted(self.groups.items())),
                "logprobs_masked": dict(sorted(self.logprobs.items()))}


def nonfinite_rewards(rewards: list[float], parts: list[dict[str, float]]) -> list[int]:
    """Indices of the completions whose total reward or any reward part is NaN or infinite."""
    isfinite = math.isfinite
    return [i for i, (total, by_name) in enumerate(zip(rewards, parts))
            if not (isfinite(total) and all(map(isfinite, by_name.values())))]


def describe_rewards(indices: list[int], rewards: list[float], parts: list[dict[str, float]],
                     labels: list[str] | None = None) -> str:
    """The offending values of `indices`, for a log line (the first few)."""
    shown = [f"{labels[i] if labels else f'completion {i}'}: reward {rewards[i]!r}, parts {parts[i]!r}"
             for i in indices[:_SHOWN]]
    more = len(indices) - _SHOWN
    return "; ".join(shown) + (f"; and {more} more" if more > 0 else "")


@dataclass
class Group:
    """`n` completions of one prompt, scored, with advantages."""

    example: Example
    group_id: str
    completions: list[Completion]
    rewards: list[float]
    reward_parts: list[dict[str, float]]
    advantages: list[float]
    policy_versions: list[int]
    info: dict[str, Any] = field(default_factory=dict)
    # Why the group must never reach a batch (a non-finite reward); None when it may.
    invalid: str | None = None
    # (env_name, samples with typed token arrays), made by `finish` as the group is done.
    _finished: tuple[str, list[dict[str, Any]]] | None = field(default=None, repr=False)

    def finish(self, env_name: str) -> None:
        """Turn the samples' token lists into typed arrays now, while other groups of the batch
        are still generating: the batch's seal then only copies them into its chunks."""
        if self.invalid is None:
            self._finished = env_name, self._typed_samples(env_name)

    def _typed_samples(self, env_name: str) -> list[dict[str, Any]]:
        """`codec.with_arrays({"samples": self.samples(env_name)})["samples"]`, built in one pass:
        no list-form sample to copy, each token field of the group converted in one step
        (`codec.typed_fields`; a prompt list shared by completions once), and one all-ones
        loss mask per length."""
        typed, typed_all, ones = codec.typed_field, codec.typed_fields, codec.ones_mask
        completions = self.completions
        # Each field of the group in one conversion (a list object shared by completions once).
        prompts: dict[int, Any] = {}
        for c in completions:
            prompts.setdefault(id(c.prompt_token_ids), c.prompt_token_ids)
        prompt_arrays = dict(zip(prompts, typed_all("prompt_token_ids", list(prompts.values()))))
        return self._rows(
            env_name, [prompt_arrays[id(c.prompt_token_ids)] for c in completions],
            typed_all("completion_token_ids", [c.token_ids for c in completions]),
            typed_all("completion_logprobs", [c.logprobs for c in completions]),
            [ones(len(c.token_ids)) if c.loss_mask is None else typed("loss_mask", c.loss_mask) for c in completions])

    def samples(self, env_name: str) -> list[dict[str, Any]]:
        if self._finished is not None and self._finished[0] == env_name:
            return self._finished[1]
        if self.invalid is not None:
            raise ValueError(f"group {self.group_id} ({self.example.prompt_id}) cannot become samples: {self.invalid}")
        completions = self.completions
        return self._rows(env_name, [c.prompt_token_ids for c in completions], [c.token_ids for c in completions],
                          [c.logprobs for c in completions],
                          [c.loss_mask if c.loss_mask is not None else [1] * len(c.token_ids) for c in completions])

    def _rows(self, env_name: str, prompts: list[Any], tokens: list[Any], logprobs: list[Any],
              masks: list[Any]) -> list[dict[str, Any]]:
        """The group's samples in their wire form, with these token fields: a plain dict per
        completion; `new_sample` checks the first (every row has the same keys) instead of each
        one (~1 us a sample on the path every completion takes), and the group's info is checked
        once for keys it would repeat."""
        info = self.info
        clash = _SAMPLE_KEYS.intersection(info)
        if not clash and any(c.metrics for c in self.completions) and "metrics" in info:
            clash = {"metrics"}
        if clash:
            raise TypeError(f"group {self.group_id}: its info repeats the sample key(s) {sorted(clash)}")
        prompt_id, prompt_text, group_id = self.example.prompt_id, self.example.prompt, self.group_id
        rewards, parts, advantages, versions = self.rewards, self.reward_parts, self.advantages, self.policy_versions
        out = []
        for i, c in enumerate(self.completions):
            sample = {
                "prompt_id": prompt_id,
                "group_id": group_id,
                "prompt_token_ids": prompts[i],
                "completion_token_ids": tokens[i],
                "completion_logprobs": logprobs[i],
                "loss_mask": masks[i],
                "reward": rewards[i],
                "rewards": parts[i],
                "advantage": advantages[i],
                "policy_version": versions[i],
                "finish_reason": c.finish_reason,
                "use_count": 1,
                "env": env_name,
                "sample_index": i,
                "versions": c.versions,
                "prompt_text": prompt_text,
                "completion_text": c.text,
                **info,
            }
            if c.metrics:
                sample["metrics"] = c.metrics
            out.append(sample)
        if out:
            new_sample(**out[0])
        return out


class Rollouts:
    """Generates and scores groups for the producer and for evals."""

    def __init__(self, env: Environment, pool: InferencePool, *, prompts_per_step: int,
                 num_generations: int, sampling: dict[str, Any], seed: int, advantage: str,
                 model_name: str | None, nonfinite: NonFiniteCounts | None = None,
                 workers: Workers | None = None, env_stats: EnvStats | None = None,
                 env_timeout: float = 60.0, env_retries: int = 2, vf: Any = None):
        self.env = env
        self.pool = pool
        self.prompts_per_step = prompts_per_step
        self.num_generations = num_generations
        self.sampling = sampling
        self.seed = seed
        self.advantage = advantage
        self.model_name = model_name
        # The sampler's setting, else the environment's default, else vLLM's default of 16.
        self.max_tokens = int(sampling.get("max_tokens") or env.sampling.get("max_tokens") or 16)
        self.train = list(env.examples("train"))
        self.order = DatasetOrder(len(self.train), seed)
        self._model_lock = asyncio.Lock()
        self.completions_done = 0
        self.tokens_done = 0
        # Shared by every environment's Rollouts of one sampler (app.py passes one in).
        self.nonfinite = nonfinite if nonfinite is not None else NonFiniteCounts()
        self._logprob_warned: dict[str, float] = {}
        # Environment code: synchronous parts in worker threads, faults counted and retried.
        self.workers = workers if workers is not None else Workers(4)
        env.workers = self.workers
        self.env_stats = env_stats if env_stats is not None else EnvStats()
        self.env_timeout = env_timeout
        self.env_retries = env_retries
        # Conversations: Tandem's multi-turn environments, or one that runs its own episodes
        # (verifiers, vf/environment.py; `vf` is its link to the sampler, vf.VerifiersLink).
        self.multiturn = isinstance(env, MultiTurnEnvironment) or hasattr(env, "run_trajectory")
        self.vf = vf
        self.renderer = ChatRenderer(self._tokenize)
        self._served: dict[str, Any] | None = None  # /v1/models' first entry, once read

    @property
    def request_sampling(self) -> dict[str, Any]:
        """The sampling parameters every generation request starts from: the environment's,
        overridden by the sampler's settings (a rollout may still add its own per call)."""
        return {**self.env.sampling, **self.sampling, "max_tokens": self.max_tokens}

    async def model(self) -> str:
        """The served model id: the setting, else the first server's /v1/models."""
        if self.model_name is None:
            self.model_name = (await self._served_model())["id"]
        return self.model_name

    async def served_model(self) -> dict[str, Any]:
        """The servers' model card (the first entry of /v1/models: `id`, `max_model_len`, and
        `root`, the path the server loaded), read once."""
        return dict(await self._served_model())

    async def aclose(self) -> None:
        """Stop what the environment holds open (a verifiers env's tool servers)."""
        close = getattr(self.env, "aclose", None)
        if close is not None:
            await close()

    async def context_length(self) -> int | None:
        """The served model's context (`max_model_len` of /v1/models), None when not given."""
        value = (await self._served_model()).get("max_model_len")
        return int(value) if value else None

    async def _served_model(self) -> dict[str, Any]:
        """The first entry of the servers' /v1/models (id, max_model_len), read once: every
        trajectory of the first groups asks at the same moment."""
        if self._served is None:
            async with self._model_lock:
                if self._served is None:
                    self._served = await self._get_models()
        return self._served

    async def _tokenize(self, body: dict[str, Any]) -> list[int]:
        """POST /tokenize on a server in rotation (render.py renders turns with it)."""
        answer, _ = await self.pool.post("/tokenize", {**body, "model": await self.model()})
        return list(answer["tokens"])

    async def _get_models(self) -> dict[str, Any]:
        # A server in rotation first, waiting for one as a request would: at start-up the
        # servers may not be up yet, and the first eval must not fail for that.
        first = await self.pool.usable()
        last_error = None
        for server in [first] + [s for s in self.pool.servers if s is not first]:
            try:
                response = await self.pool.get(server.url, "/v1/models")
                if response.status_code == 200:
                    return response.json()["data"][0]
                last_error = f"{server.url}: HTTP {response.status_code}"
            except Exception as exc:  # noqa: BLE001 - try the next server
                last_error = f"{server.url}: {exc!r}"
        raise InferenceRequestError(f"cannot read the model id from any /v1/models ({last_error})")

    async def generate(self, prompt: str | list[int] | list[str] | list[list[int]], *, n: int, min_version: int = 0,
                       session: str | None = None, **sampling: Any) -> list[Completion]:
        """`n` completions of `prompt` (text, or token ids: token-in; a list of those: `n` of
        each, in order); `session` names a multi-turn trajectory, whose turns go to one server
        (inference_pool.py)."""
        body = {
            **self.request_sampling,
            **sampling,
            "model": await self.model(),
            "prompt": prompt,
            "n": n,
            "logprobs": 0,
            "return_token_ids": True,
            "return_weight_versions": True,
        }
        completions, server = await self.pool.post("/v1/completions", body, min_version=min_version,
                                                   parse=parse_completions, session=session)
        self.completions_done += len(completions)
        self.tokens_done += sum(len(c.token_ids) for c in completions)
        # Straight from parse_completions, a loss_mask only ever masks bad logprobs.
        masked = sum(c.loss_mask.count(0) for c in completions if c.loss_mask is not None)
        if masked:
            self._masked(server.url, masked, sum(len(c.token_ids) for c in completions))
        return completions

    def _masked(self, url: str, masked: int, tokens: int) -> None:
        self.nonfinite.add(self.nonfinite.logprobs, url, masked)
        now = time.monotonic()
        last = self._logprob_warned.get(url)
        if last is None or now - last >= _LOGPROB_WARN_SECONDS:
            self._logprob_warned[url] = now
            log.warning(
                "inference server %s sent %d of %d token logprobs as null or non-finite (%d from it since start); "
                "those tokens are masked out of the loss (loss_mask 0). The server must return a finite logprob "
                "for every sampled token (logprobs=0): check its version and settings", url, masked, tokens,
                self.nonfinite.logprobs[url])

    async def group(self, example: Example, group_id: str, *, min_version: int, seed: int,
                    n: int | None = None, **sampling: Any) -> Group:
        n = n or self.num_generations
        try:
            if self.multiturn:
                completions, scored = await group_trajectories(self, example, group_id, n, min_version=min_version,
                                                               seed=seed, sampling=sampling)
            else:
                completions, scored = await self._single_turn(example, group_id, n, min_version, seed, sampling)
        except GroupFailed as exc:
            self.env_stats.of(self.env.name).groups_dropped += 1
            log.warning("environment %r, prompt %s (group %s): %s; the group is dropped and its slot refilled",
                        self.env.name, example.prompt_id, group_id, exc)
            return Group(example=example, group_id=group_id, completions=[], rewards=[], reward_parts=[],
                         advantages=[], policy_versions=[min_version], info={"created_at": time.time()},
                         invalid=f"{ENV_FAILED}: {exc}")
        rewards = [total for total, _ in scored]
        parts = [by_name for _, by_name in scored]
        versions = [min(c.versions) if c.versions else min_version for c in completions]
        invalid = None
        bad = nonfinite_rewards(rewards, parts)
        if bad:
            self.nonfinite.add(self.nonfinite.rewards, (self.env.name, "train"), len(bad))
            invalid = f"{len(bad)} of {len(rewards)} rewards are not finite ({describe_rewards(bad, rewards, parts)})"
        else:
            try:
                advantages = group_advantages(rewards, self.advantage)
            except NonFiniteAdvantages as exc:
                invalid = str(exc)
        if invalid is not None:
            self.nonfinite.add(self.nonfinite.groups, self.env.name)
            log.warning("environment %r, prompt %s (group %s): %s; the group is dropped and its slot refilled. "
                        "Fix the environment's reward function: it must return finite numbers",
                        self.env.name, example.prompt_id, group_id, invalid)
            advantages = [0.0] * len(rewards)
        return Group(
            example=example,
            group_id=group_id,
            completions=completions,
            rewards=rewards,
            reward_parts=parts,
            advantages=advantages,
            policy_versions=versions,
            info={"created_at": time.time()},
            invalid=invalid,
        )

    async def _single_turn(self, example: Example, group_id: str, n: int, min_version: int, seed: int,
                           sampling: dict[str, Any]) -> tuple[list[Completion], list[tuple[float, dict[str, float]]]]:
        """The environment's rollout of `n` completions, scored; retried as a whole when the
        environment's code fails (its `n` completions come from one request)."""
        for attempt in range(self.env_retries + 1):
            attempt_seed = seed if attempt == 0 else derive_seed(seed, attempt)

            async def generate(prompt: str, *, n: int, **kw: Any) -> list[Completion]:
                return await self.generate(prompt, n=n, min_version=min_version, **{"seed": attempt_seed, **kw})

            try:
                completions = await self.env.rollout(generate, example, n, **sampling)
                # Most scores finish without suspending: no task (nor coroutine) per completion for those.
                scored = await score_all(self.env, example, completions, timeout=self.env_timeout)
                return completions, scored
            except (InferenceError, asyncio.CancelledError):
                raise
            except asyncio.TimeoutError:
                error = note_fault(self, f"group {group_id} of prompt {example.prompt_id}",
                                   reward_timeout(self.env_timeout), attempt)
            except Exception as exc:  # noqa: BLE001 - the environment's fault: retried
                error = note_fault(self, f"group {group_id} of prompt {example.prompt_id}", exc, attempt)
        raise GroupFailed(f"failed {self.env_retries + 1} times; last error: {error}")

    async def sample_one(self, example: Example, *, min_version: int, sampling: dict[str, Any],
                         label: str) -> tuple[Completion, tuple[float, dict[str, float]]]:
        """One completion of `example`, scored (evals): a whole conversation for a multi-turn
        environment, whose faults are retried as in training."""
        if self.multiturn:
            return await trajectory(self, example, label, min_version=min_version, seed=0, sampling=sampling)
        completions = await self.generate(self.env.format_prompt(example), n=1, min_version=min_version, **sampling)
        return completions[0], await score(self, example, completions[0])

    async def sample_each(self, examples: list[Example], *, min_version: int,
                          sampling: dict[str, Any]) -> list[tuple[Completion, tuple[float, dict[str, float]]]]:
        """`sample_one` of every example of a single-turn environment, from ONE request whose
        prompt is the list of their prompts (the OpenAI API's batched form, which vLLM and the
        CPU server answer one choice per prompt, in order): an eval of 64 prompts costs the
        sampler and the server one request's overhead instead of 64. Same prompts, sampling
        and scores as one request each; a failed request retries the whole list."""
        if self.multiturn:
            raise ValueError("sample_each is for single-turn environments: a conversation is one request per turn")
        completions = await self.generate([self.env.format_prompt(ex) for ex in examples], n=1,
                                          min_version=min_version, **sampling)
        if len(completions) != len(examples):
            raise InferenceRequestError(f"asked for one completion of each of {len(examples)} prompts in one "
                                        f"request, got {len(completions)}: the server must answer a list prompt "
                                        "with one choice per prompt (OpenAI /v1/completions)")
        scores = await asyncio.gather(*(score(self, ex, c) for ex, c in zip(examples, completions)))
        return list(zip(completions, scores))


def summarize_batch(step: int, samples: list[dict[str, Any]], started_at: float, sealed_at: float) -> BatchStats:
    """The stats of batch `step` (the `stats` of its body), from its samples."""
    rewards = np.array(list(map(itemgetter("reward"), samples)), dtype=float)
    policy_versions = list(map(itemgetter("policy_version"), samples))
    # Per distinct version, not per sample: a batch holds a few.
    by_version = {v: staleness(step, v) for v in set(policy_versions)}
    stale = list(map(by_version.__getitem__, policy_versions))
    finish = dict(Counter(map(itemgetter("finish_reason"), samples)))
    version_counts = Counter(policy_versions)
    if all(type(v) is int for v in version_counts):
        versions = {str(v): count for v, count in version_counts.items()}
    else:  # counted by their text, as the contract writes them
        versions = dict(Counter(map(str, policy_versions)))
    parts = _reward_parts(list(map(itemgetter("rewards"), samples)))
    use_counts = [s.get("use_count", 1) for s in samples]
    return BatchStats(
        step=step,
        num_samples=len(samples),
        num_groups=len(set(map(itemgetter("group_id"), samples))),
        staleness_mean=float(np.mean(stale)) if stale else 0.0,
        staleness_max=int(max(stale, default=0)),
        staleness_min=int(min(stale, default=0)),
        reward_mean=float(rewards.mean()) if len(rewards) else 0.0,
        reward_std=float(rewards.std()) if len(rewards) else 0.0,
        rewards_mean={k: float(np.mean(v)) for k, v in parts.items()},
        completion_tokens_mean=(float(np.mean(list(map(len, map(itemgetter("completion_token_ids"), samples)))))
                                if samples else 0.0),
        finish_reasons=finish,
        policy_versions=versions,
        generation_started_at=started_at,
        sealed_at=sealed_at,
        generation_seconds=sealed_at - started_at,
        use_count_mean=float(np.mean(use_counts)) if samples else 0.0,
        use_count_max=int(max(use_counts, default=0)),
    )


def _reward_parts(by_sample: list[dict[str, float]]) -> dict[str, list[float]]:
    """Each reward function's values over the samples, in order of first appearance."""
    if by_sample:
        names = by_sample[0].keys()
        if all(d.keys() == names for d in by_sample):  # the usual batch: every sample has every part
            return {name: [d[name] for d in by_sample] for name in names}
    parts: dict[str, list[float]] = {}
    for d in by_sample:
        for name, value in d.items():
            parts.setdefault(name, []).append(value)
    return parts

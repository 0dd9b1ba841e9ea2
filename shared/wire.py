"""Pydantic models for every HTTP body of the sampler API (docs/sampler-api.md).

Field names here are the public contract. Models allow extra fields so that a newer
sampler can add metadata without breaking an older trainer.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, WrapValidator, field_validator, model_validator

from shared.probe import Probe, ProbeResult

FinishReason = Literal["stop", "length", "abort"]
MAX_METRICS = 128  # keys in WeightsVersionRequest.metrics; the trainer sends at most this many (a step
# with every correction metric per staleness group, a KL term and truncation has ~65)
EvalStatus = Literal["pending", "running", "done", "failed"]


def _array_or_list(kinds: str, what: str) -> WrapValidator:
    """Accept a 1-d numpy array of the right kind as it is (the arrays wire form decodes to
    those, and converting them back to lists would cost what that form saves)."""

    def validate(value: Any, handler: Any) -> Any:
        if isinstance(value, np.ndarray):
            if value.ndim != 1 or value.dtype.kind not in kinds:
                raise ValueError(f"expected a list of {what} or a 1-d array of them, "
                                 f"got an array of {value.dtype} with shape {value.shape}")
            return value
        return handler(value)

    return WrapValidator(validate)


def _to_list(value: Any) -> Any:
    return value.tolist() if isinstance(value, np.ndarray) else value


_AsList = PlainSerializer(_to_list, when_used="json")
IntArray = Annotated[list[int], _array_or_list("iub", "integers"), _AsList]
FloatArray = Annotated[list[float], _array_or_list("fiu", "numbers"), _AsList]


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class Sample(_Open):
    """One completion, ready to train on: the one definition of a sample.

    The sampler builds samples in the wire form (plain dicts whose fields `new_sample` checks),
    stores and serves them; the trainer reads them as this model. Extra keys are allowed (an
    environment's group info travels along)."""

    prompt_id: str
    group_id: str
    prompt_token_ids: IntArray
    completion_token_ids: IntArray
    completion_logprobs: FloatArray = Field(
        description="behaviour-policy logprob of each completion token"
    )
    loss_mask: IntArray = Field(description="1 where the token is trained on, one per completion token")
    reward: float
    rewards: dict[str, float] = Field(default_factory=dict)
    advantage: float
    policy_version: int = Field(description="oldest weights version that produced any token")
    finish_reason: FinishReason
    use_count: int = Field(default=1, description="times this sample has been served, this time included")
    # Metadata for people and the rollout log; the trainer does not need it.
    env: str | None = Field(default=None, description="environment (curriculum lesson) that made the prompt")
    sample_index: int | None = Field(default=None, description="position in its group")
    versions: list[int] | None = Field(default=None, description="every weights version that produced a token")
    prompt_text: str | None = None
    completion_text: str | None = None
    created_at: float | None = Field(default=None, description="unix time its group finished scoring")
    lesson: str | None = Field(default=None, description="curriculum lesson, when a curriculum runs")


_REQUIRED_SAMPLE_FIELDS = frozenset(name for name, info in Sample.model_fields.items() if info.is_required())


def new_sample(**fields: Any) -> dict[str, Any]:
    """A sample in its wire form, with `Sample`'s field names.

    A dict, not a `Sample`: the sampler packs each sample into Redis as it is built, and a
    model per sample costs about six times a dict (7 us against 1 us on this machine), on the
    path every completion takes. Required fields are checked here; their types by the trainer's
    `Sample` (and tests/sampler/test_batch_api.py, which validates what the sampler seals)."""
    missing = _REQUIRED_SAMPLE_FIELDS.difference(fields)
    if missing:
        raise TypeError(f"a sample needs {sorted(missing)}")
    return fields


class BatchStats(_Open):
    """What the sampler measured about one sealed batch (also in GET /status and the dashboard).
    Strategies and sources add their own counters as extra keys."""

    step: int | None = None
    num_samples: int = 0
    num_groups: int = 0
    staleness_mean: float = 0.0
    staleness_max: int = 0
    staleness_min: int = 0
    reward_mean: float = 0.0
    reward_std: float = 0.0
    rewards_mean: dict[str, float] = Field(default_factory=dict)
    completion_tokens_mean: float = 0.0
    finish_reasons: dict[str, int] = Field(default_factory=dict)
    policy_versions: dict[str, int] = Field(default_factory=dict)
    generation_started_at: float | None = None
    sealed_at: float | None = None
    generation_seconds: float | None = None
    use_count_mean: float = 0.0
    use_count_max: int = 0


class Batch(_Open):
    step: int
    samples: list[Sample]
    stats: BatchStats = Field(default_factory=BatchStats)


class WeightsVersionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Redis scripts compare versions as Lua numbers (doubles): exact only up to 2**53.
    version: int = Field(ge=0, le=2**53, description="weights version: number of optimizer updates applied")
    checkpoint_path: str | None = Field(
        default=None,
        description="HF-format checkpoint directory the sampler loads into every inference "
        "server; null when the trainer already pushed the weights itself",
    )
    adapter: bool = Field(
        default=False,
        description="true: checkpoint_path holds a PEFT LoRA adapter (shared/adapters.py) for the base model "
        "the inference servers were started with, loaded as the run's adapter instead of full weights",
    )
    probe: Probe | None = Field(
        default=None,
        description="token ids and the trainer's logprobs for them under these weights: every server the "
        "sampler loads them into must agree (shared/probe.py), or it is taken out of rotation",
    )
    resume_step: int | None = Field(
        default=None, ge=0, le=2**53,
        description="the step a restarted trainer would train first (the step after its newest full "
        "checkpoint; 0 before the first): the sampler keeps every batch from this step on, whatever "
        "keep_batches says, so a trainer killed at any moment can resume (null: keep_batches alone)",
    )
    metrics: dict[str, float | None] | None = Field(
        default=None, max_length=MAX_METRICS,
        description="the trainer's metrics for the step that made this version (behaviour_mismatch, loss, "
        "...): shown on the dashboard and in /status",
    )

    @model_validator(mode="after")
    def _adapter_has_a_path(self) -> WeightsVersionRequest:
        if self.adapter and not self.checkpoint_path:
            raise ValueError("adapter is true but checkpoint_path is null: an adapter is loaded from a directory; "
                             "send the published adapter's checkpoint_path")
        return self

    @field_validator("metrics")
    @classmethod
    def _finite(cls, value: dict[str, float | None] | None) -> dict[str, float | None] | None:
        for name, number in (value or {}).items():
            if number is not None and not math.isfinite(number):
                raise ValueError(f"metrics[{name!r}] is {number}: send finite numbers (or null)")
        return value


class ServerVersion(_Open):
    url: str
    version: int | None = None
    # ok (in rotation), joining, down, resyncing, stale, mismatch or leaving; `reason` says why
    # a server is out of rotation.
    state: str = "ok"
    reason: str | None = None
    healthy: bool = True
    error: str | None = None
    last_sync_seconds: float | None = None
    probe: ProbeResult | None = Field(default=None, description="how its last verified sync compared with the trainer")


class InferenceServerRequest(BaseModel):
    """Body of POST and DELETE /inference_servers."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(max_length=2048, pattern=r"^https?://[^\s/?#]+(/[^\s?#]*)?$",
                     description="base URL of a server speaking vLLM's HTTP API, e.g. http://10.0.0.5:8000")


class InferenceServers(_Open):
    servers: list[ServerVersion]
    published_version: int
    checkpoint_path: str | None = None


class InferenceServerRemoved(_Open):
    url: str
    removed: bool
    outstanding: int = Field(description="requests still in flight to it when the answer was sent")
    drained: bool


class WeightsVersion(_Open):
    version: int
    checkpoint_path: str | None = None
    adapter: bool = False  # checkpoint_path is a LoRA adapter (shared/adapters.py)
    servers: list[ServerVersion] = Field(default_factory=list)
    min_served_version: int | None = None


class EvalRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_examples: int | None = Field(default=None, ge=1, le=100_000)
    env: str | None = None
    temperature: float = Field(default=0.0, ge=0.0, le=10.0)
    max_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    seed: int | None = None


class EvalAccepted(BaseModel):
    eval_id: str


class EvalResult(_Open):
    eval_id: str
    status: EvalStatus
    result: dict[str, Any] | None = None
    error: str | None = None
    request: dict[str, Any] | None = None
    created_at: float | None = None
    finished_at: float | None = None


class Health(BaseModel):
    """GET /health: "ok", or "degraded" with what is wrong (the process is alive either way:
    restarting it would not help, so the answer stays 200)."""

    status: Literal["ok", "degraded"] = "ok"
    problems: list[str] = Field(default_factory=list)

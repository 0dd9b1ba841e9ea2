"""Sampler settings (docs/settings.md, Sampler): one pydantic-settings class."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from services.procs import local_url
from shared import contract
from shared.adapters import DEFAULT_ADAPTER_NAME
from shared.settings import CommaList, EnvArgs, GuardedSettings, json_if_str
from shared.tracking import TrackingSettings


class CurriculumStage(BaseModel):
    """Lessons (environment name -> weight) used until trainer step `until_step` (exclusive)."""

    model_config = ConfigDict(extra="forbid")

    until_step: int | None = Field(default=None, ge=1, description="None: until the end of the run")
    lessons: dict[str, float] = Field(min_length=1)

    @model_validator(mode="after")
    def _weights(self) -> "CurriculumStage":
        for name, weight in self.lessons.items():
            if not weight > 0:
                raise ValueError(f"lesson {name!r} has weight {weight}: weights must be > 0")
        return self


class SamplerSettings(TrackingSettings, GuardedSettings):
    """The sampler: generates, scores and seals batches; drives weight sync."""

    section: ClassVar[str] = "sampler"

    port: int = 8100
    redis_url: str | None = Field(
        default=None, description="external Redis; unset starts an embedded redis-server under run_dir"
    )
    redis_timeout: float = Field(
        default=15.0, gt=0, le=3600,
        description="seconds one Redis command may take before the sampler counts Redis as unreachable (a frozen "
                    "Redis: its socket accepts, nothing answers); connecting gets at most 5 of them")
    namespace: str = Field(default="default", description="run namespace: prefixes every Redis key")
    fresh: bool = Field(
        default=False,
        description="start a new run: delete the run stored in this namespace (batches, versions, membership) "
                    "first; give it once, on the command line",
    )
    inference_urls: CommaList = Field(
        default_factory=lambda: ["http://127.0.0.1:8000"],
        description="the run's initial inference servers; membership then lives in Redis (POST/DELETE /inference_servers)",
    )
    env: str = Field(default="toy", description="environment name or 'package.module:factory'")
    env_args: EnvArgs = Field(
        default_factory=dict, description="keyword arguments for the environment (JSON)"
    )
    prompts_per_step: int = Field(default=8, ge=1)
    num_generations: int = Field(default=8, ge=1)
    max_staleness: int = Field(
        default=1, ge=0, description="batch N may hold fresh samples from weights of version >= N - max_staleness"
    )
    on_policy: bool = Field(default=False, description="synchronous on-policy: shorthand for max_staleness = 0")
    strategy: str = Field(default="off_policy", description="off_policy, on_policy, replay or 'pkg.mod:Class'")
    num_iterations: int = Field(
        default=1, ge=1, description="batch reuse: each generated batch is served for this many consecutive steps"
    )
    # Replay buffer (strategy = replay).
    replay_sampling: Literal["uniform", "recency", "advantage"] = Field(
        default="uniform", description="how replayed groups are drawn: uniform, recency, or by |advantage|"
    )
    replay_ratio: float = Field(default=0.5, ge=0.0, lt=1.0, description="share of each batch drawn from the pool")
    max_reuse: int = Field(default=2, ge=1, description="times a sample may be served (fresh use included)")
    max_age: int = Field(default=4, ge=0, description="replayed samples are at most this many versions old")
    replay_capacity: int = Field(default=1024, ge=1, description="groups kept in the pool; oldest evicted")
    replay_retention: Literal["all", "newest_per_prompt"] = Field(
        default="all", description="newest_per_prompt keeps only the newest policy version's group per prompt"
    )
    # Dynamic sampling.
    filter_zero_variance: bool = Field(default=False, description="drop groups whose rewards are all equal, refill")
    max_oversample: float = Field(
        default=2.0, ge=0.0, description="refill bound: at most this many extra groups per prompt slot"
    )
    # Curriculum: stages of lessons; JSON list or TOML array of tables.
    curriculum: Annotated[list[CurriculumStage] | None, BeforeValidator(json_if_str)] = Field(
        default=None, description='e.g. [{"until_step": 50, "lessons": {"toy": 1}}, {"lessons": {"toy": 1, "math": 1}}]'
    )
    curriculum_adaptive: bool = Field(
        default=False, description="scale lesson weights down as their recent success rate rises"
    )
    # Cadence check: when given, must match prompts_per_step * num_generations.
    per_device_batch_size: int | None = Field(default=None, ge=1)
    grad_accum_steps: int | None = Field(default=None, ge=1)
    world_size: int | None = Field(default=None, ge=1)
    max_concurrency: int = Field(default=64, ge=1, description="inference requests in flight")
    eval_concurrency: int = Field(default=0, ge=0, description="eval prompts in flight (single-turn: lists of up to "
                                  "this many per request); 0 = a quarter of max_concurrency")
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="nucleus sampling; the trainer scores the same nucleus")
    top_k: int | None = Field(default=None, ge=-1, description="sample among the k most likely tokens (-1, 0: off)")
    min_p: float | None = Field(default=None, ge=0.0, le=1.0,
                                description="drop tokens below min_p x the most likely one's probability")
    max_tokens: int | None = Field(default=None, ge=1, description="unset: the environment's default, else 16")
    seed: int = 0
    advantage: Literal["grpo", "no_std", "rloo"] = Field(
        default="grpo", description="grpo: (r-mean)/std; no_std: r-mean (Dr. GRPO); rloo: leave-one-out"
    )
    metrics_token: str | None = Field(
        default=None, description="a token of its own for GET /metrics (Prometheus); unset = /metrics is open")
    keep_batches: int = Field(default=8, ge=1, description="sealed batches kept behind the published version")
    batch_chunk_bytes: int = Field(
        default=4 << 20, ge=64 << 10, le=256 << 20,
        description="a sealed batch is stored in chunks of about this many bytes, cut between groups: a "
        "rank's share is read as whole chunks plus at most part of one at each end")
    batch_store: Literal["files", "redis"] = Field(
        default="files",
        description="where a sealed batch's chunks go: files (written and fsynced once under batch_dir; Redis keeps the "
        "manifest) or redis (Redis strings through its fsync-always log: only for replicas that share no directory)")
    batch_dir: Path | None = Field(
        default=None,
        description="directory of the chunk files (batch_store = files); unset = run_dir/batches. Every sampler "
        "replica of a run must see the same directory at the same path (docs/sampler-api.md)")
    batch_store_timeout: float = Field(
        default=120.0, gt=0, le=86400,
        description="seconds storing one batch's chunks may take; past it the attempt fails with the batch's size and "
        "the build retries after a back-off")
    batch_cache_bytes: int = Field(
        default=1 << 30, ge=0,
        description="recently sealed batches kept in memory (served without a Redis read, written back "
        "after a Redis restart): the newest always, older ones while they all fit in this many bytes")
    max_poll_timeout: float = Field(default=60.0, gt=0, description="upper bound on ?timeout= of long-polls")
    request_timeout: float = Field(
        default=600.0, gt=0,
        description="the most seconds one inference request may take, whatever it asks for (the outer bound)")
    request_seconds_per_token: float = Field(
        default=1.0, gt=0,
        description="seconds an inference request may take per token it may generate (its max_tokens), on top of "
                    "request_floor: a server that answers health checks but never finishes a request costs that "
                    "much, not request_timeout (time a weight sync holds the server paused is not counted)")
    request_floor: float = Field(
        default=60.0, gt=0,
        description="seconds every inference request may take before its per-token allowance: queueing and the "
                    "prompt's prefill")
    request_retries: int = Field(default=5, ge=0, description="retries of a failed inference request")
    resume_deadline: float = Field(
        default=15.0, gt=0, description="seconds a weight sync retries /resume before handing it to a background retrier"
    )
    sync_step_timeout: float = Field(
        default=30.0, gt=0,
        description="seconds each quick step of a weight sync may take on a live server: pause, label, prefix-cache "
                    "reset, resume, probe (a server that stops answering is cut off sooner, after "
                    "server_check_timeout)")
    reload_timeout: float = Field(
        default=600.0, gt=0,
        description="seconds a weight sync's reload (reading the checkpoint into the server) may take: a big model "
                    "from a slow disk takes minutes")
    generation_deadline: float = Field(
        default=300.0, gt=0,
        description="seconds a batch may be stuck (failing builds, no new-enough server) before GET /batch answers 503 with the cause",
    )
    server_check_interval: float = Field(
        default=2.0, gt=0, description="seconds between checks of each inference server's health and weights label "
        "(a server that is down: every 0.25 s)"
    )
    server_check_timeout: float = Field(
        default=10.0, gt=0, description="seconds an inference server has to answer a health check"
    )
    paused_grace: float = Field(
        default=60.0, ge=0,
        description="seconds an inference server may stay paused with no weight sync of this run holding it (a "
                    "trainer pushing its weights itself, an operator) before the sampler takes it out of rotation "
                    "and resumes it")
    claim_ttl: float = Field(default=10.0, gt=0, description="lease on a step being built; a replica takes over after it lapses")
    drain_deadline: float = Field(default=20.0, ge=0, description="seconds a shutdown waits for batches in flight to seal")
    max_body_bytes: int = Field(default=1 << 20, ge=1024, description="larger request bodies are answered 413")
    rollout_log: bool = Field(default=True, description="append every sealed batch to run_dir/rollouts/*.parquet")
    model_name: str | None = Field(default=None, description="model id sent to inference; unset = first of /v1/models")
    adapter_name: str = Field(
        default=DEFAULT_ADAPTER_NAME, min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._-]+$",
        description="in a LoRA run (the trainer publishes adapters), the name each inference server serves the "
        "adapter under, and the `model` of every request once a server has it (shared/adapters.py)")
    eval_examples: int = Field(default=64, ge=1, description="default num_examples for POST /eval")
    # Environment code (docs/environments.md).
    env_workers: int = Field(
        default=4, ge=1, description="worker threads for synchronous environment code (rewards, env turns, tools)"
    )
    env_timeout: float = Field(
        default=60.0, gt=0, description="seconds one environment turn or one reward may take before it counts as failed"
    )
    env_retries: int = Field(
        default=2, ge=0, description="times a trajectory whose environment failed is run again before its group is dropped"
    )
    # verifiers environments (env = verifiers:<taskset-id>; docs/environments.md).
    vf_tokenizer: str | None = Field(
        default=None, description="model directory or hub id whose tokenizer and chat template render verifiers "
                                  "turns; unset = the served model's path (root of /v1/models)")
    vf_renderer: str = Field(
        default="tandem", description="renderer of verifiers turns: tandem (keeps sampled tokens verbatim), a "
                                      "renderers name (auto, qwen3, ...) or custom:<module.Class>")
    vf_client: Literal["in_process", "http"] = Field(
        default="in_process", description="how a verifiers turn's calls inside the sampler are made: in_process "
                                          "(the tandem-chat harness calls the interception server's handler, the "
                                          "training client the generate route's code) or http (the harness POSTs "
                                          "to the interception server, the training client to this sampler's "
                                          "/inference/v1/generate, as clients outside it would)")

    @property
    def self_url(self) -> str:
        """This sampler's own address, as a process on its machine reaches it."""
        return local_url(self.host, self.port)

    @property
    def chunk_dir(self) -> Path:
        """Where chunk files go (batch_store = files)."""
        return self.batch_dir if self.batch_dir is not None else self.run_dir / "batches"

    @property
    def batch_size(self) -> int:
        return contract.batch_size(self.prompts_per_step, self.num_generations)

    @model_validator(mode="after")
    def _check(self) -> SamplerSettings:
        if self.strategy == "on_policy":
            self.on_policy = True
        # From here on max_staleness is the bound in force; on_policy only says how it was asked for.
        self.max_staleness = contract.resolve_max_staleness(self.max_staleness, self.on_policy)
        if not self.inference_urls:
            raise ValueError("inference_urls is empty: give at least one inference server URL")
        for url in self.inference_urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"inference_urls: {url!r} is not an http(s) URL")
        if self.advantage == "rloo" and self.num_generations < 2:
            raise ValueError("advantage=rloo needs num_generations >= 2")
        if self.per_device_batch_size or self.grad_accum_steps or self.world_size:
            contract.check_batch_shape(self.per_device_batch_size or 1, self.grad_accum_steps or 1,
                                       self.world_size or 1, self.prompts_per_step, self.num_generations)
        if self.keep_batches < self.num_iterations:
            raise ValueError(
                f"keep_batches {self.keep_batches} must be >= num_iterations {self.num_iterations}: "
                "a reused batch must outlive its last use"
            )
        if self.curriculum:
            for earlier, later in zip(self.curriculum, self.curriculum[1:]):
                if earlier.until_step is None or (later.until_step is not None and later.until_step <= earlier.until_step):
                    raise ValueError("curriculum stages need increasing until_step; only the last may omit it")
        return self

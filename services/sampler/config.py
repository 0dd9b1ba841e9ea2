"""Sampler settings (DESIGN section 1): one pydantic-settings class."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from shared.settings import CommaList, TandemSettings


class SamplerSettings(TandemSettings):
    """The sampler: generates, scores and seals batches; drives weight sync."""

    section: ClassVar[str] = "sampler"

    port: int = 8100
    redis_url: str | None = Field(
        default=None, description="external Redis; unset starts an embedded redis-server under run_dir"
    )
    namespace: str = Field(default="default", description="run namespace: prefixes every Redis key")
    inference_urls: CommaList = Field(default_factory=lambda: ["http://127.0.0.1:8000"])
    env: str = Field(default="toy", description="environment name or 'package.module:factory'")
    env_args: dict[str, str | int | float | bool] = Field(
        default_factory=dict, description="keyword arguments for the environment (JSON)"
    )
    prompts_per_step: int = Field(default=8, ge=1)
    num_generations: int = Field(default=8, ge=1)
    max_staleness: int = Field(default=1, ge=0)
    on_policy: bool = Field(default=False, description="synchronous on-policy: max_staleness = 0")
    strategy: str = Field(default="off_policy", description="off_policy, on_policy or 'pkg.mod:Class'")
    max_concurrency: int = Field(default=64, ge=1, description="inference requests in flight")
    eval_concurrency: int = Field(default=0, ge=0, description="eval requests in flight; 0 = a quarter of max_concurrency")
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    max_tokens: int = Field(default=16, ge=1)
    seed: int = 0
    advantage: Literal["grpo", "no_std", "rloo"] = Field(
        default="grpo", description="grpo: (r-mean)/std; no_std: r-mean (Dr. GRPO); rloo: leave-one-out"
    )
    api_token: str | None = Field(default=None, description="bearer token for mutating endpoints")
    keep_batches: int = Field(default=8, ge=1, description="sealed batches kept behind the published version")
    max_poll_timeout: float = Field(default=60.0, gt=0, description="upper bound on ?timeout= of long-polls")
    request_timeout: float = Field(default=600.0, gt=0, description="seconds for one inference request")
    request_retries: int = Field(default=5, ge=0, description="retries of a failed inference request")
    resume_deadline: float = Field(
        default=15.0, gt=0, description="seconds a weight sync retries /resume before handing it to a background retrier"
    )
    model_name: str | None = Field(default=None, description="model id sent to inference; unset = first of /v1/models")
    eval_examples: int = Field(default=64, ge=1, description="default num_examples for POST /eval")

    @property
    def staleness(self) -> int:
        """The effective k: 0 when on_policy."""
        return 0 if self.on_policy or self.strategy == "on_policy" else self.max_staleness

    @property
    def batch_size(self) -> int:
        return self.prompts_per_step * self.num_generations

    @model_validator(mode="after")
    def _check(self) -> SamplerSettings:
        if self.strategy == "on_policy":
            self.on_policy = True
        if not self.inference_urls:
            raise ValueError("inference_urls is empty: give at least one inference server URL")
        for url in self.inference_urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"inference_urls: {url!r} is not an http(s) URL")
        if self.advantage != "no_std" and self.advantage == "rloo" and self.num_generations < 2:
            raise ValueError("advantage=rloo needs num_generations >= 2")
        return self

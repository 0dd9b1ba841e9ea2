"""Trainer settings (docs/settings.md, Trainer): one pydantic-settings class, section `[trainer]`.

Importing this module never imports torch: `tandem trainer --help` and invalid settings
answer before the heavy imports. The contract's names (`sampler_url`, `model`,
`per_device_batch_size`, `grad_accum_steps`, `learning_rate`, `max_steps`, `eval_every`,
`api_token`) keep their meaning; everything else is the trainer's own.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from services.trainer.corrections import IS_MODES, Correction
from services.trainer.lora import DEFAULT_TARGET_MODULES, target_module_problem
from shared import contract
from shared.probe import MAX_PROBE_TOKENS
from shared.settings import CommaList
from shared.tracking import TrackingSettings, require_installed

DType = Literal["auto", "float32", "bfloat16", "float16"]
PublishDType = Literal["auto", "float32", "bfloat16", "float16"]
Sharding = Literal["ddp", "fsdp"]
ImportanceLevel = Literal["token", "sequence"]
IsMode = Literal["truncate", "mask", "mask_truncate"]
assert IsMode.__args__ == IS_MODES


class TrainerSettings(TrackingSettings):
    """The GRPO trainer: long-polls /batch, trains, checkpoints, publishes weights."""

    section: ClassVar[str] = "trainer"

    sampler_url: str = Field(default="http://127.0.0.1:8100", description="the sampler's base URL")
    model: str = Field(default="", description="HF model directory to start from (required)")
    api_token: str | None = Field(default=None, description="the run's token, sent as a bearer token with every request to the sampler")

    # Batch shape: per_device_batch_size * grad_accum_steps * world_size must equal the
    # sampler's prompts_per_step * num_generations (checked against GET /status at start-up).
    per_device_batch_size: int = Field(default=8, ge=1, description="samples per micro-batch per rank")
    grad_accum_steps: int = Field(default=8, ge=1, description="micro-batches per optimizer step per rank")
    max_steps: int = Field(default=100, ge=0, description="train until this many optimizer steps exist (absolute, resume-safe)")

    # Optimisation.
    learning_rate: float = Field(default=1e-5, gt=0)
    warmup_steps: int = Field(default=0, ge=0, description="linear learning-rate warm-up from 0")
    weight_decay: float = Field(default=0.0, ge=0)
    adam_beta1: float = Field(default=0.9, ge=0, lt=1)
    adam_beta2: float = Field(default=0.999, ge=0, lt=1)
    adam_eps: float = Field(default=1e-8, gt=0)
    max_grad_norm: float | None = Field(default=1.0, description="gradient clipping; 0 or unset disables")
    num_iterations: int = Field(default=1, ge=1, description="optimisation passes (mu) over each batch")

    # Loss.
    loss: contract.LossName = Field(default="grpo", description="grpo: per-sequence mean; dapo: per-token mean; dr_grpo: sum / constant")
    epsilon_low: float = Field(default=0.2, ge=0, description="lower clip: ratio >= 1 - epsilon_low")
    epsilon_high: float | None = Field(default=None, description="upper clip: ratio <= 1 + epsilon_high; unset = epsilon_low")
    tis_cap: float | None = Field(
        default=2.0,
        description="truncated importance sampling cap on pi_old/pi_behaviour; 0 or unset disables "
        "(the clipped ratio is then taken against the behaviour logprobs)",
    )
    beta: float = Field(default=0.0, ge=0, description="KL coefficient to the frozen initial model (k3); 0 disables")
    importance_sampling_level: ImportanceLevel = Field(
        default="token",
        description="token: one ratio and one truncated IS weight per token; sequence: one per completion, "
        "the geometric mean over its loss tokens (GSPO-style), the same for every token of it",
    )
    # Off-policy corrections (docs/corrections.md).
    is_mode: IsMode = Field(
        default="truncate",
        description="what is done with the importance weight pi_old/pi_behaviour: truncate (at tis_cap); "
        "mask (tokens whose weight is outside [is_low, is_high] carry no loss, IcePop-style; the rest keep "
        "their untruncated weight); mask_truncate (the same band, kept weights truncated at tis_cap)",
    )
    is_low: float = Field(default=0.5, gt=0, description="mask modes: lower end of the kept band of pi_old/pi_behaviour")
    is_high: float = Field(default=5.0, gt=0, description="mask modes: upper end of the kept band of pi_old/pi_behaviour")
    seq_reject_low: float | None = Field(
        default=None, description="a completion whose geometric-mean pi_old/pi_behaviour over its loss tokens is "
        "below this (in (0, 1)) carries no loss; unset = no lower bound",
    )
    seq_reject_high: float | None = Field(
        default=None, description="a completion whose geometric-mean pi_old/pi_behaviour over its loss tokens is "
        "above this (> 1) carries no loss; unset = no upper bound",
    )
    mask_truncated_completions: bool = Field(
        default=False, description="samples that stopped for lack of room (finish_reason length: the context "
        "full, or the last reply cut at max_tokens with nothing else ending the episode) carry no loss"
    )
    temperature: float | None = Field(
        default=None, description="sampling temperature; unset = the sampler's (from GET /status). Must match it."
    )
    max_completion_length: int | None = Field(
        default=None, ge=1, description="Dr. GRPO's constant normaliser; unset = the sampler's max_tokens"
    )

    # Runtime.
    dtype: DType = Field(
        default="auto",
        description="compute dtype: auto = bfloat16 on CUDA, float32 on CPU. Parameters, gradients and AdamW "
        "state stay float32 (master weights); bfloat16/float16 run the forward and backward under autocast",
    )
    publish_dtype: PublishDType = Field(
        default="auto", description="dtype of the weights published to inference; auto = the compute dtype"
    )
    sharding: Sharding = Field(
        default="ddp",
        description="with several ranks (torchrun): ddp = every rank holds the full model, gradients summed; "
        "fsdp = parameters, gradients and optimizer state sharded over the ranks (FSDP2 fully_shard)",
    )
    logprob_chunk_size: int = Field(
        default=1024, ge=1,
        description="token positions per chunk of the float32 log-softmax; bounds its memory to "
        "chunk x vocabulary floats instead of the whole micro-batch's logits",
    )
    device: str = Field(default="auto", description="auto, cpu, cuda, cuda:N (under torchrun: the local rank's GPU)")
    seed: int = 0
    gradient_checkpointing: bool = False

    # LoRA (services/trainer/lora.py): a frozen base and a trained adapter, published alone.
    lora_rank: int = Field(
        default=0, ge=0,
        description="LoRA rank; 0 = off (the full model trains). > 0: the base model is frozen, a LoRA adapter "
        "of this rank trains, and every version is published as the adapter alone (PEFT format)",
    )
    lora_alpha: int | None = Field(
        default=None, ge=1,
        description="LoRA scaling numerator: the adapter adds (alpha / rank) x B A; unset = 2 x lora_rank",
    )
    lora_dropout: float = Field(
        default=0.0, ge=0, lt=1,
        description="dropout on the adapter's input in training forwards; > 0 runs them in train mode, so pi_old "
        "and behaviour_mismatch carry its noise",
    )
    lora_target_modules: CommaList = Field(
        default=list(DEFAULT_TARGET_MODULES),
        description="the linear layers that get an adapter (names or name suffixes), or all-linear (every one but "
        "the output layer); lm_head and the embeddings are refused: vLLM does not serve LoRA on them",
    )

    # Checkpoints, evals, observability.
    publish_dir: str | None = Field(
        default=None,
        description="where each step's weights are published for inference (unset: run_dir/published); "
        "a RAM disk such as /dev/shm/<run> saves disk writes. Inference servers must be able to read it",
    )
    keep_published: int = Field(default=2, ge=1, description="how many published weight versions to keep on disk "
                                "(and the chain of deltas each needs: a delta is kept with the versions it builds on)")
    full_every: int = Field(
        default=10, ge=1, le=1000,
        description="publish a full version every N versions and the others as deltas on the one before "
        "(only the values that changed, in publish_dtype); 1: every version whole. A LoRA adapter is always whole",
    )
    publish_in_background: bool = Field(
        default=True,
        description="write, probe and announce each version while the next step trains; False: wait for each "
        "publication before the next step, as the trainer did before issue 40 (for comparison and debugging: bench overlap)",
    )
    checkpoint_every: int = Field(
        default=10, ge=1,
        description="write a full checkpoint (weights + optimizer state, what a resume starts from) every N steps "
        "and after the last step",
    )
    keep_checkpoints: int = Field(default=2, ge=1, description="how many full step-N checkpoints to keep")
    save_optimizer: bool = Field(default=True, description="save AdamW state with each full checkpoint (exact resume)")
    resume: bool = Field(default=True, description="continue from the latest checkpoint in run_dir/checkpoints")
    eval_every: int = Field(default=0, ge=0, description="start an eval every N steps (0: only before and after)")
    eval_at_start: bool = True
    eval_at_end: bool = True
    eval_examples: int | None = Field(default=None, ge=1, description="examples per eval; unset = the sampler's default")
    eval_timeout: float = Field(default=1800.0, gt=0, description="seconds to wait for one eval result")
    batch_timeout: float | None = Field(
        default=None, gt=0,
        description="give up when one batch takes longer than this many seconds in all, even while generation "
        "progresses (unset: no such bound; a stuck sampler is bounded by retry_for)",
    )
    poll_timeout: float = Field(default=30.0, gt=0, description="seconds per /batch long-poll request")
    retry_for: float = Field(
        default=900.0, gt=0,
        description="seconds to keep retrying a sampler that cannot be reached or answers 5xx, at start-up and "
        "during the run (e.g. its 503 once generation has been stuck for its generation_deadline: every inference "
        "server down or still starting) before giving up; 900 = 15 minutes, room for a vLLM start-up",
    )
    wait_log_interval: float = Field(
        default=30.0, gt=0, description="seconds between two log lines about one wait on the sampler"
    )
    tensorboard: bool = Field(
        default=False, description="the same as adding tensorboard to report_to (kept for older configs)"
    )
    progress: bool = Field(default=True, description="show a progress display on rank 0")

    # Trainer and inference computing the same numbers (services/trainer/probe.py, mismatch.py).
    probe_tokens: int = Field(
        default=64, ge=0, le=MAX_PROBE_TOKENS,
        description="tokens of the step's first sample whose logprobs are sent with each published checkpoint, "
        "so the sampler can check every inference server computes them too; 0 disables the probe",
    )
    max_behaviour_mismatch: float = Field(
        default=0.2, ge=0,
        description="nats: warn when behaviour_mismatch (mean |trainer logprob - sampler logprob| of the sampled "
        "tokens) exceeds it, stop after behaviour_mismatch_patience such steps in a row; 0 disables",
    )
    behaviour_mismatch_patience: int = Field(
        default=5, ge=1, description="consecutive steps above max_behaviour_mismatch before the run stops"
    )

    @field_validator("max_grad_norm", "tis_cap")
    @classmethod
    def _zero_disables(cls, value: float | None) -> float | None:
        if value is not None and value < 0:
            raise ValueError("must be >= 0 (0 disables)")
        return value or None

    @model_validator(mode="after")
    def _check(self) -> TrainerSettings:
        if not self.model:
            raise ValueError("model is required: an HF model directory (e.g. from `tandem init-model --preset tiny`)")
        if self.temperature is not None and self.temperature <= 0:
            raise ValueError(
                "temperature must be > 0: training needs the sampling distribution's logprobs, "
                "and greedy decoding (temperature 0) has none"
            )
        if self.probe_tokens == 1:
            raise ValueError("probe_tokens must be 0 (no probe) or >= 2: a probe compares the logprobs of the "
                             "tokens after the first")
        self.correction()  # the band and rejection checks, with their messages
        self._check_lora()
        if self.tensorboard and "tensorboard" not in self.report_to:
            require_installed(["tensorboard"], what="tensorboard = true")
            self.report_to = [*self.report_to, "tensorboard"]
        if not self.sampler_url.startswith(("http://", "https://")):
            raise ValueError(f"sampler_url {self.sampler_url!r} is not an http(s) URL")
        return self

    def _check_lora(self) -> None:
        if not self.lora_rank:
            given = sorted({"lora_alpha", "lora_dropout", "lora_target_modules"} & self.model_fields_set)
            if given:
                raise ValueError(f"{', '.join(given)} set but lora_rank is 0 (LoRA off): set lora_rank > 0 to train "
                                 "an adapter, or drop them")
            return
        problem = target_module_problem(self.lora_target_modules)
        if problem:
            raise ValueError(problem)

    def correction(self) -> Correction:
        """The corrections as the loss applies them; raises ValueError with what to fix."""
        return Correction.of(self)

    @property
    def clip_high(self) -> float:
        return self.epsilon_low if self.epsilon_high is None else self.epsilon_high

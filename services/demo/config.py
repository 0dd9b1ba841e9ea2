"""Demo settings (docs/settings.md, Demo): one pydantic-settings class, section `[demo]`.

The contract's names `steps`, `max_staleness`, `on_policy`, `seed` and `run_dir` keep the
meaning docs/settings.md gives them; the rest are the knobs the demo passes on to its children
as flags.
The defaults are tuned so that `tandem demo` on a 2-core CPU takes the toy task from a
greedy eval reward near 0 to near 1 within a few minutes (docs/demo.md).

Importing this module never imports torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from shared import contract
from shared.settings import CommaList, EnvArgs
from shared.tracking import TrackingSettings


# Steps that take each built-in task from a greedy eval near 0 to near 1 on a 2-core CPU, with
# margin (docs/demo.md): parity_dialogue reaches >= 0.95 by step 70-80 on seeds 0-4
# (bench/results/convergence_dialogue.md).
STEPS_BY_ENV = {"toy": 150, "parity_dialogue": 250}

# The toy task's learning rates: full fine-tuning, and a LoRA adapter
# (bench/results/convergence_lora.md). An adapter trains the `tiny-lora` preset by default
# (LORA_PRESET, docs/lora.md): on `tiny` its frozen tied head lets no token past ~3.5%, so the
# sampled reward stayed near 0.03 whatever the adapter learnt. On `tiny-lora` the head is sharp
# enough that 5e-3 moved the policy 0.26-0.46 nats a step and the trainer stopped on
# max_behaviour_mismatch within 15 steps; 2e-3 does not.
FULL_LEARNING_RATE = 1e-3
LORA_LEARNING_RATE = 2e-3
# Seeds 0-4 first reach greedy eval 0.95 at versions 90-140 (bench/results/convergence_lora.md);
# 300 steps leave margin and took 60-114 s on 2 shared cores.
LORA_STEPS_BY_ENV = {"toy": 300}
LORA_PRESET = "tiny-lora"
DEFAULT_PRESET = "tiny"
# The demo's adapter goes on the MLP projections only. One GRPO step that raises the answer
# letter on even numbers raised it on odd numbers too, by this fraction of its gain (`tiny-lora`,
# seeds 0-2, docs/lora.md): 0.85-1.03 through attention adapters (attention averages over the
# prompt text every number shares, so they learn "say e" everywhere), 0.04-0.14 through MLP ones
# (they read the last digit at its own position). With every projection adapted the sampled
# policy collapsed onto one letter on 5 of 5 seeds; with the MLP alone on 1 of 5 (seed 0).
LORA_TARGET_MODULES = ("gate_proj", "up_proj", "down_proj")
# And a KL term to the starting model (the trainer's beta, k3). On an odd prompt whose 16
# samples all say the wrong letter GRPO has no signal, so a letter that spread from even numbers
# stays; the KL term still pushes every sampled token back towards the base, where the letters
# are ~1% each. Seed 0 collapsed onto "e" (eval 0.53) at beta 0 with every other setting tried,
# and reached eval 1.0 by step 110-120 at 0.04 and 0.1 (docs/lora.md). The trl trainer keeps 0.
LORA_BETA = 0.04

# The native trainer's settings the demo derives from its own (Demo._trainer_argv); trainer_args
# may not override them.
TRAINER_FLAGS_SET_BY_DEMO = frozenset({
    "model", "sampler_url", "run_dir", "per_device_batch_size", "grad_accum_steps", "max_steps",
    "learning_rate", "loss", "eval_every", "eval_examples", "seed", "progress", "log_level", "api_token",
    "lora_rank", "lora_target_modules", "beta", "report_to", "run_name", "wandb_project", "tensorboard_dir", "tensorboard"})


class DemoSettings(TrackingSettings):
    """The whole stack on one machine: a fresh model, CPU inference, sampler and trainer."""

    section: ClassVar[str] = "demo"

    run_dir: Path = Field(default=Path("runs/demo"), description="model, logs, checkpoints, summary.json")
    port: int = Field(default=0, ge=0, le=65535, description="the sampler's (and dashboard's) port; 0 = a free port")
    inference_port: int = Field(default=0, ge=0, le=65535, description="the inference server's port; 0 = a free port")
    api_token: str | None = Field(
        default=None, description="the run's token, for every service the demo starts (TANDEM_API_TOKEN); unset = "
        "a fresh random one each run")
    backend: Literal["cpu", "vllm"] = Field(
        default="cpu", description="inference server: cpu = Tandem's CPU server; vllm = real vLLM from .venv-vllm "
        "(`make vllm`, docs/vllm.md)")

    # What to train.
    steps: int | None = Field(default=None, ge=1, description="optimizer steps; unset = the environment's "
                              "(STEPS_BY_ENV: toy 150, parity_dialogue 250; toy with lora_rank 300), else 150")
    max_staleness: int = Field(
        default=1, ge=0, description="batch N may hold fresh samples from weights of version >= N - max_staleness"
    )
    on_policy: bool = Field(default=False, description="synchronous on-policy training: shorthand for max_staleness = 0")
    seed: int = Field(default=0, description="model initialisation, sampling and trainer seed")
    env: str = Field(default="toy", description="sampler environment (toy, parity_dialogue, math, calculator, ...)")
    env_args: EnvArgs = Field(
        default_factory=dict, description='keyword arguments for the environment (JSON), e.g. {"turns": 4}'
    )
    model: str | None = Field(default=None, description="start from this HF model directory instead of a fresh preset")
    preset: str | None = Field(
        default=None, description=f"init-model preset for the fresh model; unset = {DEFAULT_PRESET}, or "
        f"{LORA_PRESET} with lora_rank (an untied, larger head and embedding: docs/lora.md)")

    # Batch shape: prompts_per_step * num_generations samples per step, trained in one
    # micro-batch per `micro_batch_size` samples. 16 generations, not 8: a GRPO group whose
    # samples all give the same answer has no signal, and with 8 the policy sometimes
    # collapses to one letter for every prompt and stays there (reward 0.5, seen for 200
    # steps); with 16 an odd prompt's group still contains the rare right letter.
    prompts_per_step: int = Field(default=8, ge=1)
    num_generations: int = Field(default=16, ge=1)
    micro_batch_size: int | None = Field(
        default=None, ge=1, description="trainer per_device_batch_size; unset = the whole batch in one micro-batch"
    )
    temperature: float = Field(default=1.0, gt=0)
    max_tokens: int | None = Field(default=None, ge=1, description="per model turn; unset = the environment's default")
    learning_rate: float | None = Field(
        default=None, gt=0, description=f"unset = {FULL_LEARNING_RATE:g}, or {LORA_LEARNING_RATE:g} with lora_rank "
        "(an adapter needs a larger step than full fine-tuning)")
    lora_rank: int = Field(
        default=0, ge=0, le=256, description="train a LoRA adapter of this rank instead of every weight (docs/lora.md); "
        "0 = full fine-tuning")
    lora_target_modules: CommaList | None = Field(
        default=None, description=f"the layers that get the adapter (the trainer's lora_target_modules); unset = "
        f"{','.join(LORA_TARGET_MODULES)} (docs/lora.md)")
    beta: float | None = Field(
        default=None, ge=0, description=f"KL coefficient to the starting model (the native trainer's beta); unset = "
        f"0, or {LORA_BETA:g} with lora_rank (docs/lora.md)")
    loss: contract.LossName = "grpo"
    trainer: Literal["native", "trl"] = Field(
        default="native", description="native = Tandem's trainer (`tandem trainer`); trl = TRL's GRPOTrainer fed by "
        "the sampler (examples/trl_grpo.py, docs/trl.md; needs the trl extra, which `make install` installs)")
    eval_every: int = Field(default=10, ge=0, description="greedy eval every N steps (0: only before and after)")
    eval_examples: int = Field(default=64, ge=1)
    trainer_args: EnvArgs = Field(
        default_factory=dict, description="more settings for the native trainer (JSON, `tandem trainer` field "
        'names), passed on as its flags, e.g. {"tis_cap": 0, "max_behaviour_mismatch": 0}; not the ones the '
        "demo sets itself (batch shape, steps, learning rate, loss, evals, seed, URLs, run_dir)")

    # Processes.
    torch_threads: int = Field(
        default=1, ge=1, description="torch threads per child: inference and trainer overlap, so one core each"
    )
    preload: bool = Field(
        default=True, description="import torch and transformers once, in the demo, and fork the CPU inference "
        "server and the native trainer from it (services/demo/forking.py): each would otherwise spend ~4.5 s of CPU "
        "importing them; --no-preload starts them as fresh interpreters")
    startup_timeout: float = Field(
        default=180.0, gt=0,
        description="seconds each child may take to answer /health (vLLM gets at least 600: it compiles on first start)")
    timeout: float = Field(default=1800.0, gt=0, description="seconds the training may take before the demo gives up")
    stop_timeout: float = Field(default=20.0, gt=0, description="seconds a child gets after SIGTERM before SIGKILL")
    progress: bool = Field(default=True, description="live progress display (plain lines when not a terminal)")

    @property
    def batch_size(self) -> int:
        return contract.batch_size(self.prompts_per_step, self.num_generations)

    @property
    def per_device_batch_size(self) -> int:
        return self.micro_batch_size or self.batch_size

    @property
    def grad_accum_steps(self) -> int:
        return self.batch_size // self.per_device_batch_size

    @model_validator(mode="after")
    def _check(self) -> DemoSettings:
        if self.steps is None:
            self.steps = (LORA_STEPS_BY_ENV.get(self.env) if self.lora_rank else None) or STEPS_BY_ENV.get(self.env, 150)
        if self.preset is None:
            self.preset = LORA_PRESET if self.lora_rank else DEFAULT_PRESET
        if self.lora_target_modules is None and self.lora_rank:
            self.lora_target_modules = list(LORA_TARGET_MODULES)
        if self.lora_target_modules is not None and not self.lora_rank:
            raise ValueError("lora_target_modules set but lora_rank is 0 (LoRA off): set lora_rank > 0")
        if self.beta is None:
            self.beta = LORA_BETA if self.lora_rank and self.trainer == "native" else 0.0
        elif self.beta and self.trainer != "native":
            raise ValueError("beta is the native trainer's KL term; the trl trainer runs with beta 0")
        if self.learning_rate is None:
            self.learning_rate = LORA_LEARNING_RATE if self.lora_rank else FULL_LEARNING_RATE
        self.max_staleness = contract.resolve_max_staleness(self.max_staleness, self.on_policy)
        if self.batch_size % self.per_device_batch_size:
            raise ValueError(
                f"micro_batch_size {self.micro_batch_size} does not divide the batch: prompts_per_step "
                f"({self.prompts_per_step}) x num_generations ({self.num_generations}) = {self.batch_size}"
            )
        from services.inference.init_model import PRESETS  # stdlib-only at import time

        if self.model is None and self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of {sorted(PRESETS)}")
        if self.trainer == "trl":
            import importlib.util

            if importlib.util.find_spec("trl") is None:
                raise ValueError("trainer = trl needs TRL: pip install -e '.[trl]' (make install does)")
        if self.trainer_args:
            if self.trainer != "native":
                raise ValueError("trainer_args is for the native trainer (--trainer native)")
            clash = sorted(set(self.trainer_args) & TRAINER_FLAGS_SET_BY_DEMO)
            if clash:
                raise ValueError(f"trainer_args {clash}: the demo sets these itself; use the demo's own settings")
        if self.port and self.port == self.inference_port:
            raise ValueError(f"port and inference_port are both {self.port}; give them different ports (or 0)")
        return self

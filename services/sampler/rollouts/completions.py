"""vLLM `/v1/completions` answers -> `Completion`s: the one place token ids, logprobs and
weight versions enter the sampler.

Non-finite numbers never travel: a token whose behaviour logprob the server sent as null,
NaN or infinite is masked out of the loss (`loss_mask` 0, stored logprob 0.0) here.
"""

from __future__ import annotations

import math
from typing import Any

from services.sampler.rollouts.envs.base import Completion
from services.sampler.fleet.inference_pool import InferenceRequestError, WentBackwards

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def _label_version(label: Any) -> int | None:
    """A `weight_versions` span label as an int, or None when it is not an integer label."""
    if type(label) is int:
        return label
    if type(label) is str:
        version = _LABELS.get(label)
        if version is None and label not in _LABELS:
            version = _LABELS[label] = int(label) if label.lstrip("-").isdigit() else None
            if len(_LABELS) > 4096:  # labels are weight versions: few, but never grow without bound
                _LABELS.clear()
        return version
    return int(label) if str(label).lstrip("-").isdigit() else None


_LABELS: dict[str, int | None] = {}


def _versions(spans: list[dict[str, Any]]) -> list[int] | None:
    """The distinct versions of `weight_versions` spans, ascending; None when a span's label
    is not an integer version (vLLM's "default": a server nobody has labelled since it started)."""
    if len(spans) == 1:
        version = _label_version(spans[0].get("version", ""))
        return None if version is None else [version]
    versions = {_label_version(span.get("version", "")) for span in spans}
    return None if None in versions else sorted(versions)  # type: ignore[type-var]


def token_versions(spans: list[dict[str, Any]] | None, served_version: int | None) -> list[int]:
    """The versions that produced an answer's tokens: its `weight_versions` spans, else the
    version the server served when the request was sent. `WentBackwards` when the spans are
    older than that, or unlabelled: the server restarted or lost its weights."""
    if not spans:
        return [served_version] if served_version is not None else []
    versions = _versions(spans)
    if served_version is not None and (versions is None or versions[0] < served_version):
        labels = sorted({str(span.get("version")) for span in spans})
        raise WentBackwards(
            f"answered with weights labelled {', '.join(labels)} although it served version "
            f"{served_version} when the request was sent: it restarted or lost its weights"
        )
    return versions or []


def _masked_logprobs(logprobs: list[Any]) -> tuple[list[float], list[int] | None]:
    """Logprobs with each null or non-finite one replaced by 0.0, and the loss mask that
    leaves those tokens out (None when every one is finite)."""
    floats, mask = [], []
    for x in logprobs:
        value = None if x is None else float(x)
        if value is not None and math.isfinite(value):
            floats.append(value)
            mask.append(1)
        else:
            floats.append(0.0)
            mask.append(0)
    return floats, (mask if 0 in mask else None)


def parse_completions(body: dict[str, Any], served_version: int | None) -> list[Completion]:
    """vLLM /v1/completions JSON -> Completions (needs return_token_ids and logprobs).

    A token whose logprob is null, NaN or infinite gets `loss_mask` 0 and logprob 0.0: the
    trainer never learns from a behaviour probability nobody reported (vLLM writes -inf as
    the finite -9999.0, which passes). `loss_mask` stays None when every logprob is finite.

    `served_version` is the version the server served when the request was sent: the oldest
    that can have produced a token. Where the answer has `weight_versions` spans (vLLM >= 0.33
    with return_weight_versions) those say which versions produced the tokens; where it has
    none (vLLM 0.32), every token is stamped with `served_version`, never with a version the
    server reached later (a request paused with `keep` across a weight update finishes on
    newer weights, but its first tokens came from the older ones). Spans older than
    `served_version`, or unlabelled, mean the server lost its weights: `WentBackwards`."""
    out = []
    for choice in sorted(body.get("choices", []), key=lambda c: c.get("index", 0)):
        token_ids = choice.get("token_ids")
        prompt_ids = choice.get("prompt_token_ids") or body.get("prompt_token_ids")
        if token_ids is None or prompt_ids is None:
            raise InferenceRequestError(
                "inference answer lacks token ids: the server must support return_token_ids (vLLM >= 0.10)"
            )
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        if logprobs is None or len(logprobs) != len(token_ids):
            raise InferenceRequestError(
                f"inference answer has {0 if logprobs is None else len(logprobs)} logprobs "
                f"for {len(token_ids)} tokens: the server must honour logprobs=0"
            )
        versions = token_versions(choice.get("weight_versions"), served_version)
        mask = None
        try:
            floats = list(map(float, logprobs))
        except TypeError:  # a null logprob among them
            floats, mask = _masked_logprobs(logprobs)
        else:
            # One sum finds a NaN or inf among them (or an overflow, which the exact pass clears).
            if not math.isfinite(sum(floats)):
                floats, mask = _masked_logprobs(floats)
        out.append(Completion(
            text=choice.get("text", ""),
            prompt_token_ids=list(prompt_ids),
            token_ids=list(token_ids),
            logprobs=floats,
            finish_reason=_FINISH.get(choice.get("finish_reason") or "stop", "stop"),
            versions=versions,
            loss_mask=mask,
        ))
    return out


def _sentinel(value: Any) -> bool:
    """A logprob that reports nothing: null, NaN, infinite, or vLLM's clamp floor -9999.0 (what
    its generate endpoint writes for a sampled token without a logprob)."""
    if type(value) not in (int, float):
        return True
    return not math.isfinite(value) or value <= VLLM_LOGPROB_FLOOR


VLLM_LOGPROB_FLOOR = -9999.0


def parse_generate(body: dict[str, Any], served_version: int | None) -> tuple[dict[str, Any], list[int], list[int]]:
    """A `POST /inference/v1/generate` answer (vLLM 0.32/0.33 tokens mode, or ours) ->
    (the answer as the sampler serves it, the weight versions of its tokens, the positions of
    its tokens that carry no logprob).

    The rules are those of `parse_completions`: weight versions from `weight_versions` spans,
    else the version served when the request was sent, and `WentBackwards` for spans older
    than that. A token whose logprob is missing or a sentinel is served with logprob 0.0 and
    its position returned, so the trajectory's sample masks it out of the loss: `renderers`
    (verifiers' client) refuses a -9999.0, and the trainer must never learn from it. Each
    logprob entry is served with both vLLM's integer `token_id` and the `token: "token_id:N"`
    string `renderers` 0.1.12 checks."""
    choices = body.get("choices") or []
    if len(choices) != 1:
        raise InferenceRequestError(f"inference answer has {len(choices)} choices for n=1")
    choice = dict(choices[0])
    token_ids = choice.get("token_ids")
    if token_ids is None:
        raise InferenceRequestError("inference answer lacks choices[0].token_ids")
    entries = ((choice.get("logprobs") or {}).get("content")) or []
    if len(entries) != len(token_ids):
        raise InferenceRequestError(f"inference answer has {len(entries)} logprobs for {len(token_ids)} tokens: "
                                    "the request must ask for sampling_params.logprobs")
    versions = token_versions(choice.get("weight_versions"), served_version)
    masked: list[int] = []
    content = []
    for i, (token, entry) in enumerate(zip(token_ids, entries)):
        value = entry.get("logprob")
        if _sentinel(value):
            masked.append(i)
            value = 0.0
        content.append({**entry, "token_id": token, "token": f"token_id:{token}", "logprob": float(value)})
    choice["logprobs"] = {"content": content}
    return {**body, "choices": [choice]}, versions, masked

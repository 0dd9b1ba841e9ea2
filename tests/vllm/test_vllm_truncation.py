"""Truncated sampling through real vLLM: the logprobs vLLM reports with top_k / top_p / min_p
(`--logprobs-mode processed_logprobs`, renormalised over what its sampler kept) are the ones
the trainer computes with the same truncation (shared/truncation.py via loss.py), and not the
full distribution's.

A position whose truncated set hangs on a difference smaller than the two engines' numerical
noise (a cumulative probability within DELTA of top_p, two logits within DELTA at the k-th
place, a probability within DELTA of the min_p threshold) may legitimately come out either way;
those positions are counted and left out, and they must stay few."""

from __future__ import annotations

import math

import httpx
import pytest
import torch

from services.trainer.logprobs import token_logprobs, truncated_token_logprobs
from shared.contract import Truncation
from tests.support.vllm import VllmHandle, sync_weights

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(420)]

PROMPT = [5, 17, 42, 8, 33, 60, 12, 9]
TEMPERATURE = 0.8
TRUNCATION = Truncation(top_k=40, top_p=0.7, min_p=0.05)
DELTA = 1e-4


def _ambiguous(z: torch.Tensor, truncation: Truncation) -> torch.Tensor:
    """[N] bool: positions (rows of temperature-scaled logits z [N, V], float64) whose truncated
    set changes under a perturbation of about DELTA."""
    ambiguous = torch.zeros(z.shape[0], dtype=torch.bool)
    threshold = z.amax(-1, keepdim=True) + math.log(truncation.min_p)
    ambiguous |= ((z - threshold).abs() < DELTA).any(-1)
    z = z.masked_fill(z < threshold, float("-inf"))
    ordered = z.sort(-1, descending=True).values
    k = truncation.top_k
    ambiguous |= (ordered[:, k - 1] - ordered[:, k]).abs() < DELTA
    ordered[:, k:] = float("-inf")
    probs = torch.softmax(ordered, -1)
    before = probs.cumsum(-1) - probs
    ambiguous |= ((before - truncation.top_p).abs() < DELTA).any(-1)
    return ambiguous


def test_vllms_truncated_logprobs_are_the_trainers(vllm_server: VllmHandle) -> None:
    from transformers import AutoModelForCausalLM

    sync_weights(vllm_server.url, vllm_server.model_dir, "0")
    body = {"model": vllm_server.served_model_name, "prompt": PROMPT, "n": 16, "max_tokens": 12,
            "temperature": TEMPERATURE, "top_k": TRUNCATION.top_k, "top_p": TRUNCATION.top_p,
            "min_p": TRUNCATION.min_p, "seed": 3, "logprobs": 0, "ignore_eos": True, "return_token_ids": True}
    response = httpx.post(vllm_server.url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]

    model = AutoModelForCausalLM.from_pretrained(str(vllm_server.model_dir), dtype=torch.float32)
    completions = torch.tensor([c["token_ids"] for c in choices])
    vllm_logprobs = torch.tensor([c["logprobs"]["token_logprobs"] for c in choices], dtype=torch.float64)
    ids = torch.cat([torch.tensor(PROMPT).expand(len(choices), -1), completions], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, len(PROMPT) - 1 : -1]
    ours, outside = truncated_token_logprobs(logits, completions, TEMPERATURE, truncation=TRUNCATION)
    full = token_logprobs(logits, completions, TEMPERATURE)

    ambiguous = _ambiguous((logits.double() / TEMPERATURE).reshape(-1, logits.shape[-1]), TRUNCATION)
    ambiguous = ambiguous.view(completions.shape)
    compared = ~ambiguous
    diff = (ours.double() - vllm_logprobs).abs()
    print(f"{int(compared.sum())} of {compared.numel()} positions compared; max |ours - vLLM| "
          f"{float(diff[compared].max()):.2g}; full distribution off by {float((full.double() - vllm_logprobs).abs().mean()):.2g} on average")
    assert int(compared.sum()) >= 0.8 * compared.numel(), "too many positions on a truncation boundary"
    assert not outside[compared].any(), "vLLM sampled a token the trainer's truncation excludes"
    assert float(diff[compared].max()) < 1e-3
    # The settings bite: scoring the full distribution would be clearly off.
    assert float((full.double() - vllm_logprobs).abs()[compared].mean()) > 0.05

"""shared/truncation.py against a plain, per-row transcription of vLLM 0.32's sampler
(vllm/v1/sample: MinPLogitsProcessor.apply, then apply_top_k_top_p_pytorch): min_p on the
probabilities, top_k keeping ties at the k-th logit, top_p on an ascending sort dropping
tokens whose cumulative probability is <= 1 - p, the most likely token always kept."""

from __future__ import annotations

import math

import pytest
import torch

from shared import truncation
from shared.truncation import truncate_


def _vllm_row(z: list[float], top_k: int, top_p: float, min_p: float) -> set[int]:
    """The token ids vLLM can sample for one row of temperature-scaled logits."""
    alive = list(range(len(z)))
    if min_p > 0:
        zmax = max(z)
        total = sum(math.exp(v - zmax) for v in z)
        probs = [math.exp(v - zmax) / total for v in z]
        alive = [i for i in alive if probs[i] >= min_p * max(probs)]
    if top_k > 0:
        kth = sorted((z[i] for i in alive), reverse=True)[min(top_k, len(alive)) - 1]
        alive = [i for i in alive if z[i] >= kth]
    if top_p < 1.0:
        zmax = max(z[i] for i in alive)
        total = sum(math.exp(z[i] - zmax) for i in alive)
        ascending = sorted(alive, key=lambda i: z[i])
        cumulative, keep = 0.0, set()
        for rank, i in enumerate(ascending):
            cumulative += math.exp(z[i] - zmax) / total
            if cumulative > 1 - top_p or rank == len(ascending) - 1:
                keep.add(i)
        alive = [i for i in alive if i in keep]
    return set(alive)


def _kept(z: torch.Tensor, *settings) -> list[set[int]]:
    x = z.clone()
    dropped = truncate_(x, *settings)
    assert torch.equal(dropped, x.isinf()), "the mask returned is the one applied"
    assert torch.equal(x[~dropped], z[~dropped]), "kept logits are untouched"
    return [set(torch.nonzero(~row).flatten().tolist()) for row in dropped]


def _logits(rows: int = 16, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 2


@pytest.mark.parametrize("top_k, top_p, min_p", [
    (5, 1.0, 0.0), (0, 0.9, 0.0), (0, 0.5, 0.0), (0, 1.0, 0.1), (8, 0.8, 0.0), (20, 0.95, 0.05), (1, 0.3, 0.2),
    (0, 1.0, 0.0), (100, 1.0, 0.0),
])
def test_the_kept_sets_are_vllms(top_k: int, top_p: float, min_p: float) -> None:
    z = _logits()
    got = _kept(z, top_k, top_p, min_p)
    want = [_vllm_row(row.tolist(), top_k, top_p, min_p) for row in z]
    assert got == want
    if (top_k, top_p, min_p) == (0, 1.0, 0.0):
        assert all(len(kept) == z.shape[1] for kept in got)
    elif top_k != 100:
        assert all(len(kept) < z.shape[1] for kept in got), "the settings truncate something"


def test_per_row_settings_as_the_cpu_server_passes_them() -> None:
    z = _logits(rows=4)
    k, p, m = torch.tensor([0, 3, 0, 10]), torch.tensor([1.0, 1.0, 0.7, 0.9]), torch.tensor([0.0, 0.0, 0.0, 0.1])
    got = _kept(z, k, p, m)
    assert got == [_vllm_row(z[i].tolist(), int(k[i]), float(p[i]), float(m[i])) for i in range(4)]
    assert len(got[0]) == z.shape[1] and len(got[1]) == 3


def test_ties_at_the_kth_logit_stay() -> None:
    z = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0]])
    assert _kept(z, 2, 1.0, 0.0) == [{0, 1, 2, 3}]


def test_the_most_likely_token_always_stays_and_ties_at_the_cut_stay_too() -> None:
    z = torch.tensor([[9.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    first, tied = _kept(z, 0, 0.01, 0.0)
    assert first == {0}
    # vLLM keeps one of three equal tokens, whichever its sort puts last; the set is
    # z >= the cut here, so all three (an engine's sort order cannot be reproduced anyway).
    assert tied == {0, 1, 2}
    assert _kept(torch.tensor([[2.0, 1.0, 1.0, 0.0]]), 0, 0.75, 0.0) == [{0, 1, 2}]


def test_a_row_whose_nucleus_is_beyond_the_candidates_is_sorted_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    z = _logits(rows=6, vocab=200) * 0.1  # nearly flat: top_p 0.9 keeps ~180 tokens
    want = [_vllm_row(row.tolist(), 0, 0.9, 0.0) for row in z]
    monkeypatch.setattr(truncation, "CANDIDATES", 16)
    assert _kept(z, 0, 0.9, 0.0) == want
    assert _kept(z, 0, 0.05, 0.0) == [_vllm_row(row.tolist(), 0, 0.05, 0.0) for row in z]  # within 16
    assert all(len(kept) > 16 for kept in want)


def test_rows_sorted_in_slices_give_the_same_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    z = _logits(rows=9, vocab=40)
    whole = _kept(z, 6, 0.8, 0.02)
    monkeypatch.setattr(truncation, "SORT_ELEMENTS", 2 * 40)  # two rows per slice
    monkeypatch.setattr(truncation, "CANDIDATES", 8)
    assert _kept(z, 6, 0.8, 0.02) == whole

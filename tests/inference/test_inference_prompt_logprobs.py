"""`prompt_logprobs` on the CPU server (vLLM's request field and answer shape) and the
verified weight sync the sampler runs: tandem_reload_weights, then the prompt-logprob probe
against transformers on the new checkpoint."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from services.inference.init_model import init_model
from services.inference.testing import ServerHandle
from services.inference.vllm_ext import RELOAD_METHOD
from tests.support.vllm import max_abs_diff, probe_prompt_logprobs, reference_prompt_logprobs

IDS = [5, 17, 42, 8, 33, 60, 12, 9, 17, 42]


def _complete(url: str, **body) -> dict:
    r = httpx.post(url + "/v1/completions", json={"max_tokens": 1, "temperature": 0, **body}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def other_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture, different random weights: what a training step could have written."""
    return init_model(tmp_path_factory.mktemp("models") / "tiny-seed1", preset="tiny", seed=1)


def test_prompt_logprobs_shape_is_vllms(server: ServerHandle) -> None:
    choice = _complete(server.url, prompt=IDS, prompt_logprobs=0)["choices"][0]
    rows = choice["prompt_logprobs"]
    assert rows[0] is None and len(rows) == len(IDS)
    piece = server.engine.tokenizer
    for i in range(1, len(IDS)):
        assert list(rows[i]) == [str(IDS[i])]  # k = 0: the prompt token only
        entry = rows[i][str(IDS[i])]
        assert set(entry) == {"logprob", "rank", "decoded_token"}
        assert entry["logprob"] < 0 and 1 <= entry["rank"] <= server.engine.vocab_size
        assert entry["decoded_token"] == piece.decode([IDS[i]])
    # Not asked for: null, as in vLLM.
    assert _complete(server.url, prompt=IDS)["choices"][0]["prompt_logprobs"] is None


def test_prompt_logprobs_top_k_and_ranks(server: ServerHandle) -> None:
    rows = _complete(server.url, prompt=IDS, prompt_logprobs=3)["choices"][0]["prompt_logprobs"]
    for i in range(1, len(IDS)):
        row = rows[i]
        keys = list(row)
        mine = row[str(IDS[i])]
        assert keys[0] == str(IDS[i])  # the prompt token first, then the top 3 by rank
        ranks = sorted(e["rank"] for e in row.values())
        if mine["rank"] <= 3:  # among the top 3: listed once, 3 entries
            assert len(row) == 3 and ranks == [1, 2, 3]
        else:
            assert len(row) == 4 and ranks[:3] == [1, 2, 3]
            assert mine["logprob"] <= min(row[k]["logprob"] for k in keys[1:])
        top = sorted(row.values(), key=lambda e: e["rank"])[:3]
        assert [e["logprob"] for e in top] == sorted((e["logprob"] for e in top), reverse=True)


def test_prompt_logprobs_equal_transformers_and_ignore_temperature(server: ServerHandle, tiny_model: Path) -> None:
    ref = reference_prompt_logprobs(tiny_model, IDS)
    got = probe_prompt_logprobs(server.url, IDS)
    assert max_abs_diff(got, ref) < 1e-5
    # Prompt tokens are scored with the raw distribution: temperature and top-p do not apply.
    hot = _complete(server.url, prompt=IDS, prompt_logprobs=0, temperature=1.7, top_p=0.5, seed=3)
    rows = hot["choices"][0]["prompt_logprobs"]
    assert [rows[i][str(IDS[i])]["logprob"] for i in range(1, len(IDS))] == got


def test_prompt_logprobs_for_every_choice_and_bad_values(server: ServerHandle) -> None:
    choices = _complete(server.url, prompt=IDS, prompt_logprobs=0, n=2, temperature=1.0)["choices"]
    assert len(choices) == 2 and choices[0]["prompt_logprobs"] == choices[1]["prompt_logprobs"]
    for bad in (-1, 21):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": IDS, "max_tokens": 1, "prompt_logprobs": bad})
        assert r.status_code == 400 and "prompt_logprobs" in r.json()["error"]["message"]


def test_verified_sync_with_tandem_reload_weights(fresh_server: ServerHandle, tiny_model: Path,
                                                  other_model: Path) -> None:
    """The sampler's sequence with the extension's method name, then the probe."""
    url = fresh_server.url
    before = probe_prompt_logprobs(url, IDS)
    assert httpx.post(url + "/pause", params={"mode": "keep"}).json() == {"status": "paused"}
    r = httpx.post(url + "/collective_rpc", timeout=60,
                   json={"method": RELOAD_METHOD, "kwargs": {"weights_path": str(other_model)}})
    assert r.status_code == 200, r.text
    result = r.json()["results"][0]
    assert result["weights_path"] == str(other_model) and result["repacked"] == [] and result["seconds"] >= 0
    assert httpx.post(url + "/update_weight_version", json={"new_version": "1"}).status_code == 200
    assert httpx.post(url + "/reset_prefix_cache").json() == {"success": True}
    assert httpx.post(url + "/resume").json() == {"status": "resumed"}

    after = probe_prompt_logprobs(url, IDS)
    assert max_abs_diff(after, reference_prompt_logprobs(other_model, IDS)) < 1e-5
    # The probe can tell the checkpoints apart by far more than its tolerance.
    assert max_abs_diff(after, before) > 0.05
    # No path: the checkpoint the server loaded at start.
    r = httpx.post(url + "/collective_rpc", json={"method": RELOAD_METHOD}, timeout=60)
    assert r.status_code == 200 and r.json()["results"][0]["weights_path"] == str(tiny_model)
    assert max_abs_diff(probe_prompt_logprobs(url, IDS), before) < 1e-6


def test_collective_rpc_names_what_it_supports(server: ServerHandle) -> None:
    r = httpx.post(server.url + "/collective_rpc", json={"method": "sleep"})
    assert r.status_code == 400
    assert "reload_weights" in r.json()["error"]["message"] and RELOAD_METHOD in r.json()["error"]["message"]

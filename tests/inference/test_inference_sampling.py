"""Sampling semantics: seeds, greedy, stop strings, and vLLM's processed logprobs."""

from __future__ import annotations

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from services.inference.testing import ServerHandle


def _complete(server: ServerHandle, **body) -> dict:
    body.setdefault("return_token_ids", True)
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_seed_reproducible_and_seeds_differ(server: ServerHandle) -> None:
    def ids(seed):
        data = _complete(server, prompt="Once upon", max_tokens=12, seed=seed, n=2, ignore_eos=True)
        return [c["token_ids"] for c in data["choices"]]

    assert ids(11) == ids(11)
    assert ids(11) != ids(12)


def test_greedy_is_deterministic_and_matches_hf(server: ServerHandle, tiny_model) -> None:
    a = _complete(server, prompt="The answer is", max_tokens=10, temperature=0, ignore_eos=True)
    b = _complete(server, prompt="The answer is", max_tokens=10, temperature=0, ignore_eos=True, seed=99)
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
    # Same tokens as a plain argmax loop over the HF model.
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    ids = list(a["choices"][0]["prompt_token_ids"])
    expected = []
    with torch.no_grad():
        for _ in range(10):
            nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            expected.append(nxt)
            ids.append(nxt)
    assert a["choices"][0]["token_ids"] == expected


def test_processed_logprobs_follow_temperature(server: ServerHandle, tiny_model) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    prompt = "2 + 2 ="
    for temperature in (1.0, 0.5, 0.0):
        data = _complete(server, prompt=prompt, max_tokens=1, temperature=temperature, seed=3, logprobs=0)
        choice = data["choices"][0]
        with torch.no_grad():
            logits = model(torch.tensor([choice["prompt_token_ids"]])).logits[0, -1]
        scaled = logits / temperature if temperature > 0 else logits
        expected = torch.log_softmax(scaled, -1)[choice["token_ids"][0]].item()
        assert choice["logprobs"]["token_logprobs"][0] == pytest.approx(expected, abs=1e-4)


def test_top_p_masks_the_distribution(server: ServerHandle) -> None:
    # With top_p tiny, only the argmax survives: its processed logprob is exactly 0.
    data = _complete(server, prompt="abc", max_tokens=4, temperature=1.0, top_p=1e-6, seed=1, logprobs=0,
                     ignore_eos=True)
    assert data["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx([0.0] * 4, abs=1e-6)
    greedy = _complete(server, prompt="abc", max_tokens=4, temperature=0, ignore_eos=True)
    assert data["choices"][0]["token_ids"] == greedy["choices"][0]["token_ids"]


def test_truncated_logprobs_are_renormalised_over_the_kept_set(server: ServerHandle, tiny_model) -> None:
    """min_p, top_k and top_p together (shared/truncation.py, vLLM's order): the processed
    logprob of the first sampled token is log_softmax over what survives the truncation."""
    from shared.truncation import truncate_

    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    settings = {"temperature": 0.8, "min_p": 0.05, "top_k": 30, "top_p": 0.7}
    data = _complete(server, prompt="2 + 2 =", max_tokens=1, seed=7, n=8, logprobs=0, **settings)
    with torch.no_grad():
        z = model(torch.tensor([data["choices"][0]["prompt_token_ids"]])).logits[0, -1:] / 0.8
    dropped = truncate_(z, settings["top_k"], settings["top_p"], settings["min_p"])
    assert 1 < int((~dropped).sum()) < 30, "the settings leave a few tokens"
    expected = torch.log_softmax(z, -1)[0]
    for choice in data["choices"]:
        token = choice["token_ids"][0]
        assert not dropped[0, token], "sampled a token the truncation removes"
        assert choice["logprobs"]["token_logprobs"][0] == pytest.approx(expected[token].item(), abs=1e-4)
    with httpx.Client() as client:
        bad = client.post(server.url + "/v1/completions", json={"prompt": "x", "min_p": 1.5}, timeout=30)
    assert bad.status_code == 400 and "min_p" in bad.text


def test_stop_strings_cut_text(server: ServerHandle) -> None:
    base = _complete(server, prompt="Hello", max_tokens=20, temperature=1.0, seed=5, ignore_eos=True)
    text = base["choices"][0]["text"]
    stop = text[6:8]
    assert stop and stop not in text[:6] + text[6:7]  # precondition of the seeded sample
    cut = text.index(stop)
    stopped = _complete(server, prompt="Hello", max_tokens=20, temperature=1.0, seed=5, ignore_eos=True,
                        stop=[stop, "never-there"])
    choice = stopped["choices"][0]
    assert choice["text"] == text[:cut]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    kept = _complete(server, prompt="Hello", max_tokens=20, temperature=1.0, seed=5, ignore_eos=True,
                     stop=stop, include_stop_str_in_output=True)
    assert kept["choices"][0]["text"] == text[: cut + len(stop)]


def test_stop_token_ids_and_eos(server: ServerHandle) -> None:
    base = _complete(server, prompt="Hi", max_tokens=6, temperature=0, ignore_eos=True)
    third = base["choices"][0]["token_ids"][2]
    stopped = _complete(server, prompt="Hi", max_tokens=6, temperature=0, ignore_eos=True, stop_token_ids=[third])
    choice = stopped["choices"][0]
    assert choice["token_ids"] == base["choices"][0]["token_ids"][: choice["token_ids"].index(third) + 1]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == third


def test_top_k_one_is_greedy_and_min_tokens_delays_stops(server: ServerHandle) -> None:
    greedy = _complete(server, prompt="xyz", max_tokens=6, temperature=0, ignore_eos=True)["choices"][0]
    top1 = _complete(server, prompt="xyz", max_tokens=6, temperature=1.3, top_k=1, seed=4, ignore_eos=True,
                     logprobs=0)["choices"][0]
    assert top1["token_ids"] == greedy["token_ids"]
    assert top1["logprobs"]["token_logprobs"] == pytest.approx([0.0] * 6, abs=1e-6)
    first = greedy["token_ids"][0]
    early = _complete(server, prompt="xyz", max_tokens=6, temperature=0, stop_token_ids=[first])["choices"][0]
    assert early["token_ids"] == [first] and early["finish_reason"] == "stop"
    late = _complete(server, prompt="xyz", max_tokens=6, temperature=0, stop_token_ids=[first],
                     min_tokens=3)["choices"][0]
    assert first not in late["token_ids"][:3]

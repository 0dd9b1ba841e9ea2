"""verifiers' own TextArena taskset (infinite: its games generate episodes forever) through the
sampler, bounded by Tandem's `limit` key, offline: nltk's word list comes from the small
stand-in under tests/vf/nltk_data through NLTK_DATA (issue 43)."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from shared.wire import Sample

pytestmark = pytest.mark.timeout(180)

NLTK_DATA = Path(__file__).parent / "nltk_data"
HANGMAN = {"taskset": {"game": "Hangman-v0"}}


@pytest.fixture
def word_list(monkeypatch: pytest.MonkeyPatch) -> Path:
    pytest.importorskip("textarena", reason="TextArena comes with verifiers[ta] (make install)")
    import nltk

    monkeypatch.setenv("NLTK_DATA", str(NLTK_DATA))
    monkeypatch.setattr(nltk.data, "path", [str(NLTK_DATA), *nltk.data.path])  # nltk read the variable at import
    return NLTK_DATA


def load(env_args: dict):
    from services.sampler.rollouts.envs import load_environment

    return load_environment("verifiers:textarena", **env_args)


def test_an_infinite_taskset_is_refused_naming_the_limit_key(word_list: Path) -> None:
    from services.sampler.rollouts.envs import EnvironmentLoadError

    with pytest.raises(EnvironmentLoadError) as refused:
        load(HANGMAN)
    message = str(refused.value)
    assert "is infinite" in message and "'limit'" in message and '{"limit": {"train": N, "eval": M}}' in message
    with pytest.raises(EnvironmentLoadError, match="bound its eval split with the Tandem key 'limit'"):
        load({**HANGMAN, "limit": {"train": 4}})


def test_limit_indexes_the_first_tasks_of_each_split_the_same_every_time(word_list: Path) -> None:
    env = load({**HANGMAN, "limit": {"train": 5, "eval": 2}})
    train = env.examples("train")
    assert [e.prompt_id for e in train] == [f"train:{i}" for i in range(5)]
    assert [e.prompt_id for e in env.examples("eval")] == ["eval:0", "eval:1"]
    again = load({**HANGMAN, "limit": {"train": 5, "eval": 2}}).examples("train")
    assert [(e.prompt_id, e.prompt) for e in again] == [(e.prompt_id, e.prompt) for e in train]
    assert len(load({**HANGMAN, "limit": 3}).examples("eval")) == 3


@pytest.mark.parametrize("limit", [0, -1, True, "8", {"test": 3}, {"train": 2.5}])
def test_a_bad_limit_is_refused_in_one_line(word_list: Path, limit: object) -> None:
    from services.sampler.rollouts.envs import EnvironmentLoadError

    with pytest.raises(EnvironmentLoadError, match="env-args 'limit'"):
        load({**HANGMAN, "limit": limit})


async def test_hangman_plays_through_the_sampler_bounded_and_offline(word_list, make_sampler, standin,
                                                                    byte_tokenizer) -> None:
    # The word is always "cat": three right guesses win the game, which ends the episode.
    httpx.post(standin.url + "/_standin/configure", json={"replies": ["[C]", "[A]", "[T]"]}).raise_for_status()
    sampler = make_sampler(env="verifiers:textarena", env_args={**HANGMAN, "limit": 8},
                           vf_tokenizer=str(byte_tokenizer), prompts_per_step=2, num_generations=2, max_tokens=16)
    async with httpx.AsyncClient(base_url=sampler.url, timeout=120) as http:
        body = (await http.get("/batch", params={"step": 0, "timeout": 120})).json()
    samples = [Sample.model_validate(s) for s in body["samples"]]
    assert len(samples) == 4
    for s in samples:
        assert s.prompt_id in {f"train:{i}" for i in range(8)}, s.prompt_id
        text = bytes(s.prompt_token_ids + s.completion_token_ids).decode()
        assert "You are playing Hangman" in text
        for guess in ("[C]", "[A]"):
            assert f"<|im_start|>assistant\n{guess}<|im_end|>" in text, text[-800:]
        # The third guess solved it: the game ended the episode, no user turn follows.
        assert "  C   A   _<|im_end|>\n<|im_start|>assistant\n[T]" in text and text.rstrip("\x00").endswith("[T]"), text[-300:]
        assert s.reward == pytest.approx(1.0), (s.rewards, text[-800:])
    assert os.environ["NLTK_DATA"] == str(NLTK_DATA)

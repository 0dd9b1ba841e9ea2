"""A small environment for the trainer's integration tests (loaded by the sampler as
`tests.trainer.letter_env:LetterEnv`): the prompt names a letter, the reward is the
fraction of completion characters equal to it. A random tiny model scores ~1/100, and
every completion gets a graded reward, so advantages are non-zero from the first step.
"""

from __future__ import annotations

import string

from services.sampler.envs.base import Completion, Environment, Example, Reward


async def letter_fraction(example: Example, completion: Completion) -> float:
    text = completion.text
    return sum(ch == example.answer for ch in text) / max(len(text), 1)


class LetterEnv(Environment):
    name = "letter"
    rewards = (Reward("letter", letter_fraction),)

    def __init__(self, **_: object) -> None:
        letters = string.ascii_lowercase
        self._train = [Example(f"letter-train-{i}", f"Write {c}: ", answer=c) for i, c in enumerate(letters * 4)]
        self._eval = [Example(f"letter-eval-{i}", f"Write {c}: ", answer=c) for i, c in enumerate(letters[:8])]

    def examples(self, split):
        return self._train if split == "train" else self._eval

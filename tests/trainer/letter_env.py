"""A small environment for the trainer's integration tests (loaded by the sampler as
`tests.trainer.letter_env:LetterEnv`): the prompt names a letter, and each completion
character scores by how close it is to that letter (1 for the letter itself, falling
linearly to 0 at 128 code points away); the reward is the mean over the characters. A random
tiny model's completions all get different graded rewards, so every group carries advantage
signal from the first step (the trainer skips steps without any, and these tests count steps
that move the weights).
"""

from __future__ import annotations

import string

from services.sampler.rollouts.envs.base import Completion, Environment, Example, Reward


async def letter_fraction(example: Example, completion: Completion) -> float:
    text = completion.text
    target = ord(example.answer)
    return sum(max(0.0, 1 - abs(ord(ch) - target) / 128) for ch in text) / max(len(text), 1)


class LetterEnv(Environment):
    name = "letter"
    rewards = (Reward("letter", letter_fraction),)

    def __init__(self, **_: object) -> None:
        letters = string.ascii_lowercase
        self._train = [Example(f"letter-train-{i}", f"Write {c}: ", answer=c) for i, c in enumerate(letters * 4)]
        self._eval = [Example(f"letter-eval-{i}", f"Write {c}: ", answer=c) for i, c in enumerate(letters[:8])]

    def examples(self, split):
        return self._train if split == "train" else self._eval

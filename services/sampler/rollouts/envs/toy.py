"""The toy task: say whether a number is even or odd. The default environment.

Prompt ``"even or odd? 4827"``; the answer is one character, ``"e"`` (even) or ``"o"``
(odd). The single reward, ``correct`` (weight 1.0), is 1 when the first non-space
character of the completion is the answer letter and 0 otherwise. Nothing after that
character counts, so the policy is not asked to emit EOS, which a random model rarely does.

Why a randomly initialised character-level model learns it from scratch in a few minutes
of CPU GRPO (about 50-150 steps of 8 prompts x 16 generations, max_tokens 4, temperature 1,
learning rate around 1e-3):

* The answer depends only on the last prompt character, the token the model is predicting
  from. Learning it is a ten-row lookup from the last digit's embedding to two output
  logits: no attention pattern or position arithmetic is needed. The digits before it vary,
  so the eval split (numbers never seen in training) checks that the model learnt the
  rule instead of memorising prompts.
* A uniformly random policy over ~95 printable characters scores 1/95 per sample, but once
  the model emits the two letters at all, a group of 8 almost always has both right and
  wrong answers, so GRPO gets a signal on nearly every prompt.
* An untrained model scores ~0 under greedy decoding. With tied embeddings it echoes the
  last input character (a digit) and never an answer letter, which is also why the task
  is not "copy the last digit": an untrained tied model already solves that.
* There is deliberately no "format" reward for emitting *some* answer letter: in
  simulation it paid a wrong letter more than noise, so the policy collapsed to always
  answering the same letter (reward 0.5, zero variance within groups, no further learning).

Prompts are distinct numbers below ``10**max_digits`` from a seeded permutation: eval takes
the first ``num_eval`` and train the next ``num_train``, so the splits are disjoint and
growing one split never changes the other. ``prompt_id`` is ``"toy/<split>/<number>"``,
derived from the prompt itself, so it is unique and stable across runs and seeds.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from services.sampler.rollouts.envs.base import Completion, Environment, Example, Reward, Split

PROMPT_PREFIX = "even or odd? "
LABELS = "eo"  # index = last digit % 2


def answer_for(number: int) -> str:
    return LABELS[number % 2]


def first_answer_char(text: str) -> str:
    """The character the reward reads: the first one after any leading whitespace."""
    stripped = text.lstrip()
    return stripped[:1]


class ToyEnv(Environment):
    """Parity of a number, answered with one letter; learnable from scratch on a CPU."""

    name = "toy"

    def __init__(
        self,
        num_train: int = 1024,
        num_eval: int = 64,
        seed: int = 0,
        max_digits: int = 4,
        max_tokens: int = 4,
    ) -> None:
        # Settings may arrive as strings from env_args; coerce once here.
        num_train, num_eval, seed, max_digits = (
            int(num_train),
            int(num_eval),
            int(seed),
            int(max_digits),
        )
        if not 1 <= max_digits <= 6:
            raise ValueError(f"toy: max_digits must be between 1 and 6, got {max_digits}")
        space = 10**max_digits
        if num_train < 1 or num_eval < 1 or num_train + num_eval > space:
            raise ValueError(
                f"toy: need 1 <= num_train, num_eval and num_train + num_eval <= {space} distinct "
                f"numbers below 10**{max_digits}; got num_train={num_train}, num_eval={num_eval}"
            )
        numbers = list(range(space))
        random.Random(seed).shuffle(numbers)
        self._examples: dict[Split, list[Example]] = {
            "eval": [self._example("eval", n) for n in numbers[:num_eval]],
            "train": [self._example("train", n) for n in numbers[num_eval : num_eval + num_train]],
        }
        self.rewards = (Reward("correct", self._correct, 1.0),)
        # Only the first character is scored; longer completions only add noise to the loss.
        self.sampling = {"max_tokens": int(max_tokens)}

    @staticmethod
    def _example(split: Split, number: int) -> Example:
        return Example(
            prompt_id=f"toy/{split}/{number}",
            prompt=f"{PROMPT_PREFIX}{number}",
            answer=answer_for(number),
            info={"number": number},
        )

    def examples(self, split: Split) -> Sequence[Example]:
        if split not in self._examples:
            raise ValueError(f"unknown split {split!r}: use 'train' or 'eval'")
        return self._examples[split]

    async def _correct(self, example: Example, completion: Completion) -> float:
        return float(first_answer_char(completion.text) == example.answer)

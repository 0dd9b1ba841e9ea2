"""`parity_dialogue`: the toy task as a conversation, the built-in multi-turn environment.

The environment says a number, the model answers `e` (even) or `o` (odd), the environment
says the next number, and so on for `turns` numbers (3 by default). Every message is
rendered with the model's chat template; the model's answers are the only tokens trained
on. Reward `correct` = the fraction of the numbers answered right (only the first
non-space character of each answer counts, as in the toy task); a conversation cut short
counts its missing answers as wrong.

It is learnable from scratch by the tiny model, and the default of one-digit numbers
(`max_digits` 1) is what makes it so. Between a number and the model's answer the template
writes a fixed 13-token suffix (`<|im_end|>`, the assistant header), so the answer must be
read through attention, and with RoPE an untrained model's attention sees an unordered bag
of the digits before it: with one-digit numbers the first turn's bag holds exactly the
digit that matters, GRPO gets a signal at once, and sharpening attention to the latest
number then pays for the later turns. With four-digit numbers the bag holds four digits and
the policy settled on one letter (greedy eval 0.52 for 300 steps at learning rates 1e-3 and
3e-3); supervised training learns either in ~100 steps. `make demo ARGS="--env
parity_dialogue"` trains it (docs/demo.md, "Multi-turn: parity_dialogue").

Examples are seeded and stable: distinct conversations (sequences of numbers) from one seeded
stream, the first `num_eval` for eval and the next `num_train` for training, so no eval
conversation is trained on. `prompt_id` is `parity_dialogue/<split>/<index>`.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

from services.sampler.rollouts.envs.base import Completion, Example, Reward, Split
from services.sampler.rollouts.envs.multiturn import Conversation, Message, MultiTurnEnvironment
from services.sampler.rollouts.envs.toy import answer_for, first_answer_char


class ParityDialogueEnv(MultiTurnEnvironment):
    name = "parity_dialogue"

    def __init__(self, turns: int = 3, num_train: int = 512, num_eval: int = 64, seed: int = 0,
                 max_digits: int = 1, max_tokens: int = 1) -> None:
        turns, num_train, num_eval, seed, max_digits, max_tokens = (
            int(turns), int(num_train), int(num_eval), int(seed), int(max_digits), int(max_tokens))
        if not 1 <= turns <= 64:
            raise ValueError(f"parity_dialogue: turns must be between 1 and 64, got {turns}")
        if not 1 <= max_digits <= 6:
            raise ValueError(f"parity_dialogue: max_digits must be between 1 and 6, got {max_digits}")
        if max_tokens < 1:
            raise ValueError(f"parity_dialogue: max_tokens must be >= 1, got {max_tokens}")
        space = 10**max_digits
        distinct = space**turns
        if num_train < 1 or num_eval < 1 or num_train + num_eval > distinct:
            raise ValueError(
                f"parity_dialogue: need 1 <= num_train, num_eval and num_train + num_eval <= {distinct} "
                f"(distinct conversations of {turns} numbers below 10**{max_digits}); "
                f"got num_train={num_train}, num_eval={num_eval}")
        self.max_turns = turns
        sequences = _distinct_sequences(num_eval + num_train, turns, space, random.Random(seed))
        self._examples: dict[Split, list[Example]] = {
            "eval": [self._example("eval", i, numbers) for i, numbers in enumerate(sequences[:num_eval])],
            "train": [self._example("train", i, numbers) for i, numbers in enumerate(sequences[num_eval:])],
        }
        self.rewards = (Reward("correct", self._correct, 1.0),)
        self.sampling = {"max_tokens": max_tokens}

    @staticmethod
    def _example(split: Split, index: int, numbers: tuple[int, ...]) -> Example:
        return Example(prompt_id=f"parity_dialogue/{split}/{index}", prompt=str(numbers[0]),
                       answer="".join(answer_for(n) for n in numbers), info={"numbers": list(numbers)})

    def examples(self, split: Split) -> Sequence[Example]:
        if split not in self._examples:
            raise ValueError(f"unknown split {split!r}: use 'train' or 'eval'")
        return self._examples[split]

    async def env_response(self, convo: Conversation) -> list[Message] | None:
        numbers = convo.example.info["numbers"]
        said = len(convo.turns)
        if said >= len(numbers):
            return None
        return [{"role": "user", "content": str(numbers[said])}]

    async def _correct(self, example: Example, completion: Completion) -> float:
        turns = completion.conversation.turns if completion.conversation is not None else []
        right = sum(first_answer_char(turn.text) == letter for turn, letter in zip(turns, example.answer))
        return right / len(example.answer)


def _distinct_sequences(count: int, turns: int, space: int, rng: random.Random) -> list[tuple[int, ...]]:
    """`count` distinct sequences of `turns` numbers below `space`, in a seeded order."""
    if count * 2 > space**turns:  # dense: shuffle them all
        every = list(itertools.product(range(space), repeat=turns))
        rng.shuffle(every)
        return every[:count]
    seen: dict[tuple[int, ...], None] = {}
    while len(seen) < count:
        seen.setdefault(tuple(rng.randrange(space) for _ in range(turns)), None)
    return list(seen)

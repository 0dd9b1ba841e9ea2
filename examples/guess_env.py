"""A complete multi-turn environment with a tool, to copy from (docs/environments.md).

The model guesses a secret number between 1 and `high`; after each guess the environment says
"higher" or "lower". An `is_even` tool says whether a number is even. Reward `solved` is 1 for
finding the number, scaled down by the guesses it took; `format` (weight 0.1) pays for
answering with a number at all.

Run it (from the repository root, so `examples` imports):

    tandem sampler --env examples.guess_env:GuessEnv --env-args '{"high": 20}'
    make demo ARGS='--env examples.guess_env:GuessEnv --steps 50'

The tiny model will not learn to bisect in a demo; a real model served by vLLM can.
"""

from __future__ import annotations

import random
import re

from services.sampler.rollouts.envs import Completion, Conversation, Example, MultiTurnEnvironment, Reward, Tool

NUMBER = re.compile(r"-?\d+")


def first_number(text: str) -> int | None:
    match = NUMBER.search(text)
    return int(match.group()) if match else None


class GuessEnv(MultiTurnEnvironment):
    name = "guess"

    def __init__(self, high: int = 20, max_turns: int = 5, num_train: int = 256, num_eval: int = 32, seed: int = 0):
        self.high, self.max_turns = int(high), int(max_turns)
        if self.high < 2:
            raise ValueError(f"guess: high must be >= 2, got {high}")
        rng = random.Random(int(seed))
        self._examples = {
            split: [Example(f"guess/{split}/{i}", f"Guess my number between 1 and {self.high}.",
                            answer=rng.randint(1, self.high)) for i in range(int(count))]
            for split, count in (("eval", num_eval), ("train", num_train))
        }
        self.rewards = (Reward("solved", self._solved, 1.0), Reward("format", self._format, 0.1))
        self.sampling = {"max_tokens": 8}
        # Tools see only their arguments; logic that needs the trajectory (the secret) lives
        # in `env_response`.
        self.tools = (Tool("is_even", lambda n: "yes" if int(n) % 2 == 0 else "no",
                           description="Whether a number is even.",
                           parameters={"type": "object", "properties": {"n": {"type": "integer"}},
                                       "required": ["n"]}),)

    def examples(self, split):
        return self._examples[split]

    def initial_messages(self, example: Example) -> list[dict]:
        return [{"role": "system", "content": "Answer with one number."},
                {"role": "user", "content": example.prompt}]

    def env_response(self, convo: Conversation) -> list[dict] | None:
        # A plain `def`: the sampler runs it in a worker thread.
        guess = first_number(convo.last.text)
        secret = convo.example.answer
        if guess == secret:
            convo.state["solved_at"] = len(convo.turns)
            return None
        if guess is None:
            return [{"role": "user", "content": "Please answer with a number."}]
        return [{"role": "user", "content": "higher" if guess < secret else "lower"}]

    async def _solved(self, example: Example, completion: Completion) -> float:
        turn = completion.conversation.state.get("solved_at")
        return 0.0 if turn is None else 1.0 / turn

    async def _format(self, example: Example, completion: Completion) -> float:
        turns = completion.conversation.turns
        return sum(first_number(t.text) is not None for t in turns) / len(turns)

"""A verifiers environment to copy from (docs/environments.md, "verifiers environments"): the
guessing game of examples/guess_env.py, written with verifiers 0.4's API instead of Tandem's.

* `GuessTaskset` yields the tasks: "Guess my number between 1 and `high`", the secret kept on
  the task's data where the model does not see it.
* `GuessEnv` drives the conversation: after each guess it answers "higher" or "lower" through
  `agents.agent.interaction(task)`, until the number is found or `max_guesses` are spent.
* `GuessTask` scores the finished trace: `solved` is 1 for finding the number, scaled down by
  the guesses it took; `format` (weight 0.1) pays for answering with a number at all; the
  metric `guesses` counts them.
* `Parity` is a tool server (MCP) the taskset offers every rollout: `parity_is_even(n)`.
  It belongs to the taskset (one process for the sampler's life), not to each task (one per
  rollout), because it keeps no per-rollout state.

verifiers finds an environment by importing its id (`guess-number` -> `guess_number`), so the
directory holding this file goes on PYTHONPATH (for the sampler, and for the tool server's
process):

    PYTHONPATH=examples/verifiers tandem sampler --env verifiers:guess-number \\
        --env-args '{"taskset": {"high": 20}, "max_guesses": 4}'
    PYTHONPATH=examples/verifiers make demo ARGS='--env verifiers:guess-number --steps 50'

The tiny model will not learn to bisect in a demo; a real model served by vLLM can.
"""

from __future__ import annotations

import random
import re

import verifiers.v1 as vf

NUMBER = re.compile(r"-?\d+")


def first_number(text: str | None) -> int | None:
    match = NUMBER.search(text or "")
    return int(match.group()) if match else None


class ParityConfig(vf.SharedToolsetConfig):
    pass


class Parity(vf.Toolset[ParityConfig]):
    @vf.tool
    async def is_even(self, n: int) -> str:
        """Whether a number is even: yes or no."""
        return "yes" if n % 2 == 0 else "no"


class GuessData(vf.TaskData):
    secret: int


class GuessTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def solved(self, task, trace) -> float:
        guesses = [first_number(m.content) for m in trace.assistant_messages if not m.tool_calls]
        return 1.0 / (guesses.index(task.secret) + 1) if task.secret in guesses else 0.0

    @vf.reward(weight=0.1)
    async def format(self, trace) -> float:
        replies = [m for m in trace.assistant_messages if not m.tool_calls]
        return sum(first_number(m.content) is not None for m in replies) / max(len(replies), 1)

    @vf.metric
    async def guesses(self, trace) -> float:
        return float(sum(1 for m in trace.assistant_messages if not m.tool_calls))


class GuessTasksetConfig(vf.TasksetConfig):
    high: int = 20
    size: int = 256
    seed: int = 0


class GuessTaskset(vf.Taskset[GuessTask, GuessTasksetConfig]):
    def load(self):
        if self.config.high < 2:
            raise ValueError(f"guess-number: high must be >= 2, got {self.config.high}")
        rng = random.Random(self.config.seed)
        for i in range(self.config.size):
            yield GuessTask(GuessData(prompt=f"Guess my number between 1 and {self.config.high}.",
                                      secret=rng.randint(1, self.config.high), id=f"guess-{i}"), self.config.task)

    @classmethod
    def toolsets(cls, config):
        return [Parity(ParityConfig())]


class GuessEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()
    max_guesses: int = 5


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        secret = task.data.secret
        async with agents.agent.interaction(task) as chat:
            segment = await chat.turn()
            for _ in range(self.config.max_guesses - 1):
                guess = first_number(segment.last_reply)
                if segment.terminated or guess == secret:
                    break
                segment = await chat.turn("higher" if guess is None or guess < secret else "lower")


__all__ = ["GuessTaskset", "GuessEnv"]

if __name__ == "__main__":  # verifiers starts the tool server as `python -m guess_number`
    Parity.run()

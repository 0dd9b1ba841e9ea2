"""A single-turn verifiers taskset for tests: the toy task (services/sampler/rollouts/envs/toy.py) as
verifiers writes tasks. "even or odd? 4827" -> "o"; the reward reads the first character.
With `accept` set, an answer is right when it starts with any of those characters, whatever
the number: a task a fresh model learns in a few steps even behind a chat template (parity
does not: the digit is no longer the last prompt token the model predicts from)."""

import random

import verifiers.v1 as vf


class ParityData(vf.TaskData):
    answer: str  # the characters a right answer may start with


class ParityTask(vf.Task[ParityData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, task, trace) -> float:
        first = trace.last_reply.lstrip()[:1]
        return float(bool(first) and first in task.answer)

    @vf.metric
    async def reply_chars(self, trace) -> float:
        return float(len(trace.last_reply))


class ParityConfig(vf.TasksetConfig):
    size: int = 256
    seed: int = 0
    accept: str | None = None


class ParityTaskset(vf.Taskset[ParityTask, ParityConfig]):
    def load(self):
        numbers = random.Random(self.config.seed).sample(range(10_000), self.config.size)
        for n in numbers:
            answer = self.config.accept or "eo"[n % 2]
            yield ParityTask(ParityData(prompt=f"even or odd? {n}", answer=answer, id=f"n{n}"), self.config.task)


__all__ = ["ParityTaskset"]

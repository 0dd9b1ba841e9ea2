"""A single-turn verifiers taskset for tests: the toy task (services/sampler/envs/toy.py) as
verifiers writes tasks. "even or odd? 4827" -> "o"; the reward reads the first character."""

import random

import verifiers.v1 as vf


class ParityData(vf.TaskData):
    answer: str


class ParityTask(vf.Task[ParityData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, task, trace) -> float:
        return float(trace.last_reply.lstrip()[:1] == task.answer)

    @vf.metric
    async def reply_chars(self, trace) -> float:
        return float(len(trace.last_reply))


class ParityConfig(vf.TasksetConfig):
    size: int = 256
    seed: int = 0


class ParityTaskset(vf.Taskset[ParityTask, ParityConfig]):
    def load(self):
        numbers = random.Random(self.config.seed).sample(range(10_000), self.config.size)
        for n in numbers:
            yield ParityTask(ParityData(prompt=f"even or odd? {n}", answer="eo"[n % 2], id=f"n{n}"),
                             self.config.task)


__all__ = ["ParityTaskset"]

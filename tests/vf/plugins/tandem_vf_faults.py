"""A verifiers taskset whose reward fails on purpose, for fault tests. `fail_first` makes the
reward raise on the first `fail_first` calls of each task (then it scores 1), counted per
`tag` in this process (a test gives its own); a negative value makes it raise every time."""

from collections import Counter

import verifiers.v1 as vf

CALLS: Counter = Counter()


class FaultyTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    fail_first: int = 0
    tag: str = ""

    @vf.reward(weight=1.0)
    async def flaky(self, task) -> float:
        key = (self.tag, task.id)
        CALLS[key] += 1
        if self.fail_first < 0 or CALLS[key] <= self.fail_first:
            raise RuntimeError(f"the reward of {task.id} failed on purpose (call {CALLS[key]})")
        return 1.0


class FaultsConfig(vf.TasksetConfig):
    fail_first: int = 1
    size: int = 4
    tag: str = ""


class FaultsTaskset(vf.Taskset[FaultyTask, FaultsConfig]):
    def load(self):
        for i in range(self.config.size):
            task = FaultyTask(vf.TaskData(prompt=f"fault {i}", id=f"f{i}"), self.config.task)
            task.fail_first, task.tag = self.config.fail_first, self.config.tag
            yield task


__all__ = ["FaultsTaskset"]

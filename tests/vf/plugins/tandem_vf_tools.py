"""A tool-using verifiers taskset for tests: "add a and b" with a `calc_add` tool served by a
taskset-level MCP toolset (one process for the sampler's lifetime). The reward is 1 when the
final reply is the sum; a metric counts the tool calls."""

import verifiers.v1 as vf


class CalcConfig(vf.SharedToolsetConfig):
    pass


class Calc(vf.Toolset[CalcConfig]):
    @vf.tool
    async def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b


class SumData(vf.TaskData):
    total: int


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def right(self, task, trace) -> float:
        return float(trace.last_reply.strip() == str(task.total))

    @vf.metric
    async def tool_calls(self, trace) -> float:
        return float(len(trace.tool_messages))


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self):
        for a, b in [(2, 3), (4, 4), (1, 6), (5, 2)]:
            yield SumTask(SumData(prompt=f"add {a} and {b}", total=a + b, id=f"{a}+{b}"), self.config.task)

    @classmethod
    def toolsets(cls, config):
        return [Calc(CalcConfig())]


__all__ = ["SumTaskset"]

if __name__ == "__main__":
    Calc.run()

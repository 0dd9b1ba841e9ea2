"""A multi-turn verifiers environment for tests: the env talks back. The agent answers the
prompt; the env replies "again" `turns - 1` times through `interaction()`; the reward is the
share of the agent's replies that start with a digit."""

import verifiers.v1 as vf


class DialogueTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def digits(self, trace) -> float:
        replies = [m.content or "" for m in trace.assistant_messages]
        return sum(r[:1].isdigit() for r in replies) / max(len(replies), 1)


class DialogueTaskset(vf.Taskset[DialogueTask, vf.TasksetConfig]):
    def load(self):
        for i in range(16):
            yield DialogueTask(vf.TaskData(prompt=f"count {i}", id=f"d{i}"), self.config.task)


class DialogueConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()
    turns: int = 3


class DialogueEnv(vf.Env[DialogueConfig]):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            segment = await chat.turn()
            for _ in range(self.config.turns - 1):
                if segment.terminated:
                    break
                segment = await chat.turn("again")


__all__ = ["DialogueTaskset", "DialogueEnv"]

"""A small deterministic environment for sampler tests (no model needed)."""

from __future__ import annotations

from services.sampler.rollouts.envs.base import Completion, Environment, Example, Reward


async def _has_digit(example: Example, completion: Completion) -> float:
    return float(any(ch.isdigit() for ch in completion.text))


async def _length(example: Example, completion: Completion) -> float:
    return min(len(completion.token_ids), 8) / 8


class CountEnv(Environment):
    """`size` prompts "count <i>"; rewards: any digit in the output, and output length."""

    name = "count"
    rewards = (Reward("digit", _has_digit, 1.0), Reward("length", _length, 0.5))

    def __init__(self, size: int = 50):
        self.size = int(size)

    def examples(self, split):
        return [Example(f"count/{split}/{i}", f"count {i}", answer=i) for i in range(self.size)]


async def _constant(example: Example, completion: Completion) -> float:
    return 1.0


async def _odd_prompts_vary(example: Example, completion: Completion) -> float:
    # Prompts with an even number score 1 for every completion (no variance);
    # odd ones score by the completion's length, which varies within a group.
    if example.answer % 2 == 0:
        return 1.0
    return len(completion.token_ids) / 16


class ConstEnv(CountEnv):
    """Every completion scores 1: every group has zero reward variance."""

    name = "const"
    rewards = (Reward("one", _constant, 1.0),)


class HalfFlatEnv(CountEnv):
    """Groups of even-numbered prompts have zero variance; odd ones do not."""

    name = "halfflat"
    rewards = (Reward("mixed", _odd_prompts_vary, 1.0),)

    def examples(self, split):
        return [Example(f"halfflat/{split}/{i}", f"half {i}", answer=i) for i in range(self.size)]


class LetterEnv(CountEnv):
    """A second lesson for curriculum tests, with its own prompt ids."""

    name = "letter"

    def examples(self, split):
        return [Example(f"letter/{split}/{i}", f"letter {chr(97 + i % 26)}", answer=i) for i in range(self.size)]


# --- multi-turn ------------------------------------------------------------------------------

from services.sampler.rollouts.envs.multiturn import Conversation, MultiTurnEnvironment  # noqa: E402


async def _turns(example: Example, completion: Completion) -> float:
    return float(len(completion.conversation.turns))


class EchoDialogue(MultiTurnEnvironment):
    """`size` prompts; the environment answers every model turn with "next <k>" until
    `max_turns`. `fail` makes env_response raise: "always", "first" (each trajectory's first
    attempt only, remembered per prompt and sample) or "odd" (always, for odd prompts only);
    `sleep` makes it take that long (async)."""

    name = "echo_dialogue"
    rewards = (Reward("turns", _turns, 1.0),)

    def __init__(self, size: int = 20, max_turns: int = 3, fail: str = "", sleep: float = 0.0):
        self.size, self.max_turns, self.fail, self.sleep = int(size), int(max_turns), str(fail), float(sleep)
        self.failed: set[str] = set()

    def examples(self, split):
        return [Example(f"echo/{split}/{i}", f"hello {i}", answer=i) for i in range(self.size)]

    async def env_response(self, convo: Conversation):
        import asyncio

        if self.sleep:
            await asyncio.sleep(self.sleep)
        key = f"{convo.example.prompt_id}/{id(convo)}"
        if self.fail == "always" or (self.fail == "odd" and convo.example.answer % 2):
            raise RuntimeError(f"env broke on {convo.example.prompt_id}")
        if self.fail == "first" and convo.example.prompt_id not in self.failed:
            self.failed.add(convo.example.prompt_id)
            raise RuntimeError(f"env broke once on {key}")
        return [{"role": "user", "content": f"next {len(convo.turns)}"}]


def broken_env(missing: str = "") -> Environment:
    """A native environment factory that fails as user code does while it builds: an import of
    a package that is not installed (`missing`), else a plain error."""
    if missing:
        __import__(missing)
    raise RuntimeError("the prompt file could not be parsed at line 3")

"""Multi-turn environments: a conversation between the model and the environment (a user, a
game, a checker) or its tools, trained on as one sample.

Subclass `MultiTurnEnvironment`, give it `examples` and `rewards` as for a single-turn
environment, and say what the environment answers after each model turn:

    class Quiz(MultiTurnEnvironment):
        name = "quiz"
        max_turns = 3

        def initial_messages(self, example):
            return [{"role": "user", "content": example.prompt}]

        async def env_response(self, convo):
            if convo.turns[-1].text.strip() == convo.example.answer:
                return None                      # ends the conversation
            return [{"role": "user", "content": "no, try again"}]

The sampler renders every message with the served model's chat template, as token ids, and
appends them to the ids the model sampled: nothing the model sampled is turned back into
text and tokenized again, so the tokens the trainer learns from are the tokens sampled
(docs/environments.md). `convo.messages` is the conversation as messages for the
environment's own logic; it is never re-rendered.

Tools: set `tools` to `Tool`s. The model calls one by writing a `<tool_call>` block
(shared/toolcalls.py); the sampler runs it with its timeout and answers with a `tool`
message, masked out of the loss. A turn with tool calls is answered by the tools; any other
turn by `env_response`. A tool that raises or times out answers the model with an error
message and is counted; it never ends the conversation.

Every hook may be `async def` or plain `def`: a plain function (and a plain reward function)
runs in the sampler's worker threads (setting `env_workers`), off the event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.sampler.rollouts.envs.base import Environment, Example
from shared.toolcalls import ToolCall

Message = dict[str, Any]


@dataclass(frozen=True)
class Tool:
    """A function the model may call. `fn` takes the call's arguments as keyword arguments
    and returns a string (anything else is sent as JSON); `parameters` is its JSON schema."""

    name: str
    fn: Callable[..., Any]
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    timeout: float = 10.0

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"tool name {self.name!r}: use letters, digits, '_' and '-'")
        if self.parameters.get("type") != "object":
            raise ValueError(f"tool {self.name!r}: parameters must be a JSON schema of type 'object'")
        if not self.timeout > 0:
            raise ValueError(f"tool {self.name!r}: timeout must be > 0 seconds, got {self.timeout}")

    def schema(self) -> dict[str, Any]:
        """The tool as chat templates and OpenAI servers take it."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


@dataclass
class Turn:
    """One model turn: what it sampled, and the tool calls read from the text."""

    text: str
    token_ids: list[int]
    finish_reason: str
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class Conversation:
    """A trajectory in progress, as the environment sees it."""

    example: Example
    messages: list[Message]
    turns: list[Turn] = field(default_factory=list)
    # The environment's own scratch space for this trajectory.
    state: dict[str, Any] = field(default_factory=dict)
    tool_calls: int = 0
    tool_errors: int = 0
    # Why the conversation ended: "env" (env_response said so), "max_turns", "length".
    ended_by: str | None = None

    @property
    def last(self) -> Turn:
        return self.turns[-1]


class MultiTurnEnvironment(Environment):
    """Base class of conversations; see the module docstring."""

    max_turns: int = 3
    tools: Sequence[Tool] = ()

    def initial_messages(self, example: Example) -> list[Message]:
        """The conversation's opening messages (system and user)."""
        return [{"role": "user", "content": self.format_prompt(example)}]

    async def env_response(self, convo: Conversation) -> list[Message] | None:
        """The messages after the model's last turn (`convo.last`); None or [] ends the
        conversation. The default ends it: a tool-only environment needs nothing more."""
        return None

    def check(self) -> None:
        """Refuse bad settings at start-up, naming them (called by the sampler)."""
        if not isinstance(self.max_turns, int) or self.max_turns < 1:
            raise ValueError(f"{self.name}: max_turns must be an integer >= 1, got {self.max_turns!r}")
        names = [tool.name for tool in self.tools]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.name}: tool names must be unique, got {names}")

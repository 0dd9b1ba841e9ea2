"""Tool calls in sampled text: the one format the CPU inference server, the stand-in and the
sampler agree on.

A model asks for a tool by writing, anywhere in its answer, one block per call:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2+3"}}
    </tool_call>

This is the Hermes format (Qwen 2.5/3, Hermes, many fine-tunes; vLLM's `hermes` tool parser
reads it), so a model trained here calls tools the same way under `vllm serve
--tool-call-parser hermes`. `parse_tool_calls` turns text into the content before the first
call and the calls in order; a block whose body is not a JSON object with a string `name`
becomes a `ToolCall` with `error` set, so the caller can tell the model what was wrong
instead of dropping the turn. An opening tag without its closing tag (an answer cut off by
max_tokens) is not a call: it stays in the content.

Tool calls are read from the text; the token ids the model sampled are never rebuilt from
it (the sampler appends the tool's answer after the sampled ids, see
services/sampler/rollouts/multiturn).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


@dataclass
class ToolCall:
    """One call: `arguments` a JSON object; `error` says why the block could not be read."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    id: str = ""
    error: str | None = None

    def openai(self) -> dict[str, Any]:
        """The call as an OpenAI `tool_calls` entry (arguments as a JSON string)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments)}}


def parse_tool_calls(text: str, id_prefix: str = "call") -> tuple[str, list[ToolCall]]:
    """(content before the first call, the calls in order) of `text`. Call ids are
    `id_prefix` + a three-digit index: unique within the answer."""
    if OPEN not in text:
        return text, []
    calls: list[ToolCall] = []
    for i, match in enumerate(_BLOCK.finditer(text)):
        body = match.group(1).strip()
        call_id = f"{id_prefix}{i:03d}"
        try:
            value = json.loads(body)
        except ValueError as exc:
            calls.append(ToolCall("", id=call_id, error=f"the tool call is not valid JSON ({exc.msg} at {exc.pos})"))
            continue
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
            calls.append(ToolCall("", id=call_id, error='a tool call must be a JSON object with a "name" string'))
            continue
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
        if not isinstance(arguments, dict):
            calls.append(ToolCall(value["name"], id=call_id, error='"arguments" must be a JSON object'))
            continue
        calls.append(ToolCall(value["name"], arguments, id=call_id))
    if not calls:
        return text, []
    return text[: text.index(OPEN)].rstrip(), calls


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The text of one call, as a model should write it (for templates, scripts and docs)."""
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CLOSE}"

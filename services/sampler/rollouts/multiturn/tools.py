"""Running the model's tool calls. Every call gets a `tool` message back, whatever happened:
its result, or an error that tells the model what went wrong (an unknown tool, arguments
that do not fit the schema, an exception, a timeout). A failing tool is counted and logged;
it never ends the trajectory, so the model can learn to call tools well."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from typing import Any

from services.sampler.rollouts.envs.multiturn import Message, Tool
from services.sampler.rollouts.multiturn.stats import EnvCounts
from services.sampler.rollouts.multiturn.workers import Workers
from shared.toolcalls import ToolCall

log = logging.getLogger("tandem.sampler.tools")

_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool,
               "object": dict, "array": list}


def check_arguments(tool: Tool, arguments: dict[str, Any]) -> str | None:
    """What is wrong with `arguments` for `tool`'s schema (required keys, unknown keys when
    additionalProperties is false, top-level types), or None."""
    schema = tool.parameters
    properties = schema.get("properties", {})
    missing = [name for name in schema.get("required", []) if name not in arguments]
    if missing:
        return f"missing required argument(s) {', '.join(missing)}"
    if schema.get("additionalProperties") is False:
        unknown = sorted(set(arguments) - set(properties))
        if unknown:
            return f"unknown argument(s) {', '.join(unknown)}; {tool.name} takes {', '.join(properties) or 'none'}"
    for name, value in arguments.items():
        expected = _JSON_TYPES.get(properties.get(name, {}).get("type", ""))
        if expected is not None and (not isinstance(value, expected) or (expected is not bool and isinstance(value, bool))):
            return f"argument {name!r} must be of type {properties[name]['type']}, got {json.dumps(value)}"
    return None


async def run_tool_calls(calls: Sequence[ToolCall], tools: dict[str, Tool], workers: Workers,
                         counts: EnvCounts, env_name: str) -> tuple[list[Message], int]:
    """One `tool` message per call, in order (the calls run concurrently), and how many failed."""
    answers = await asyncio.gather(*(_one(call, tools, workers, counts, env_name) for call in calls))
    return [message for message, _ in answers], sum(failed for _, failed in answers)


async def _one(call: ToolCall, tools: dict[str, Tool], workers: Workers, counts: EnvCounts,
               env_name: str) -> tuple[Message, bool]:
    counts.tool_calls += 1
    tool = tools.get(call.name)
    if call.error is not None:
        error = call.error
    elif tool is None:
        error = f"there is no tool named {call.name!r}; the tools are {', '.join(sorted(tools))}"
    else:
        error = check_arguments(tool, call.arguments)
    if error is not None:
        counts.tool_errors += 1
    else:
        assert tool is not None
        try:
            result = await asyncio.wait_for(workers.call(tool.fn, **call.arguments), tool.timeout)
        except asyncio.TimeoutError:
            counts.tool_timeouts += 1
            error = f"{tool.name} did not answer within {tool.timeout:g} s"
        except Exception as exc:  # noqa: BLE001 - any tool failure goes back to the model
            counts.tool_errors += 1
            error = f"{tool.name} failed: {type(exc).__name__}: {exc}"
        else:
            content = result if isinstance(result, str) else json.dumps(result, default=str)
            return {"role": "tool", "content": content, "tool_call_id": call.id, "name": tool.name}, False
    counts.last_error = f"tool call {call.name or '?'}: {error}"
    log.info("environment %r: tool call %s: %s", env_name, call.name or "?", error)
    return {"role": "tool", "content": f"error: {error}", "tool_call_id": call.id, "name": call.name}, True

"""Chat messages to prompt token ids, with the model's chat template (POST /v1/chat/completions
and POST /tokenize with `messages`), and the request's `tools` and `tool_choice`, read as
`vllm serve --enable-auto-tool-choice --tool-call-parser hermes` reads them."""

from __future__ import annotations

from typing import Any

from services.inference import protocol as P
from services.inference.request_error import RequestError
from services.inference.tokenizer import template_messages

# What a caller who wanted a forced call can do instead; vLLM forces one with guided decoding.
_NO_FORCED_CALLS = ("the CPU inference server cannot force a tool call (vLLM does it with guided "
                    "decoding, which this server lacks): send tool_choice \"auto\" (the default with tools; "
                    "calls the model writes are returned as tool_calls) or \"none\", or serve the model with vLLM")


def render_chat(tokenizer, messages: list[P.ChatMessage], add_generation_prompt: bool,
                continue_final_message: bool, extra: dict[str, Any] | None,
                tools: list[dict[str, Any]] | None = None) -> list[int]:
    convo = template_messages([m.model_dump(exclude_none=True) for m in messages])
    # Passed only when given, so a template that does not know `tools` renders as it always did.
    kwargs = {**(extra or {}), **({"tools": tools} if tools else {})}
    try:
        text = tokenizer.apply_chat_template(
            convo, tokenize=False, add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message, **kwargs,
        )
    except Exception as exc:  # noqa: BLE001 - jinja errors or no template: the request's or the model's fault
        raise RequestError(f"could not apply the chat template: {exc}", param="messages") from None
    # The template already wrote every special token the model expects.
    return tokenizer.encode(text, add_special_tokens=False)


def check_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """`tools` if every entry is an OpenAI function tool, else a 400 naming the first bad entry.
    `type` may be left out (vLLM defaults it to "function"); an empty list is no tools."""
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise RequestError(f"{where} must be an object "
                               '{"type": "function", "function": {"name": ..., "parameters": {...}}}', param="tools")
        if tool.get("type", "function") != "function":
            raise RequestError(f'{where}.type must be "function", got {tool["type"]!r}', param="tools")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise RequestError(f'{where}.function must be an object with a "name"', param="tools")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestError(f"{where}.function.name must be a non-empty string", param="tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise RequestError(f"{where}.function.parameters must be a JSON Schema object", param="tools")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise RequestError(f"{where}.function.description must be a string", param="tools")
    return tools or None


def parses_tool_calls(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None) -> bool:
    """Whether the answers are read for tool calls: tool_choice "auto", the default when tools
    are given. "none" renders the tools but reads nothing; "required" and a named function are a
    400, since vLLM forces those with guided decoding."""
    if tool_choice is None:
        return bool(tools)
    if tool_choice == "none":
        return False
    if tools is None:
        raise RequestError("tool_choice needs tools: give tools, or leave tool_choice out", param="tool_choice")
    if tool_choice == "auto":
        return True
    if tool_choice == "required":
        raise RequestError(f'tool_choice "required" is not supported: {_NO_FORCED_CALLS}', param="tool_choice")
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if isinstance(fn, dict) and isinstance(fn.get("name"), str):
        raise RequestError(f"tool_choice naming the function {fn['name']!r} is not supported: {_NO_FORCED_CALLS}",
                           param="tool_choice")
    raise RequestError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                       f'{{"name": ...}}}}, got {tool_choice!r}', param="tool_choice")

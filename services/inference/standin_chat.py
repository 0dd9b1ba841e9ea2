"""The tiny model's chat template rendered without transformers, for the stand-in's
`POST /tokenize` with `messages`: the same text `tokenizer.apply_chat_template` writes for the
CPU server (tests/inference/test_inference_chat_template.py compares them), so a sampler that renders
conversations through the stand-in gets what it would get from a server of the tiny model.

Only what CHAT_TEMPLATE needs of transformers' rendering is reproduced: its Jinja sandbox with
`trim_blocks` / `lstrip_blocks`, its `tojson` (json.dumps, non-ASCII kept, no HTML escaping,
unlike Jinja's own filter) and its `continue_final_message` (the text ends where the final
message's content does).
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

from services.inference.tokenizer import CHAT_TEMPLATE, template_messages

# Marks where the final message's content ends, to cut the text there (continue_final_message).
_CONTINUE_TAG = "\x00TANDEM_CONTINUE_FINAL_MESSAGE\x00"


class ChatTemplateError(ValueError):
    """The messages or tools cannot be rendered: the request's fault (a 400)."""


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@cache
def _template():
    # Imported here: only `POST /tokenize` with messages needs Jinja, not the rest of the stand-in.
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    return env.from_string(CHAT_TEMPLATE)


def render_chat_text(messages: Any, tools: Any = None, add_generation_prompt: bool = True,
                     continue_final_message: bool = False, extra: dict[str, Any] | None = None) -> str:
    """The text of `messages` (OpenAI chat messages) under CHAT_TEMPLATE, as the CPU server
    renders it; ChatTemplateError says what is wrong with the input."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                 for m in messages):
        raise ChatTemplateError('messages must be a list of objects with a "role" string')
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ChatTemplateError("tools must be a list of objects")
    if extra is not None and not isinstance(extra, dict):
        raise ChatTemplateError("chat_template_kwargs must be an object")
    convo = template_messages(messages)
    if continue_final_message:
        if not convo:
            raise ChatTemplateError("continue_final_message needs a final message to continue")
        convo[-1] = {**convo[-1], "content": convo[-1]["content"] + _CONTINUE_TAG}
    variables = {**(extra or {}), "messages": convo, "tools": tools or None,
                 "add_generation_prompt": add_generation_prompt and not continue_final_message}
    try:
        text = _template().render(**variables)
    except Exception as exc:  # noqa: BLE001 - Jinja and json errors: the input does not fit the template
        raise ChatTemplateError(f"could not apply the chat template: {exc}") from None
    if continue_final_message:
        text = text[:text.rindex(_CONTINUE_TAG)]
    return text

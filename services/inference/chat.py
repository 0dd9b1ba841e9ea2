"""Chat messages to prompt token ids, with the model's chat template (POST /v1/chat/completions
and POST /tokenize with `messages`)."""

from __future__ import annotations

from typing import Any

from services.inference import protocol as P
from services.inference.engine import RequestError


def render_chat(tokenizer, messages: list[P.ChatMessage], add_generation_prompt: bool,
                continue_final_message: bool, extra: dict[str, Any] | None) -> list[int]:
    convo = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in messages]
    try:
        text = tokenizer.apply_chat_template(
            convo, tokenize=False, add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message, **(extra or {}),
        )
    except Exception as exc:  # noqa: BLE001 - jinja errors or no template: the request's or the model's fault
        raise RequestError(f"could not apply the chat template: {exc}", param="messages") from None
    # The template already wrote every special token the model expects.
    return tokenizer.encode(text, add_special_tokens=False)

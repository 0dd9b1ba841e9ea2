"""A character-level tokenizer built locally (no hub): every printable ASCII character,
"\\n" and "\\t" is one token, so any prompt or answer of the built-in environments
round-trips exactly through `encode`/`decode(skip_special_tokens=True)`.

Special tokens follow the ChatML convention so vLLM and the CPU server treat them alike:
`<|endoftext|>` (pad), `<|im_start|>` / `<|im_end|>` (chat turns; `<|im_end|>` is also the
EOS token, so a chat answer and a plain completion end the same way, even under vLLM's
`--generation-config vllm`, which ignores generation_config.json), `<|unk|>` for anything else.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

PAD, IM_START, IM_END, UNK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|unk|>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END, UNK]
# Printable ASCII without the vertical whitespace that never occurs in prompts, plus \n and \t.
CHARACTERS = [chr(c) for c in range(0x20, 0x7F)] + ["\n", "\t"]
assert set(CHARACTERS) >= set(string.ascii_letters + string.digits + string.punctuation + " \n\t")

# ChatML: "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n". Given `tools`, the template
# first writes a system block of its own: TOOL_INSTRUCTION, then one line per tool (its name,
# and its description and parameters when given, in that order, so a tool rendered from vLLM's
# request model, which fills the missing ones with null, renders as the same text). It is a block
# of its own, not merged into a leading system message: then every conversation renders as a
# prefix of its continuations, even the empty one, which multi-turn rollouts rely on
# (services/sampler/rollouts/multiturn/render.py). An assistant message's `tool_calls` follow its content,
# one Hermes block each (shared/toolcalls.py), separated by "\n"; arguments given as a dict are
# written as JSON, a string as it is (vLLM and chat.py decode JSON strings to dicts first). A
# "tool" message is an ordinary turn: "<|im_start|>tool\n{content}<|im_end|>\n". Without tools
# and tool calls the text is exactly what the first, tool-less template wrote.
TOOL_INSTRUCTION = ('To call a tool, write {"name": <tool name>, "arguments": <JSON object>} between '
                    '<tool_call> and </tool_call>. Tools:')
assert "'" not in TOOL_INSTRUCTION and "\\" not in TOOL_INSTRUCTION  # spliced into a Jinja '...' literal
CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n" + TOOL_INSTRUCTION + "\\n' -}}"
    "{%- for tool in tools -%}"
    "{%- set fn = tool['function'] if tool['function'] is defined else tool -%}"
    "{{- '{\"name\": ' + (fn['name'] | tojson) -}}"
    "{%- if fn['description'] -%}{{- ', \"description\": ' + (fn['description'] | tojson) -}}{%- endif -%}"
    "{%- if fn['parameters'] -%}{{- ', \"parameters\": ' + (fn['parameters'] | tojson) -}}{%- endif -%}"
    "{{- '}\\n' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') -}}"
    "{%- for call in message['tool_calls'] or [] -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{%- set args = fn['arguments'] if fn['arguments'] is defined and fn['arguments'] is not none else {} -%}"
    "{%- if message['content'] or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": ' + (fn['name'] | tojson) + ', \"arguments\": ' -}}"
    "{{- args if args is string else args | tojson -}}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

MODEL_MAX_LENGTH = 2048


def build_core():
    """The `tokenizers.Tokenizer` behind `build_tokenizer()`: WordLevel over SPECIAL_TOKENS +
    CHARACTERS (ids in that order). Needs only the `tokenizers` library, so `init_model` can
    write tokenizer.json without importing transformers."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # One piece per character; `[\s\S]` so that "\n" is a character like any other.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # WordLevel would join pieces with spaces; characters concatenate.
    core.decoder = decoders.Fuse()
    # What transformers 5 installs when a tokenizer has none and adds neither BOS nor EOS
    # (update_post_processor); set here so that tokenizer.json is the same with or without it.
    core.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
    core.add_special_tokens(SPECIAL_TOKENS)
    return core


def build_tokenizer():
    """A `PreTrainedTokenizerFast` over `build_core()`."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=build_core(),
        pad_token=PAD,
        eos_token=IM_END,
        unk_token=UNK,
        additional_special_tokens=[IM_START],
        clean_up_tokenization_spaces=False,
        model_max_length=MODEL_MAX_LENGTH,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def write_tokenizer_files(directory: str | Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja into `directory`, byte
    for byte what `build_tokenizer().save_pretrained(directory)` writes with transformers 5.24,
    plus the chat template in tokenizer_config.json; without importing transformers (the demo's
    start-up waits for this). tests/inference/test_inference_init_model.py checks the bytes."""
    directory = Path(directory)
    build_core().save(str(directory / "tokenizer.json"))  # pretty, as transformers saves it
    config = {
        "backend": "tokenizers",
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "extra_special_tokens": [IM_START],
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": PAD,
        "tokenizer_class": "TokenizersBackend",
        "unk_token": UNK,
        # Newer transformers writes the template only to chat_template.jinja; older readers
        # (and some vLLM versions) look in tokenizer_config.json.
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages as CHAT_TEMPLATE reads them, so that the CPU server and the stand-in give it
    what vLLM gives it: `content` a string (the text parts of a list, "" for null), and a tool
    call's `arguments` a dict when they arrive as a JSON string (OpenAI clients send strings;
    vLLM decodes them before templating). Other arguments stay as they are. Copies, never edits."""
    out = []
    for message in messages:
        message = {**message, "content": message_text(message.get("content"))}
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            message["tool_calls"] = [_decoded_arguments(call) for call in calls]
        out.append(message)
    return out


def message_text(content: Any) -> str:
    """A message's `content` as text: a string as is, the text parts of a list joined, null as ""."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content
                       if isinstance(part, dict) and part.get("type", "text") == "text")
    return str(content)


def _decoded_arguments(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        arguments = json.loads(fn["arguments"])
    except ValueError:
        return call  # not JSON: the template writes the string as the model wrote it
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**fn, "arguments": arguments}}

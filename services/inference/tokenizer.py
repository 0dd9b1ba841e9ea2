"""A character-level tokenizer built locally (no hub): every printable ASCII character,
"\\n" and "\\t" is one token, so any prompt or answer of the built-in environments
round-trips exactly through `encode`/`decode(skip_special_tokens=True)`.

Special tokens follow the ChatML convention so vLLM and the CPU server treat them alike:
`<|endoftext|>` (pad), `<|im_start|>` / `<|im_end|>` (chat turns; `<|im_end|>` is also the
EOS token, so a chat answer and a plain completion end the same way, even under vLLM's
`--generation-config vllm`, which ignores generation_config.json), `<|unk|>` for anything else.
"""

from __future__ import annotations

import string

PAD, IM_START, IM_END, UNK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|unk|>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END, UNK]
# Printable ASCII without the vertical whitespace that never occurs in prompts, plus \n and \t.
CHARACTERS = [chr(c) for c in range(0x20, 0x7F)] + ["\n", "\t"]
assert set(CHARACTERS) >= set(string.ascii_letters + string.digits + string.punctuation + " \n\t")

# ChatML: "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n".
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def build_tokenizer():
    """A `PreTrainedTokenizerFast` over SPECIAL_TOKENS + CHARACTERS (ids in that order)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # One piece per character; `[\s\S]` so that "\n" is a character like any other.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # WordLevel would join pieces with spaces; characters concatenate.
    core.decoder = decoders.Fuse()
    core.add_special_tokens(SPECIAL_TOKENS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=IM_END,
        unk_token=UNK,
        additional_special_tokens=[IM_START],
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok

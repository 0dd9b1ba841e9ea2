"""A tokenizer of the stand-in's tokens (services/inference/standin.py: token id = byte value,
id 0 = EOS), with the tiny model's chat template: what a sampler must load to render turns the
stand-in reads (a verifiers environment renders locally, services/sampler/rollouts/vf/renderer.py).
Chat markup is plain text here, as the stand-in sees it: `<|im_end|>` is ten bytes."""

from __future__ import annotations

from pathlib import Path


def save_byte_tokenizer(directory: Path) -> Path:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from services.inference.tokenizer import CHAT_TEMPLATE

    vocab = {chr(i): i for i in range(128)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="\x7f"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="\x00", unk_token="\x7f",
                                  clean_up_tokenization_spaces=False)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(directory)
    return directory

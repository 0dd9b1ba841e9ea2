"""The Tandem renderer (services/sampler/rollouts/vf/renderer.py) against the tiny model's own chat
template: full renders are the template's, and a bridge keeps sampled ids verbatim."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from services.sampler.rollouts.vf.renderer import TandemRenderer

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path):
    return AutoTokenizer.from_pretrained(tiny_model)


def template_ids(tokenizer, messages, tools=None, generation_prompt=True) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                         **({"tools": tools} if tools else {}))
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_a_render_is_the_templates_with_each_token_attributed(tokenizer, tools) -> None:
    renderer = TandemRenderer(tokenizer)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "even or odd? 12"}]
    rendered = renderer.render(messages, tools=tools, add_generation_prompt=True)
    assert rendered.token_ids == template_ids(tokenizer, messages, tools)
    spans = rendered.message_token_spans()
    assert len(spans) == 2 and spans[1][1] < len(rendered.token_ids)  # the generation prompt is nobody's
    assert tokenizer.decode(rendered.token_ids[slice(*spans[1])]).endswith("even or odd? 12<|im_end|>\n")


def test_a_bridge_extends_the_sampled_ids_as_they_are(tokenizer) -> None:
    renderer = TandemRenderer(tokenizer)
    prompt = template_ids(tokenizer, [{"role": "user", "content": "hi"}])
    im_start, im_end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    # A stray special token inside the answer: its text (parsed, special tokens dropped) would
    # re-render without it, so a re-render would not extend these ids. The bridge keeps them.
    sampled = tokenizer.encode("a", add_special_tokens=False) + [im_start] + tokenizer.encode("b") + [im_end]
    bridged = renderer.bridge_to_next_turn(prompt, sampled, [{"role": "user", "content": "again"}])
    assert bridged.token_ids[: len(prompt) + len(sampled)] == prompt + sampled
    assert tokenizer.decode(bridged.token_ids[len(prompt) + len(sampled):]) == \
        "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    assert bridged.message_indices[: len(prompt) + len(sampled)] == [-1] * (len(prompt) + len(sampled))
    assert renderer.parse_response(sampled).content == "ab"


def test_an_answer_cut_off_by_max_tokens_gets_the_close_it_did_not_sample(tokenizer) -> None:
    renderer = TandemRenderer(tokenizer)
    prompt = template_ids(tokenizer, [{"role": "user", "content": "hi"}], TOOLS)
    cut = tokenizer.encode("abc", add_special_tokens=False)  # no <|im_end|>: max_tokens ended it
    tool_turn = [{"role": "tool", "tool_call_id": "call000", "content": "5"}]
    bridged = renderer.bridge_to_next_turn(prompt, cut, tool_turn, tools=TOOLS)
    assert tokenizer.decode(bridged.token_ids[len(prompt) + len(cut):]) == \
        "<|im_end|>\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    # The same conversation rendered whole (the answer's text as the assistant's message) agrees.
    whole = template_ids(tokenizer, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "abc"},
                                     *tool_turn], TOOLS)
    assert bridged.token_ids == whole


def test_an_assistant_message_nobody_sampled_is_not_bridged(tokenizer) -> None:
    renderer = TandemRenderer(tokenizer)
    assert renderer.bridge_to_next_turn([1, 2], [3], [{"role": "assistant", "content": "x"}]) is None


def test_tool_calls_are_read_in_the_hermes_format_and_turns_stop_at_im_end(tokenizer) -> None:
    renderer = TandemRenderer(tokenizer)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert renderer.get_stop_token_ids() == [im_end]
    text = 'sure\n<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>'
    ids = tokenizer.encode(text, add_special_tokens=False) + [im_end]
    parsed = renderer.parse_response(ids, tools=TOOLS)
    assert parsed.content == "sure"
    assert [(c.name, c.arguments, c.status.value) for c in parsed.tool_calls] == [("add", {"a": 2}, "ok")]
    broken = renderer.parse_response(tokenizer.encode("<tool_call>\n{oops\n</tool_call>", add_special_tokens=False),
                                     tools=TOOLS)
    assert broken.tool_calls[0].status.value == "invalid_json"
    assert renderer.parse_response(ids).content == text  # no tools offered: the text as it is


def test_cached_renders_are_the_templates_and_the_cache_is_bounded(tokenizer, monkeypatch) -> None:
    from services.sampler.rollouts.vf import renderer as module

    renderer = TandemRenderer(tokenizer)
    conversations = [[{"role": "user", "content": f"count {i}"}] for i in range(6)]
    for _ in range(2):  # the second round comes from the cache
        for messages in conversations:
            for tools in (None, TOOLS):
                first = renderer.render_ids(messages, tools=tools, add_generation_prompt=True)
                assert first == template_ids(tokenizer, messages, tools)
                first.append(-1)  # a caller's list is its own
                assert renderer.render_ids(messages, tools=tools, add_generation_prompt=True)[-1] != -1
    assert renderer.render_ids(conversations[0], add_generation_prompt=False) == \
        template_ids(tokenizer, conversations[0], generation_prompt=False)
    # Bounded by the ids it holds: the oldest go first, and what is evicted renders again the same.
    one = len(template_ids(tokenizer, conversations[0]))
    monkeypatch.setattr(module, "CACHED_TOKENS", 3 * one)
    small = TandemRenderer(tokenizer)
    for messages in conversations:
        small.render_ids(messages, add_generation_prompt=True)
    assert len(small._rendered_ids) <= 3 and small._rendered_tokens <= 3 * one + 3
    assert small.render_ids(conversations[0], add_generation_prompt=True) == template_ids(tokenizer, conversations[0])


def test_a_template_that_reads_the_clock_is_rendered_each_time(tokenizer) -> None:
    class Clocked:
        chat_template = "{{ strftime_now('%d %b %Y') }}"

        def __getattr__(self, name):
            return getattr(tokenizer, name)

    renderer = TandemRenderer(Clocked())
    messages = [{"role": "user", "content": "hi"}]
    assert renderer.render_ids(messages, add_generation_prompt=True) == template_ids(tokenizer, messages)
    assert not renderer._rendered_ids

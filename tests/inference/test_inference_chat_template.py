"""The tiny model's chat template with tools: byte-identical to the tool-less template when no
tools are given, conversations render as prefixes of their continuations, tool calls render as
the Hermes blocks shared/toolcalls.py reads, and the stand-in's transformers-free rendering
writes exactly what transformers writes."""

from __future__ import annotations

import json

import pytest

from services.inference.standin_chat import ChatTemplateError, render_chat_text
from services.inference.tokenizer import CHAT_TEMPLATE, TOOL_INSTRUCTION, build_tokenizer, template_messages
from shared.toolcalls import format_tool_call, parse_tool_calls

pytestmark = pytest.mark.timeout(30)

# The template as it was before tools (commit 8329ff6): models written then, and every test
# that pins a prompt, depend on the new one rendering tool-less conversations the same.
TOOL_LESS_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

TOOLS = [
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "clock"}},
]

# Every kind of turn: system, user, assistant with content and two calls (arguments as a dict
# and as the JSON string OpenAI clients send), tool answers, a call without content, a final answer.
CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is 2 + 3, and what time is it?"},
    {"role": "assistant", "content": "Let me see.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}},
        {"id": "c2", "type": "function", "function": {"name": "clock", "arguments": '{"zone": "UTC"}'}},
    ]},
    {"role": "tool", "tool_call_id": "c1", "content": "5"},
    {"role": "tool", "tool_call_id": "c2", "content": "12:00"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c3", "type": "function", "function": {"name": "add", "arguments": {"a": 5, "b": 0}}}]},
    {"role": "tool", "tool_call_id": "c3", "content": "5"},
    {"role": "assistant", "content": "5, at 12:00."},
]

TOOL_LESS_CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?\n\tthanks <&> 'q' \"d\""}],
    [{"role": "user", "content": ""}, {"role": "assistant", "content": "empty question"}],
    [{"role": "tool", "content": "a tool's answer, without tools given"}],
]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def render(tok, messages, tools=None, add_generation_prompt=False, template=CHAT_TEMPLATE, **kwargs) -> str:
    if not messages:
        # transformers refuses an empty conversation; the stand-in's rendering (the same text
        # for every other conversation, test_the_standins_rendering_is_transformers) does not.
        assert template == CHAT_TEMPLATE and not kwargs
        return render_chat_text([], tools, add_generation_prompt)
    if tools is not None:
        kwargs["tools"] = tools
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                   chat_template=template, **kwargs)


@pytest.mark.parametrize("messages", TOOL_LESS_CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_without_tools_the_text_is_the_tool_less_templates(tok, messages, add_generation_prompt) -> None:
    old = render(tok, messages, add_generation_prompt=add_generation_prompt, template=TOOL_LESS_TEMPLATE)
    assert render(tok, messages, add_generation_prompt=add_generation_prompt) == old
    # No tools, however said: an empty list and None are no tools.
    assert render(tok, messages, [], add_generation_prompt) == old
    assert render(tok, messages, None, add_generation_prompt) == old


def test_continuing_a_final_message_is_unchanged_without_tools(tok) -> None:
    messages = [{"role": "user", "content": "Count:"}, {"role": "assistant", "content": "1, 2,"}]
    old = render(tok, messages, template=TOOL_LESS_TEMPLATE, continue_final_message=True)
    assert old.endswith("<|im_start|>assistant\n1, 2,")
    assert render(tok, messages, continue_final_message=True) == old


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["without-tools", "with-tools"])
def test_every_conversation_is_a_prefix_of_its_continuation(tok, tools) -> None:
    texts = [render(tok, CONVERSATION[:k], tools) for k in range(len(CONVERSATION) + 1)]
    for k in range(len(CONVERSATION)):
        assert texts[k + 1].startswith(texts[k]), f"messages[:{k}] is not a prefix of messages[:{k + 1}]"
        assert len(texts[k + 1]) > len(texts[k])
        if CONVERSATION[k]["role"] == "assistant":
            # The generation prompt is where the model's answer starts: what it writes follows it.
            prompt = render(tok, CONVERSATION[:k], tools, add_generation_prompt=True)
            assert texts[k + 1].startswith(prompt)


def test_tools_come_first_in_a_system_block_of_their_own(tok) -> None:
    text = render(tok, CONVERSATION[:2], TOOLS)
    block = (
        "<|im_start|>system\n" + TOOL_INSTRUCTION + "\n"
        '{"name": "add", "description": "Add two integers.", "parameters": '
        + json.dumps(TOOLS[0]["function"]["parameters"]) + "}\n"
        '{"name": "clock"}\n'
        "<|im_end|>\n"
    )
    assert text == block + render(tok, CONVERSATION[:2])
    assert "<tool_call>" in TOOL_INSTRUCTION and "</tool_call>" in TOOL_INSTRUCTION
    # A tool as vLLM's request model hands it to the template (missing fields filled with null)
    # renders as the tool as sent, so vLLM and the CPU server write the same prompt.
    vllm_shaped = [{"type": "function", "function": {"name": "clock", "description": None, "parameters": None}}]
    assert render(tok, [], vllm_shaped) == render(tok, [], TOOLS[1:])


def test_assistant_tool_calls_render_as_hermes_blocks(tok) -> None:
    text = render(tok, CONVERSATION[:3])
    turn = text[text.rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n"):]
    # The JSON-string arguments render as JSON, exactly as a dict would.
    assert turn == ("Let me see.\n" + format_tool_call("add", {"a": 2, "b": 3}) + "\n"
                    + format_tool_call("clock", {"zone": "UTC"}) + "<|im_end|>\n")
    # What the template writes for a call is what the parser reads back.
    content, calls = parse_tool_calls(turn.removesuffix("<|im_end|>\n"))
    assert content == "Let me see."
    assert [(c.name, c.arguments, c.error) for c in calls] == [("add", {"a": 2, "b": 3}, None),
                                                              ("clock", {"zone": "UTC"}, None)]
    # A call without content starts the turn; a tool's answer is a turn of role "tool".
    text = render(tok, CONVERSATION[:7])
    assert ("<|im_start|>assistant\n" + format_tool_call("add", {"a": 5, "b": 0}) + "<|im_end|>\n"
            "<|im_start|>tool\n5<|im_end|>\n") in text


def test_arguments_that_are_not_json_are_written_as_sent(tok) -> None:
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": "{a: 2"}}]}
    assert template_messages([call])[0]["tool_calls"] == call["tool_calls"]
    assert render(tok, [call]) == '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {a: 2}\n</tool_call><|im_end|>\n'


CASES = {
    "plain": dict(messages=TOOL_LESS_CONVERSATIONS[1]),
    "generation-prompt": dict(messages=TOOL_LESS_CONVERSATIONS[1], add_generation_prompt=True),
    "tools": dict(messages=CONVERSATION, tools=TOOLS),
    "tools-generation-prompt": dict(messages=CONVERSATION[:5], tools=TOOLS, add_generation_prompt=True),
    "continue": dict(messages=CONVERSATION[:2] + [{"role": "assistant", "content": "It is"}], tools=TOOLS,
                     continue_final_message=True),
    # Characters Jinja's own tojson would escape as HTML, and non-ASCII that json.dumps would escape.
    "escapes": dict(messages=[{"role": "user", "content": "<b> & 'x'"}],
                    tools=[{"type": "function", "function": {"name": "f<&>", "description": "caf\u00e9 'q'"}}]),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_the_standins_rendering_is_transformers(tok, case) -> None:
    messages, tools = case["messages"], case.get("tools")
    gen, cont = case.get("add_generation_prompt", False), case.get("continue_final_message", False)
    # The CPU server hands transformers the messages as vLLM does (chat.render_chat).
    expected = tok.apply_chat_template(template_messages(messages), tools=tools, tokenize=False,
                                       add_generation_prompt=gen, continue_final_message=cont)
    assert render_chat_text(messages, tools, gen, cont) == expected


@pytest.mark.parametrize("messages, tools, fragment", [
    ("hi", None, "messages must be a list"),
    ([{"content": "no role"}], None, "messages must be a list"),
    ([{"role": "user", "content": "x"}], {"name": "f"}, "tools must be a list"),
    ([{"role": "user", "content": "x"}], [{"type": "function", "function": {"description": "no name"}}],
     "could not apply the chat template"),
    ([], None, "continue_final_message needs"),
])
def test_the_standins_rendering_rejects_what_it_cannot_render(messages, tools, fragment) -> None:
    with pytest.raises(ChatTemplateError, match=fragment):
        render_chat_text(messages, tools, continue_final_message=messages == [])

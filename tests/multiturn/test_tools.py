"""Tools, end to end against the stand-in, whose scripted replies play a model that calls
them: the tool runs, its answer reaches the next prompt as a rendered `tool` message masked
out of the loss, and the batch's ids are the sampled ids plus the rendered ones, id for id.
A tool that fails in any way answers the model with an error and never ends the rollout."""

from __future__ import annotations

import time

import httpx
import pytest

from services.inference.standin_chat import render_chat_text
from services.sampler.rollouts.envs.calculator import CalculatorEnv
from services.sampler.rollouts.envs.multiturn import Tool
from shared.toolcalls import format_tool_call
from tests.multiturn.test_token_exact import oracle_messages

pytestmark = pytest.mark.timeout(60)


def script(standin, replies: list[str]) -> None:
    httpx.post(standin.url + "/_standin/configure", json={"replies": replies}).raise_for_status()


def tool_messages(convo) -> list[dict]:
    return [m for m in convo.messages if m["role"] == "tool"]


async def test_a_tool_call_runs_and_its_answer_is_rendered_masked_and_exact(standin, make_rollouts):
    env = CalculatorEnv(num_train=4, num_eval=1)
    example = env.examples("train")[0]
    expression, answer = example.info["expression"], example.answer
    call = format_tool_call("calculator", {"expression": expression})
    script(standin, [f"Let me compute.\n{call}", f"It is {answer}."])
    rollouts = make_rollouts(env, [standin.url], max_tokens=256)
    group = await rollouts.group(example, "g0", min_version=0, seed=1)
    assert group.invalid is None
    schemas = [tool.schema() for tool in env.tools]
    for c, reward, parts in zip(group.completions, group.rewards, group.reward_parts):
        convo = c.conversation
        assert [t.text for t in convo.turns] == [f"Let me compute.\n{call}", f"It is {answer}."]
        assert tool_messages(convo) == [{"role": "tool", "content": answer, "tool_call_id": convo.turns[0].tool_calls[0].id,
                                         "name": "calculator"}]
        assert convo.turns[0].tool_calls[0].arguments == {"expression": expression}
        assert reward == 1.0 and parts == {"correct": 1.0, "used_tool": 1.0}
        # For people (rollout log, dashboard): the turns and the tool's answer as a transcript.
        assert c.text == f"Let me compute.\n{call}\n[tool] {answer}\nIt is {answer}."
        # The tool's answer is in the second turn's prompt, rendered by the template, and masked.
        text = bytes(c.prompt_token_ids + c.token_ids).decode()
        rendered_tool = f"<|im_start|>tool\n{answer}<|im_end|>\n"
        assert rendered_tool in text
        start = len(bytes(c.prompt_token_ids).decode()) + text[len(bytes(c.prompt_token_ids)):].index(rendered_tool) \
            - len(c.prompt_token_ids)
        assert c.loss_mask[start:start + len(rendered_tool)] == [0] * len(rendered_tool)
        # Id for id: the prompt and every id after it are what the template renders for the
        # conversation with the assistant turns as sampled (then the last turn's closing).
        oracle = list(render_chat_text(oracle_messages(convo), schemas, False).encode())
        ours = c.prompt_token_ids + c.token_ids
        assert oracle[:len(ours)] == ours and bytes(oracle[len(ours):]) == b"<|im_end|>\n"
        sampled = [t for turn in convo.turns for t in turn.token_ids]
        assert [t for t, m in zip(c.token_ids, c.loss_mask) if m] == sampled
    counts = rollouts.env_stats.of("calculator")
    assert counts.tool_calls == 4 and counts.tool_errors == 0 and counts.trajectories == 4


def _slow(seconds: float) -> str:
    time.sleep(seconds)
    return "late"


async def _boom(**_: object) -> str:
    raise RuntimeError("the tool broke")


class ToolBox(CalculatorEnv):
    """The calculator, a tool that raises and a synchronous tool slower than its timeout."""

    def __init__(self) -> None:
        super().__init__(num_train=2, num_eval=1, max_turns=2)
        seconds = {"type": "object", "properties": {"seconds": {"type": "number"}}, "required": ["seconds"]}
        self.tools = (*self.tools, Tool("boom", _boom), Tool("slow", _slow, timeout=0.2, parameters=seconds),
                      Tool("nap", _slow, timeout=5.0, parameters=seconds))


@pytest.mark.parametrize("call, error", [
    (format_tool_call("nope", {}), "error: there is no tool named 'nope'; the tools are boom, calculator, nap, slow"),
    (format_tool_call("calculator", {}), "error: missing required argument(s) expression"),
    (format_tool_call("calculator", {"expression": 7}), "error: argument 'expression' must be of type string, got 7"),
    (format_tool_call("calculator", {"expression": "1/0"}), "error: calculator failed: ZeroDivisionError: division by zero"),
    ("<tool_call>\n{not json}\n</tool_call>", "error: the tool call is not valid JSON"),
    (format_tool_call("boom", {}), "error: boom failed: RuntimeError: the tool broke"),
    (format_tool_call("slow", {"seconds": 2}), "error: slow did not answer within 0.2 s"),
])
async def test_a_failing_tool_call_answers_the_model_with_an_error(standin, make_rollouts, call, error):
    env = ToolBox()
    script(standin, [call, "fine"])
    rollouts = make_rollouts(env, [standin.url], max_tokens=256)
    started = time.monotonic()
    group = await rollouts.group(env.examples("train")[0], "g0", min_version=0, seed=2, n=2)
    assert time.monotonic() - started < 1.5  # a slow tool is not waited for past its timeout
    assert group.invalid is None
    for c in group.completions:
        convo = c.conversation
        assert len(convo.turns) == 2 and convo.turns[1].text == "fine"  # the rollout went on
        (message,) = tool_messages(convo)
        assert message["content"].startswith(error), message
        assert convo.tool_errors == 1
        assert message["content"] in bytes(c.token_ids).decode()  # the model was told
    counts = rollouts.env_stats.of("calculator")
    assert counts.tool_calls == 2 and counts.tool_errors + counts.tool_timeouts == 2
    assert counts.env_errors == 0 and counts.trajectory_retries == 0


async def test_tool_calls_of_one_turn_run_concurrently_and_answer_in_order(standin, make_rollouts):
    env = ToolBox()
    calls = "\n".join(format_tool_call("nap", {"seconds": 1.0}) for _ in range(2))
    both = f"{calls}\n{format_tool_call('calculator', {'expression': '6*7'})}"
    script(standin, [both, "done"])
    rollouts = make_rollouts(env, [standin.url], max_tokens=256)
    started = time.monotonic()
    group = await rollouts.group(env.examples("train")[0], "g0", min_version=0, seed=3, n=1)
    assert time.monotonic() - started < 1.8  # two 1 s calls in two worker threads, not one after the other (2 s)
    assert [m["content"] for m in tool_messages(group.completions[0].conversation)] == ["late", "late", "42"]


async def test_repeated_environment_turns_are_rendered_once(standin, make_rollouts):
    env = ToolBox()
    call = format_tool_call("calculator", {"expression": "6*7"})
    script(standin, [call, "done"])
    rollouts = make_rollouts(env, [standin.url], max_tokens=256)

    def tokenized() -> int:
        return httpx.get(standin.url + "/_standin/stats").json()["tokenize_requests"]

    group = await rollouts.group(env.examples("train")[0], "g0", min_version=0, seed=3, n=4)
    # The template's fixed parts (3 requests), the opening prompt (1) and the tool's answer (1),
    # which all four trajectories got: each rendered once, not once per trajectory.
    assert tokenized() == 5 and group.invalid is None
    await rollouts.group(env.examples("train")[0], "g1", min_version=0, seed=4, n=4)
    assert tokenized() == 5
    deltas = {tuple(c.token_ids[len(c.conversation.turns[0].token_ids):-len(c.conversation.turns[1].token_ids)])
              for c in group.completions}
    assert len(deltas) == 1 and len(rollouts.renderer.turns) == 1

"""`calculator`: arithmetic questions and a calculator tool, the built-in tool environment.

The user asks for the value of an expression ("What is 37 * 41?"); the model may call the
`calculator` tool (JSON schema: one string argument, `expression`), sees its result as a
`tool` message, and answers. Reward `correct` is 1 when the model's last turn contains the
value, 0 otherwise; `used_tool` (weight 0, reported only) says whether it called the tool.

It proves the mechanics of tools (rendering, parsing, running, masking, errors) more than it
teaches: the tiny model never writes a tool call on its own, so the tests script the calls
with the stand-in (tests/sampler/test_multiturn_tools.py). A capable model can learn it.

The calculator evaluates + - * / // % ** and parentheses over integers and decimals with
Python's `ast`, never `eval`; anything else, a division by zero or a result with more than
`max_digits` digits is an error the model is told about.
"""

from __future__ import annotations

import ast
import operator
import random
from collections.abc import Sequence

from services.sampler.rollouts.envs.base import Completion, Example, Reward, Split
from services.sampler.rollouts.envs.multiturn import MultiTurnEnvironment, Tool

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
MAX_DIGITS = 30


def calculate(expression: str) -> str:
    """The value of an arithmetic expression, as text."""
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r}: use numbers, + - * / // % ** and parentheses") from None
    value = _value(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    text = str(value)
    if len(text.lstrip("-")) > MAX_DIGITS:
        raise ValueError(f"the result has more than {MAX_DIGITS} digits")
    return text


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = _value(node.operand)
        return -inner if isinstance(node.op, ast.USub) else inner
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponents above 64 are not allowed")
        return _OPS[type(node.op)](left, right)
    raise ValueError(f"unsupported expression element {type(node).__name__}: use numbers, + - * / // % ** and ()")


class CalculatorEnv(MultiTurnEnvironment):
    name = "calculator"

    def __init__(self, num_train: int = 512, num_eval: int = 64, seed: int = 0, max_turns: int = 3,
                 max_tokens: int = 64, tool_timeout: float = 5.0) -> None:
        num_train, num_eval, seed, max_turns, max_tokens = (int(num_train), int(num_eval), int(seed),
                                                            int(max_turns), int(max_tokens))
        if num_train < 1 or num_eval < 1:
            raise ValueError(f"calculator: num_train and num_eval must be >= 1, got {num_train}, {num_eval}")
        if max_turns < 2:
            raise ValueError(f"calculator: max_turns must be >= 2 (a tool call, then the answer), got {max_turns}")
        if max_tokens < 1:
            raise ValueError(f"calculator: max_tokens must be >= 1, got {max_tokens}")
        self.max_turns = max_turns
        self.tools = (Tool("calculator", calculate, description="Evaluate an arithmetic expression.",
                           parameters={"type": "object",
                                       "properties": {"expression": {"type": "string",
                                                                     "description": "e.g. 37 * (41 - 3)"}},
                                       "required": ["expression"], "additionalProperties": False},
                           timeout=float(tool_timeout)),)
        rng = random.Random(seed)
        seen: set[str] = set()
        questions: list[str] = []
        while len(questions) < num_eval + num_train:
            expression = f"{rng.randrange(10, 1000)} {rng.choice('+-*')} {rng.randrange(10, 1000)}"
            if expression not in seen:
                seen.add(expression)
                questions.append(expression)
        self._examples: dict[Split, list[Example]] = {
            "eval": [self._example("eval", i, q) for i, q in enumerate(questions[:num_eval])],
            "train": [self._example("train", i, q) for i, q in enumerate(questions[num_eval:])],
        }
        self.rewards = (Reward("correct", self._correct, 1.0), Reward("used_tool", self._used_tool, 0.0))
        self.sampling = {"max_tokens": max_tokens}

    @staticmethod
    def _example(split: Split, index: int, expression: str) -> Example:
        return Example(prompt_id=f"calculator/{split}/{index}", prompt=f"What is {expression}?",
                       answer=calculate(expression), info={"expression": expression})

    def examples(self, split: Split) -> Sequence[Example]:
        if split not in self._examples:
            raise ValueError(f"unknown split {split!r}: use 'train' or 'eval'")
        return self._examples[split]

    async def _correct(self, example: Example, completion: Completion) -> float:
        convo = completion.conversation
        if convo is None or not convo.turns or convo.last.tool_calls:
            return 0.0
        return float(example.answer in convo.last.text)

    async def _used_tool(self, example: Example, completion: Completion) -> float:
        convo = completion.conversation
        return float(convo is not None and convo.tool_calls > 0)

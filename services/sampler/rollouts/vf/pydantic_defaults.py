"""A cache for one question pydantic asks at every `model_construct`: does a field's
`default_factory` take the validated data? Answered once per builtin factory, not each time.

verifiers records every turn in its trace graph with `MessageNode.model_construct(...)`,
and for each field left to its default pydantic (2.14) calls `FieldInfo.get_default`, which
asks `takes_validated_data_argument(default_factory)`, which calls `inspect.signature` on the
factory. For a builtin such as `list` that means parsing its C text signature with `ast`
(~50-300 us each); a MessageNode has six `list` fields, so one model_construct cost ~0.7 ms,
17% of the sampler's event loop per verifiers turn (bench/results/verifiers.md).

The answer can only change when the factory's signature can, and the signature of a builtin
function or of an immutable type (`list`, `dict`, ...; CPython's Py_TPFLAGS_IMMUTABLETYPE)
is fixed by the interpreter: no attribute of theirs can be set, `__signature__` included. So
the cache holds those and only those, and every other factory (a lambda, a class of
someone's, a partial) is asked each time exactly as before. The answers are pydantic's own,
for the process; it is bounded by the builtins a process has.

`install()` wraps `pydantic._internal._fields.takes_validated_data_argument`, the name
`FieldInfo.default_factory_takes_validated_data` looks up at each call; idempotent.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

# CPython's Py_TPFLAGS_IMMUTABLETYPE (3.10+): set on static builtin types and on heap types
# created immutable; such a type's attributes, its signature's sources, cannot be set.
IMMUTABLE_TYPE = 1 << 8


def fixed_signature(factory: Any) -> bool:
    """Whether `factory`'s signature is fixed for the life of the process."""
    if isinstance(factory, types.BuiltinFunctionType):
        # A module's function (`time.time`), not a method bound to some object (`[].copy`),
        # which the cache would keep alive.
        return factory.__self__ is None or isinstance(factory.__self__, types.ModuleType)
    return isinstance(factory, type) and bool(factory.__flags__ & IMMUTABLE_TYPE)


def cached(ask: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """`ask`, answered once per factory with a fixed signature."""
    answers: dict[Any, bool] = {}

    def takes_validated_data_argument(default_factory: Any) -> bool:
        try:
            return answers[default_factory]
        except (KeyError, TypeError):  # not asked yet, or unhashable
            pass
        answer = ask(default_factory)
        if fixed_signature(default_factory):
            answers[default_factory] = answer
        return answer

    takes_validated_data_argument.tandem_cached = True  # type: ignore[attr-defined]
    takes_validated_data_argument.wrapped = ask  # type: ignore[attr-defined]
    takes_validated_data_argument.answers = answers  # type: ignore[attr-defined]
    return takes_validated_data_argument


def install() -> None:
    from pydantic._internal import _fields

    current = _fields.takes_validated_data_argument
    if not getattr(current, "tandem_cached", False):
        _fields.takes_validated_data_argument = cached(current)

"""The cache of pydantic's "does this default_factory take the validated data?"
(services/sampler/rollouts/vf/pydantic_defaults.py): pydantic's own answers, kept only for factories
whose signature cannot change, and model_construct's defaults as before."""

from __future__ import annotations

import functools
import inspect
import time

from pydantic import BaseModel, Field
from pydantic._internal import _fields

from services.sampler.rollouts.vf import pydantic_defaults


def plain_ask(factory):
    ask = _fields.takes_validated_data_argument
    return getattr(ask, "wrapped", ask)(factory)


class Settable:
    def __init__(self):
        pass


def test_answers_are_pydantics_and_only_fixed_signatures_are_kept():
    ask = pydantic_defaults.cached(plain_ask)

    def with_data(data):
        return data

    holder: list[int] = []
    factories = [list, dict, time.time, lambda: 1, with_data, lambda data: data, Settable,
                 functools.partial(dict, a=1), holder.copy]
    for factory in factories:
        assert ask(factory) == plain_ask(factory) == ask(factory), factory
    assert set(ask.answers) == {list, dict, time.time}  # not lambdas, classes of ours, partials, bound methods
    # A class's signature can change, so it is asked again each time.
    assert ask(Settable) is False
    Settable.__signature__ = inspect.Signature([inspect.Parameter("data", inspect.Parameter.POSITIONAL_ONLY)])
    try:
        assert ask(Settable) is True
    finally:
        del Settable.__signature__


def test_model_construct_defaults_are_unchanged_once_installed():
    pydantic_defaults.install()
    installed = _fields.takes_validated_data_argument
    pydantic_defaults.install()
    assert _fields.takes_validated_data_argument is installed and installed.tandem_cached

    class Node(BaseModel):
        a: int = 1
        items: list[int] = Field(default_factory=list)
        stamp: float = Field(default_factory=time.time)
        twice: int = Field(default_factory=lambda data: data["a"] * 2)

    one, two = Node.model_construct(a=3), Node.model_construct(a=4)
    assert (one.items, one.twice, two.twice) == ([], 6, 8) and one.items is not two.items
    assert 0 < one.stamp <= time.time()
    from verifiers.v1.graph import MessageNode

    node = MessageNode.model_construct(parent=None, message=None, token_ids=[1])
    assert node.mask == [] and node.logprobs == [] and node.tools == [] and node.mask is not node.logprobs

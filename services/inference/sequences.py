"""What the engine is asked and what it answers: `SamplingParams` in, `Output` (with its
`VersionSpan`s and `PromptLogprobs`) out, and the `Sequence` the engine steps for each choice.
Also what the engine needs of LoRA adapters (`Adapter`, `Adapters`: adapters.py has the real
ones), declared here so that the engine need not import the module that loads them. Imports
nothing of the server but torch's generator type: the routes, the protocol and the engine all
use these."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class Adapter(Protocol):
    """A LoRA adapter a request names (adapters.py's `Adapter`); hashable. `slot` is where its
    weights are now, None once unloaded. Declared here: the engine runs adapters, adapters.py
    loads them through the engine, and only adapters.py imports the other."""

    @property
    def slot(self) -> str | None: ...


class Adapters(Protocol):
    """The adapters a server serves (adapters.py's `Adapters`), as the engine uses them."""

    def forward(self, adapters: list[Any], **kwargs: Any) -> Any: ...

    def base_parameters(self) -> dict[str, torch.nn.Parameter]: ...


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None: no logprobs; k >= 0: sampled token's plus the top k
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None  # None: none; k >= 0: the prompt token's plus the top k


# One prompt position: (token id, logprob, rank) for the prompt token first, then the top k
# (the prompt token appears once even when it is among them, as in vLLM).
PromptLogprobs = list[list[tuple[int, float, int]]]


@dataclass
class VersionSpan:
    """Output tokens [start, end) were sampled with weights labelled `version`."""

    version: str
    start: int
    end: int

    def as_dict(self) -> dict[str, Any]:
        return {"version": self.version, "start": self.start, "end": self.end}


@dataclass
class Output:
    token_ids: list[int]
    text: str
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: str  # "stop" | "length" | "abort"
    stop_reason: str | int | None
    weight_versions: list[VersionSpan]
    # Positions 1..len(prompt)-1 (position 0 has no logprob); None when not requested.
    prompt_logprobs: PromptLogprobs | None = None


@dataclass(eq=False)
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    future: asyncio.Future
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    spans: list[VersionSpan] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text: str | None = None  # set when a stop string cut the text
    checked_chars: int = 0  # decoded length already searched for stop strings
    cancelled: bool = False  # the client went away; dropped at the next step
    prompt_logprobs: PromptLogprobs | None = None
    adapter: Adapter | None = None  # None: the base model

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.cancelled

    def append(self, token: int, logprob: float, top: list[tuple[int, float]] | None, label: str,
               eos_ids: frozenset[int], tokenizer: Any) -> None:
        """Add one sampled token (stamped with the weights' `label`); finish the sequence when
        it hits a stop token, EOS, a stop string or max_tokens."""
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        if top is not None:
            self.top.append(top)
        n = len(self.token_ids)
        if self.spans and self.spans[-1].version == label:
            self.spans[-1].end = n
        else:
            self.spans.append(VersionSpan(label, n - 1, n))
        p = self.params
        if token in p.stop_token_ids:
            self.finish_reason, self.stop_reason = "stop", token
        elif not p.ignore_eos and token in eos_ids:
            self.finish_reason = "stop"
        elif p.stop and self._check_stop_strings(tokenizer):
            pass
        elif n >= p.max_tokens:
            self.finish_reason = "length"

    def _check_stop_strings(self, tokenizer: Any) -> bool:
        text = tokenizer.decode(self.token_ids, skip_special_tokens=self.params.skip_special_tokens)
        longest = max(len(s) for s in self.params.stop)
        # Only text that is new since the last check (plus a stop string's overlap) can hold a new match.
        window_start = max(0, self.checked_chars - longest + 1)
        self.checked_chars = len(text)
        hits = [(text.find(s, window_start), s) for s in self.params.stop if s]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        at, stop = min(hits)
        cut = at + len(stop) if self.params.include_stop_str_in_output else at
        self.text = text[:cut]
        self.finish_reason, self.stop_reason = "stop", stop
        return True

    def output(self, tokenizer: Any) -> Output:
        text = self.text
        if text is None:
            text = tokenizer.decode(self.token_ids, skip_special_tokens=self.params.skip_special_tokens)
        return Output(
            token_ids=list(self.token_ids),
            text=text,
            logprobs=list(self.logprobs),
            top_logprobs=list(self.top) if self.params.logprobs is not None else None,
            finish_reason=self.finish_reason or "abort",
            stop_reason=self.stop_reason,
            weight_versions=[VersionSpan(s.version, s.start, s.end) for s in self.spans],
            prompt_logprobs=self.prompt_logprobs,
        )

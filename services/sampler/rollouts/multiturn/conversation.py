"""One multi-turn trajectory, turn by turn, and the one sample it becomes.

Each turn's prompt, as token ids, is the previous prompt + the ids the model sampled + the
ids of the environment's answer (render.py). The trajectory's `Completion` holds, after the
opening prompt, every id of every turn:

    token_ids  = sampled(1) + env(1) + sampled(2) + env(2) + ... + sampled(k)
    loss_mask  = 1 on sampled ids (0 where the server sent no finite logprob), 0 on env ids
    logprobs   = the behaviour logprobs of sampled ids, 0.0 on env ids
    versions   = every weight version that produced a sampled id (oldest first)

so the trainer scores exactly the ids that were sampled, in the context they were sampled
in. The conversation ends when the environment says so, after `max_turns` model turns, or
when the context is full. Only a full context makes `finish_reason` "length" (the trainer's
`mask_truncated_completions` applies): a last turn cut by `max_tokens` that the environment
or `max_turns` then ended did not end the episode, so it is "stop" (docs/environments.md,
"How an episode ended"). How each turn's call ended stays in the sample's `metrics`
(`finish_metrics`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from services.sampler.rollouts.envs.base import Completion, Example
from services.sampler.rollouts.envs.multiturn import Conversation, MultiTurnEnvironment, Turn
from services.sampler.rollouts.multiturn.render import ChatRenderer
from services.sampler.rollouts.multiturn.stats import EnvCounts
from services.sampler.rollouts.multiturn.tools import run_tool_calls
from services.sampler.rollouts.multiturn.workers import Workers
from shared.toolcalls import parse_tool_calls

# (prompt ids, max_tokens) -> the one completion sampled from them.
TurnGenerate = Callable[[list[int], int], Awaitable[Completion]]


class EnvFault(RuntimeError):
    """An environment turn or reward raised or passed its timeout (the trajectory is retried)."""


@dataclass(frozen=True)
class Limits:
    max_tokens: int               # per model turn
    max_model_len: int | None     # the context: prompt + every turn; None = unknown (no check)
    env_timeout: float            # seconds for one env_response (and one reward)


async def run_conversation(env: MultiTurnEnvironment, example: Example, *, generate: TurnGenerate,
                           renderer: ChatRenderer, workers: Workers, counts: EnvCounts,
                           limits: Limits) -> Completion:
    tools = {tool.name: tool for tool in env.tools}
    schemas = [tool.schema() for tool in env.tools] or None
    convo = Conversation(example=example, messages=list(env.initial_messages(example)))
    opening = len(convo.messages)
    prompt = await renderer.prompt(convo.messages, schemas)
    ids: list[int] = []
    logprobs: list[float] = []
    mask: list[int] = []
    versions: set[int] = set()
    finish = "stop"
    context = limits.max_model_len
    for turn_index in range(env.max_turns):
        room = limits.max_tokens if context is None else min(limits.max_tokens, context - len(prompt) - len(ids))
        if room <= 0:
            finish, convo.ended_by = "length", "length"
            break
        c = await generate(prompt + ids, room)
        ids += c.token_ids
        logprobs += c.logprobs
        mask += c.loss_mask if c.loss_mask is not None else [1] * len(c.token_ids)
        versions.update(c.versions)
        # Ids unique within the conversation (what templates need), the same in every
        # trajectory, so identical tool answers render identically and are rendered once.
        # Nine alphanumerics: what Mistral's templates accept.
        content, calls = parse_tool_calls(c.text, f"call{turn_index:02d}") if tools else (c.text, [])
        convo.turns.append(Turn(c.text, c.token_ids, c.finish_reason, calls))
        message = {"role": "assistant", "content": content if calls else c.text}
        if calls:
            message["tool_calls"] = [call.openai() for call in calls]
        convo.messages.append(message)
        counts.turns += 1
        if c.finish_reason == "length" and room < limits.max_tokens and len(c.token_ids) >= room:
            finish, convo.ended_by = "length", "length"  # the context filled up mid-turn
            break
        if turn_index + 1 == env.max_turns:
            convo.ended_by = "max_turns"
            break
        if calls:
            convo.tool_calls += len(calls)
            new, failed = await run_tool_calls(calls, tools, workers, counts, env.name)
            convo.tool_errors += failed
        else:
            new = await env_step(env, convo, workers, limits.env_timeout)
        if not new:
            convo.ended_by = "env"
            break
        convo.messages += new
        delta = await renderer.after_turn(c.token_ids, new, schemas)
        if context is not None and len(prompt) + len(ids) + len(delta) >= context:
            # The answer leaves no room for another token: nothing more can be sampled.
            finish, convo.ended_by = "length", "length"
            break
        ids += delta
        logprobs += [0.0] * len(delta)
        mask += [0] * len(delta)
    counts.trajectories += 1
    return Completion(
        text=transcript(convo, opening),
        prompt_token_ids=prompt,
        token_ids=ids,
        logprobs=logprobs,
        finish_reason=finish,
        versions=sorted(versions),
        loss_mask=mask,
        conversation=convo,
        metrics=finish_metrics([t.finish_reason for t in convo.turns]) or None,
    )


def finish_metrics(reasons: Sequence[str]) -> dict[str, float]:
    """How each model call of an episode ended, for the sample's `metrics`: the sample's own
    `finish_reason` says how the episode ended, which hides a last reply cut by `max_tokens`
    that the environment then ended. `turn_finish/<reason>` counts the calls that ended so,
    `last_turn_finish/<reason>` is 1.0 for the last call's. The names hold a "/", which a
    `@vf.metric` (named after its function) cannot, so they do not clash with an environment's."""
    out: dict[str, float] = {}
    for reason in reasons:
        out[f"turn_finish/{reason}"] = out.get(f"turn_finish/{reason}", 0.0) + 1.0
    if reasons:
        out[f"last_turn_finish/{reasons[-1]}"] = 1.0
    return out


def transcript(convo: Conversation, opening: int) -> str:
    """The conversation after its `opening` messages, for people (the rollout log, the
    dashboard): each model turn as sampled, each environment message as `[role] content`."""
    turns = iter(convo.turns)
    parts = []
    for message in convo.messages[opening:]:
        if message["role"] == "assistant":
            parts.append(next(turns).text)
        else:
            parts.append(f"\n[{message['role']}] {message.get('content') or ''}\n")
    return "".join(parts)


async def env_step(env: MultiTurnEnvironment, convo: Conversation, workers: Workers,
                   timeout: float) -> list[dict] | None:
    """`env.env_response(convo)` within `timeout`; a failure is an `EnvFault`."""
    try:
        new = await asyncio.wait_for(workers.call(env.env_response, convo), timeout)
    except asyncio.TimeoutError:
        raise EnvFault(f"env_response did not answer within {timeout:g} s (setting env_timeout)") from None
    except Exception as exc:  # noqa: BLE001 - the environment's code: retried by the caller
        raise EnvFault(f"env_response raised {type(exc).__name__}: {exc}") from exc
    if new is not None and not (isinstance(new, list) and all(isinstance(m, dict) and "role" in m for m in new)):
        raise EnvFault(f"env_response must return a list of messages (dicts with 'role') or None, got {new!r:.200}")
    return new

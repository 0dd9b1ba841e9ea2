"""A finished verifiers episode -> one sample: the trainable trace's tokens, masks and
logprobs, its reward, its metrics.

* **Which trace.** An episode's trainable traces (an agent the env did not mark
  `trainable = False`, as user-sim marks its simulated user). Exactly one is needed: a group
  has one sample per trajectory (the batch-shape contract), so an env with several trainable
  seats per episode (self-play, best-of-n) is refused with what to do about it.
* **Which tokens.** A trace is a graph of messages; each root-to-leaf path (`Branch`) is an
  exact token sequence. A conversation whose every prompt extends the tokens before it is
  one branch; one whose re-rendered prompt does not (a harness that rewrote history, a
  template that re-tokenizes sampled text differently) forks. The sample is the branch that
  holds the trace's last model turn, the conversation as it ended; the other branches are
  counted (`forks`, GET /status and the dashboard) and not trained on. Tandem's renderer
  (vf/renderer.py) carries sampled tokens verbatim, so our models never fork.
* **Masks and logprobs.** The prompt is everything up to the end of the first model turn's
  generation prompt (its first sampled token; a turn may come back empty); the completion is
  the rest, model turns and the environment's turns between them, with
  `loss_mask` 1 on sampled tokens only (and 0 on a sampled token the server gave no
  logprob for, vf/sessions.py). Logprobs are the sampled ones, 0.0 elsewhere.
* **Versions.** Those of the model calls whose prompt and answer this branch contains.
* **finish_reason.** How the episode ended, by the one rule of docs/environments.md ("How an
  episode ended"): "length" when it ran out of room (the last call was refused and the
  harness ended there, the context being full: `tandem-chat` ends a conversation so, as
  verifiers' own chat loop does without compaction; or a verifiers token budget stopped it),
  or when the last reply was cut by `max_tokens` and that reply ended the episode (the agent's
  program finished with it); otherwise "stop". A cut reply after which the env closed the
  exchange (a game that ended), `max_turns` or a `@stop` ended the episode is "stop". The
  calls' own reasons are in the sample's `metrics` (`multiturn.conversation.finish_metrics`).
* **Reward.** `trace.reward` (the weighted sum of `@vf.reward`s); `rewards` by name, raw
  scores; `@vf.metric`s go to the sample's `metrics` (the rollout log keeps them).
"""

from __future__ import annotations

from typing import Any

from services.sampler.rollouts.envs.base import Completion
from services.sampler.rollouts.multiturn.conversation import EnvFault, finish_metrics
from services.sampler.rollouts.vf.sessions import Session

Scored = tuple[float, dict[str, float]]

# verifiers' stop conditions for a token budget spent: the episode ran out of room, as with a
# full context.
OUT_OF_ROOM = frozenset({"max_input_tokens", "max_output_tokens", "max_total_tokens", "compaction_failed"})
# The agent's program ended by itself (`tandem-chat`: an answer without tool calls), so its last
# reply ended the episode; None: no condition was recorded, nothing else ended it either.
AGENT_ENDED = frozenset({"agent_completed", None})


def trace_errors(traces: list[Any], episode: Any) -> str:
    errors = [*episode.errors, *(e for t in traces for e in t.errors)]
    return "; ".join(f"{e.type}: {e.message}" for e in errors[-3:]) or "no error was recorded"


def trainable_trace(episode: Any) -> Any:
    if not episode.ok:
        raise EnvFault(f"the verifiers episode failed: {trace_errors(episode.traces, episode)}")
    trainable = [t for t in episode.traces if t.agent is None or t.agent.trainable]
    if len(trainable) != 1:
        seats = ", ".join(sorted({t.agent.name for t in trainable if t.agent is not None})) or "none"
        raise EnvFault(f"a verifiers episode must have exactly one trainable trace to become one sample; this one "
                       f"has {len(trainable)} (seats: {seats}). Mark the other agents untrainable in the env's "
                       "setup() (agents.<name>.trainable = False)")
    return trainable[0]


def final_branch(trace: Any) -> tuple[Any, int]:
    """The branch holding the trace's last model turn, and how many other branches there are."""
    sampled = [node for node in trace.nodes if node.sampled]
    if not sampled:
        raise EnvFault("the verifiers trace has no model turn")
    last = sampled[-1]
    branches = trace.branches
    for branch in branches:
        if any(node is last for node in branch.nodes):
            return branch, len(branches) - 1
    raise EnvFault("the verifiers trace's last model turn is on no branch")  # a graph verifiers would not build


def completion_start(branch: Any) -> int:
    """Where the completion starts: after the generation prompt of the branch's first model turn
    (its first sampled token, if that turn sampled any: a turn may also come back empty)."""
    start = 0
    for node in branch.nodes:
        if node.sampled:
            return start + len(node.mask) - sum(node.mask)
        start += len(node.token_ids)
    raise EnvFault("the verifiers trace has no model turn")


def completion_of(trace: Any, session: Session | None, min_version: int) -> tuple[Completion, Scored, int]:
    """(the sample's completion, its score, forks) of a finished trainable trace."""
    branch, forks = final_branch(trace)
    ids = branch.token_ids
    mask = branch.sampled_mask
    logprobs = branch.logprobs
    first = completion_start(branch)
    loss_mask = [int(m) for m in mask[first:]]
    versions: set[int] = set()
    reasons: list[str] = []
    for call in session.calls if session is not None else []:
        whole = call.prompt_ids + call.completion_ids
        if ids[: len(whole)] != whole:
            continue  # a call of another branch
        versions.update(call.versions)
        reasons.append(call.finish_reason)
        for position in call.masked:
            loss_mask[len(call.prompt_ids) + position - first] = 0
    parts = {name: float(r.score) for name, r in trace.rewards.items() if r is not None}
    metrics = {name: float(v) for name, v in trace.metrics.items() if v is not None} | finish_metrics(reasons)
    completion = Completion(
        text=transcript(branch.messages),
        prompt_token_ids=ids[:first],
        token_ids=ids[first:],
        logprobs=[float(x) if m else 0.0 for x, m in zip(logprobs[first:], mask[first:])],
        finish_reason=episode_finish(trace, reasons[-1] if reasons else None),
        versions=sorted(versions) or [min_version],
        loss_mask=loss_mask,
        metrics=metrics or None,
    )
    return completion, (float(trace.reward), parts), forks


def episode_finish(trace: Any, last_reason: str | None) -> str:
    """The sample's finish_reason: "length" only when the episode ended for lack of room (module
    docstring); `last_reason` is the branch's last model call's own."""
    if trace.calls and trace.calls[-1].error is not None:
        return "length"  # its last model call was refused and the harness ended there: the context was full
    if trace.stop_condition in OUT_OF_ROOM:
        return "length"
    if last_reason == "length" and trace.stop_condition in AGENT_ENDED:
        return "length"  # the cut reply was the agent's last word: nothing else ended the episode
    return "stop"


def transcript(messages: list[Any]) -> str:
    """The conversation after its prompt, for people (rollout log, dashboard)."""
    start = next((i for i, m in enumerate(messages) if m.role == "assistant"), len(messages))
    lines = []
    for message in messages[start:]:
        content = message.content if isinstance(message.content, str) else str(message.content or "")
        calls = getattr(message, "tool_calls", None) or []
        text = content + "".join(f" [tool call {c.name} {c.arguments}]" for c in calls)
        lines.append(text if message.role == "assistant" else f"[{message.role}] {text}")
    return "\n".join(lines)

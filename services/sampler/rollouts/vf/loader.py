"""`--env verifiers:<taskset-id>` and `--env-args` -> a verifiers `Env`, set up to run in the
sampler.

`--env-args` is verifiers' own `[env]` block as JSON: `id` picks the env (else the
taskset's own, else `SingleAgentEnv`), `taskset` holds the taskset's config fields (its `id`
comes from `--env`), each role (`agent`, or the env's own roles) its harness, runtime,
limits and sampling. Where a role leaves them unset, Tandem's defaults differ from
verifiers' command line, for a trainer on a couple of GPUs rather than an eval farm:

* harness `tandem-chat` (vf/harness.py), the agent loop in the sampler's own event loop,
  instead of `bash` in a `uv`-bootstrapped program per rollout;
* runtime `subprocess` (a scratch directory on this machine) instead of a Prime sandbox,
  which needs an account and the network.

A role's own defaults, from its env's config class, stand (user-sim's user keeps its `null`
harness). Two Tandem keys are read and removed before verifiers sees the block:

* `eval`, an `[env]` block merged over the training one for `POST /eval` (e.g. `{"taskset":
  {"split": "test"}}` for a taskset with a split field). Without it, evals run the training
  tasks.
* `limit`, the number of tasks the sampler indexes, the first ones the taskset yields: `N` for
  both splits, or `{"train": N, "eval": M}`. An infinite taskset (TextArena's games generate
  episodes forever) needs one for every split it serves; verifiers bounds such tasksets with its
  run-level `select`, which an `[env]` block cannot carry.
"""

from __future__ import annotations

import copy
from typing import Any

PREFIX = "verifiers:"
EVAL_KEY = "eval"
LIMIT_KEY = "limit"
SPLITS = ("train", "eval")
DEFAULT_HARNESS = "tandem-chat"
DEFAULT_RUNTIME = {"type": "subprocess"}


class VerifiersMissing(ImportError):
    pass


def import_verifiers() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError as exc:
        raise VerifiersMissing(
            f"--env verifiers:... needs the verifiers package ({exc}): `make install` installs it "
            "(pip install 'verifiers==0.4.0')") from None
    return vf


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` deep-merged onto a copy of `base` (objects merge key by key; anything else replaces)."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def env_config(taskset_id: str, block: dict[str, Any]) -> Any:
    """The validated `EnvConfig` of `block` for `taskset_id`, with Tandem's defaults filled in
    where the block and the env's own role defaults leave them unset."""
    vf = import_verifiers()
    if not taskset_id:
        raise ValueError("--env verifiers:<taskset-id> needs a taskset id after 'verifiers:'")
    raw = copy.deepcopy(block)
    taskset = raw.setdefault("taskset", {})
    if not isinstance(taskset, dict):
        raise ValueError(f"env-args 'taskset' must be an object of the taskset's config fields, got {taskset!r}")
    given = taskset.get("id")
    if given not in (None, "", taskset_id):
        raise ValueError(f"env-args taskset.id {given!r} differs from --env verifiers:{taskset_id}: the id comes "
                         "from --env, leave it out of env-args")
    taskset["id"] = taskset_id
    try:
        config_cls = vf.env_config_type(taskset_id, raw.get("id") or "")
    except ModuleNotFoundError as exc:
        raise ValueError(f"verifiers: {exc}") from None
    for name, field in config_cls.model_fields.items():
        declared = field.default
        if not isinstance(declared, vf.AgentConfig):
            continue
        role = raw.setdefault(name, {})
        if not isinstance(role, dict):
            raise ValueError(f"env-args {name!r} must be an object (the role's AgentConfig), got {role!r}")
        if "harness" not in role and declared.harness is None:
            role["harness"] = {"id": DEFAULT_HARNESS}
        if "runtime" not in role and "runtime" not in declared.model_fields_set:
            role["runtime"] = dict(DEFAULT_RUNTIME)
    return vf.resolve_env_config(raw)


def split_blocks(block: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the training `[env]` block, the eval one or None) of `--env-args`."""
    train = dict(block)
    over = train.pop(EVAL_KEY, None)
    if over is not None and not isinstance(over, dict):
        raise ValueError(f"env-args 'eval' must be an [env] block (an object) merged over the training one, got {over!r}")
    return train, (merged(train, over) if over is not None else None)


def split_limits(block: dict[str, Any]) -> tuple[dict[str, Any], dict[str, int | None]]:
    """(`block` without `limit`, the task limit of each split: None where none was given)."""
    rest = dict(block)
    given = rest.pop(LIMIT_KEY, None)
    if given is None:
        return rest, dict.fromkeys(SPLITS)
    per_split = given if isinstance(given, dict) else dict.fromkeys(SPLITS, given)
    unknown = sorted(set(per_split) - set(SPLITS))
    if unknown:
        raise ValueError(f"env-args 'limit' names {unknown}: its keys are 'train' and 'eval'")
    for split, value in per_split.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"env-args 'limit' must be a positive number of tasks, or {{\"train\": N, \"eval\": M}}; "
                             f"got {value!r} for {split}")
    return rest, {split: per_split.get(split) for split in SPLITS}


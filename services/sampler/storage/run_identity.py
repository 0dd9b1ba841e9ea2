"""The run's identity: the settings its stored batches depend on, recorded once in Redis.

Sealed batches never change, so a sampler continuing a run (a restart on the same run_dir or
namespace, or another replica) must make batches the trainer reads the same way as the
stored ones. The first sampler of a run records these settings (`tandem:<ns>:run`); a later
one with other values refuses to start, naming each difference, instead of sealing batches
that wreck the run:

* `prompts_per_step`, `num_generations`: the batch shape the trainer splits batches by;
* `env`, `env_args`, `curriculum`, `seed`: which prompts batch N holds (the seeded order);
* `temperature`, `top_p`, `top_k`, `min_p`: the distribution the behaviour logprobs are from,
  which the trainer scores again;
* `advantage`: the advantages stored in each batch;
* `num_iterations`: which steps reuse which batch.

Everything else may change between restarts: throughput and capacity (max_concurrency,
inference_urls, timeouts), retention (keep_batches), the staleness bound and the strategy
(they shape batches not yet built, and every sample carries its own policy_version),
max_tokens, ports, tokens and logging.

A namespace holding a run from before identities were recorded is adopted: this sampler's
settings become its identity. `--fresh` deletes the namespace's stored run (batches,
versions, membership, identity) in the same atomic step that records the new identity, and
moves `run_dir/rollouts` aside.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from services.sampler.config import SamplerSettings
from services.sampler.storage.keys import Keys
from shared.settings import SettingsError

log = logging.getLogger("tandem.sampler.run")

FIELDS = ("prompts_per_step", "num_generations", "env", "env_args", "curriculum", "seed",
          "temperature", "top_p", "top_k", "min_p", "advantage", "num_iterations")

# KEYS: run, sealed, meta. ARGV: fresh ('1' or '0'), key prefix, then field, value pairs.
# Returns {state, deleted, field, value, ...}: state 'new' (nothing stored: recorded now),
# 'adopted' (a run from before identities: recorded now) or 'stored' (the stored identity
# follows; nothing written). With fresh, the namespace's keys are deleted first (KEYS is
# fine here: it runs once, at start-up, and keeps the wipe and the new record one step).
_CLAIM = """
local deleted = 0
if ARGV[1] == '1' then
  local found = redis.call('KEYS', ARGV[2] .. '*')
  for i = 1, #found, 1000 do redis.call('DEL', unpack(found, i, math.min(i + 999, #found))) end
  deleted = #found
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  local out = {'stored', deleted}
  for _, v in ipairs(redis.call('HGETALL', KEYS[1])) do out[#out + 1] = v end
  return out
end
local state = 'new'
if redis.call('EXISTS', KEYS[2]) == 1 or redis.call('EXISTS', KEYS[3]) == 1 then state = 'adopted' end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
return {state, deleted}
"""


def identity(settings: SamplerSettings) -> dict[str, Any]:
    """The identity of the run these settings make (JSON-able values)."""
    values = settings.model_dump(mode="json", include=set(FIELDS))
    return {name: values[name] for name in FIELDS}


def differences(stored: dict[str, Any], mine: dict[str, Any]) -> list[str]:
    """'name X stored, Y given' for each setting both record with other values. A setting the
    stored identity lacks (recorded by an older sampler) is not compared."""
    return [f"{name} {_show(stored[name])} stored, {_show(mine[name])} given"
            for name in mine if name in stored and stored[name] != mine[name]]


def _set_aside(rollouts: Path) -> None:
    """The previous run's rollout files would read as part of the new run's dataset: moved aside."""
    if rollouts.is_dir() and any(rollouts.iterdir()):
        target = rollouts.with_name(f"rollouts.before-{time.strftime('%Y%m%d-%H%M%S')}")
        rollouts.rename(target)
        log.warning("--fresh: moved the previous run's rollout files to %s", target)


def _show(value: Any) -> str:
    return json.dumps(value, sort_keys=True) if isinstance(value, (dict, list, str)) else str(value)


async def claim(redis: aioredis.Redis, keys: Keys, settings: SamplerSettings, redis_url: str) -> None:
    """Record this run's identity, or check it against the stored one: SettingsError (exit
    status 2) naming every difference when they differ."""
    mine = identity(settings)
    encoded = {name: json.dumps(value, sort_keys=True) for name, value in mine.items()}
    args: list[Any] = ["1" if settings.fresh else "0", keys.prefix]
    for name, value in [*encoded.items(), ("recorded_at", str(time.time()))]:
        args += [name, value]
    reply = await redis.register_script(_CLAIM)(keys=[keys.run, keys.sealed, keys.meta], args=args)
    state, deleted = reply[0].decode(), int(reply[1])
    if settings.redis_url:
        ns, elsewhere = f"namespace {settings.namespace!r} on Redis {redis_url.split('@')[-1]}", "--namespace"
    else:
        ns, elsewhere = f"namespace {settings.namespace!r} of the embedded Redis under {settings.run_dir / 'redis'}", \
            "--run-dir"
    if settings.fresh:
        log.warning("--fresh: deleted the %d key(s) of %s; starting a new run", deleted, ns)
        _set_aside(settings.run_dir / "rollouts")
    if state == "adopted":
        log.info("%s holds a run from before run identities were recorded: adopted with these settings", ns)
    if state != "stored":
        return
    flat = reply[2:]
    stored = {k.decode(): v.decode() for k, v in zip(flat[::2], flat[1::2])}
    stored_values = {name: json.loads(stored[name]) for name in FIELDS if name in stored}
    differ = differences(stored_values, mine)
    if differ:
        raise SettingsError(
            f"{ns} holds a run made with other settings: {'; '.join(differ)}. Its sealed batches never "
            "change, so continuing with these settings would wreck it: restart with the stored values "
            "to continue that run, or add --fresh to delete it and start a new one (or choose another "
            f"{elsewhere})")
    missing = {name: encoded[name] for name in FIELDS if name not in stored}
    if missing:
        # Recorded by an older sampler that did not record these: the run carries on with ours.
        async with redis.pipeline(transaction=True) as pipe:
            for name, value in missing.items():
                pipe.hsetnx(keys.run, name, value)
            await pipe.execute()

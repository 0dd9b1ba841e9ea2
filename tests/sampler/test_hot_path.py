"""The sampler's per-completion hot path keeps its results: scoring without a task per
completion (`gather_now`), answer parsing, the columnar rollout-log table and the
observability hook (`bench throughput` measures the speed; these pin the behaviour)."""

from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from services.sampler.observability import rollout_log
from services.sampler.rollouts.envs.base import Completion, Environment, Example, Reward, gather_now, run_now
from services.sampler.observability.metrics import SamplerMetrics, _StateCollector
from services.sampler.observability.recent import RecentRollouts
from services.sampler.rollouts.completions import parse_completions
from services.sampler.observability.rollout_log import RolloutLog, to_table

# ---------------------------------------------------------------- gather_now / run_now


async def now(value):
    return value


async def later(value, delay=0.01):
    await asyncio.sleep(delay)
    return value


async def test_run_now_finishes_coroutines_that_never_suspend():
    assert run_now(now(7)) == (True, 7)
    done, rest = run_now(later(8))
    assert not done and await rest == 8
    future = asyncio.get_running_loop().create_future()
    future.set_result(9)
    done, same = run_now(future)  # not a coroutine: handed back untouched
    assert not done and same is future and await same == 9


async def test_gather_now_matches_gather():
    async def bare(value):
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return value

    assert await gather_now([]) == []
    assert await gather_now([now(1), later(2), bare(3), now(4)]) == [1, 2, 3, 4]
    # Suspending awaitables still run concurrently.
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await gather_now([later(1, 0.2), later(2, 0.2), now(3)]) == [1, 2, 3]
    assert loop.time() - started < 0.35


async def test_gather_now_raises_the_first_error_and_leaves_nothing_dangling():
    async def boom():
        raise ValueError("at once")

    async def boom_later():
        await asyncio.sleep(0.01)
        raise KeyError("later")

    suspended = later(1, 10)
    never_started = now(2)
    with pytest.raises(ValueError, match="at once"):
        await gather_now([suspended, boom(), never_started])
    # Both were closed (no "never awaited" warning, no pending sleep).
    assert suspended.cr_frame is None and never_started.cr_frame is None
    with pytest.raises(KeyError):
        await gather_now([later(1), boom_later()])


async def test_cancelling_gather_now_cancels_a_suspended_coroutine():
    seen = []

    async def slow():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    task = asyncio.ensure_future(gather_now([slow(), now(1)]))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == ["cancelled"]


async def test_environment_score_with_immediate_and_suspending_rewards():
    async def right(example, completion):
        return float(completion.text == example.answer)

    async def length(example, completion):
        await asyncio.sleep(0.001)
        return len(completion.text)

    class Env(Environment):
        rewards = (Reward("right", right, 2.0), Reward("length", length, 0.5))

    example = Example("p/1", "q", answer="ab")
    completion = Completion(text="ab", prompt_token_ids=[1], token_ids=[2, 3], logprobs=[0.0, 0.0],
                            finish_reason="stop")
    assert await Env().score(example, completion) == (3.0, {"right": 1.0, "length": 2.0})


# ---------------------------------------------------------------- parse_completions


def _choice(index, token_ids, logprobs, spans, **extra):
    return {"index": index, "text": "x" * len(token_ids), "token_ids": token_ids, "prompt_token_ids": [1, 2],
            "logprobs": {"token_logprobs": logprobs}, "finish_reason": "length", "weight_versions": spans, **extra}


def test_parse_completions_versions_and_logprobs():
    body = {"choices": [
        _choice(0, [5, 6], [-0.5, None], [{"version": "4"}]),  # a null logprob: 0.0, masked out
        _choice(1, [5], [-1], [{"version": 7}]),  # an int label; an int logprob becomes a float
        _choice(2, [5, 6, 7], [-0.1, -0.2, -0.3], [{"version": "5"}, {"version": "4"}, {"version": "5"}]),
        _choice(3, [5], [-0.1], []),  # no spans: the version served when the request was sent
    ]}
    parsed = parse_completions(body, served_version=4)
    assert [c.versions for c in parsed] == [[4], [7], [4, 5], [4]]
    assert parsed[0].logprobs == [-0.5, 0.0] and parsed[0].loss_mask == [1, 0]
    assert [c.loss_mask for c in parsed[1:]] == [None, None, None]
    assert parsed[1].logprobs == [-1.0] and type(parsed[1].logprobs[0]) is float
    # Each completion owns its lists.
    assert parsed[0].prompt_token_ids == parsed[1].prompt_token_ids and parsed[0].prompt_token_ids is not parsed[1].prompt_token_ids
    assert parse_completions({"choices": [_choice(0, [5], [-0.1], [])]}, served_version=None)[0].versions == []


# ---------------------------------------------------------------- rollout log


def reference_table(payload):
    """The rollout-log table the straightforward way: one dict of values per sample."""
    step, samples, stats = payload["step"], payload["samples"], payload.get("stats", {})
    known = set(rollout_log._COLUMNS)
    rows = []
    for s in samples:
        extra = {k: v for k, v in s.items() if k not in known}
        rows.append({**{name: s.get(name) for name in rollout_log._COLUMNS},
                     "step": step, "rewards": list((s.get("rewards") or {}).items()),
                     "staleness": step - s["policy_version"], "sealed_at": stats.get("sealed_at"),
                     "extra": json.dumps(extra, default=str) if extra else None})
    schema = rollout_log.schema()
    return pa.Table.from_pylist(rows, schema=schema.with_metadata({"tandem.stats": json.dumps(stats, default=str)}))


def sample(i, **over):
    s = {"prompt_id": f"toy/train/{i // 4}", "group_id": f"s3-g{i // 4}", "prompt_token_ids": [1, 2, 3],
         "completion_token_ids": [4, 5][: i % 3], "completion_logprobs": [-0.25, -0.5][: i % 3],
         "loss_mask": [1, 1][: i % 3], "reward": float(i % 2), "rewards": {"correct": float(i % 2)},
         "advantage": 0.5 - (i % 2), "policy_version": 2, "finish_reason": "length", "use_count": 1,
         "env": "toy", "sample_index": i % 4, "versions": [2], "prompt_text": "even or odd? 12",
         "completion_text": "e" * (i % 3), "created_at": 1700000000.5, "lesson": "toy"}
    s.update(over)
    return s


def awkward_payload():
    samples = [sample(i) for i in range(24)]
    samples[1]["lesson"] = 1
    samples[2]["lesson"] = True  # equal to 1, but JSON true
    samples[3]["lesson"] = 1.0
    samples[4]["lesson"] = -0.0
    samples[5]["lesson"] = math.nan
    samples[6].update(z=1, a=2)  # several extra keys, in insertion order
    samples[7].update(a=2, z=1)
    samples[8]["weird"] = [1, {"b": 2}]  # unhashable
    samples[9]["obj"] = object()  # not JSON: str()
    del samples[10]["lesson"]  # no extra at all
    samples[11].pop("rewards")
    samples[12]["rewards"] = None
    samples[13]["rewards"] = {}
    samples[14]["rewards"] = {"correct": 1, "format": True, "len": 0.5}
    samples[15].pop("advantage")
    samples[16]["completion_token_ids"] = np.array([7, 8], dtype=np.int32)  # a reused batch decodes arrays
    samples[16]["completion_logprobs"] = np.array([-0.1, -0.2])
    samples[17]["policy_version"] = 3
    return {"step": 3, "samples": samples, "stats": {"step": 3, "sealed_at": 1700000001.25, "reward_mean": 0.5}}


def test_rollout_table_matches_one_row_per_sample():
    payload = awkward_payload()
    table = to_table(payload)
    assert table.equals(reference_table(payload), check_metadata=True)
    extras = table.column("extra").to_pylist()
    assert extras[1] == '{"lesson": 1}' and extras[2] == '{"lesson": true}' and extras[3] == '{"lesson": 1.0}'
    assert extras[4] == '{"lesson": -0.0}' and extras[5] == '{"lesson": NaN}'
    assert extras[6].endswith('"z": 1, "a": 2}') and extras[7].endswith('"a": 2, "z": 1}')
    assert extras[10] is None
    empty = {"step": 0, "samples": [], "stats": {}}
    assert to_table(empty).equals(reference_table(empty), check_metadata=True)


def test_rollout_table_from_the_arrays_form_is_the_same_table():
    from shared import codec

    payload = {**awkward_payload(), "samples": [sample(i) for i in range(24)]}
    payload["samples"][2]["loss_mask"] = [1, 100]  # uint8 in the arrays form, int8 in the file
    payload["samples"][5]["completion_logprobs"] = [None, -0.5]  # stays a list: the column mixes
    typed = codec.with_arrays(payload)  # what the producer hands its hooks
    assert isinstance(typed["samples"][0]["prompt_token_ids"], np.ndarray)
    assert typed["samples"][2]["loss_mask"].dtype == np.uint8
    assert typed["samples"][5]["completion_logprobs"] == [None, -0.5]
    assert to_table(typed).equals(to_table(payload), check_metadata=True)


async def test_rollout_log_hook_writes_the_file_in_slices(tmp_path, monkeypatch):
    monkeypatch.setattr(rollout_log, "_SLICE_SECONDS", 0.0)  # yield after every column
    payload = awkward_payload()
    log = RolloutLog(tmp_path / "rollouts")
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    other = asyncio.create_task(ticker())
    try:
        await log.on_sealed(payload)
    finally:
        other.cancel()
    assert ticks >= len(rollout_log.schema()) // 2  # the event loop ran between columns
    path = tmp_path / "rollouts" / "step-000003.parquet"
    assert log.snapshot()["last_file"] == str(path) and log.snapshot()["rows_written"] == 24
    read = pq.read_table(path)
    expected = reference_table(payload)
    assert read.schema.equals(expected.schema)
    assert read.schema.metadata[b"tandem.stats"] == expected.schema.metadata[b"tandem.stats"]
    assert read.to_pylist() == expected.to_pylist()
    assert not list((tmp_path / "rollouts").glob(".*.tmp"))


async def test_rollout_log_waits_for_the_batch_hand_off_before_writing(tmp_path):
    handed_off = asyncio.Event()
    waited_for: list[int] = []

    async def wait_for_handoff(step):
        waited_for.append(step)
        await handed_off.wait()

    log = RolloutLog(tmp_path / "rollouts", wait_for_handoff=wait_for_handoff)
    writing = asyncio.create_task(log.on_sealed(awkward_payload()))
    await asyncio.sleep(0.2)
    assert waited_for == [3] and not writing.done()
    assert not (tmp_path / "rollouts").exists()
    handed_off.set()
    await asyncio.wait_for(writing, 30)
    assert (tmp_path / "rollouts" / "step-000003.parquet").exists()


async def test_rollout_log_reports_a_failed_write(tmp_path):
    (tmp_path / "rollouts").write_text("a file where the directory should be")
    log = RolloutLog(tmp_path / "rollouts")
    with pytest.raises(OSError):
        await log.on_sealed(awkward_payload())
    assert log.snapshot()["last_error"].startswith("step 3: ") and log.snapshot()["files_written"] == 0


# ---------------------------------------------------------------- observability hook


def test_observability_on_sealed_counts_every_sample_and_keeps_the_last_ones(monkeypatch):
    monkeypatch.setattr(_StateCollector, "collect", lambda self: iter(()))
    metrics = SamplerMetrics(pool=None, rollouts=None, producer=None, store=None, link=None)  # type: ignore[arg-type]
    recent = RecentRollouts()
    samples = [sample(i, completion_text=f"c{i}", completion_token_ids=[1] * (i % 5)) for i in range(500)]
    payload = {"step": 3, "samples": samples, "stats": {"reward_mean": 0.5, "generation_seconds": 0.1}}
    metrics.on_sealed(payload)
    recent.on_sealed(payload)

    def value(name, suffix=""):
        return metrics.registry.get_sample_value(name + suffix)

    assert value("tandem_sampler_sealed_completion_tokens", "_total") == sum(i % 5 for i in range(500))
    assert value("tandem_sampler_samples_sealed", "_total") == 500
    assert value("tandem_sampler_reward", "_count") == 500
    assert value("tandem_sampler_staleness", "_count") == 500
    ring = list(recent.ring)
    assert len(ring) == recent.ring.maxlen
    assert [r["completion"] for r in ring] == [f"c{i}" for i in range(500 - recent.ring.maxlen, 500)]
    assert ring[-1]["tokens"] == 499 % 5 and ring[-1]["step"] == 3


def test_observe_counts_matches_observing_each_value():
    from collections import Counter

    from prometheus_client import CollectorRegistry, Histogram

    from services.sampler.observability.metrics import REWARD_BUCKETS, STALENESS_BUCKETS, observe_counts

    def samples(registry):
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for m in registry.collect() for s in m.samples if not s.name.endswith("_created")}

    values = [-3, -2.0, -1, 0, 0.1, 0.05, 1, 1.0, True, 2, 5, 7, 16, 33, math.inf, 0.75, 0.9, -0.25] * 7
    for buckets in (REWARD_BUCKETS, STALENESS_BUCKETS):
        one, many = CollectorRegistry(), CollectorRegistry()
        each = Histogram("h", "h", buckets=buckets, registry=one)
        batched = Histogram("h", "h", buckets=buckets, registry=many)
        for value in values:
            each.observe(value)
        observe_counts(batched, Counter(values))
        assert samples(many) == samples(one)
    # NaN: counted in no bucket (its sum is NaN), as observe does it.
    registry = CollectorRegistry()
    h = Histogram("n", "n", buckets=STALENESS_BUCKETS, registry=registry)
    observe_counts(h, {math.nan: 2, 1: 3})
    assert registry.get_sample_value("n_count") == 3 and math.isnan(registry.get_sample_value("n_sum"))
    # A labelled histogram's parent cannot be observed: the same error as observe's.
    labelled = Histogram("l", "l", ["k"], registry=CollectorRegistry())
    with pytest.raises(ValueError):
        observe_counts(labelled, {1.0: 1})


# ---------------------------------------------------------------- typed samples of a group


def test_finished_group_samples_are_the_arrays_form_of_its_samples():
    from services.sampler.rollouts.rollout import Group
    from shared import codec

    prompt = [10, 11, 12]
    completions = [
        Completion(text="a", prompt_token_ids=prompt, token_ids=[1, 2], logprobs=[-0.5, -0.25], finish_reason="stop",
                   versions=[3]),
        Completion(text="b", prompt_token_ids=prompt, token_ids=[3], logprobs=[0.0], finish_reason="length",
                   versions=[3], loss_mask=[0], metrics={"turns": 1.0}),
        Completion(text="", prompt_token_ids=[10, 11, 12], token_ids=[], logprobs=[], finish_reason="stop"),
        Completion(text="c", prompt_token_ids=[10, 2**40], token_ids=[2**40, 1.5], logprobs=[None, -1.0],
                   finish_reason="stop", versions=[3, 4], loss_mask=[1, 0]),  # int64 prompt; lists stay lists
        Completion(text="d", prompt_token_ids=np.array([10, 11], np.int32), token_ids=(5, 6), logprobs=[-1.0, -2.0],
                   finish_reason="stop"),  # not lists: left as they are
    ]
    n = len(completions)
    group = Group(example=Example("p/1", "q"), group_id="s0-g0", completions=completions, rewards=[1.0] * n,
                  reward_parts=[{"r": 1.0}] * n, advantages=[0.0] * n, policy_versions=[3] * n,
                  info={"created_at": 12.5, "lesson": "toy"})
    expected = codec.with_arrays({"samples": group.samples("toy")})["samples"]
    group.finish("toy")
    got = group.samples("toy")
    assert [list(s) for s in got] == [list(s) for s in expected]  # the same keys, in the same order
    for a, b in zip(got, expected):
        for key in a:
            assert type(a[key]) is type(b[key]), key
            if isinstance(a[key], np.ndarray):
                assert a[key].dtype == b[key].dtype and a[key].tolist() == b[key].tolist()
                assert a[key].flags.writeable == b[key].flags.writeable
            else:
                assert a[key] == b[key], key
    assert got[0]["prompt_token_ids"] is got[1]["prompt_token_ids"]  # one list object: converted once
    assert got[3]["prompt_token_ids"].dtype == np.int64 and got[3]["completion_token_ids"] == [2**40, 1.5]
    # A group whose info repeats a sample key is refused, as new_sample refuses it.
    clash = Group(example=Example("p/1", "q"), group_id="g", completions=completions[:1], rewards=[1.0],
                  reward_parts=[{}], advantages=[0.0], policy_versions=[3], info={"reward": 2.0})
    with pytest.raises(TypeError):
        clash.finish("toy")


def test_gc_tuning_only_in_the_process_that_enables_it():
    import gc
    import subprocess
    import sys

    from services.sampler.observability import gc_tuning

    frozen, threshold = gc.get_freeze_count(), gc.get_threshold()
    gc_tuning.settle()  # not enabled here (an app in a test process): nothing happens
    gc_tuning.settle_episodes()
    assert (gc.get_freeze_count(), gc.get_threshold()) == (frozen, threshold)
    code = ("import gc; from services.sampler.observability import gc_tuning; gc_tuning.enable(); "
            "assert gc.get_freeze_count() > 1000, gc.get_freeze_count(); "
            "assert gc.get_threshold()[0] == gc_tuning.GEN0_THRESHOLD; "
            "gc_tuning.settle_episodes(); "
            "assert gc.get_threshold()[0] == gc_tuning.EPISODES_GEN0_THRESHOLD")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_rollout_table_with_one_extra_key_of_every_kind():
    payload = {**awkward_payload(), "samples": [sample(i) for i in range(12)]}
    values = [1, True, 1.0, -0.0, math.nan, None, [1, {"b": 2}], "toy", "toy", object()]
    for s, value in zip(payload["samples"], values):
        s["lesson"] = value
    del payload["samples"][10]["lesson"]
    table = to_table(payload)
    assert table.equals(reference_table(payload), check_metadata=True)
    extras = table.column("extra").to_pylist()
    assert extras[:4] == ['{"lesson": 1}', '{"lesson": true}', '{"lesson": 1.0}', '{"lesson": -0.0}']
    assert extras[10] is None and extras[11] == '{"lesson": "toy"}'
    for s in payload["samples"]:
        s.pop("lesson", None)
    assert to_table(payload).column("extra").to_pylist() == [None] * 12


def test_summarize_batch_counts_every_sample():
    from services.sampler.rollouts.rollout import summarize_batch

    samples = [sample(i, reward=float(i % 3), policy_version=[2, 3, 2, 1][i % 4], finish_reason=["stop", "length"][i % 2],
                      rewards={"correct": float(i % 3)} if i % 5 else {"format": 0.5, "correct": 1.0},
                      completion_token_ids=[7] * (i % 6), use_count=1 + i % 2)
               for i in range(40)]
    del samples[3]["use_count"]
    stats = summarize_batch(3, samples, 10.0, 12.5)
    rewards = [s["reward"] for s in samples]
    stale = [3 - s["policy_version"] for s in samples]
    assert stats.num_samples == 40 and stats.num_groups == 10
    assert stats.reward_mean == float(np.mean(rewards)) and stats.reward_std == float(np.std(rewards))
    assert (stats.staleness_mean, stats.staleness_max, stats.staleness_min) == (float(np.mean(stale)), 2, 0)
    assert stats.finish_reasons == {"stop": 20, "length": 20} and list(stats.finish_reasons) == ["stop", "length"]
    assert stats.policy_versions == {"2": 20, "3": 10, "1": 10} and list(stats.policy_versions) == ["2", "3", "1"]
    correct = [s["rewards"]["correct"] for s in samples]
    assert stats.rewards_mean == {"format": 0.5, "correct": float(np.mean(correct))}
    assert list(stats.rewards_mean) == ["format", "correct"]  # first appearance (sample 0 has both)
    assert stats.completion_tokens_mean == float(np.mean([i % 6 for i in range(40)]))
    uses = [s.get("use_count", 1) for s in samples]
    assert stats.use_count_mean == float(np.mean(uses)) and stats.use_count_max == 2
    same = summarize_batch(3, [sample(i) for i in range(8)], 0.0, 1.0)
    assert same.rewards_mean == {"correct": 0.5} and same.policy_versions == {"2": 8}
    empty = summarize_batch(3, [], 0.0, 1.0)
    assert empty.num_samples == 0 and empty.rewards_mean == {} and empty.completion_tokens_mean == 0.0


def test_rollout_table_from_the_sealed_chunks_is_the_same_table():
    from services.sampler.storage import packing
    from shared import codec

    plain = {**awkward_payload(), "samples": [sample(i) for i in range(24)]}
    for payload in (plain, codec.with_arrays(plain)):
        for chunk_bytes in (packing.DEFAULT_CHUNK_BYTES, 600):  # one chunk; a chunk per group or two
            sealed = packing.pack(payload["step"], payload["samples"], payload["stats"], chunk_bytes)
            table = rollout_log.chunk_table(payload, sealed.chunks)
            assert table is not None and table.equals(to_table(payload), check_metadata=True)
        assert len(sealed.chunks) > 1
    kinds = {**plain, "samples": [sample(i, reward=i % 2, created_at=7, use_count=2, completion_text=None,
                                          rewards={"b": 1, "a": 0.5}, lesson=3) for i in range(8)]}
    table = rollout_log.chunk_table(kinds, packing.pack(3, kinds["samples"], kinds["stats"]).chunks)
    assert table is not None and table.equals(to_table(kinds), check_metadata=True)
    # The samples decide when the chunks cannot say it all: a key some samples lack, several
    # extra keys (their order within a sample), chunks of other samples, values the schema refuses.
    awkward = awkward_payload()
    awkward["samples"][9].pop("obj")
    for odd in (awkward, {**plain, "samples": [sample(i, z=1, a=2) for i in range(4)]}):
        assert rollout_log.chunk_table(odd, packing.pack(3, odd["samples"], odd["stats"]).chunks) is None
    assert rollout_log.chunk_table(plain, packing.pack(3, plain["samples"][:4], {}).chunks) is None
    too_big = {**plain, "samples": [sample(i, sample_index=2**40) for i in range(4)]}
    assert rollout_log.chunk_table(too_big, packing.pack(3, too_big["samples"], {}).chunks) is None


async def test_rollout_log_hook_builds_from_the_sealed_chunks_or_else_the_samples(tmp_path, monkeypatch):
    from services.sampler.storage import packing

    payload = {**awkward_payload(), "samples": [sample(i) for i in range(24)]}
    sealed = packing.pack(3, payload["samples"], payload["stats"], 600)
    asked = []

    async def held(step):
        asked.append(step)
        return sealed.chunks

    async def gone(step):
        raise ConnectionError("redis away")

    expected = reference_table(payload).to_pylist()
    from_samples = rollout_log._arrays
    for n, source in enumerate((held, gone, None)):
        if source is held:  # the chunks alone make this table
            monkeypatch.setattr(rollout_log, "_arrays", None)
        log = RolloutLog(tmp_path / f"r{n}", sealed_chunks=source)
        await log.on_sealed(payload)
        monkeypatch.setattr(rollout_log, "_arrays", from_samples)
        assert pq.read_table(tmp_path / f"r{n}" / "step-000003.parquet").to_pylist() == expected
    assert asked == [3]
    # Chunks that do not hold these samples: the samples are used.
    log = RolloutLog(tmp_path / "other", sealed_chunks=held)
    sealed = packing.pack(3, payload["samples"][:4], {})
    await log.on_sealed(payload)
    assert pq.read_table(tmp_path / "other" / "step-000003.parquet").to_pylist() == expected


def test_typed_fields_is_typed_field_for_each():
    from shared import codec

    cases = [
        ("completion_token_ids", [[1, 2], [], [3], [4, 5, 6]]),
        ("completion_token_ids", [[1, 2], [2**40], [3]]),  # one needs int64: each its own
        ("completion_token_ids", [[1, 2], [None], [3.5]]),  # lists that stay lists
        ("completion_token_ids", [[1, 2], (3, 4), np.array([5], np.int64)]),  # not all lists
        ("completion_logprobs", [[-0.5, -1], [0.0], []]),
        ("completion_logprobs", [[-0.5], [None, -1.0]]),
        ("prompt_token_ids", [[7, 8, 9]]),
        ("versions", [[1], [2]]),  # not a token field: as they are
    ]
    for name, values in cases:
        got, want = codec.typed_fields(name, values), [codec.typed_field(name, v) for v in values]
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert type(a) is type(b)
            if isinstance(a, np.ndarray):
                assert a.dtype == b.dtype and a.tolist() == b.tolist() and a.flags.writeable == b.flags.writeable
            else:
                assert a == b


async def test_score_all_is_gather_now_of_score():
    from services.sampler.rollouts.envs.base import score_all

    async def right(example, completion):
        return float(completion.text == example.answer)

    async def length(example, completion):
        if completion.text == "slow":
            await asyncio.sleep(0.001)
        return len(completion.text)

    def plain(example, completion):  # a synchronous reward (run inline: no workers set)
        return 0.25

    class Env(Environment):
        rewards = (Reward("right", right, 2.0), Reward("length", length, 0.5), Reward("plain", plain, 1.0))

    class Own(Env):
        async def score(self, example, completion):
            total, parts = await super().score(example, completion)
            return total + 1, parts

    example = Example("p/1", "q", answer="ab")
    completions = [Completion(text=t, prompt_token_ids=[1], token_ids=[2], logprobs=[0.0], finish_reason="stop")
                   for t in ("ab", "slow", "", "ab")]
    for env in (Env(), Own()):
        want = await gather_now([env.score(example, c) for c in completions])
        assert await score_all(env, example, completions, timeout=5) == want
    assert (await score_all(Env(), example, completions))[1] == (0.5 * 4 + 0.25, {"right": 0.0, "length": 4.0, "plain": 0.25})

    seen = []

    async def boom(example, completion):
        seen.append(completion.text)
        if completion.text == "boom":
            raise ValueError("reward failed")
        if completion.text == "slow":
            await asyncio.sleep(10)
        return 1.0

    class Failing(Environment):
        rewards = (Reward("boom", boom),)

    bad = [Completion(text=t, prompt_token_ids=[1], token_ids=[2], logprobs=[0.0], finish_reason="stop")
           for t in ("slow", "boom", "never")]
    with pytest.raises(ValueError, match="reward failed"):
        await score_all(Failing(), example, bad)
    assert seen == ["slow", "boom"]  # the first error stops it, as with gather

    class Slow(Environment):
        rewards = (Reward("boom", boom),)

    with pytest.raises(asyncio.TimeoutError):
        await score_all(Slow(), example, bad[:1], timeout=0.05)

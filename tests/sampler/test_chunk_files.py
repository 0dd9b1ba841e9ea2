"""The bulk store (services/sampler/storage/chunk_files.py, batch_store = files): a batch's chunks are
files written and fsynced once, Redis holds the manifest; trimming deletes the files, a start
sweeps the orphans a crash left, a replica reads another's chunks, and a write that cannot
finish within its bound fails its attempt once, with the batch's size and the bound, and the
build backs off before it tries again."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import redis.asyncio as aioredis

from services.sampler.storage.chunk_files import ChunkFiles, ChunkUnreadable, StoreFailed, describe_bytes
from services.sampler.storage.keys import Keys
from services.sampler.storage.packing import SealedBatch, pack, pack_writing, pieces, share_range
from services.sampler.storage.store import Store
from shared.chunks import samples_of_chunks
from shared.client import BatchDamaged, SamplerClient


@pytest.fixture
async def redis(redis_url):
    client = aioredis.from_url(redis_url)
    yield client
    await client.aclose()


def _batch(step: int, groups: int = 6, tokens: int = 300) -> SealedBatch:
    """A batch of several chunks (a group of 4 samples is ~7 KB here)."""
    rng = np.random.default_rng(step)
    samples = [{"prompt_id": f"p{g}", "group_id": f"s{step}-g{g}", "prompt_token_ids": rng.integers(0, 50_000, 40).tolist(),
                "completion_token_ids": rng.integers(0, 50_000, tokens).tolist(),
                "completion_logprobs": (-rng.random(tokens)).tolist(), "loss_mask": [1] * tokens,
                "reward": float(g), "advantage": 0.5, "policy_version": step, "finish_reason": "stop"}
               for g in range(groups) for _ in range(4)]
    return pack(step, samples, {"step": step}, 8 << 10)


def _plain(samples: list[dict]) -> list[dict]:
    return [{k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in s.items()} for s in samples]


def _bytes(buffers) -> list[bytes]:
    return [bytes(b) for b in buffers]


async def test_chunks_are_files_redis_holds_only_the_manifest_and_a_trim_deletes_them(redis, namespace, tmp_path):
    keys = Keys(namespace)
    files = ChunkFiles(tmp_path / "batches")
    store, reader = Store(redis, keys, files=files), Store(redis, keys, files=files)
    batch = _batch(0)
    assert len(batch.table) >= 3
    assert await store.seal(0, batch) == 1
    # Redis holds the manifest, naming the directory; no chunk is a Redis value.
    assert [k async for k in redis.scan_iter(f"{keys.batch(0)}*")] == [keys.batch(0).encode()]
    where = Path((await redis.hget(keys.batch(0), "dir")).decode())
    assert where.parent == files.root
    assert sorted(os.listdir(where)) == sorted(str(i) for i in range(len(batch.table)))  # no .part left
    read = await reader.get_batch(0)  # another process: from the files
    assert read.files == str(where) and _bytes(read.chunks) == _bytes(batch.chunks)
    # The same build sealed again (a write-back after a Redis restart) keeps its files.
    assert await store.restore(0) == 0 and where.is_dir()
    # A second build of the same step loses: its files go, the first's stay.
    loser = _batch(0)
    assert await reader.seal(0, loser) == 0
    assert [w for _, _, w in files.builds()] == [where]

    assert await store.seal(1, _batch(1)) == 1
    orphan = files.new_dir(0, "deadbeef")  # a build of step 0 that died before its seal
    orphan.mkdir()
    assert await store.trim_below(1) == 1
    assert not where.exists() and not orphan.exists()
    assert await reader.get_batch(0) is None
    assert [s for s, _, _ in files.builds()] == [1]


async def test_a_start_sweeps_orphans_and_keeps_what_may_still_be_sealed(redis, namespace, tmp_path):
    keys = Keys(namespace)
    files = ChunkFiles(tmp_path / "batches")
    store = Store(redis, keys, files=files)
    for step in (0, 1, 2):
        assert await store.seal(step, _batch(step)) == 1
    await redis.hset(keys.meta, "trimmed_below", 1)  # another sampler trimmed step 0 (its files are here)
    sealed = {s: Path((await redis.hget(keys.batch(s), "dir")).decode()) for s in (1, 2)}
    loser = files.new_dir(1, "0123456789abcdef")  # lost its step's seal to another build
    stale = files.new_dir(5, "aaaaaaaaaaaaaaaa")  # a crashed build, untouched for two hours
    fresh = files.new_dir(6, "bbbbbbbbbbbbbbbb")  # maybe another replica writing right now
    for where in (loser, stale, fresh):
        where.mkdir()
        (where / "0").write_bytes(b"x" * 64)
    two_hours_ago = time.time() - 7200
    os.utime(stale, (two_hours_ago, two_hours_ago))
    assert await Store(redis, keys, files=files).sweep_orphans() == 3
    left = {w for _, _, w in files.builds()}
    assert left == {sealed[1], sealed[2], fresh}


def test_a_sampler_sweeps_orphans_when_it_starts(make_sampler, run_dir):
    orphan = ChunkFiles(run_dir / "batches").new_dir(7, "cccccccccccccccc")
    orphan.mkdir(parents=True)
    long_ago = time.time() - 7200
    os.utime(orphan, (long_ago, long_ago))
    make_sampler()
    assert not orphan.exists()


async def test_a_replica_reads_the_files_another_sealed_and_only_those_of_its_share(make_sampler, run_dir):
    settings = {"prompts_per_step": 16, "num_generations": 4, "max_tokens": 450, "temperature": 0.0,
                "batch_chunk_bytes": 64 << 10, "max_staleness": 0}
    a = make_sampler(**settings)
    async with SamplerClient(a.url, poll_timeout=20) as client:
        whole = await client.get_batch_arrays(0, timeout=60)
    (where,) = [w for _, _, w in ChunkFiles(run_dir / "batches").builds()]
    table = [(n, (where / str(i)).stat().st_size) for i, n in enumerate(c.n for c in whole.chunks)]
    assert len(table) >= 4, table
    b = make_sampler(**settings)  # holds nothing in memory: it reads A's files
    # A read of a moved-away chunk would answer 503: the client gives up within seconds.
    async with SamplerClient(b.url, poll_timeout=5, retry_for=3) as client:
        total = whole.num_samples
        for rank in range(4):
            start, stop = share_range(total, rank, 4)
            needed = {p.index for p in pieces(table, start, stop)}
            # Every other chunk is moved away: the share is served all the same.
            aside = [where / str(i) for i in range(len(table)) if i not in needed]
            for path in aside:
                path.rename(path.with_suffix(".aside"))
            try:
                share = await client.get_batch_arrays(0, rank, 4, timeout=10)
            finally:
                for path in aside:
                    path.with_suffix(".aside").rename(path)
            assert _plain(share.samples()) == _plain(whole.samples()[start:stop])
    frames = {"Accept": "application/vnd.tandem.batch"}
    async with httpx.AsyncClient(timeout=30, headers=frames) as http:
        bodies = [(await http.get(f"{s.url}/batch", params={"step": 0, "timeout": 0})).content for s in (a, b)]
    assert len(bodies[0]) > sum(size for _, size in table) and bodies[0] == bodies[1]


def _damage(path: Path, how: str) -> bytes:
    """Damage chunk file `path` as a failing disk or a stray copy would; returns its bytes."""
    good = path.read_bytes()
    if how == "short":
        path.write_bytes(good[:-8])
    elif how == "long":
        path.write_bytes(good + bytes(8))
    elif how == "not a chunk":
        path.write_bytes(bytes(len(good)))
    else:  # unreadable: a directory where the file was
        path.unlink()
        path.mkdir()
    return good


def _undamage(path: Path, good: bytes) -> None:
    if path.is_dir():
        path.rmdir()
    path.write_bytes(good)


@pytest.mark.parametrize("how", ["short", "long", "not a chunk", "unreadable"])
async def test_a_damaged_chunk_file_is_refused_naming_it_and_a_restored_one_reads_the_same(redis, namespace,
                                                                                           tmp_path, how):
    keys = Keys(namespace)
    files = ChunkFiles(tmp_path / "batches")
    batch = _batch(0)
    assert await Store(redis, keys, files=files).seal(0, batch) == 1
    reader = Store(redis, keys, files=files)  # holds nothing in memory: reads the files
    sealed = await reader.manifest(0)
    (where,) = [w for _, _, w in files.builds()]
    good = _damage(where / "1", how)
    with pytest.raises(ChunkUnreadable, match=f"chunk file {where / '1'} "):
        await reader.read_chunks(sealed, [0, 1])
    assert await reader.read_chunks(sealed, [0, 2]) is not None  # the other chunks still read
    _undamage(where / "1", good)
    assert _bytes(await reader.read_chunks(sealed, [0, 1, 2])) == _bytes(batch.chunks[:3])


async def test_a_damaged_chunk_file_answers_500_saying_which_and_what_to_do(make_sampler, run_dir):
    settings = {"prompts_per_step": 4, "num_generations": 4, "max_tokens": 64, "temperature": 0.0,
                "max_staleness": 0}
    a = make_sampler(**settings)
    async with SamplerClient(a.url, poll_timeout=20) as client:
        await client.get_batch_arrays(0, timeout=60)
    (where,) = [w for _, _, w in ChunkFiles(run_dir / "batches").builds()]
    b = make_sampler(**settings)  # holds nothing in memory: it reads A's files
    frames = {"Accept": "application/vnd.tandem.batch"}
    async with httpx.AsyncClient(timeout=30, headers=frames) as http:
        good = _damage(where / "0", "short")
        refused = await http.get(f"{b.url}/batch", params={"step": 0, "timeout": 0})
        async with SamplerClient(b.url, poll_timeout=5, retry_for=60) as client:
            started = time.monotonic()
            with pytest.raises(BatchDamaged, match=r"^GET /batch step=0 rank=0/1: batch 0 is sealed but cannot be "
                                                   r"served: chunk file .* Restore the file"):
                await client.get_batch_arrays(0, timeout=30)
            assert time.monotonic() - started < 5  # raised at once: no retry can help
        _undamage(where / "0", good)
        bodies = [(await http.get(f"{s.url}/batch", params={"step": 0, "timeout": 0})).content for s in (a, b)]
    assert refused.status_code == 500, refused.text
    detail = refused.json()["detail"]
    assert detail["reason"] == "damaged"
    assert detail["message"].startswith(f"batch 0 is sealed but cannot be served: chunk file {where / '0'} holds "
                                        f"{len(good) - 8} bytes, its batch's manifest says {len(good)}")
    assert "Restore the file, or restart the run from a checkpoint past step 0" in detail["message"]
    assert bodies[0] == bodies[1]


async def test_a_write_past_its_bound_fails_once_with_the_batch_size_and_redis_stays_responsive(redis, namespace,
                                                                                                tmp_path):
    keys = Keys(namespace)
    files = ChunkFiles(tmp_path / "batches", timeout=0.5)
    store = Store(redis, keys, files=files)
    batch = _batch(0, groups=40)
    pings: list[float] = []

    async def stuck() -> None:  # the first chunk is on disk; the rest never comes within the bound
        for _ in range(20):
            t0 = time.perf_counter()
            await redis.ping()
            pings.append(time.perf_counter() - t0)
            await asyncio.sleep(0.05)

    started = time.monotonic()
    with pytest.raises(StoreFailed) as failed:
        await store.seal(0, batch, writing=stuck)
    took = time.monotonic() - started
    size = describe_bytes(batch.nbytes)
    assert str(failed.value).startswith(f"batch 0: {size} could not be stored in 0.5 s: 1 of {len(batch.table)} "
                                        "chunks"), failed.value
    assert 0.5 <= took < 2.0, took
    assert await redis.exists(keys.batch(0)) == 0  # nothing sealed
    assert max(pings) < 0.05, pings  # Redis answered all along
    # The attempt's directory goes once its writers are done (they are idle here).
    await asyncio.get_running_loop().run_in_executor(None, time.sleep, 0.2)
    assert files.builds() == []
    # The next attempt, within the bound, seals the same bytes.
    assert await store.seal(0, batch) == 1


def test_a_build_whose_write_passes_the_bound_fails_once_then_backs_off_and_seals(make_sampler, run_dir, tmp_path,
                                                                                 monkeypatch, caplog):
    """The drill holds the first attempt at its `writing` point past batch_store_timeout: that
    attempt fails with the message, /status shows it, and the build seals on its next attempt,
    after the back-off."""
    drill = tmp_path / "drill"
    monkeypatch.setenv("TANDEM_DRILL_PAUSE", "writing:0")
    monkeypatch.setenv("TANDEM_DRILL_DIR", str(drill))
    caplog.set_level(logging.INFO, logger="tandem.sampler.producer")
    sampler = make_sampler(batch_store_timeout=1.0)
    with httpx.Client(base_url=sampler.url, timeout=30) as http:
        answer = http.get("/batch", params={"step": 0, "timeout": 30})
        answered = time.time()
        assert answer.status_code == 200, answer.text
        status = http.get("/status").json()["steps"]
    assert (drill / "writing-0").exists()  # the first attempt did pause there (and nobody released it)
    assert status["store_failures"] == 1, status
    failures = [r for r in caplog.records if "sealing batch 0 failed" in r.getMessage()]
    assert len(failures) == 1, [r.getMessage() for r in failures]
    message = failures[0].getMessage()
    assert "(attempt 1): batch 0: " in message and " could not be stored in 1 s: 1 of " in message, message
    assert message.endswith("trying the same bytes again in 0.5s"), message
    assert answered - failures[0].created >= 0.5  # the back-off came before the attempt that sealed it


def _samples(step: int, groups: int = 6, tokens: int = 300) -> list[dict]:
    """The samples of `_batch` (token fields as numpy arrays, as a built batch has them)."""
    return samples_of_chunks(_batch(step, groups, tokens).chunks)


async def test_chunks_written_while_they_are_packed_are_the_sealed_files(redis, namespace, tmp_path):
    """pack_writing hands each chunk to the writers as it is packed; the seal waits for those
    writes (no second write) and seals the same bytes as a batch packed first and written after."""
    keys = Keys(namespace)
    files = ChunkFiles(tmp_path / "batches")
    store = Store(redis, keys, files=files)
    samples = _samples(0, groups=12)
    batch = await pack_writing(0, samples, {"step": 0}, 8 << 10, files)
    assert batch.early is not None and len(batch.early.futures) == len(batch.table) >= 3
    assert await store.seal(0, batch) == 1
    assert batch.early is None and Path(batch.files) == batch_dir(files)
    assert [f.read_bytes() for f in sorted(Path(batch.files).iterdir(), key=lambda p: int(p.name))] == _bytes(batch.chunks)
    reader = Store(redis, keys, files=files)
    stored = await reader.get_batch(0)
    assert _bytes(stored.chunks) == _bytes(pack(0, samples, {}, 8 << 10).chunks)


def batch_dir(files: ChunkFiles) -> Path:
    (only,) = files.builds()
    return only[2]


async def test_a_batch_that_fails_to_pack_leaves_no_files_and_a_root_that_cannot_be_made_fails_the_store(
        redis, namespace, tmp_path):
    files = ChunkFiles(tmp_path / "batches")
    samples = _samples(0, groups=12)
    samples[-1]["extra"] = object()  # the last chunk cannot be encoded: the earlier ones were being written
    with pytest.raises(TypeError):
        await pack_writing(0, samples, {}, 8 << 10, files)
    await asyncio.get_running_loop().run_in_executor(None, time.sleep, 0.3)  # the writers stop, the directory goes
    assert files.builds() == []
    # A root that is a file: the early write cannot make its directory; the seal says so, once.
    (tmp_path / "blocked").write_text("")
    blocked = ChunkFiles(tmp_path / "blocked" / "batches")
    batch = await pack_writing(1, _samples(1), {}, 8 << 10, blocked)
    with pytest.raises(StoreFailed, match=r"^batch 1: .* could not be stored in .*blocked"):
        await Store(redis, Keys(namespace), files=blocked).seal(1, batch)


def test_a_trainer_meeting_a_damaged_batch_stops_at_once_in_one_line(make_sampler, run_dir, tiny_model, tmp_path,
                                                                     capsys):
    from services.trainer.entrypoint import main as trainer_main

    settings = {"prompts_per_step": 4, "num_generations": 4, "max_tokens": 8, "max_staleness": 0,
                "max_poll_timeout": 5}
    a = make_sampler(**settings)

    async def sealed() -> None:
        async with SamplerClient(a.url, poll_timeout=20) as client:
            await client.get_batch_arrays(0, timeout=60)

    asyncio.run(sealed())
    (where,) = [w for _, _, w in ChunkFiles(run_dir / "batches").builds()]
    b = make_sampler(**settings)  # holds nothing in memory: it reads A's files
    _damage(where / "0", "not a chunk")
    started = time.monotonic()
    code = trainer_main(["--model", str(tiny_model), "--sampler-url", b.url, "--run-dir", str(tmp_path / "t"),
                         "--per-device-batch-size", "4", "--grad-accum-steps", "4", "--no-progress",
                         "--no-eval-at-start", "--no-eval-at-end", "--retry-for", "120"], prog="tandem trainer")
    err = capsys.readouterr().err
    assert code == 6, err
    assert time.monotonic() - started < 60  # not the 120 s a retried 5xx would take
    assert "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("tandem trainer: GET /batch step=0 rank=0/1: batch 0 is sealed but cannot be served: "
                           f"chunk file {where / '0'} does not start as a batch chunk does"), line

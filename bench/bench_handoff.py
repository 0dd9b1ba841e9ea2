"""Hand-off: from a batch being built and sealed to the trainer holding it decoded, 1 MiB to 4 GiB.

Real processes on loopback: a private redis-server per batch size (AOF on, `appendfsync
always`: the embedded Redis's and compose's setting), the vLLM-protocol stand-in (it only
has to be there for the producer to start a batch), a fresh sampler per batch size
(`tandem sampler` with the `bench.handoff_strategy:SyntheticBatches` strategy, max_staleness 1,
keep_batches 1, batch_cache_bytes 3 GiB, the Parquet rollout log off), and this process as
the trainer. Per measurement it publishes version N (it has read batch N-1, which trims
batch N-2), parks `GET /batch?step=N` (world_size 1, or one rank's share at world_size 8),
then opens the strategy's gate for step N: the sampler builds batch N (synthetic samples
whose token fields are numpy arrays already, as finished groups have them), packs it into
group-aligned chunks, writes them to files under its run directory (each fsynced once:
batch_store = files, the default), seals the manifest in Redis and answers the parked request.
While it builds and seals, a process of its own pings Redis every 5 ms: the round trips say
whether Redis stayed responsive to everything else while the batch was stored.

Clocks, all wall time on this one host:
* built: `stats.sealed_at`, which the producer stamps when the samples are done, before they
  are packed and written to Redis.
* sealed: an independent Redis subscriber (a process of its own) hears `sealed:N` on the
  run's events channel, which the seal's Lua script publishes as it commits the batch.
* decoded: `SamplerClient.get_batch_arrays` returned (`BatchArrays`, numpy views of the
  received body) for the frames encoding; `get_batch_raw` (sample dicts) for the others.
  The body's arrival is timed by wrapping the client's own `get_batch_body`.
At world_size 8 the clock stops when the one rank (SHARE_RANK) holds its share decoded. The two
frames cases of a size are measured in turn, batch by batch (ws 1, ws 8, ws 1, ...), so that the
share and the whole batch it is judged against see the same load.

Sampler RSS: before each measured batch the peak is reset (`echo 5 > /proc/PID/clear_refs`);
idle = VmRSS then, peak = VmHWM once the batch is decoded and the sampler has finished with it.

Ceilings of the machine, measured first: one loopback TCP socket between two processes
(sendall of 1 GiB from memory into recv_into a preallocated buffer), the disk (1 GiB as 4 MiB
files, each written and fsynced, by one thread and by two, as the bulk store writes them),
Redis SETs of 1 GiB in 4 MiB values pipelined 8 per round trip (same redis-server settings),
a 1 GiB memcpy.

`python -m bench handoff` (or `make bench ARGS=handoff`) runs everything (under 10 minutes on
2 cores); `python -m bench.bench_handoff --quick` only 1 MiB and 64 MiB (and 256 MiB ceilings);
`--sizes 1M,64M,256M` picks sizes. HANDOFF_SIZES=1M,64M does the same for `python -m bench
handoff`; HANDOFF_TMP=<dir> puts the Redis data (many GiB of AOF at 2 GiB) elsewhere than the
system temporary directory. Writes bench/results/handoff.json and handoff.md.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import redis as syncredis
import redis.asyncio as aioredis

from bench._common import (
    REPO, RUN_TOKEN, host, median, redis_server, sampler_process, standin_process, write_results,
)
from shared.client import SamplerClient

COMMAND = "make bench ARGS=handoff  (or .venv/bin/python -m bench handoff)"
KIB, MIB, GIB = 1024, 1024 * 1024, 1024 * 1024 * 1024
SIZES = (1 * MIB, 64 * MIB, 256 * MIB, 1 * GIB, 2 * GIB, 4 * GIB)
QUICK_SIZES = (1 * MIB, 64 * MIB)
# 1 GiB gets five: its share and sealed -> decoded are judged there, and on this VM one batch in
# three or four is an outlier (50 against 110-150 ms for a share), which a median of three follows.
REPS = {1 * MIB: 20, 64 * MIB: 5, 256 * MIB: 3, 1 * GIB: 5, 2 * GIB: 2, 4 * GIB: 1}
# Sizes measured at world_size 1 only (memory: the sampler holds ~2x the batch at its peak).
WHOLE_ONLY = (4 * GIB,)
OLD_ENCODINGS = ("arrays", "msgpack", "json")
OLD_SIZES = (1 * MIB, 64 * MIB)
OLD_REPS = {1 * MIB: 10, 64 * MIB: 3}
WORLD_SIZES = (1, 8)
SHARE_RANK = 3  # an interior rank: its share's edges may cut a chunk at both ends
VALIDATE_MAX = 64 * MIB  # pydantic validation of the sample dicts only up to here (it is slow)
CACHE_BYTES = 3 * GIB
GROUP = 8


# --- /proc ------------------------------------------------------------------------------

def _vm(pid: int, field: str) -> int:
    """A `Vm...` line of /proc/PID/status, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak(pid: int) -> None:
    """Reset VmHWM to the current RSS (clear_refs 5)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


# --- sizes -------------------------------------------------------------------------------

def parse_size(text: str) -> int:
    """'1M', '64MiB', '2G', '64K' or a byte count."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    for suffix, unit in (("K", KIB), ("M", MIB), ("G", GIB)):
        if t.endswith(suffix):
            return int(float(t[:-1]) * unit)
    return int(t)


def label(n: float) -> str:
    for unit, name in ((GIB, "GiB"), (MIB, "MiB")):
        if n >= 0.9 * unit:
            return f"{n / unit:.2f} {name}"
    return f"{n / KIB:.0f} KiB"


def prompts_for(target_bytes: int) -> int:
    """prompts_per_step (groups of GROUP samples) for a stored batch of about `target_bytes`."""
    from bench.handoff_strategy import POOL, batch_samples, make_pool
    from shared.chunks import encode_samples

    per_sample = len(encode_samples(batch_samples(make_pool(GROUP), POOL, GROUP, 0, 0))) / POOL
    return max(1, round(target_bytes / per_sample / GROUP))


def offline_build(prompts: int) -> dict[str, float]:
    """What the producer does between `sealed_at` and the Redis write, timed in this process
    on the same samples: summarize_batch, codec.with_arrays, packing.pack (default chunk size)."""
    from bench.handoff_strategy import batch_samples, make_pool
    from services.sampler.storage import packing
    from services.sampler.rollouts.rollout import summarize_batch
    from shared import codec

    samples = batch_samples(make_pool(GROUP), prompts * GROUP, GROUP, 1, 0)
    t0 = time.perf_counter()
    stats = summarize_batch(1, samples, t0, time.time()).model_dump()
    t1 = time.perf_counter()
    payload = codec.with_arrays({"step": 1, "samples": samples, "stats": stats})
    t2 = time.perf_counter()
    packed = packing.pack(1, payload["samples"], stats)
    t3 = time.perf_counter()
    out = {"summarize_s": t1 - t0, "with_arrays_s": t2 - t1, "pack_s": t3 - t2, "chunks": len(packed.table)}
    del samples, payload, packed
    gc.collect()
    return out


# --- ceilings ----------------------------------------------------------------------------

_SENDER = """
import os, socket, sys
port, n, reps = map(int, sys.argv[1:])
data = bytearray(os.urandom(1 << 20)) * (n >> 20)
s = socket.create_connection(("127.0.0.1", port))
view = memoryview(data)
for _ in range(reps):
    if s.recv(1) != b"g":
        break
    s.sendall(view)
s.recv(1)
"""


def _private_alloc(size: int) -> Any:
    """An anonymous MAP_PRIVATE mapping asking for huge pages. `shared.chunks.alloc`'s
    `mmap.mmap(-1, size)` is MAP_SHARED (Python's default): shmem, for which transparent huge
    pages are off unless /sys/kernel/mm/transparent_hugepage/shmem_enabled allows them."""
    import mmap

    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    return buf


def tcp_ceiling(nbytes: int, reps: int = 3) -> dict[str, Any]:
    """One loopback TCP socket between two processes: the sender `sendall`s `nbytes` from
    memory, this process `recv_into`s a preallocated buffer. `reps` into a prefaulted buffer,
    then `reps` into a fresh `shared.chunks.alloc` buffer each (what the client receives
    into), then `reps` into a fresh private mapping with huge pages."""
    from shared.chunks import alloc

    modes = {"prefaulted": None, "fresh": alloc, "fresh_private": _private_alloc}
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    sender = subprocess.Popen([sys.executable, "-c", _SENDER, str(port), str(nbytes), str(len(modes) * reps)])
    try:
        srv.settimeout(60)
        conn, _ = srv.accept()
        conn.settimeout(120)
        times: dict[str, list[float]] = {mode: [] for mode in modes}
        buf = alloc(nbytes)
        np.frombuffer(buf, np.uint8)[::4096] = 1  # touch every page
        for mode, make in modes.items():
            for _ in range(reps):
                if make is not None:
                    buf = None
                    buf = make(nbytes)
                view = memoryview(buf)
                conn.sendall(b"g")
                t0 = time.perf_counter()
                got = 0
                while got < nbytes:
                    k = conn.recv_into(view[got:], nbytes - got)
                    if not k:
                        raise RuntimeError("the sender closed early")
                    got += k
                times[mode].append(time.perf_counter() - t0)
                view.release()
        buf = None
        conn.sendall(b"x")
        conn.close()
    finally:
        srv.close()
        sender.wait(30)
    return {"bytes": nbytes, "reps": reps,
            "GB_per_s": round(nbytes / median(times["prefaulted"]) / 1e9, 3),
            "GB_per_s_fresh_buffer": round(nbytes / median(times["fresh"]) / 1e9, 3),
            "GB_per_s_fresh_private_buffer": round(nbytes / median(times["fresh_private"]) / 1e9, 3),
            "seconds": {mode: [round(t, 4) for t in ts] for mode, ts in times.items()}}


def redis_ceiling(tmp: Path, nbytes: int, value_bytes: int = 4 * MIB, per_trip: int = 8,
                  reps: int = 2) -> dict[str, Any]:
    """SETs of `nbytes` in `value_bytes` values, `per_trip` per pipelined round trip, on a
    fresh redis-server with the bench's settings (appendonly yes, appendfsync always); then
    the same with appendfsync everysec. Each round's keys are deleted before the next."""
    from tests.support.servers import start_redis

    proc, url = start_redis(tmp / "redis-ceiling", appendfsync="always")
    client = syncredis.Redis.from_url(url)
    value_bytes = min(value_bytes, nbytes)
    value = os.urandom(value_bytes)
    count = nbytes // value_bytes
    out: dict[str, Any] = {"bytes": count * value_bytes, "value_bytes": value_bytes, "per_round_trip": per_trip,
                           "reps": reps}
    try:
        for fsync, rounds in (("always", reps), ("everysec", max(1, reps - 1))):
            client.config_set("appendfsync", fsync)
            times = []
            for rep in range(rounds):
                t0 = time.perf_counter()
                for i in range(0, count, per_trip):
                    pipe = client.pipeline(transaction=False)
                    for j in range(i, min(i + per_trip, count)):
                        pipe.set(f"c:{rep}:{j}", value)
                    pipe.execute()
                times.append(time.perf_counter() - t0)
                client.delete(*[f"c:{rep}:{j}" for j in range(count)])
            out[f"GB_per_s_{fsync}"] = round(count * value_bytes / median(times) / 1e9, 3)
            out[f"seconds_{fsync}"] = [round(t, 3) for t in times]
    finally:
        client.close()
        proc.terminate()
        shutil.rmtree(tmp / "redis-ceiling", ignore_errors=True)
    return out


def memcpy_ceiling(nbytes: int) -> dict[str, Any]:
    """One copy of `nbytes` in this process: into a fresh `shared.chunks.alloc` buffer (page
    faults included, what packing and the client pay), into a fresh private mapping with huge
    pages, and into the same buffer again (prefaulted)."""
    from shared.chunks import alloc

    src = np.frombuffer(bytearray(os.urandom(MIB)) * max(1, nbytes // MIB), np.uint8)
    out: dict[str, Any] = {"bytes": len(src)}
    for name, make in (("fresh_buffer", alloc), ("fresh_private_buffer", _private_alloc)):
        buf = make(len(src))
        t0 = time.perf_counter()
        np.copyto(np.frombuffer(buf, np.uint8), src)
        out[f"GB_per_s_{name}"] = round(len(src) / (time.perf_counter() - t0) / 1e9, 3)
        t0 = time.perf_counter()
        np.copyto(np.frombuffer(buf, np.uint8), src)
        out["GB_per_s_prefaulted"] = round(len(src) / (time.perf_counter() - t0) / 1e9, 3)
        del buf
    return out


def _write_fsync(where: Path, data: Any, indices: range) -> None:
    from services.sampler.storage.durable_write import write_durably

    never = threading.Event()
    for i in indices:
        write_durably(where / str(i), memoryview(data), never)


def disk_ceiling(tmp: Path, nbytes: int, file_bytes: int = 4 * MIB, reps: int = 2) -> dict[str, Any]:
    """`nbytes` as `file_bytes` files, each written and fsynced, then the directory fsynced:
    what the bulk store does (services/sampler/storage/chunk_files.py, with its own writes:
    O_DIRECT from a page-aligned chunk buffer where the filesystem takes it), by one thread and
    by two."""
    from concurrent.futures import ThreadPoolExecutor

    from shared.chunks import alloc

    data = alloc(file_bytes)
    memoryview(data)[:] = os.urandom(file_bytes)
    count = max(1, nbytes // file_bytes)
    out: dict[str, Any] = {"bytes": count * file_bytes, "file_bytes": file_bytes, "where": str(tmp), "reps": reps}
    for threads in (1, 2):
        times = []
        for rep in range(reps):
            where = tmp / f"disk-ceiling-{threads}-{rep}"
            where.mkdir()
            t0 = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(lambda k: _write_fsync(where, data, range(k, count, threads)), range(threads)))
            fd = os.open(where, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            times.append(time.perf_counter() - t0)
            shutil.rmtree(where)
        out[f"GB_per_s_{threads}_threads"] = round(count * file_bytes / median(times) / 1e9, 3)
        out[f"seconds_{threads}_threads"] = [round(t, 3) for t in times]
    return out


def measure_ceilings(tmp: Path, nbytes: int) -> dict[str, Any]:
    return {"tcp_loopback": tcp_ceiling(nbytes), "disk_fsync": disk_ceiling(tmp, nbytes),
            "redis_set": redis_ceiling(tmp, nbytes), "memcpy": memcpy_ceiling(nbytes)}


# --- the measurement ----------------------------------------------------------------------

_SUBSCRIBER = """
import sys, time
import redis
pubsub = redis.Redis.from_url(sys.argv[1]).pubsub()
pubsub.subscribe(sys.argv[2])
for message in pubsub.listen():
    if message["type"] == "subscribe":
        print("ready", flush=True)
    elif message["type"] == "message" and message["data"].startswith(b"sealed:"):
        print(int(message["data"][7:]), repr(time.time()), flush=True)
"""


class Announcements:
    """When each `sealed:N` was heard on the run's events channel, by a subscriber process of
    its own: its stamp waits neither for this process's event loop nor for its GIL (a thread's
    stamp did, by up to the 5 ms switch interval, and came out after the decode)."""

    def __init__(self, redis_url: str, channel: str):
        self.redis_url, self.channel = redis_url, channel
        self.heard: dict[int, float] = {}
        self._new = asyncio.Event()

    async def __aenter__(self) -> Announcements:
        self.proc = await asyncio.create_subprocess_exec(sys.executable, "-c", _SUBSCRIBER, self.redis_url,
                                                         self.channel, stdout=asyncio.subprocess.PIPE)
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), 30)
        if line.strip() != b"ready":
            raise RuntimeError(f"the seal subscriber did not subscribe to {self.channel}: {line!r}")
        self.task = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for line in self.proc.stdout:
            step, at = line.split()
            self.heard[int(step)] = float(at)
            self._new.set()

    async def wait(self, step: int, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while step not in self.heard:
            self._new.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no seal announcement for step {step} within {timeout}s")
            try:
                await asyncio.wait_for(self._new.wait(), remaining)
            except TimeoutError:
                pass
        return self.heard[step]

    async def __aexit__(self, *exc: object) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        if self.proc.returncode is None:
            self.proc.terminate()
        await self.proc.wait()


_PINGER = """
import sys, time
import redis
r = redis.Redis.from_url(sys.argv[1], socket_timeout=60)
r.ping()
print("ready", flush=True)
while True:
    at = time.time()
    t0 = time.perf_counter()
    r.ping()
    print(repr(at), repr(time.perf_counter() - t0), flush=True)
    time.sleep(0.005)
"""


class RedisPings:
    """Redis round trips (PING) every 5 ms, by a process of its own, stamped with when each
    was sent: `between(a, b)` is what anyone else using Redis saw while a batch was stored."""

    def __init__(self, redis_url: str):
        self.redis_url = redis_url
        self.pings: list[tuple[float, float]] = []

    async def __aenter__(self) -> RedisPings:
        self.proc = await asyncio.create_subprocess_exec(sys.executable, "-c", _PINGER, self.redis_url,
                                                         stdout=asyncio.subprocess.PIPE)
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), 30)
        if line.strip() != b"ready":
            raise RuntimeError(f"the Redis pinger did not start: {line!r}")
        self.task = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for line in self.proc.stdout:
            at, rtt = line.split()
            self.pings.append((float(at), float(rtt)))

    def between(self, start: float, end: float) -> list[float]:
        """Round trips sent from `start` to `end`. The pinger waits for each answer before it
        sends the next, so once a ping stamped after `end` is in, every one before has returned
        and a stall cannot hide by never answering (the caller waits for that one)."""
        return [rtt for at, rtt in self.pings if start <= at <= end]

    async def __aexit__(self, *exc: object) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        if self.proc.returncode is None:
            self.proc.terminate()
        await self.proc.wait()


def _p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]


async def _done(client: SamplerClient, step: int, timeout: float = 300) -> None:
    """Wait until the sampler has finished building `step` (its on-sealed hooks included), so
    the next measurement does not share the CPU with them."""
    deadline = time.monotonic() + timeout
    while any(p["step"] == step for p in (await client.status())["steps"]["in_progress"]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the sampler's build of batch {step} did not finish")
        await asyncio.sleep(0.02)


async def _probe_loop(url: str, stop: asyncio.Event, every: float = 0.025) -> float:
    """The slowest GET /health (answered from memory) until `stop`: how long the sampler's
    event loop was kept from answering while it built and sealed (a lower bound: a request
    only sees the part of a stall after it was sent). One keep-alive connection
    of raw HTTP/1.1, opened and used once before the clock starts, so the probe costs little
    CPU here and its connection set-up is not counted."""
    host_port = url.split("://", 1)[1]
    host_name, port = host_port.rsplit(":", 1)
    request = f"GET /health HTTP/1.1\r\nHost: {host_port}\r\n\r\n".encode()
    reader, writer = await asyncio.open_connection(host_name, int(port))

    async def once() -> None:
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        await reader.readexactly(length)

    worst = 0.0
    try:
        await once()
        while not stop.is_set():
            t0 = time.perf_counter()
            await once()
            worst = max(worst, time.perf_counter() - t0)
            try:
                await asyncio.wait_for(stop.wait(), every)
            except TimeoutError:
                pass
    finally:
        writer.close()
    return worst


class Trainer:
    """This process's side: one SamplerClient per encoding, with the arrival of each body
    timed by wrapping the client's own `get_batch_body`."""

    def __init__(self, url: str, sampler_pid: int, redis: aioredis.Redis, keys: Any, heard: Announcements,
                 park_s: float, validate_max: int, pings: RedisPings | None = None):
        self.url, self.pid, self.redis, self.keys, self.heard = url, sampler_pid, redis, keys, heard
        self.pings = pings
        self.park_s, self.validate_max = park_s, validate_max
        self.received: dict[str, float] = {}

    def client(self, encoding: str) -> SamplerClient:
        client = SamplerClient(self.url, encoding=encoding, poll_timeout=60, api_token=RUN_TOKEN)
        inner = client.get_batch_body

        async def timed(*args: Any, **kwargs: Any) -> tuple[str | None, Any]:
            content_type, body = await inner(*args, **kwargs)
            self.received.update(at=time.time(), body_bytes=len(body))
            return content_type, body

        client.get_batch_body = timed  # type: ignore[method-assign]
        return client

    async def one(self, client: SamplerClient, encoding: str, step: int, world_size: int, rank: int,
                  batch_target: int) -> dict[str, Any]:
        from bench.handoff_strategy import gate
        from services.sampler.storage.packing import SealedBatch
        from shared.wire import Batch

        if step >= 1:  # batch step-1 has been read: version `step` may go out (it trims step-2)
            await client.publish_weights(step)
        me = os.getpid()
        forks = (await self.redis.info("stats")).get("total_forks", 0)
        idle = _vm(self.pid, "VmRSS")
        client_idle = _vm(me, "VmRSS")
        _reset_peak(self.pid)
        _reset_peak(me)
        self.received.clear()
        if encoding == "frames":
            poll = asyncio.create_task(client.get_batch_arrays(step, rank, world_size, timeout=300))
        else:
            poll = asyncio.create_task(client.get_batch_raw(step, rank, world_size, timeout=300))
        await asyncio.sleep(self.park_s)  # the request is parked on the sampler's notifier by now
        stop_probe = asyncio.Event()
        probe = asyncio.create_task(_probe_loop(self.url, stop_probe))
        gated = time.time()
        await self.redis.lpush(gate(self.keys.prefix, step), 1)  # the build of batch `step` goes on
        sealed_task = asyncio.create_task(self.heard.wait(step, 600))
        await asyncio.wait([poll, sealed_task], return_when=asyncio.FIRST_COMPLETED)
        stop_probe.set()  # the seal (or the answer) is in: the build is over
        got = await poll
        decoded = time.time()
        client_peak = _vm(me, "VmHWM")
        sealed = await sealed_task
        stall = await probe
        # The pings sent while the batch was built, stored and sealed (the pinger's lines may
        # trail by a few ms: wait for the first one stamped after the seal).
        rtts: list[float] = []
        if self.pings is not None:
            for _ in range(200):
                if self.pings.pings and self.pings.pings[-1][0] > sealed:
                    break
                await asyncio.sleep(0.01)
            rtts = self.pings.between(gated, sealed)
        fields = await self.redis.hgetall(self.keys.batch(step))
        stored = SealedBatch.from_manifest(step, fields)
        await _done(client, step)
        peak = _vm(self.pid, "VmHWM")
        forks = (await self.redis.info("stats")).get("total_forks", 0) - forks
        if encoding == "frames":
            stats, share_samples = got.stats, got.num_samples
        else:
            stats, share_samples = got["stats"], len(got["samples"])
        assert stats["num_samples"] == stored.num_samples and share_samples == stored.num_samples // world_size
        built = stats["sealed_at"]
        res: dict[str, Any] = {
            "sealed_to_decoded": decoded - sealed, "built_to_decoded": decoded - built,
            "pack_and_seal": sealed - built, "to_response": self.received["at"] - sealed,
            "decode": decoded - self.received["at"], "gate_to_built": built - gated,
            "body_bytes": self.received["body_bytes"], "batch_bytes": stored.nbytes, "chunks": len(stored.table),
            "samples": stored.num_samples, "share_samples": share_samples,
            "sampler_rss_idle": idle, "sampler_rss_peak": peak, "client_rss_idle": client_idle,
            "client_rss_peak": client_peak, "loop_stall_max": stall, "aof_rewrites": forks,
            "redis_rtt_p99": _p99(rtts), "redis_rtt_max": max(rtts) if rtts else None, "redis_pings": len(rtts),
            "store_failures": await _store_failures(client),
        }
        if encoding == "frames":
            t0 = time.perf_counter()
            got.column("completion_token_ids")
            res["column"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            dicts = got.samples()
            res["samples_dicts"] = time.perf_counter() - t0
            del dicts
        if batch_target <= self.validate_max:
            body = got.as_dict() if encoding == "frames" else got
            t0 = time.perf_counter()
            Batch.model_validate(body)
            res["validate"] = time.perf_counter() - t0
            del body
        del got, poll  # the body's buffer goes back before the next batch
        gc.collect()
        return res


async def _measure(url: str, pid: int, redis_url: str, namespace: str, cases: list[tuple[str, int]],
                   target: int, reps: int, old_reps: int, warmups: int, park_s: float,
                   validate_max: int) -> list[dict[str, Any]]:
    from services.sampler.storage.keys import Keys

    keys = Keys(namespace)
    out = []
    step = 0
    redis = aioredis.from_url(redis_url)
    heard = await Announcements(redis_url, keys.events).__aenter__()
    pings = await RedisPings(redis_url).__aenter__()
    trainer = Trainer(url, pid, redis, keys, heard, park_s, validate_max, pings)
    # The frames cases (world sizes 1 and 8) are measured in turn, batch by batch (ws 1, ws 8,
    # ws 1, ...): the share is judged against the whole batch (share <= whole/8 + 10 ms), and on
    # a shared machine two cases measured a minute apart differ by the load of that minute.
    frames = [case for case in cases if case[0] == "frames"]
    groups = ([frames] if frames else []) + [[case] for case in cases if case[0] != "frames"]
    try:
        for group in groups:
            n = reps if group[0][0] == "frames" else old_reps
            clients = [trainer.client(encoding) for encoding, _ in group]
            runs: list[list[dict[str, Any]]] = [[] for _ in group]
            seconds = [0.0 for _ in group]
            try:
                # A case's warm-ups come right before its first measured batch, as when the cases ran
                # one after the other: the first measured batch of a size is still the sampler's
                # second, the one whose build grows the chunk pool (RSS x batch).
                for i in range(n):
                    for j, (encoding, world_size) in enumerate(group):
                        for _ in range(1 + (warmups if i == 0 else 0)):
                            started = time.monotonic()
                            res = await trainer.one(clients[j], encoding, step, world_size, SHARE_RANK % world_size,
                                                    target)
                            seconds[j] += time.monotonic() - started
                            step += 1
                        runs[j].append(res)
            finally:
                for client in clients:
                    await client.aclose()
            for (encoding, world_size), mine, took in zip(group, runs, seconds):
                # AOF rewrites: the Redis forks during this case's measured batches.
                out.append({"encoding": encoding, "world_size": world_size, "rank": SHARE_RANK % world_size,
                            "runs": mine, "warmups": warmups,
                            "redis_aof_rewrites": sum(r["aof_rewrites"] for r in mine),
                            "case_seconds": round(took, 1)})
                print(f"  {label(target)} {encoding} world_size={world_size}: "
                      f"p50 {median([r['sealed_to_decoded'] for r in mine]) * 1e3:.1f} ms sealed -> decoded, "
                      f"{median([r['built_to_decoded'] for r in mine]) * 1e3:.1f} ms built -> decoded "
                      f"({out[-1]['case_seconds']} s)", flush=True)
    finally:
        await heard.__aexit__()
        await pings.__aexit__()
        await redis.aclose()
    return out


async def _store_failures(client: SamplerClient) -> int:
    """The sampler's failed attempts at storing a built batch since it started (/status)."""
    response = await client._http.request("GET", client.base_url + "/status", timeout=30.0)
    return int(response.json()["steps"].get("store_failures", 0))


def _p50(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if key in r]
    return round(median(values), 6) if values else None


def _row(target: int, prompts: int, fsync: str, measured: dict[str, Any],
         offline: dict[str, float] | None) -> dict[str, Any]:
    runs = measured["runs"]
    first = runs[0]
    batch, body = first["batch_bytes"], first["body_bytes"]
    s2d, b2d = _p50(runs, "sealed_to_decoded"), _p50(runs, "built_to_decoded")
    rate_bytes = batch if measured["world_size"] == 1 else body
    above = max(r["sampler_rss_peak"] - r["sampler_rss_idle"] for r in runs)
    row: dict[str, Any] = {
        "target_bytes": target, "batch_bytes": batch, "encoding": measured["encoding"],
        "world_size": measured["world_size"], "rank": measured["rank"], "appendfsync": fsync,
        "prompts_per_step": prompts, "samples": first["samples"], "share_samples": first["share_samples"],
        "chunks": first["chunks"], "body_bytes": body, "reps": len(runs), "warmups": measured["warmups"],
        "sealed_to_decoded_p50_s": s2d,
        "sealed_to_decoded_max_s": round(max(r["sealed_to_decoded"] for r in runs), 6),
        "built_to_decoded_p50_s": b2d,
        "share_p50_s": s2d,
        "legs_p50_s": {leg: _p50(runs, leg) for leg in ("gate_to_built", "pack_and_seal", "to_response", "decode")},
        # Throughput: the stored batch at world_size 1, the share's body at world_size > 1.
        "sealed_to_decoded_GB_per_s": round(rate_bytes / s2d / 1e9, 3),
        "built_to_decoded_GB_per_s": round(rate_bytes / b2d / 1e9, 3),
        "sampler_rss_idle_bytes": int(median([r["sampler_rss_idle"] for r in runs])),
        "sampler_rss_peak_bytes": max(r["sampler_rss_peak"] for r in runs),
        "sampler_rss_peak_above_idle_bytes": above,
        "sampler_rss_peak_above_idle_x_batch": round(above / batch, 3),
        "client_rss_peak_above_idle_bytes": max(r["client_rss_peak"] - r["client_rss_idle"] for r in runs),
        "sampler_loop_stall_max_s": round(max(r["loop_stall_max"] for r in runs), 4),
        "samples_dicts_s": _p50(runs, "samples_dicts"),
        "column_s": _p50(runs, "column"),
        "pydantic_validate_s": _p50(runs, "validate"),
        "redis_aof_rewrites": measured["redis_aof_rewrites"],
        # Redis PING round trips while each batch was built, stored and sealed (another process).
        "redis_rtt_p99_s": max((r["redis_rtt_p99"] for r in runs if r["redis_rtt_p99"] is not None), default=None),
        "redis_rtt_max_s": max((r["redis_rtt_max"] for r in runs if r["redis_rtt_max"] is not None), default=None),
        "redis_pings": sum(r["redis_pings"] for r in runs),
        # Failed attempts at storing a batch, warm-ups included (0: every batch sealed at its first attempt).
        "store_failures": runs[-1]["store_failures"],
        "case_seconds": measured["case_seconds"],
        # Per measured batch; aof_rewrites: Redis forks (AOF rewrites) from its publish to its end.
        "runs_s": [{**{k: round(r[k], 5) for k in ("sealed_to_decoded", "built_to_decoded", "to_response")},
                    "aof_rewrites": r["aof_rewrites"]} for r in runs],
    }
    if offline and measured["world_size"] == 1 and measured["encoding"] == "frames":
        row["offline_build_s"] = {k: round(v, 4) if isinstance(v, float) else v for k, v in offline.items()}
    return row


def _size_rows(tmp: Path, standin_url: str, target: int, cases: list[tuple[str, int]], fsync: str,
               reps: int, old_reps: int, warmups: int, park_s: float, validate_max: int,
               sampler_settings: dict[str, Any]) -> list[dict[str, Any]]:
    prompts = prompts_for(target)
    offline = offline_build(prompts) if fsync == "always" else None
    where = tmp / f"{fsync}-{target}"
    try:
        with redis_server(where, appendfsync=fsync) as redis_url:
            namespace = "h" + uuid.uuid4().hex[:10]
            settings = {"redis_url": redis_url, "namespace": namespace, "inference_urls": [standin_url],
                        "strategy": "bench.handoff_strategy:SyntheticBatches", "prompts_per_step": prompts,
                        "num_generations": GROUP, "max_staleness": 1, "keep_batches": 1, "max_poll_timeout": 60,
                        "batch_cache_bytes": CACHE_BYTES, "rollout_log": False, "drain_deadline": 0,
                        **sampler_settings}
            with sampler_process(where / "run", **settings) as sampler:
                measured = asyncio.run(_measure(sampler.url, sampler.pid, redis_url, namespace, cases, target,
                                                reps, old_reps, warmups, park_s, validate_max))
    finally:
        shutil.rmtree(where, ignore_errors=True)  # the AOF of a 2 GiB case is many GiB
    return [_row(target, prompts, fsync, m, offline) for m in measured]


def run(results_dir: Path, *, sizes: tuple[int, ...] | None = None, quick: bool = False,
        reps: dict[int, int] | None = None, old_reps: dict[int, int] | None = None, warmups: int = 1,
        world_sizes: tuple[int, ...] = WORLD_SIZES, old_encodings: tuple[str, ...] = OLD_ENCODINGS,
        old_sizes: tuple[int, ...] = OLD_SIZES, everysec_sizes: tuple[int, ...] | None = None,
        ceiling_bytes: int | None = None, park_s: float = 0.05, validate_max: int = VALIDATE_MAX,
        **sampler_settings: Any) -> dict:
    """Frames at every size and world size; the old encodings at `old_sizes` (world_size 1);
    frames at `everysec_sizes` also on a Redis that fsyncs once a second; the ceilings at
    `ceiling_bytes` (0: none)."""
    if sizes is None:
        env = os.environ.get("HANDOFF_SIZES")
        sizes = tuple(parse_size(s) for s in env.split(",")) if env else (QUICK_SIZES if quick else SIZES)
    if ceiling_bytes is None:  # 1 GiB as the issue asks, smaller for runs of small sizes only
        ceiling_bytes = GIB if max(sizes) >= GIB else 256 * MIB if max(sizes) >= 64 * MIB else 16 * MIB
    if everysec_sizes is None:
        everysec_sizes = tuple(s for s in (MIB, 64 * MIB) if s in sizes)
    reps = {**REPS, **(reps or {})}
    old_reps = {**OLD_REPS, **(old_reps or {})}
    started = time.monotonic()
    load_at_start = round(os.getloadavg()[0], 2)
    rows: list[dict[str, Any]] = []
    ceilings = None
    tmp_root = Path(os.environ.get("HANDOFF_TMP", tempfile.gettempdir()))
    with tempfile.TemporaryDirectory(prefix="tandem-bench-handoff-", dir=tmp_root) as tmp_name:
        tmp = Path(tmp_name)
        if ceiling_bytes:
            print(f"  ceilings at {label(ceiling_bytes)}", flush=True)
            ceilings = measure_ceilings(tmp, ceiling_bytes)
            print(f"  {ceilings}", flush=True)
        with standin_process(tmp, 0.0) as standin:
            for size in sizes:
                cases = ([("frames", ws) for ws in world_sizes if ws == 1 or size not in WHOLE_ONLY]
                         + [(e, 1) for e in old_encodings if size in old_sizes])
                rows += _size_rows(tmp, standin.url, size, cases, "always", reps.get(size, 3),
                                   old_reps.get(size, 3), warmups, park_s, validate_max, sampler_settings)
            for size in everysec_sizes:
                rows += _size_rows(tmp, standin.url, size, [("frames", 1)], "everysec", reps.get(size, 3),
                                   old_reps.get(size, 3), warmups, park_s, validate_max, sampler_settings)
    full = tuple(sizes) == SIZES
    return _report(results_dir, rows, ceilings, time.monotonic() - started, full, sizes, load_at_start)


# --- the report --------------------------------------------------------------------------

def _targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    def cell(size: int, ws: int = 1, enc: str = "frames") -> dict[str, Any] | None:
        return next((r for r in rows if r["target_bytes"] == size and r["encoding"] == enc
                     and r["world_size"] == ws and r["appendfsync"] == "always"), None)

    out = []

    def target(name: str, row: dict[str, Any] | None, value: Any, goal: str, met: Any) -> None:
        out.append({"name": name, "goal": goal, "value": value if row else None,
                    "met": bool(met) if row else None})

    for size, name in ((2 * GIB, "2GiB"), (4 * GIB, "4GiB")):
        r = cell(size)
        target(f"sealed_in_one_attempt_at_{name}", r, r and r["store_failures"], "0 failed attempts at storing",
               r and r["store_failures"] == 0)
    r = cell(2 * GIB)
    rtt = r and r["redis_rtt_p99_s"]
    target("redis_rtt_p99_ms_during_2GiB_seal", r, rtt and round(rtt * 1e3, 2), "<= 50 ms", rtt is not None and rtt <= 0.05)
    for size, name in ((64 * MIB, "64MiB"), (GIB, "1GiB")):
        r = cell(size)
        target(f"built_to_decoded_GB_per_s_at_{name}", r,
               r and r["built_to_decoded_GB_per_s"], ">= 1 GB/s", r and r["built_to_decoded_GB_per_s"] >= 1.0)
    r = cell(GIB)
    target("sealed_to_decoded_GB_per_s_at_1GiB", r, r and r["sealed_to_decoded_GB_per_s"], ">= 2 GB/s",
           r and r["sealed_to_decoded_GB_per_s"] >= 2.0)
    whole, share = cell(GIB), cell(GIB, 8)
    if whole and share:
        bound = whole["sealed_to_decoded_p50_s"] / 8 + 0.010
        out.append({"name": "share_p50_s_at_1GiB_world_size_8", "goal": "<= whole/8 + 10 ms",
                    "value": share["share_p50_s"], "bound_s": round(bound, 4), "met": share["share_p50_s"] <= bound})
    else:
        out.append({"name": "share_p50_s_at_1GiB_world_size_8", "goal": "<= whole/8 + 10 ms", "value": None,
                    "met": None})
    target("sampler_rss_peak_above_idle_x_batch_at_1GiB", r, r and r["sampler_rss_peak_above_idle_x_batch"],
           "<= 1.5", r and r["sampler_rss_peak_above_idle_x_batch"] <= 1.5)
    r = cell(MIB)
    target("sealed_to_decoded_p50_s_at_1MiB", r, r and r["sealed_to_decoded_p50_s"], "<= 0.005",
           r and r["sealed_to_decoded_p50_s"] <= 0.005)
    return out


def _with_bounds(targets: list[dict[str, Any]], ceilings: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The physical bound beside each rate target, from this run's ceilings. built -> decoded:
    a batch is sealed only once its chunks are fsynced and sent only once sealed, so even with
    packing overlapped with the writes it takes at least a write + fsync by two threads and then
    a loopback transfer: 1 / (1/disk + 1/loopback). sealed -> decoded: the loopback transfer."""
    if not ceilings or not ceilings.get("disk_fsync"):
        return targets
    tcp = ceilings["tcp_loopback"]["GB_per_s_fresh_buffer"]
    disk = ceilings["disk_fsync"]["GB_per_s_2_threads"]
    for t in targets:
        if t["name"].startswith("built_to_decoded_GB_per_s"):
            t["physical_bound_GB_per_s"] = round(1 / (1 / disk + 1 / tcp), 3)
            # Whatever the design: a batch handed over only once durable is never faster than
            # the disk writes it (even with the transfer overlapping the writes).
            t["disk_bound_GB_per_s"] = disk
        elif t["name"].startswith("sealed_to_decoded_GB_per_s"):
            t["physical_bound_GB_per_s"] = tcp
    return targets


def _ms(x: float | None) -> str:
    return "" if x is None else f"{x * 1e3:.1f}" if x >= 0.01 else f"{x * 1e3:.2f}"


def _report(results_dir: Path, rows: list[dict[str, Any]], ceilings: dict[str, Any] | None, seconds: float,
            full: bool, sizes: tuple[int, ...], load_at_start: float | None = None) -> dict:
    from bench.handoff_strategy import COMPLETION_TOKENS, PROMPT_TOKENS

    targets = _with_bounds(_targets(rows), ceilings)
    result: dict[str, Any] = {
        "benchmark": "handoff",
        "full_run": full,
        "sizes": list(sizes),
        "setup": {"sample": f"{PROMPT_TOKENS} prompt + {COMPLETION_TOKENS} completion tokens (int32 ids, "
                            "float64 logprobs, uint8 loss mask as numpy arrays), texts of 300 + 1500 chars",
                  "clocks": {"built": "stats.sealed_at, stamped by the producer when the samples are done",
                             "sealed": "an independent Redis subscriber hears sealed:<step>",
                             "decoded": "SamplerClient.get_batch_arrays returned (frames); get_batch_raw (others)"},
                  "sampler": {"batch_chunk_bytes": 4 * MIB, "batch_cache_bytes": CACHE_BYTES, "keep_batches": 1,
                              "rollout_log": False, "max_staleness": 1},
                  "redis": "redis-server, one per batch size: appendonly yes, appendfsync always, save ''",
                  "chunks": "files under the sampler's run directory, each fsynced once (batch_store = files)",
                  "share_rank": SHARE_RANK},
        "rows": rows,
        "targets": targets,
        "ceilings": ceilings,
        "seconds": round(seconds, 1),
        "host": {**host(), "loadavg_1m_at_start": load_at_start},
        "command": COMMAND,
    }
    lines = [
        "# Hand-off: batch built and sealed -> trainer holds it decoded",
        "",
        ("Full run." if full else f"**Partial run**: sizes {', '.join(label(s) for s in sizes)} only "
                                  f"(`python -m bench.bench_handoff --quick` or `--sizes`)."),
        f" {host()['cpus']} CPUs; {seconds:.0f} s in all; load average (1 min) {load_at_start} at the start, "
        f"{result['host']['loadavg_1m_at_end']} at the end.",
        "",
        f"A fresh sampler per size builds batches of synthetic samples ({result['setup']['sample']}) through "
        "its own producer (token fields typed already, so packing into 4 MiB group-aligned chunks is the one "
        "copy), writes the chunks to files under its run directory as they are packed (each fsynced once: "
        "`batch_store = files`), seals the manifest in Redis (`appendfsync always`) and answers a parked `GET "
        "/batch` from memory; the client receives the body in place (shared/http_into.py) into a buffer of the "
        "batch before, dropped by then (shared/recv_buffers.py). "
        "4 GiB is measured at world size 1 only (the sampler's peak is about twice the batch). The Parquet rollout log is off (`rollout_log = false`): it is a producer hook after "
        "each seal that would dominate the sampler's CPU and RSS at 1-2 GiB. `batch_cache_bytes` = 3 GiB, "
        "`keep_batches` = 1 (Redis holds at most the batch before and this one).",
        "",
        "Clocks: **built** = `stats.sealed_at` (samples done, before packing); **sealed** = an independent "
        "Redis subscriber hears `sealed:N`; **decoded** = `SamplerClient.get_batch_arrays` returned "
        "(`BatchArrays`, numpy views of the received body; `get_batch_raw` for the old encodings). At "
        f"world_size 8, rank {SHARE_RANK} fetches its share alone; its clock is the share's. The frames "
        "batches of a size are measured in turn, ws 1 and ws 8 (so both see the same load).",
        "",
        "| batch | enc | ws | samples (share) | body | reps | sealed->decoded p50 ms | GB/s | built->decoded "
        "p50 ms | GB/s | pack+seal ms | to response ms | decode ms | sampler RSS idle -> peak (x batch) "
        "| loop stall ms | samples() ms | column ms | + pydantic ms | AOF rewrites | Redis RTT p99 / max ms "
        "| store failures |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["appendfsync"] != "always":
            continue
        legs = r["legs_p50_s"]
        lines.append(
            f"| {label(r['batch_bytes'])} | {r['encoding']} | {r['world_size']} | {r['samples']} "
            f"({r['share_samples']}) | {label(r['body_bytes'])} | {r['reps']} | {_ms(r['sealed_to_decoded_p50_s'])} "
            f"| {r['sealed_to_decoded_GB_per_s']} | {_ms(r['built_to_decoded_p50_s'])} | "
            f"{r['built_to_decoded_GB_per_s']} | {_ms(legs['pack_and_seal'])} | {_ms(legs['to_response'])} | "
            f"{_ms(legs['decode'])} | {label(r['sampler_rss_idle_bytes'])} -> {label(r['sampler_rss_peak_bytes'])} "
            f"({r['sampler_rss_peak_above_idle_x_batch']}) | {_ms(r['sampler_loop_stall_max_s'])} | "
            f"{_ms(r['samples_dicts_s'])} | {_ms(r['column_s'])} | {_ms(r['pydantic_validate_s'])} | "
            f"{sum(x['aof_rewrites'] for x in r['runs_s'])} | {_ms(r.get('redis_rtt_p99_s'))} / "
            f"{_ms(r.get('redis_rtt_max_s'))} | {r.get('store_failures')} |")
    lines += [
        "",
        "GB/s = the stored batch (at ws 8: the share's body) / the p50, 1 GB = 1e9 bytes. Legs (p50): "
        "pack+seal = built -> sealed (summarize_batch, codec.with_arrays, packing.pack, the chunk files' "
        "writes with their fsyncs, the seal script); to response = sealed -> body received (wake-up, chunks from "
        "memory, HTTP transfer into the client's buffer); decode = body received -> decoded. Sampler RSS: "
        "VmRSS before the build -> VmHWM after it (reset with clear_refs before each batch); x batch = the "
        "largest (peak - idle) / batch: what building a batch adds. Idle holds the batch before (keep_batches 1) "
        "and, for batches of 1 MiB chunks, the chunk pool (services/sampler/storage/packing.py: up to one "
        "batch of free mappings, which the next batch is packed into), so compare the absolute peak with the "
        "batch too. Loop stall = the slowest `GET /health` (answered from memory, polled "
        "every 25 ms) while the batch was built and sealed: a lower bound on how long the sampler's event loop "
        "was blocked at a stretch. "
        "samples() = `BatchArrays.samples()` (sample dicts); column = `BatchArrays.column('completion_token_ids')`; "
        "+ pydantic = `Batch.model_validate` of the dict form (only up to 64 MiB). AOF rewrites = the Redis "
        "forks (auto-aof-rewrite, Redis's default, as the embedded Redis has it) during the measured batches: "
        "each rewrites the whole dataset while the batch is being served. Redis RTT = PING round trips "
        "every 5 ms from a process of its own, sent between the gate's opening and the seal's announcement "
        "(the worst p99 of the measured batches, and the slowest). Store failures = attempts at storing a "
        "built batch that failed, over the sampler's life (warm-ups included): 0 = every batch sealed at its "
        "first attempt. Per-batch numbers are in the JSON (`runs_s`).",
        "",
        "The seal's subscriber is a process of its own; on a loaded 2-core machine its stamp can still come "
        "a millisecond late, which shows as a sealed -> decoded of about 0 in a few 1 MiB batches.",
        "",
    ]
    offline = [r for r in rows if "offline_build_s" in r]
    if offline:
        lines += ["**The producer's share of pack+seal**, timed in the benchmark process on the same samples "
                  "(one run each):", "",
                  "| batch | chunks | summarize_batch ms | codec.with_arrays ms | packing.pack ms | pack GB/s |",
                  "|---|---|---|---|---|---|"]
        for r in offline:
            o = r["offline_build_s"]
            lines.append(f"| {label(r['batch_bytes'])} | {o['chunks']} | {_ms(o['summarize_s'])} | "
                         f"{_ms(o['with_arrays_s'])} | {_ms(o['pack_s'])} | {r['batch_bytes'] / o['pack_s'] / 1e9:.2f} |")
        lines.append("")
    everysec = [r for r in rows if r["appendfsync"] == "everysec"]
    if everysec:
        result["durability_cost"] = []
        lines += ["**What fsyncing every write costs** (frames, ws 1; always / everysec):", "",
                  "| batch | sealed->decoded p50 ms | built->decoded p50 ms | pack+seal ms |", "|---|---|---|---|"]
        for e in everysec:
            a = next((r for r in rows if r["appendfsync"] == "always" and r["target_bytes"] == e["target_bytes"]
                      and r["encoding"] == "frames" and r["world_size"] == 1), None)
            if a is None:
                continue
            result["durability_cost"].append({
                "batch_bytes": a["batch_bytes"],
                "sealed_to_decoded_p50_s": {"always": a["sealed_to_decoded_p50_s"], "everysec": e["sealed_to_decoded_p50_s"]},
                "built_to_decoded_p50_s": {"always": a["built_to_decoded_p50_s"], "everysec": e["built_to_decoded_p50_s"]},
                "pack_and_seal_s": {"always": a["legs_p50_s"]["pack_and_seal"], "everysec": e["legs_p50_s"]["pack_and_seal"]}})
            lines.append(f"| {label(a['batch_bytes'])} | {_ms(a['sealed_to_decoded_p50_s'])} / "
                         f"{_ms(e['sealed_to_decoded_p50_s'])} | {_ms(a['built_to_decoded_p50_s'])} / "
                         f"{_ms(e['built_to_decoded_p50_s'])} | {_ms(a['legs_p50_s']['pack_and_seal'])} / "
                         f"{_ms(e['legs_p50_s']['pack_and_seal'])} |")
        lines.append("")
    old = [r for r in rows if r["encoding"] != "frames" and r["appendfsync"] == "always"]
    if old:
        lines += ["**The old encodings** (transcoded by the sampler from the chunks; ws 1), against frames:", ""]
        for size in sorted({r["target_bytes"] for r in old}):
            base = next((r for r in rows if r["target_bytes"] == size and r["encoding"] == "frames"
                         and r["world_size"] == 1 and r["appendfsync"] == "always"), None)
            if base is None:
                continue
            parts = [f"{r['encoding']} {_ms(r['sealed_to_decoded_p50_s'])} ms "
                     f"({r['sealed_to_decoded_p50_s'] / base['sealed_to_decoded_p50_s']:.1f}x)"
                     for r in old if r["target_bytes"] == size]
            lines.append(f"* {label(base['batch_bytes'])}: frames {_ms(base['sealed_to_decoded_p50_s'])} ms; "
                         + ", ".join(parts) + " (sealed -> decoded p50).")
        lines.append("")
    lines += ["**Targets**:", ""]
    for t in targets:
        state = "not measured in this run" if t["met"] is None else ("met" if t["met"] else "NOT met")
        extra = f" (bound {t['bound_s']} s)" if "bound_s" in t else ""
        if "physical_bound_GB_per_s" in t:
            extra += (f" (this machine's physical bound: {t['physical_bound_GB_per_s']} GB/s, "
                      + ("1 / (1/disk write+fsync by two threads + 1/loopback): the seal follows the fsyncs, the "
                         "transfer follows the seal" if t["name"].startswith("built") else "loopback TCP") + ")")
        if "disk_bound_GB_per_s" in t:
            extra += (f"; no hand-off of durable batches beats the disk alone: {t['disk_bound_GB_per_s']} GB/s, "
                      "even with the transfer overlapping the writes")
        lines.append(f"* {t['name']} {t['goal']}: {state}" + ("" if t["value"] is None else f", {t['value']}{extra}"))
    lines.append("")
    if ceilings:
        tcp, rs, mc = ceilings["tcp_loopback"], ceilings["redis_set"], ceilings["memcpy"]
        disk = ceilings.get("disk_fsync")
        lines += [f"**This machine's ceilings** ({label(tcp['bytes'])}):", "",
                  f"* loopback TCP, one socket, two processes (sendall from memory -> recv_into): "
                  f"{tcp['GB_per_s']} GB/s into a prefaulted buffer, {tcp['GB_per_s_fresh_buffer']} GB/s into a "
                  "fresh `shared.chunks.alloc` buffer (page faults: what a client receiving into fresh memory pays; "
                  f"a Python sendall -> recv_into loop, not a strict bound), {tcp['GB_per_s_fresh_private_buffer']} GB/s into a fresh MAP_PRIVATE one "
                  "with huge pages;",
                  *([f"* disk, {label(disk['file_bytes'])} files each written and fsynced (as the bulk store "
                     f"writes chunks), in {disk['where']}: {disk['GB_per_s_1_threads']} GB/s by one thread, "
                     f"{disk['GB_per_s_2_threads']} GB/s by two (runs: {disk['seconds_1_threads']} s, "
                     f"{disk['seconds_2_threads']} s);"] if disk else []),
                  f"* Redis SET, {label(rs['value_bytes'])} values, {rs['per_round_trip']} per round trip, AOF on: "
                  f"{rs['GB_per_s_always']} GB/s with appendfsync always, {rs['GB_per_s_everysec']} GB/s with everysec;",
                  f"* memcpy in one process: {mc['GB_per_s_fresh_buffer']} GB/s into a fresh `alloc` buffer, "
                  f"{mc['GB_per_s_fresh_private_buffer']} GB/s into a fresh private one with huge pages, "
                  f"{mc['GB_per_s_prefaulted']} GB/s prefaulted.", ""]
    lines += [f"`{COMMAND}`; quick: `.venv/bin/python -m bench.bench_handoff --quick`"]
    write_results(results_dir, "handoff", result, "\n".join(lines))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_handoff", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 MiB and 64 MiB only, ceilings at 256 MiB")
    parser.add_argument("--sizes", help="comma-separated batch sizes, e.g. 1M,64M,256M,1G,2G")
    parser.add_argument("--reps", type=int, help="measured repetitions per case (default: by size)")
    parser.add_argument("--no-old", action="store_true", help="frames only (no arrays/msgpack/json rows)")
    parser.add_argument("--no-everysec", action="store_true", help="no appendfsync everysec comparison")
    parser.add_argument("--ceiling-bytes", help="size of the ceiling measurements (0: skip them)")
    parser.add_argument("--results", default=str(REPO / "bench" / "results"))
    args = parser.parse_args(argv)
    sizes = tuple(parse_size(s) for s in args.sizes.split(",")) if args.sizes else None
    kwargs: dict[str, Any] = {}
    if args.reps:
        kwargs["reps"] = {s: args.reps for s in (sizes or SIZES)}
        kwargs["old_reps"] = dict(kwargs["reps"])
    if args.no_old:
        kwargs["old_encodings"] = ()
    if args.no_everysec:
        kwargs["everysec_sizes"] = ()
    if args.ceiling_bytes is not None:
        kwargs["ceiling_bytes"] = parse_size(args.ceiling_bytes)
    result = run(Path(args.results), sizes=sizes, quick=args.quick, **kwargs)
    for t in result["targets"]:
        print(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())

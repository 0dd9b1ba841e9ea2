"""A sealed batch's chunks as files: the bulk bytes, kept out of Redis's write path.

Redis fsyncs every write (`appendfsync always`): right for the run's state, ruinous for
gigabytes of payload, which then stall every other command while they are written (issue
44). Here each chunk is written once, to a file of its own, and fsynced once; Redis keeps
only the manifest that names the files' directory (store.py).

Layout: `<root>/<step>-<build>-<attempt>/<i>` for chunk i of build `build` of batch `step`;
each attempt at writing a build has a directory of its own (the manifest names the one that
was sealed), so a retry never meets the leftovers of an attempt that failed or timed out.

Invariants:
* A chunk file has its final name only once its bytes are on disk: it is written as
  `<i>.part` (its aligned bulk past the page cache: durable_write.py), fsynced, renamed, and
  before `write` returns the build's directory (and the root, which holds the directory's
  name) is fsynced. So once `write` returns, a crash of the machine loses none of it, and the
  seal that follows (store.py) acknowledges durable bytes.
* A named file never changes (a write-back after a Redis restart keeps the files it finds
  complete and only adds missing ones), so every read of a chunk returns the same bytes.
* Every write has a bound (`timeout`): one that cannot finish in time raises `StoreFailed`
  naming the batch, its size and the bound; its thread stops at the next slice it writes
  and removes the partial build. Writes run on this module's own threads, so a disk that
  hangs holds up only other chunk writes (which then fail on their own bound), never the
  event loop or the threads environments run on.
* A build directory no manifest names is an orphan (a build that died, or lost its seal to
  another build); `sweep` removes the ones that can never be sealed, and trimming removes
  every build of the steps it deletes (store.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from services.sampler.storage.durable_write import write_durably
from shared.chunks import CHUNK_MAGIC, alloc

log = logging.getLogger("tandem.sampler.chunk_files")

# Threads writing chunks, shared by every store of the process. Two keep a disk that takes
# parallel writes busy (measured: one thread leaves most of its bandwidth idle while it waits for
# an fsync); more only compete for the same disk.
_WRITERS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="chunk-writer")


class StoreFailed(RuntimeError):
    """A batch's chunks could not be stored (within the bound, or at all): the build fails
    this attempt with this message and backs off (producer.py). Not an outage of Redis."""


class ChunkUnreadable(RuntimeError):
    """A sealed batch's chunk file is there but cannot be served as its manifest says (another
    length, not a chunk, or the disk refuses to read it): something outside the sampler changed
    or lost it. Never retried into a different answer: every read of a chunk returns the same
    bytes or this."""


def describe_bytes(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class EarlyWrite:
    """A build's chunks handed to the writers one by one as they are packed (packing.pack_writing),
    so that packing one chunk overlaps writing and fsyncing the ones before it; `ChunkFiles.write`
    (the seal) then waits for those writes under its bound, as for chunks it submitted itself.
    Submitted from the packing thread; `abandon` (packing failed or was cancelled) stops them."""

    def __init__(self, files: ChunkFiles, step: int, build: str):
        self.files, self.where = files, files.new_dir(step, build)
        self.stop = threading.Event()
        self.progress = [0, 0]
        self.futures: dict[int, Future[None]] = {}
        self.error: OSError | None = None

    def submit(self, index: int, buffer: Any) -> None:
        if self.stop.is_set():
            return
        if not self.futures:
            try:
                self.files._make_dir(self.where)
            except OSError as exc:  # reported by the seal's write, as a failed store
                self.error = exc
                self.stop.set()
                return
        self.futures[index] = _WRITERS.submit(ChunkFiles._write_files, self.where, {index: buffer}, [index],
                                              self.stop, self.progress, False)

    def abandon(self) -> None:
        self.stop.set()  # writers stop at their next slice and remove the directory
        _WRITERS.submit(shutil.rmtree, self.where, True)


class ChunkFiles:
    def __init__(self, root: Path, timeout: float = 120.0):
        self.root = Path(root).resolve()
        self.timeout = timeout

    def new_dir(self, step: int, build: str) -> Path:
        return self.root / f"{step}-{build}-{uuid.uuid4().hex[:8]}"

    # --- writing ----------------------------------------------------------------------------

    async def write(self, step: int, build: str, buffers: list[Any], *,
                    pause: Callable[[], Awaitable[None]] | None = None, reuse: str | Path | None = None,
                    early: EarlyWrite | None = None) -> Path:
        """Write `buffers` as build `build` of batch `step`, durably, within `timeout` seconds;
        returns the build's directory. `pause` is awaited once the first chunk is durable (the
        restart drills kill there). `reuse`: the directory this build was sealed from before (a
        write-back after a Redis restart): chunks still there with the right size are kept.
        `early`: the chunks' writes already under way (EarlyWrite): waited for, not repeated."""
        keep_existing = reuse is not None and Path(reuse).is_dir()
        if keep_existing:
            early = None
        where = early.where if early else Path(reuse) if keep_existing else self.new_dir(step, build)
        stop = early.stop if early else threading.Event()
        progress = early.progress if early else [0, 0]  # chunks, bytes written
        total = sum(len(memoryview(b).cast("B")) for b in buffers)
        loop = asyncio.get_running_loop()

        async def run(indices: list[int]) -> None:
            started = [early.futures[i] for i in indices if i in early.futures] if early else []
            left = [i for i in indices if not early or i not in early.futures]
            if left:
                started.append(_WRITERS.submit(self._write_files, where, buffers, left, stop, progress, keep_existing))
            await asyncio.gather(*map(asyncio.wrap_future, started))

        async def everything() -> None:
            if early is None or not early.futures:
                if early is not None and early.error is not None:
                    raise early.error
                await loop.run_in_executor(_WRITERS, self._make_dir, where)
            first, rest = [0][:len(buffers)], list(range(1, len(buffers)))
            await run(first)
            if pause is not None:
                await pause()
            # Two writers, interleaved so that both finish at about the same time.
            await asyncio.gather(*(run(rest[k::2]) for k in range(2) if rest[k::2]))
            await loop.run_in_executor(_WRITERS, _fsync_dir, where)

        started = time.monotonic()
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a shutdown's
            # cancellation that lands as the write finishes (shared/aio.py, wait_event).
            async with asyncio.timeout(self.timeout):
                await everything()
        except TimeoutError:
            stop.set()
            if not keep_existing:  # the attempt's own directory: removed once the writers are done
                _WRITERS.submit(shutil.rmtree, where, True)
            raise StoreFailed(
                f"batch {step}: {describe_bytes(total)} could not be stored in {self.timeout:g} s: {progress[0]} of "
                f"{len(buffers)} chunks ({describe_bytes(progress[1])}) were written to {where} in that time; the "
                "disk is too slow or stuck (raise batch_store_timeout, or give batch_dir a faster disk)") from None
        except OSError as exc:
            stop.set()
            if not keep_existing:
                _WRITERS.submit(shutil.rmtree, where, True)
            raise StoreFailed(f"batch {step}: {describe_bytes(total)} could not be stored in {where}: "
                              f"{type(exc).__name__}: {exc}") from exc
        except BaseException:
            stop.set()  # cancelled (shutdown): the writers stop at their next slice
            raise
        log.debug("batch %d: %d chunks, %s, stored in %.2fs", step, len(buffers), describe_bytes(total),
                  time.monotonic() - started)
        return where

    def _make_dir(self, where: Path) -> None:
        new_root = not self.root.exists()
        where.mkdir(parents=True, exist_ok=True)
        # The directory's name lives in the root (and the root's in its parent, when just made).
        _fsync_dir(self.root)
        if new_root:
            _fsync_dir(self.root.parent)

    @staticmethod
    def _write_files(where: Path, buffers: list[Any], indices: list[int], stop: threading.Event,
                     progress: list[int], keep_existing: bool) -> None:
        """In a writer thread: each chunk to `<i>.part`, fsynced, renamed to `<i>`. On `stop`
        (the bound passed, or the build was cancelled) the partial build is removed."""
        for i in indices:
            if stop.is_set():  # stopped between two chunks: the partial build goes, as below
                if not keep_existing:
                    shutil.rmtree(where, ignore_errors=True)
                return
            view = memoryview(buffers[i]).cast("B")
            final = where / str(i)
            if keep_existing and final.exists() and final.stat().st_size == len(view):
                continue
            part = where / f"{i}.part"
            if not write_durably(part, view, stop):
                if keep_existing:  # a sealed build's directory: only the unfinished file goes
                    part.unlink(missing_ok=True)
                else:
                    shutil.rmtree(where, ignore_errors=True)
                return
            os.replace(part, final)
            progress[0] += 1
            progress[1] += len(view)

    # --- reading ----------------------------------------------------------------------------

    @staticmethod
    def read(where: str | Path, indices: list[int], sizes: list[int]) -> list[Any] | None:
        """Chunks `indices` of the build in `where`, read into buffers of their own (a memory
        map would hold a file descriptor per chunk for as long as the answer takes to send);
        None when one is gone (trimmed meanwhile, or `where` is on another machine's disk);
        ChunkUnreadable when one is there but damaged. `sizes`: their lengths from the manifest."""
        found = []
        for i, size in zip(indices, sizes):
            path = Path(where) / str(i)
            try:
                found.append(ChunkFiles._read_one(path, size))
            except FileNotFoundError:
                return None
            except OSError as exc:
                raise ChunkUnreadable(f"chunk file {path} cannot be read: {exc.strerror or exc}") from exc
        return found

    @staticmethod
    def _read_one(path: Path, size: int) -> Any:
        """The `size` bytes of chunk file `path`; ChunkUnreadable when it holds another number of
        bytes or does not start as a chunk does (the magic: a check that costs nothing)."""
        with open(path, "rb", buffering=0) as f:
            held = os.fstat(f.fileno()).st_size
            if held != size:
                raise ChunkUnreadable(f"chunk file {path} holds {held} bytes, its batch's manifest says {size}")
            buffer = alloc(size)
            view, got = memoryview(buffer), 0
            while got < size and (n := f.readinto(view[got:])):
                got += n
        if got != size:
            raise ChunkUnreadable(f"chunk file {path} ended after {got} of its {size} bytes while being read")
        if bytes(view[:len(CHUNK_MAGIC)]) != CHUNK_MAGIC:
            raise ChunkUnreadable(f"chunk file {path} does not start as a batch chunk does ({CHUNK_MAGIC!r})")
        return buffer

    # --- removing ---------------------------------------------------------------------------

    def builds(self) -> list[tuple[int, str, Path]]:
        """(step, build, directory) of every build under the root."""
        out = []
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return []
        for entry in entries:
            step, _, build = entry.name.partition("-")
            if entry.is_dir() and step.isdigit() and build and not entry.name.startswith("."):
                out.append((int(step), build, Path(entry.path)))
        return out

    @staticmethod
    def remove(where: str | Path) -> None:
        shutil.rmtree(where, ignore_errors=True)

    def remove_below(self, step: int, also: list[str] | None = None) -> int:
        """Remove every build of the steps below `step` under the root, and the directories in
        `also` (builds a trim deleted whose files are elsewhere); returns how many went."""
        gone = 0
        for s, _, where in self.builds():
            if s < step:
                self.remove(where)
                gone += 1
        for where in also or []:
            if Path(where).parent != self.root and Path(where).exists():
                self.remove(where)
                gone += 1
        return gone

    def touch(self, where: Path, count: int) -> bool:
        """Mark the build in `where` as about to be sealed (a sweep leaves fresh builds alone)
        and check its `count` chunks are all there."""
        try:
            os.utime(where)
        except FileNotFoundError:
            return False
        return all((where / str(i)).exists() for i in range(count))

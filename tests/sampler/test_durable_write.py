"""Chunk files written past the page cache (services/sampler/storage/durable_write.py): the aligned
bulk of a page-aligned buffer with O_DIRECT, the tail buffered, every byte as given; buffered
throughout where the buffer is not aligned or the filesystem refuses O_DIRECT."""

from __future__ import annotations

import errno
import fcntl
import os
import threading

import numpy as np
import pytest

from services.sampler.storage import durable_write
from services.sampler.storage.durable_write import ALIGN, direct_length, write_durably
from shared.chunks import alloc

pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux's")


@pytest.fixture(autouse=True)
def direct_on(monkeypatch):
    monkeypatch.setattr(durable_write, "_DIRECT", True)  # each test starts as a fresh process does


def _chunk(size: int) -> memoryview:
    """A chunk as packing makes one: a page-aligned mapping, random bytes."""
    buffer = alloc(max(size, 1 << 20))
    view = memoryview(buffer)[:size]
    view[:] = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    return view


def _opens(monkeypatch, refuse: bool = False) -> list[int]:
    """The flags of every os.open of the module; `refuse`: O_DIRECT opens fail as on tmpfs."""
    flags_seen: list[int] = []
    real = os.open

    def spy(path, flags, *args):
        flags_seen.append(flags)
        if refuse and flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, *args)

    monkeypatch.setattr(durable_write.os, "open", spy)
    return flags_seen


def _takes_o_direct(where) -> bool:
    """Whether the filesystem under `where` writes with O_DIRECT (tmpfs refuses it)."""
    try:
        fd = os.open(where / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:
        return False
    try:
        os.write(fd, memoryview(alloc(1 << 20))[:ALIGN])
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def test_the_aligned_bulk_goes_direct_and_the_tail_buffered_every_byte_as_given(tmp_path, monkeypatch):
    if not _takes_o_direct(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT (the buffered path is tested below)")
    opens = _opens(monkeypatch)
    view = _chunk(3 * ALIGN + 104)
    assert direct_length(view) == 3 * ALIGN
    # SLICE shortened: the bulk crosses slices, so later direct writes start at an offset.
    monkeypatch.setattr(durable_write, "SLICE", 2 * ALIGN)
    assert write_durably(tmp_path / "0", view, threading.Event())
    assert (tmp_path / "0").read_bytes() == bytes(view)
    assert [bool(f & os.O_DIRECT) for f in opens] == [True]
    assert durable_write._DIRECT  # written direct: never refused


def test_a_buffer_not_aligned_or_shorter_than_a_block_is_written_buffered(tmp_path, monkeypatch):
    opens = _opens(monkeypatch)
    whole = _chunk(4 * ALIGN)
    for name, view in (("shifted", whole[8:]), ("small", whole[:ALIGN - 8])):
        assert direct_length(view) == 0
        assert write_durably(tmp_path / name, view, threading.Event())
        assert (tmp_path / name).read_bytes() == bytes(view)
    assert opens and not any(f & os.O_DIRECT for f in opens)


def test_a_filesystem_that_refuses_o_direct_at_open_gets_buffered_writes_from_then_on(tmp_path, monkeypatch):
    opens = _opens(monkeypatch, refuse=True)
    view = _chunk(5 * ALIGN)
    assert write_durably(tmp_path / "0", view, threading.Event())
    assert write_durably(tmp_path / "1", view, threading.Event())
    assert (tmp_path / "0").read_bytes() == (tmp_path / "1").read_bytes() == bytes(view)
    # Refused once, then not asked again.
    assert [bool(f & os.O_DIRECT) for f in opens] == [True, False, False]


def test_a_refused_direct_write_goes_on_buffered_from_where_it_stopped(tmp_path, monkeypatch):
    view = _chunk(6 * ALIGN + 40)
    monkeypatch.setattr(durable_write, "SLICE", 2 * ALIGN)
    real, calls = os.write, []

    def write(fd, data):  # the second direct slice is refused, as after an unaligned short write
        calls.append(os.O_DIRECT & fcntl.fcntl(fd, fcntl.F_GETFL))
        if len(calls) == 2 and calls[-1]:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data)

    monkeypatch.setattr(durable_write.os, "write", write)
    assert write_durably(tmp_path / "0", view, threading.Event())
    assert (tmp_path / "0").read_bytes() == bytes(view)
    assert [bool(c) for c in calls] == [True, True, False, False, False]


def test_a_stopped_write_says_so_and_leaves_the_file_partial(tmp_path):
    stop = threading.Event()
    stop.set()
    assert not write_durably(tmp_path / "0", _chunk(4 * ALIGN), stop)
    assert (tmp_path / "0").stat().st_size == 0

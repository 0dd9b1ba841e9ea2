"""shared/recv_buffers.py: a batch body's buffer goes back to the pool only when nothing built on
it is alive, and is handed out again for a body of about the same size."""

from __future__ import annotations

import gc
import threading

import numpy as np

from shared.chunks import decode_frame, frame_head
from shared.recv_buffers import MIN_POOLED, RecvBuffers

MIB = 1 << 20


def _address(buffer) -> int:
    return buffer.__array_interface__["data"][0]


def test_a_buffer_is_reused_only_once_every_view_of_it_is_gone():
    pool = RecvBuffers()
    first = pool.take(64 * MIB)
    assert len(first) == 64 * MIB and first.flags.writeable
    at = _address(first)
    # What a trainer keeps of a batch: a memoryview, numpy views, a view of a view.
    view = memoryview(first).cast("B")
    column = np.frombuffer(view, np.int32, 1000, 4096)
    tail = column[10:]
    del first, view, column
    gc.collect()
    second = pool.take(64 * MIB)
    assert _address(second) != at and pool.reused == 0  # `tail` still uses the first one
    del tail
    gc.collect()
    third = pool.take(64 * MIB - 12345)  # a body of nearly the same size takes it
    assert _address(third) == at and pool.reused == 1 and len(third) == 64 * MIB - 12345
    del second, third


def test_sizes_that_do_not_fit_map_anew_at_most_keep_stay_and_clear_lets_them_go():
    pool = RecvBuffers(keep=2)
    buffers = [pool.take(n * MIB) for n in (4, 8, 16)]
    while buffers:  # dropped in this order: 4 MiB first
        del buffers[0]
    gc.collect()
    assert pool.free_bytes == (8 + 16) * MIB  # the oldest (4 MiB) went back to the system
    big = pool.take(64 * MIB)  # nothing free is large enough
    small = pool.take(2 * MIB)  # 8 MiB would waste more than a quarter
    assert pool.reused == 0 and pool.free_bytes == 24 * MIB
    del big, small
    pool.clear()
    assert pool.free_bytes == 0
    assert isinstance(pool.take(MIN_POOLED - 1), bytearray)


def test_a_reused_buffer_decodes_the_new_body_and_the_last_view_may_die_on_another_thread():
    pool = RecvBuffers()

    def body(step: int, n: int) -> bytes:
        return frame_head(step=step, stats={}, chunk_lengths=[], num_samples=0) + bytes([step]) * n

    first = pool.take(2 * MIB)
    raw = body(1, 2 * MIB - len(body(1, 0)))
    first[:] = np.frombuffer(raw, np.uint8)
    assert decode_frame(first).step == 1
    holder = [first]
    del first
    thread = threading.Thread(target=holder.clear)
    thread.start()
    thread.join()
    gc.collect()
    second = pool.take(2 * MIB)
    assert pool.reused == 1
    raw = body(2, 2 * MIB - len(body(2, 0)))
    second[:] = np.frombuffer(raw, np.uint8)
    assert decode_frame(second).step == 2 and bytes(second) == raw


def test_a_finer_grain_maps_closer_to_the_size_and_set_keep_lets_the_oldest_go():
    pool = RecvBuffers(keep=8, grain=MIB)
    buffers = [pool.take(4 * MIB + 100 * (k + 1)) for k in range(4)]  # a GiB batch's chunks: ~4 MiB each
    addresses = [_address(b) for b in buffers]
    del buffers
    gc.collect()
    assert pool.free_bytes == 4 * 5 * MIB  # 5 MiB mappings, not 6 (the default 2 MiB grain)
    again = [pool.take(4 * MIB + 50) for _ in range(4)]
    assert sorted(map(_address, again)) == sorted(addresses) and pool.reused == 4
    del again
    gc.collect()
    pool.set_keep(1)
    assert pool.free_bytes == 5 * MIB

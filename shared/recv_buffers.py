"""Receive buffers that go back to a pool once nothing uses them (SamplerClient's batch bodies).

First-touching fresh memory is a large and variable part of receiving a big batch. Page
faults and zeroing cost ~0.05-0.3 s per GiB on the 2-core VM when its memory is warm, and
1-5 s per GiB when the hypervisor has taken the pages back: this VM reports every freed
2 MiB block to its host (virtio-balloon free page reporting, /sys/module/page_reporting), so
each batch's freshly mapped buffer paid that again (measured: the same 1 GiB fetch took
0.3 s into a reused buffer, 1.5-5 s into a fresh one). A trainer receives one batch per step
and drops the one before, whose buffer, reused, is already resident.

A buffer is a numpy uint8 array over a pooled mapping (`shared.chunks.alloc`);
`weakref.finalize` on that array returns the mapping to the pool only when the last thing
built on it is gone (numpy views and torch tensors of the batch hold memoryviews that hold
the array), so a buffer is never handed out while any of it is in use. Its old bytes are not
cleared: the client overwrites every byte of a body before returning it, or raises.

At most `keep` free mappings stay (the newest), and `clear()` (the client's `aclose`) lets
them go; smaller requests than MIN_POOLED get a plain bytearray.

The sampler pools its chunk buffers the same way (services/sampler/storage/packing.py): a
batch's chunks are packed into the mappings of a batch dropped before, already resident,
instead of into fresh memory.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from typing import Any

import numpy as np

from shared.chunks import alloc

MIN_POOLED = 1 << 20
# Mappings are made in whole huge pages, so that bodies of nearly the same size share them.
_GRAIN = 2 << 20


class RecvBuffers:
    """`keep`: how many free mappings stay (it may be changed at any time: the sampler's chunk
    pool sets it to a batch's chunk count). `grain`: mapping sizes are multiples of it."""

    def __init__(self, keep: int = 2, *, grain: int = _GRAIN):
        self.keep, self.grain = keep, grain
        # capacity -> free mappings of that capacity as (age, mapping), oldest first: a lookup
        # scans the distinct capacities (a few), not every free mapping (a GiB batch's chunk
        # pool holds hundreds).
        self._free: dict[int, deque[tuple[int, Any]]] = {}
        self._count = self._age = 0
        self._lock = threading.Lock()  # the last view of a batch may die on any thread
        self.reused = 0

    def take(self, size: int) -> Any:
        """A writable buffer of exactly `size` bytes (contents undefined)."""
        if size < MIN_POOLED:
            return bytearray(size)
        mapping = self._reuse(size)
        if mapping is None:
            mapping = alloc(-(-size // self.grain) * self.grain)
        buffer = np.frombuffer(mapping, np.uint8, size)
        weakref.finalize(buffer, self._put, len(mapping), mapping).atexit = False
        return buffer

    def _reuse(self, size: int) -> Any:
        """The smallest free mapping that holds `size` bytes without wasting more than a quarter
        (the most recently freed of that size: the likeliest to be in the CPU's caches)."""
        with self._lock:
            fits = [cap for cap, free in self._free.items() if free and size <= cap <= size + size // 4 + self.grain]
            if not fits:
                return None
            self.reused += 1
            self._count -= 1
            return self._free[min(fits)].pop()[1]

    def _put(self, capacity: int, mapping: Any) -> None:
        with self._lock:
            self._age += 1
            self._free.setdefault(capacity, deque()).append((self._age, mapping))
            self._count += 1
            self._trim()

    def _trim(self) -> None:
        while self._count > self.keep:  # the oldest go back to the system
            oldest = min((free[0][0], cap) for cap, free in self._free.items() if free)[1]
            self._free[oldest].popleft()
            self._count -= 1

    def set_keep(self, keep: int) -> None:
        with self._lock:
            self.keep = keep
            self._trim()

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._count = 0

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(cap * len(free) for cap, free in self._free.items())

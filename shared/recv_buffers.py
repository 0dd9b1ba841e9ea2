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
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np

from shared.chunks import alloc

MIN_POOLED = 1 << 20
# Mappings are made in whole huge pages, so that bodies of nearly the same size share them.
_GRAIN = 2 << 20


class RecvBuffers:
    def __init__(self, keep: int = 2):
        self.keep = keep
        self._free: list[tuple[int, Any]] = []  # (capacity, mapping), oldest first
        self._lock = threading.Lock()  # the last view of a batch may die on any thread
        self.reused = 0

    def take(self, size: int) -> Any:
        """A writable buffer of exactly `size` bytes (contents undefined)."""
        if size < MIN_POOLED:
            return bytearray(size)
        mapping = self._reuse(size)
        if mapping is None:
            mapping = alloc(-(-size // _GRAIN) * _GRAIN)
        buffer = np.frombuffer(mapping, np.uint8, size)
        weakref.finalize(buffer, self._put, len(mapping), mapping).atexit = False
        return buffer

    def _reuse(self, size: int) -> Any:
        """The smallest free mapping that holds `size` bytes without wasting more than a quarter."""
        with self._lock:
            fits = [(cap, i) for i, (cap, _) in enumerate(self._free) if size <= cap <= size + size // 4 + _GRAIN]
            if not fits:
                return None
            _, i = min(fits)
            self.reused += 1
            return self._free.pop(i)[1]

    def _put(self, capacity: int, mapping: Any) -> None:
        with self._lock:
            self._free.append((capacity, mapping))
            if len(self._free) > self.keep:  # the oldest go back to the system
                del self._free[:len(self._free) - self.keep]

    def clear(self) -> None:
        with self._lock:
            self._free.clear()

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(cap for cap, _ in self._free)

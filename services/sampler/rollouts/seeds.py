"""Determinism: seeds derived from names, and the dataset order they fix.

Dataset order is a pure function of (seed, global prompt index): index i lives in epoch
i // len(dataset), and each epoch is a fresh seeded permutation. Batch N's prompts are
indices N*P .. N*P+P-1 (P = prompts_per_step), so a restarted sampler regenerates
exactly the prompts an uninterrupted one would have, with no cursor to persist. Every
request's sampling seed is derived the same way, from the step, group, trajectory, attempt
and turn it belongs to. Imports nothing of the sampler: rollouts, trajectories, sources and
the verifiers path all draw from here.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np


def derive_seed(*parts: Any) -> int:
    """A stable 31-bit seed from any parts (Python's hash() is salted per process)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


class DatasetOrder:
    """Global prompt index -> dataset index, one seeded permutation per epoch."""

    def __init__(self, size: int, seed: int):
        if size <= 0:
            raise ValueError("the environment's dataset is empty")
        self.size = size
        self.seed = seed
        self._perms: dict[int, np.ndarray] = {}

    def __getitem__(self, index: int) -> int:
        epoch, offset = divmod(index, self.size)
        perm = self._perms.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.size)
            self._perms = {epoch: perm}  # only the current epoch is ever needed again
        return int(perm[offset])

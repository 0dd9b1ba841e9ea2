"""Weights holding NaN or infinity are refused before any inference server loads them.

`POST /weights_version` with a `checkpoint_path` the sampler can read: every safetensors file
of the checkpoint (`model.safetensors`, or the shards an index names, or every `*.safetensors`)
is scanned, and a checkpoint with a non-finite value in any float tensor is answered 422
naming the tensors; nothing is loaded and nothing is published. A server that loaded such
weights would answer empty completions with -9999 logprobs, and a probe (which would catch
it) is optional.

No torch here: the file's header is parsed by hand (8-byte little-endian length, then JSON)
and each tensor's bytes are read in chunks as unsigned integers. In the IEEE formats (f64,
f32, f16, bf16, f8 e5m2) a value is NaN or infinite exactly when its exponent bits are all
ones, that is when its bits without the sign are >= the exponent mask; f8 e4m3fn has no
infinity and one NaN pattern per sign (all other bits ones). So one pass of `x & ~sign` and a
max per chunk decides, without converting a value. Integer tensors are skipped. The scan runs
in a worker thread (numpy and file reads release the GIL), so the event loop keeps serving
(its longest stall during 1 GB scans: 8 ms).
A checkpoint whose files are unchanged since their last clean scan is not scanned again (a
retried publication): `WeightsCheck`, one per sampler (SamplerState.weights_check), remembers it.

Speed, measured with `.venv/bin/python -m services.sampler.fleet.weights_check --bench 1` (writes a
1.07 GB bf16 file to a temporary directory and scans it, best of 3) on the 2-core development
VM with other test runs sharing it: 0.09-0.21 s from the page cache (5-11 GB/s; a checkpoint
the trainer just wrote is there) and 0.45-0.51 s with its pages evicted (2.1-2.4 GB/s, the
VM's disk). A 7B model in bf16 (14 GB) adds about 1.3-3 s to its publication, 6-7 s from disk.

A path the sampler cannot read (one only the servers see) is not refused: it is logged once,
and the servers load it as before.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from fastapi import HTTPException, status

from shared.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, is_adapter_dir

log = logging.getLogger("tandem.sampler.weights_check")

# safetensors dtype -> (the unsigned integer of its width, the smallest non-finite pattern
# with the sign bit cleared).
_FLOATS: dict[str, tuple[type[np.unsignedinteger], int]] = {
    "F64": (np.uint64, 0x7FF0_0000_0000_0000),
    "F32": (np.uint32, 0x7F80_0000),
    "F16": (np.uint16, 0x7C00),
    "BF16": (np.uint16, 0x7F80),
    "F8_E5M2": (np.uint8, 0x7C),
    "F8_E4M3": (np.uint8, 0x7F),
}
CHUNK_BYTES = 8 << 20
_MAX_HEADER = 100 << 20  # the format's own bound on the header

class Unreadable(Exception):
    """The checkpoint cannot be checked here (not readable, not safetensors, malformed)."""


@dataclass
class NonFinite:
    file: str
    tensor: str
    count: int
    total: int

    def __str__(self) -> str:
        return f"{self.file}: {self.tensor} ({self.count} of {self.total} values NaN or infinite)"


class WeightsCheck:
    """One sampler's check of the checkpoints it is asked to publish."""

    def __init__(self) -> None:
        # What was last found clean (its files' names, sizes and mtimes), and whether a path
        # the sampler could not read has been logged.
        self.last_clean: tuple | None = None
        self.warned_unreadable = False

    async def refuse_nonfinite(self, checkpoint_path: str) -> None:
        """HTTPException 422 when the checkpoint at `checkpoint_path` holds a NaN or infinity."""
        try:
            found = await asyncio.to_thread(self.scan, checkpoint_path)
        except Unreadable as exc:
            if not self.warned_unreadable:
                self.warned_unreadable = True
                log.warning("could not check %r for NaN/inf weights (%s); the inference servers load it unchecked. "
                            "Logged once", checkpoint_path, exc)
            return
        if found:
            shown = "; ".join(map(str, found[:8])) + (f"; and {len(found) - 8} more tensors" if len(found) > 8 else "")
            raise HTTPException(
                status.HTTP_422_UNPROCESSABLE_CONTENT,
                detail=f"{checkpoint_path!r} holds non-finite weights: {shown}. Nothing was loaded into the inference "
                "servers and the version is not published. The training step that wrote them diverged (lower the "
                "learning rate, check the loss and gradient norm); publish a checkpoint with finite weights.")

    @staticmethod
    def refuse_wrong_kind(checkpoint_path: str, adapter: bool) -> None:
        """HTTPException 422 when a directory the sampler can read is a LoRA adapter published as
        full weights, or the other way round: the servers would refuse it, or worse, load
        something else than the trainer meant. A path the sampler cannot see is not judged."""
        path = Path(checkpoint_path)
        try:
            if not path.is_dir():
                return
            is_adapter = is_adapter_dir(path)
        except OSError:
            return
        if adapter and not is_adapter:
            raise HTTPException(
                status.HTTP_422_UNPROCESSABLE_CONTENT,
                detail=f"{checkpoint_path!r} was published with adapter: true but holds no LoRA adapter (no "
                f"{ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}): publish the adapter directory (PEFT's save_pretrained "
                "format), or full weights with adapter: false")
        if is_adapter and not adapter:
            raise HTTPException(
                status.HTTP_422_UNPROCESSABLE_CONTENT,
                detail=f"{checkpoint_path!r} is a LoRA adapter ({ADAPTER_CONFIG}) but was published as full weights: "
                "send adapter: true with it, so the sampler loads it into the servers as an adapter")

    def scan(self, checkpoint_path: str | os.PathLike) -> list[NonFinite]:
        """`scan_checkpoint`, skipped when the files are unchanged since they were last found clean."""
        files = checkpoint_files(checkpoint_path)
        try:
            stamp = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
        except OSError as exc:
            raise Unreadable(f"{type(exc).__name__}: {exc}") from None
        if stamp == self.last_clean:
            return []
        found = _scan_files(files)
        if not found:
            self.last_clean = stamp
        return found


def checkpoint_files(checkpoint_path: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint directory (or the path itself, if it is one)."""
    path = Path(checkpoint_path)
    try:
        if path.is_file():
            return [path]
        if not path.is_dir():
            raise Unreadable(f"{path} is not a file or directory here")
        index = path / "model.safetensors.index.json"
        if index.is_file():
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return [path / name for name in names]
        files = sorted(path.glob("*.safetensors"))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise Unreadable(f"{type(exc).__name__}: {exc}") from None
    if not files:
        raise Unreadable(f"no *.safetensors file in {path}")
    return files


def scan_checkpoint(checkpoint_path: str | os.PathLike) -> list[NonFinite]:
    """Every float tensor of the checkpoint holding a NaN or infinity (empty when all are finite)."""
    return _scan_files(checkpoint_files(checkpoint_path))


def _scan_files(files: list[Path]) -> list[NonFinite]:
    return [bad for f in files for bad in scan_file(f)]


def scan_file(path: Path) -> list[NonFinite]:
    """The non-finite float tensors of one safetensors file."""
    try:
        with open(path, "rb", buffering=0) as fh:
            size = os.fstat(fh.fileno()).st_size
            (header_len,) = struct.unpack("<Q", _read_exactly(fh, 8))
            if header_len > min(_MAX_HEADER, size - 8):
                raise Unreadable(f"{path.name}: header length {header_len} does not fit the file ({size} bytes)")
            header = json.loads(_read_exactly(fh, header_len))
            base = 8 + header_len
            tensors = sorted(((name, spec) for name, spec in header.items() if name != "__metadata__"),
                             key=lambda item: item[1]["data_offsets"][0])
            buffer = np.empty(CHUNK_BYTES, dtype=np.uint8)
            found = []
            for name, spec in tensors:
                kind = _FLOATS.get(spec["dtype"])
                begin, end = spec["data_offsets"]
                if kind is None or end == begin:
                    continue
                if not 0 <= begin <= end <= size - base:
                    raise Unreadable(f"{path.name}: tensor {name} lies outside the file")
                count = _count_nonfinite(fh, base + begin, end - begin, kind, buffer)
                if count:
                    found.append(NonFinite(path.name, name, count, (end - begin) // np.dtype(kind[0]).itemsize))
            return found
    except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
        raise Unreadable(f"{path.name}: {type(exc).__name__}: {exc}") from None


def _count_nonfinite(fh, offset: int, length: int, kind: tuple[type[np.unsignedinteger], int],
                     buffer: np.ndarray) -> int:
    """Non-finite values among `length` bytes at `offset`; 0 after one and-plus-max pass per
    chunk when all are finite (counting only happens in a chunk that has one)."""
    uint, threshold = kind
    itemsize = np.dtype(uint).itemsize
    if length % itemsize:
        raise ValueError(f"{length} bytes is not a whole number of {itemsize}-byte values")
    without_sign = np.iinfo(uint).max >> 1
    step = CHUNK_BYTES - CHUNK_BYTES % itemsize
    fh.seek(offset)
    bad = 0
    done = 0
    while done < length:
        n = min(step, length - done)
        view = memoryview(buffer)[:n]
        got = fh.readinto(view)
        if got != n:
            raise ValueError(f"file ends {length - done - got} bytes early")
        values = buffer[:n].view(uint)
        np.bitwise_and(values, without_sign, out=values)
        if values.max() >= threshold:
            bad += int(np.count_nonzero(values >= threshold))
        done += n
    return bad


def _read_exactly(fh, n: int) -> bytes:
    data = fh.read(n)
    if len(data) != n:
        raise ValueError(f"file ends after {len(data)} of {n} header bytes")
    return data


def _bench(gigabytes: float) -> None:
    """Write a bf16 safetensors file of about `gigabytes` GiB and print the scan's time, from the
    page cache (a checkpoint the trainer just wrote) and from disk (its pages evicted first)."""
    import tempfile
    import time

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        per_tensor = 64 << 20  # bytes: 32 Mi bf16 values
        count = max(1, round(gigabytes * 2**30 / per_tensor))
        header = {f"layer.{i}.weight": {"dtype": "BF16", "shape": [per_tensor // 2],
                                         "data_offsets": [i * per_tensor, (i + 1) * per_tensor]} for i in range(count)}
        raw = json.dumps(header).encode()
        rng = np.random.default_rng(0)
        block = (rng.standard_normal(per_tensor // 2, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
        with open(path, "wb") as fh:
            fh.write(struct.pack("<Q", len(raw)) + raw)
            for _ in range(count):
                fh.write(block.tobytes())
            fh.flush()
            os.fsync(fh.fileno())
        size = path.stat().st_size

        def timed(cold: bool) -> float:
            if cold:
                fd = os.open(path, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
            started = time.perf_counter()
            assert scan_file(path) == []
            return time.perf_counter() - started

        for label, cold in (("page cache", False), ("disk", True)):
            timed(cold)  # warm-up
            times = [timed(cold) for _ in range(3)]
            print(f"{size / 1e9:.2f} GB bf16 from {label}: best of 3 {min(times):.3f} s "
                  f"({size / min(times) / 1e9:.1f} GB/s); all {', '.join(f'{t:.3f}' for t in times)} s")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="measure the NaN/inf scan of a bf16 safetensors file")
    parser.add_argument("--bench", type=float, default=1.0, metavar="GB")
    _bench(parser.parse_args().bench)

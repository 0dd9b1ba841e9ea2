"""shared/chunks.py's columns: a column's types are checked once per distinct type (not per
sample), which must keep every value and type exactly as a per-sample check did, and a chunk
laid out in a reused (dirty) buffer is the same bytes as one in fresh zeroed memory."""

from __future__ import annotations

import struct

import msgpack
import numpy as np
import pytest

from shared.chunks import alloc, decode_chunk, encode_chunk, encode_samples, columns_of, samples_of, slice_chunk


def _round_trip(samples: list[dict]) -> list[dict]:
    return samples_of(decode_chunk(encode_samples(samples)))


class Tagged(np.ndarray):
    """An ndarray subclass (what np.memmap and friends are): still a typed array."""


def test_an_ndarray_subclass_travels_as_a_typed_column():
    values = np.arange(5, dtype=np.int32).view(Tagged)
    cols = columns_of([{"completion_token_ids": values}, {"completion_token_ids": values[:2]}])
    assert "completion_token_ids" in cols.arrays
    got = _round_trip([{"completion_token_ids": values}, {"completion_token_ids": values[:2]}])
    assert got[0]["completion_token_ids"].dtype == np.int32 and got[1]["completion_token_ids"].tolist() == [0, 1]


def test_a_token_field_mixing_lists_and_arrays_is_one_typed_column():
    samples = [{"loss_mask": np.array([1, 0], np.uint8)}, {"loss_mask": [1, 1, 0]}]
    cols = columns_of(samples)
    assert "loss_mask" in cols.arrays
    got = _round_trip(samples)
    assert [s["loss_mask"].tolist() for s in got] == [[1, 0], [1, 1, 0]]


def test_arrays_no_column_type_holds_travel_as_exact_lists():
    """Checked per distinct dtype and ndim now: one odd array among typed ones still sends the
    whole field to lists, values unchanged."""
    typed = np.arange(3, dtype=np.int32)
    for odd in (np.array([True, False]), np.array([[1, 2], [3, 4]], np.int32), np.array([1.5], np.float16)):
        samples = [{"prompt_token_ids": typed}, {"prompt_token_ids": odd}, {"prompt_token_ids": typed}]
        cols = columns_of(samples)
        assert "prompt_token_ids" not in cols.arrays and "prompt_token_ids" in cols.lists, odd.dtype
        got = _round_trip(samples)
        assert [s["prompt_token_ids"] for s in got] == [typed.tolist(), odd.tolist(), typed.tolist()]


def test_numpy_scalars_come_back_as_python_values_of_their_kind():
    samples = [{"reward": np.float64(0.5), "n": np.int64(3)}, {"reward": np.float64(-1.0), "n": np.int64(-4)}]
    got = _round_trip(samples)
    assert got == [{"reward": 0.5, "n": 3}, {"reward": -1.0, "n": -4}]
    assert all(type(s["reward"]) is float and type(s["n"]) is int for s in got)


def test_ints_just_outside_int64_fall_back_exactly_and_its_edges_stay_typed():
    got = _round_trip([{"n": 1}, {"n": 2**63}])  # numpy refuses it (OverflowError): a list column
    assert [s["n"] for s in got] == [1, 2**63]
    got = _round_trip([{"n": 2**63 - 1}, {"n": -2**63}])  # still int64: a typed column
    assert [s["n"] for s in got] == [2**63 - 1, -2**63]


def test_samples_with_the_same_keys_and_with_different_keys_both_round_trip():
    same = [{"a": 1.0, "b": "x", "c": [1]}, {"a": 2.0, "b": "yz", "c": [2, 3]}]
    # Same key count in total as `same`, but not the same keys: must not be taken for the usual case.
    swapped = [{"a": 1.0, "b": "x", "c": [1]}, {"a": 2.0, "b": "yz", "d": [2, 3]}]
    assert _round_trip(same) == same
    got = _round_trip(swapped)
    assert got == swapped and "d" not in got[0] and "c" not in got[1]


def _dirty(size: int) -> np.ndarray:
    buffer = np.frombuffer(alloc(size), np.uint8, size)
    buffer.fill(0xAB)  # what a pooled buffer holds: the last chunk's bytes
    return buffer


def test_a_chunk_in_a_reused_buffer_is_the_same_bytes_padding_included():
    rng = np.random.default_rng(0)
    samples = [{"prompt_token_ids": rng.integers(0, 1000, rng.integers(0, 9)).astype(np.int32),
                "loss_mask": np.ones(rng.integers(0, 7), np.uint8), "text": "é" * int(rng.integers(0, 5)),
                "reward": float(i), "k": i, "rewards": {"r": 1.0}} for i in range(13)]
    fresh = bytes(encode_samples(samples))
    reused = encode_samples(samples, _dirty)
    assert isinstance(reused, np.ndarray) and bytes(reused) == fresh
    assert bytes(slice_chunk(fresh, 3, 9, _dirty)) == bytes(slice_chunk(fresh, 3, 9))
    assert bytes(encode_chunk(columns_of([]), _dirty)) == bytes(encode_chunk(columns_of([])))


def _with_header(chunk, header: bytes) -> bytes:
    """`chunk` with its header replaced (the data re-aligned after it)."""
    view = memoryview(chunk)
    size = struct.unpack_from("<I", view, 4)[0]
    data = bytes(view[(8 + size + 7) & ~7:])
    head = b"TCK1" + struct.pack("<I", len(header)) + header
    return head + bytes(-len(head) % 8) + data


def test_the_lists_of_a_decoded_chunk_are_read_on_use_and_are_the_values_sent():
    samples = [{"rewards": {"a": 1.0, "b": [i, None]}, "versions": [i, i + 1], "k": i} for i in range(5)]
    cols = decode_chunk(encode_samples(samples))
    assert not isinstance(cols.lists, dict) and sorted(cols.lists) == ["rewards", "versions"]
    assert len(cols.lists) == 2 and "rewards" in cols.lists
    assert cols.lists["versions"] == [[i, i + 1] for i in range(5)]
    assert dict(cols.lists.items())["rewards"] == [s["rewards"] for s in samples]
    assert samples_of(cols) == samples


def test_a_chunk_header_with_bytes_past_its_end_or_lists_not_a_map_is_a_value_error():
    chunk = encode_samples([{"versions": [1]}])
    view = memoryview(chunk)
    size = struct.unpack_from("<I", view, 4)[0]
    header = msgpack.unpackb(bytes(view[8:8 + size]), raw=False)
    with pytest.raises(ValueError, match="past its end"):
        decode_chunk(_with_header(chunk, msgpack.packb(header) + b"\xc0"))
    with pytest.raises(ValueError, match="not valid msgpack"):
        decode_chunk(_with_header(chunk, msgpack.packb({**header, "lists": [1, 2]})))
    with pytest.raises(ValueError, match="not valid msgpack"):
        decode_chunk(_with_header(chunk, msgpack.packb(header)[:-2]))

"""The chunked batch format (shared/chunks.py) and how batches are cut into chunks and shares
(services/sampler/storage/packing.py): every value comes back with its type, every array is 8-aligned,
a frame decodes to views of the received buffer, and broken bodies are clear ValueErrors."""

from __future__ import annotations

import math
import random
import struct

import msgpack
import numpy as np
import pytest

from services.sampler.storage import packing
from shared.chunks import (
    BatchArrays, chunk_pieces, columns_of, decode_chunk, decode_frame, encode_samples, frame_head, samples_of,
    slice_chunk, slice_columns, slice_pieces,
)
from shared.codec import ARRAY_FIELDS

TOKEN_FIELDS = tuple(ARRAY_FIELDS)


# --- exact comparison ---------------------------------------------------------------------

def _same(got, want, where: str = "") -> None:
    """`got` equals `want` value for value and type for type (a numpy array: its dtype too)."""
    if isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray), f"{where}: {type(got).__name__}, expected an ndarray"
        assert got.dtype == want.dtype, f"{where}: dtype {got.dtype}, expected {want.dtype}"
        assert got.tolist() == want.tolist(), where
        return
    assert type(got) is type(want), f"{where}: {type(got).__name__} {got!r}, expected {type(want).__name__} {want!r}"
    if isinstance(want, dict):
        assert list(got) == list(want), f"{where}: keys {list(got)}, expected {list(want)}"
        for key in want:
            _same(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert len(got) == len(want), f"{where}: {len(got)} items, expected {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"{where}[{i}]")
    elif isinstance(want, float) and math.isnan(want):
        assert math.isnan(got), where
    else:
        assert got == want, f"{where}: {got!r}, expected {want!r}"


def _same_samples(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want), (len(got), len(want))
    for i, (g, w) in enumerate(zip(got, want)):
        assert set(g) == set(w), f"sample {i}: keys {sorted(g)}, expected {sorted(w)}"
        for key in w:
            _same(g[key], w[key], f"sample {i}.{key}")


def _round_trip(samples: list[dict]) -> list[dict]:
    return samples_of(decode_chunk(encode_samples(samples)))


# --- values and types -----------------------------------------------------------------------

def test_token_lists_become_the_narrowest_exact_array():
    samples = [
        {"prompt_token_ids": [1, 2, 2**31 - 1, -2**31], "completion_token_ids": [5, 6, 7],
         "completion_logprobs": [-0.5, -1e-300, 0.0], "loss_mask": [1, 0, 1]},
        {"prompt_token_ids": [3], "completion_token_ids": [], "completion_logprobs": [], "loss_mask": []},
    ]
    got = _round_trip(samples)
    _same_samples(got, [
        {"prompt_token_ids": np.array([1, 2, 2**31 - 1, -2**31], np.int32),
         "completion_token_ids": np.array([5, 6, 7], np.int32),
         "completion_logprobs": np.array([-0.5, -1e-300, 0.0], np.float64),
         "loss_mask": np.array([1, 0, 1], np.uint8)},
        {"prompt_token_ids": np.array([3], np.int32), "completion_token_ids": np.array([], np.int32),
         "completion_logprobs": np.array([], np.float64), "loss_mask": np.array([], np.uint8)},
    ])


def test_token_ids_beyond_int32_become_int64_and_keep_their_values():
    big = [2**31, -2**31 - 1, 2**62, -2**63, 2**63 - 1]
    got = _round_trip([{"completion_token_ids": big}, {"completion_token_ids": [1, 2]}])
    assert got[0]["completion_token_ids"].dtype == np.int64
    assert got[0]["completion_token_ids"].tolist() == big
    assert got[1]["completion_token_ids"].tolist() == [1, 2]  # an int32-sized neighbour: same values


@pytest.mark.parametrize("dtype", ["<i4", "<i8", "<f8", "<f4", "u1", ">i4", ">f8"])
def test_numpy_token_arrays_keep_dtype_and_values(dtype):
    rng = np.random.default_rng(0)
    values = rng.integers(0, 200, 17).astype(dtype)
    if values.dtype.kind == "f":
        values = (values / 7).astype(dtype)  # values a float32 holds exactly after the cast
    samples = [{"prompt_token_ids": values, "reward": 1.0}, {"prompt_token_ids": values[:0], "reward": 0.0}]
    got = _round_trip(samples)
    want = values.dtype.newbyteorder("<")
    for sample, original in zip(got, (values, values[:0])):
        assert sample["prompt_token_ids"].dtype == want
        assert sample["prompt_token_ids"].tolist() == original.tolist()


def test_a_field_mixing_array_types_keeps_every_value():
    """One column per field: a float32 and a float64 logprob array share a float64 column,
    an int32 and an int64 one an int64 column: the values must not change on the way."""
    f32 = np.array([-0.1, -2.5, -1e-8], np.float32)
    f64 = np.array([-0.1, -1 / 3], np.float64)
    i64 = np.array([2**40, 7], np.int64)
    got = _round_trip([{"completion_logprobs": f32, "prompt_token_ids": np.array([1, 2], np.int32)},
                       {"completion_logprobs": f64, "prompt_token_ids": i64}])
    assert got[0]["completion_logprobs"].tolist() == f32.tolist()
    assert got[1]["completion_logprobs"].tolist() == f64.tolist()
    assert got[0]["prompt_token_ids"].tolist() == [1, 2]
    assert got[1]["prompt_token_ids"].tolist() == i64.tolist()


def test_int64_token_ids_beside_a_float_array_keep_their_exact_values():
    """A column's type is the common type of its samples' arrays; int64 ids above 2**53 in a
    float64 column would be rounded (2**53 + 1 -> 2**53). The format promises never to
    change a value."""
    ids = np.array([2**53 + 1, 2**62 + 1], np.int64)
    got = _round_trip([{"prompt_token_ids": ids}, {"prompt_token_ids": np.array([1.5], np.float64)}])
    # Such a field travels as exact lists (one typed column cannot hold both exactly).
    assert list(got[0]["prompt_token_ids"]) == ids.tolist()
    assert list(got[1]["prompt_token_ids"]) == [1.5]


def test_scalars_strings_none_dicts_lists_and_bools_keep_value_and_type():
    samples = [
        {"reward": 1, "advantage": 0.0, "policy_version": 3, "prompt_id": "p-ü", "finish_reason": "stop",
         "rewards": {"digit": 1.0, "length": 0.25}, "versions": [3, 4], "truncated": False, "note": None,
         "mixed": 1, "text": "naïve — 日本語 🙂", "empty": "", "nan": float("nan"), "big": 2**63 - 1},
        {"reward": 0, "advantage": -1.5, "policy_version": 4, "prompt_id": "p2", "finish_reason": "length",
         "rewards": {}, "versions": [], "truncated": True, "note": "set", "mixed": 1.0,
         "text": "", "empty": "", "nan": float("inf"), "big": -2**63},
    ]
    got = _round_trip(samples)
    _same_samples(got, samples)
    assert type(got[0]["reward"]) is int and type(got[1]["advantage"]) is float  # an int reward stays int
    assert type(got[0]["mixed"]) is int and type(got[1]["mixed"]) is float  # no column changes a type


def test_float_rewards_stay_floats_even_when_whole():
    got = _round_trip([{"reward": 1.0}, {"reward": 0.0}, {"reward": -3.0}])
    assert [type(s["reward"]) for s in got] == [float] * 3
    assert [s["reward"] for s in got] == [1.0, 0.0, -3.0]


def test_ints_beyond_int64_fall_back_exactly():
    got = _round_trip([{"n": 2**63}, {"n": 5}])
    _same_samples(got, [{"n": 2**63}, {"n": 5}])


def test_samples_with_different_keys_come_back_without_the_keys_they_lacked():
    samples = [
        {"prompt_id": "a", "reward": 1.0, "completion_token_ids": [1, 2], "extra": {"x": 1}},
        {"prompt_id": "b", "completion_token_ids": [3], "only_here": "x"},
        {"reward": 2.0, "extra": None, "loss_mask": [1]},
        {},
        {"prompt_id": "e", "reward": 3.0, "completion_token_ids": [], "only_here": "y", "loss_mask": [0, 1]},
    ]
    got = _round_trip(samples)
    want = [{k: (np.array(v, np.int32) if k == "completion_token_ids" else
                 np.array(v, np.uint8) if k == "loss_mask" else v) for k, v in s.items()} for s in samples]
    _same_samples(got, want)
    assert "reward" not in got[1] and "prompt_id" not in got[2] and got[3] == {}


def test_a_token_list_holding_none_falls_back_to_exact_lists():
    samples = [
        {"completion_logprobs": [None, -0.5, -1.25], "prompt_token_ids": [1, None]},
        {"completion_logprobs": [-0.75], "prompt_token_ids": [7, 8]},
        {"completion_logprobs": [1, 2.5], "prompt_token_ids": [1.5]},  # an int logprob, a float token id
    ]
    got = _round_trip(samples)
    for g, w in zip(got, samples):
        assert g["completion_logprobs"] == w["completion_logprobs"]
        assert g["prompt_token_ids"] == w["prompt_token_ids"]
        assert [type(v) for v in g["prompt_token_ids"]] == [type(v) for v in w["prompt_token_ids"]]
        assert [type(v) for v in g["completion_logprobs"]] == [type(v) for v in w["completion_logprobs"]]


def _random_samples(rng: random.Random, count: int) -> list[dict]:
    out = []
    for i in range(count):
        n = rng.randrange(0, 30)
        sample = {
            "prompt_id": f"p{i}", "group_id": f"g{i // 3}",
            "prompt_token_ids": [rng.randrange(200_000) for _ in range(rng.randrange(1, 20))],
            "completion_token_ids": [rng.randrange(200_000) for _ in range(n)],
            "completion_logprobs": [-rng.expovariate(1.0) for _ in range(n)],
            "loss_mask": [rng.randrange(2) for _ in range(n)],
            "reward": rng.random(), "policy_version": rng.randrange(5), "rewards": {"r": rng.random()},
            "versions": [1, 2], "finish_reason": rng.choice(["stop", "length", "ünïcode"]),
        }
        for key in ("reward", "rewards", "finish_reason", "loss_mask"):
            if rng.random() < 0.2:
                del sample[key]
        out.append(sample)
    return out


def _expected(samples: list[dict]) -> list[dict]:
    """What a round trip gives for samples whose token lists fit int32/float64/uint8."""
    kinds = {"prompt_token_ids": np.int32, "completion_token_ids": np.int32,
             "completion_logprobs": np.float64, "loss_mask": np.uint8}
    return [{k: np.array(v, kinds[k]) if k in kinds else v for k, v in s.items()} for s in samples]


@pytest.mark.parametrize("seed", range(3))
def test_random_samples_round_trip(seed):
    samples = _random_samples(random.Random(seed), 23)
    _same_samples(_round_trip(samples), _expected(samples))


@pytest.mark.parametrize("seed", range(3))
def test_slice_chunk_of_any_range_is_those_samples(seed):
    rng = random.Random(seed)
    samples = _random_samples(rng, 13)
    chunk = encode_samples(samples)
    want = _expected(samples)
    ranges = [(0, 13), (0, 0), (13, 13), (0, 1), (12, 13)] + [tuple(sorted(rng.sample(range(14), 2))) for _ in range(12)]
    for start, stop in ranges:
        part = slice_chunk(chunk, start, stop)
        assert len(part) % 8 == 0
        _same_samples(samples_of(decode_chunk(part)), want[start:stop])
        # Slicing a slice is a slice too.
        if stop - start > 2:
            _same_samples(samples_of(decode_chunk(slice_chunk(part, 1, stop - start - 1))), want[start + 1:stop - 1])


@pytest.mark.parametrize("seed", range(3))
def test_chunk_pieces_are_the_chunk_bytes_with_large_arrays_as_views(seed):
    """What GET /batch sends for a share's edge (slice_pieces) is exactly slice_chunk's chunk,
    whatever goes by view and whatever is copied; the views are of the sliced chunk itself."""
    rng = random.Random(seed)
    samples = _random_samples(rng, 13)
    chunk = encode_samples(samples)
    cols = columns_of(samples)  # token fields as lists of per-sample arrays: always copied
    for view_bytes in (0, 8, 64, 1 << 16):
        assert b"".join(chunk_pieces(cols, view_bytes)) == bytes(chunk)
    ranges = [(0, 13), (0, 0), (13, 13), (0, 1), (12, 13)] + [tuple(sorted(rng.sample(range(14), 2))) for _ in range(8)]
    for start, stop in ranges:
        want = bytes(slice_chunk(chunk, start, stop))
        assert b"".join(slice_pieces(chunk, start, stop)) == want
        for view_bytes in (0, 8, 64):
            part = slice_columns(decode_chunk(chunk), start, stop)
            pieces = chunk_pieces(part, view_bytes)
            assert b"".join(pieces) == want, (start, stop, view_bytes)
            if not view_bytes:  # every value array and text is sent from the chunk itself
                stored = np.frombuffer(chunk, np.uint8)
                shared = sum(len(p) for p in pieces if np.shares_memory(np.frombuffer(p, np.uint8), stored))
                assert shared == sum(v.nbytes for v, _ in [*part.arrays.values(), *part.texts.values()]) + \
                    sum(v.nbytes for v in part.numbers.values())


def test_slice_of_a_range_where_a_key_is_absent_throughout():
    samples = [{"a": 1.0, "t": "x", "completion_token_ids": [1, 2]}, {"b": "only"}, {"b": "again"},
               {"a": 2.0, "t": "y", "completion_token_ids": [3]}]
    chunk = encode_samples(samples)
    _same_samples(samples_of(decode_chunk(slice_chunk(chunk, 1, 3))), samples[1:3])
    _same_samples(samples_of(decode_chunk(slice_chunk(chunk, 2, 4))),
                  [samples[2], {"a": 2.0, "t": "y", "completion_token_ids": np.array([3], np.int32)}])


# --- layout ----------------------------------------------------------------------------------

def _address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def _views(cols) -> list[np.ndarray]:
    out = []
    for values, offsets in cols.arrays.values():
        out += [values, offsets]
    out += list(cols.numbers.values())
    for values, offsets in cols.texts.values():
        out += [values, offsets]
    return out


@pytest.mark.parametrize("seed", range(4))
def test_chunk_lengths_are_multiples_of_8_and_every_array_is_8_aligned(seed):
    rng = random.Random(seed)
    for count in (1, 2, 5, 11):
        samples = _random_samples(rng, count)
        samples[0]["odd"] = "abc"  # 3 bytes of text: the next array must still be aligned
        samples[-1]["loss_mask"] = [1] * 5  # 5 bytes of uint8
        chunk = encode_samples(samples)
        assert len(chunk) % 8 == 0
        assert chunk[:4] == b"TCK1"
        buffer = bytearray(chunk)
        base = _address(np.frombuffer(buffer, np.uint8))
        cols = decode_chunk(buffer)
        views = _views(cols)
        assert len(views) >= 10
        for view in views:
            assert (_address(view) - base) % 8 == 0, view.dtype
            assert base <= _address(view) <= base + len(buffer)


def _frame(chunks: list, *, num_samples: int | None = None, step: int = 7) -> bytearray:
    head = frame_head(step=step, stats={"num_samples": 3}, chunk_lengths=[len(c) for c in chunks],
                      num_samples=sum(decode_chunk(c).n for c in chunks) if num_samples is None else num_samples,
                      rank=1, world_size=4)
    return bytearray(head + b"".join(bytes(c) for c in chunks))


def test_a_frame_decodes_to_batch_arrays_whose_columns_join_the_chunks():
    samples = _random_samples(random.Random(5), 17)
    for s in samples:
        s.setdefault("loss_mask", [1] * len(s["completion_token_ids"]))
    runs = [(0, 4), (4, 5), (5, 12), (12, 17)]
    chunks = [encode_samples(samples[a:b]) for a, b in runs]
    body = _frame(chunks)
    assert len(frame_head(step=7, stats={}, chunk_lengths=[], num_samples=0)) % 8 == 0
    batch = decode_frame(body)
    assert isinstance(batch, BatchArrays)
    assert (batch.step, batch.rank, batch.world_size, batch.num_samples) == (7, 1, 4, 17)
    assert batch.stats == {"num_samples": 3} and len(batch.chunks) == 4
    _same_samples(batch.samples(), _expected(samples))
    for name in TOKEN_FIELDS:
        values, offsets = batch.column(name)
        assert values.tolist() == [v for s in samples for v in s[name]], name
        lengths = [len(s[name]) for s in samples]
        assert offsets.tolist() == np.concatenate([[0], np.cumsum(lengths)]).tolist(), name
        assert offsets.dtype == np.int64
    as_dict = batch.as_dict()
    assert as_dict["step"] == 7 and as_dict["rank"] == 1 and as_dict["world_size"] == 4
    # Every array of every chunk is 8-aligned within the body.
    base = _address(np.frombuffer(body, np.uint8))
    for cols in batch.chunks:
        for view in _views(cols):
            assert (_address(view) - base) % 8 == 0


def test_a_single_chunk_column_is_a_view_of_the_body():
    samples = [{"completion_token_ids": [1, 2, 3]}, {"completion_token_ids": [4]}]
    body = _frame([encode_samples(samples)])
    values, offsets = decode_frame(body).column("completion_token_ids")
    assert values.tolist() == [1, 2, 3, 4] and offsets.tolist() == [0, 3, 4]
    values[0] = 99
    assert decode_frame(body).column("completion_token_ids")[0][0] == 99


def test_column_of_a_field_that_is_not_typed_everywhere_is_a_key_error():
    chunks = [encode_samples([{"completion_token_ids": [1]}]), encode_samples([{"completion_token_ids": [None]}])]
    with pytest.raises(KeyError, match="completion_token_ids"):
        decode_frame(_frame(chunks)).column("completion_token_ids")


def _body() -> bytearray:
    samples = _random_samples(random.Random(9), 8)
    return _frame([encode_samples(samples[:3]), encode_samples(samples[3:])])


def test_a_truncated_body_is_a_clear_value_error_at_every_cut():
    body = _body()
    assert decode_frame(body).num_samples == 8
    cuts = sorted({0, 1, 3, 4, 7, 8, 9, 16, 40, len(body) // 2, len(body) - 8, len(body) - 1}
                  | set(range(0, len(body), max(1, len(body) // 97))))
    for cut in cuts:
        if cut >= len(body):
            continue
        with pytest.raises(ValueError, match=r"batch body|batch chunk") as caught:
            decode_frame(body[:cut])
        message = str(caught.value)
        assert "too short" in message or "overruns" in message or "truncated" in message, (cut, message)


def test_bad_magic_is_a_clear_value_error():
    body = _body()
    with pytest.raises(ValueError, match=r"expected b'TBT1'"):
        decode_frame(b"XXXX" + bytes(body[4:]))
    # A chunk given where a frame is expected (and the other way round).
    with pytest.raises(ValueError, match=r"starts with b'TCK1', expected b'TBT1'"):
        decode_frame(encode_samples([{"a": 1}]))
    with pytest.raises(ValueError, match=r"batch chunk: starts with b'TBT1'"):
        decode_chunk(bytes(body))
    with pytest.raises(ValueError, match="too short"):
        decode_frame(b"")


def test_a_corrupt_chunk_inside_a_frame_is_a_value_error():
    chunk = bytearray(encode_samples([{"a": 1}]))
    chunk[:4] = b"JUNK"
    with pytest.raises(ValueError, match="batch chunk: starts with b'JUNK'"):
        decode_frame(_frame([encode_samples([{"a": 2}]), chunk], num_samples=2))


def test_damaged_text_bytes_are_a_value_error_naming_the_column():
    chunk = bytearray(encode_samples([{"completion_text": "caf\u00e9 " * 8}, {"completion_text": "ok"}]))
    at = bytes(chunk).index("\u00e9".encode())
    chunk[at] = 0xFF  # not UTF-8 any more; the layout is intact, so the chunk decodes
    body = _frame([chunk], num_samples=2)
    arrays = decode_frame(body)
    with pytest.raises(ValueError, match=r"batch chunk: text column 'completion_text' is not UTF-8 .*damaged"):
        arrays.samples()


def test_a_header_length_past_the_end_is_a_value_error():
    body = _body()
    struct.pack_into("<I", body, 4, len(body) * 2)
    with pytest.raises(ValueError, match="overruns"):
        decode_frame(body)


def test_a_num_samples_mismatch_raises():
    chunk = encode_samples([{"a": 1}, {"a": 2}])
    for claimed in (1, 3, 0):
        with pytest.raises(ValueError, match=f"hold 2 samples, its header says {claimed}"):
            decode_frame(_frame([chunk], num_samples=claimed))


def test_frame_head_refuses_a_chunk_length_not_a_multiple_of_8():
    with pytest.raises(ValueError, match="multiple of 8"):
        frame_head(step=0, stats={}, chunk_lengths=[16, 13], num_samples=1)


def test_the_frame_header_is_msgpack_with_the_documented_fields():
    body = _body()
    (size,) = struct.unpack_from("<I", body, 4)
    header = msgpack.unpackb(bytes(body[8:8 + size]))
    assert header["chunks"] == [len(c) for c in (encode_samples(_random_samples(random.Random(9), 8)[:3]),
                                                  encode_samples(_random_samples(random.Random(9), 8)[3:]))]
    assert {"step", "stats", "rank", "world_size", "num_samples"} <= set(header)


# --- views of a writable buffer ------------------------------------------------------------

def test_views_of_a_bytearray_are_writable_and_share_its_memory():
    samples = [{"completion_token_ids": [1, 2, 3], "completion_logprobs": [-0.5, -0.25, -1.0], "reward": 1.0}]
    body = _frame([encode_samples(samples)])
    batch = decode_frame(body)
    ids = batch.samples()[0]["completion_token_ids"]
    assert ids.flags.writeable and batch.column("completion_logprobs")[0].flags.writeable
    ids[1] = 12345
    assert decode_frame(body).samples()[0]["completion_token_ids"].tolist() == [1, 12345, 3]
    # An immutable buffer gives read-only views instead of copies.
    frozen = decode_frame(bytes(body)).samples()[0]["completion_token_ids"]
    assert not frozen.flags.writeable


def test_torch_from_numpy_shares_the_received_buffer():
    torch = pytest.importorskip("torch")
    samples = [{"completion_token_ids": [5, 6, 7], "completion_logprobs": [-0.5, -1.5, -2.5]}]
    body = _frame([encode_samples(samples)])
    batch = decode_frame(body)
    values, _ = batch.column("completion_logprobs")
    tensor = torch.from_numpy(values)
    assert tensor.dtype == torch.float64 and tensor.tolist() == [-0.5, -1.5, -2.5]
    tensor[0] = 42.0
    assert decode_frame(body).column("completion_logprobs")[0][0] == 42.0  # the body's own bytes changed
    ids = torch.from_numpy(batch.column("completion_token_ids")[0])
    assert ids.dtype == torch.int32
    assert ids.data_ptr() == _address(batch.column("completion_token_ids")[0])


def test_tensors_are_per_chunk_views_of_the_body():
    torch = pytest.importorskip("torch")
    first = [{"completion_token_ids": [1, 2], "loss_mask": [1, 0]}, {"completion_token_ids": [3], "loss_mask": [1]}]
    second = [{"completion_token_ids": [4, 5, 6], "loss_mask": [0, 1, 1]}]
    body = _frame([encode_samples(first), encode_samples(second)])
    batch = decode_frame(body)
    parts = batch.tensors("completion_token_ids")
    assert [(v.tolist(), o.tolist()) for v, o in parts] == [([1, 2, 3], [0, 2, 3]), ([4, 5, 6], [0, 3])]
    for (values, offsets), chunk in zip(parts, batch.chunks):
        assert values.data_ptr() == _address(chunk.arrays["completion_token_ids"][0])
        assert offsets.dtype == torch.int64
    assert batch.tensors("loss_mask")[1][0].dtype == torch.uint8
    with pytest.raises(KeyError):
        batch.tensors("prompt_token_ids")


# --- packing ---------------------------------------------------------------------------------

def _grouped_samples(rng: random.Random, groups: int, *, tokens: tuple[int, int] = (50, 400)) -> list[dict]:
    """Samples as the producer hands them to `pack` (token fields as numpy arrays)."""
    out = []
    for g in range(groups):
        for k in range(rng.randrange(1, 7)):
            n = rng.randrange(*tokens)
            out.append({"group_id": f"g{g}", "prompt_id": f"p{g}", "reward": float(k),
                        "prompt_token_ids": np.arange(20, dtype=np.int32),
                        "completion_token_ids": np.arange(n, dtype=np.int32),
                        "completion_logprobs": np.full(n, -0.5), "loss_mask": np.ones(n, np.uint8)})
    return out


def _group_spans(samples: list[dict], start: int, stop: int) -> list[tuple[int, int]]:
    spans, at = [], start
    for i in range(start + 1, stop + 1):
        if i == stop or samples[i]["group_id"] != samples[i - 1]["group_id"]:
            spans.append((at, i))
            at = i
    return spans


@pytest.mark.parametrize("seed", range(4))
def test_group_runs_cut_only_between_groups_and_near_the_byte_bound(seed):
    rng = random.Random(seed)
    samples = _grouped_samples(rng, 60)
    bound = 24 << 10
    runs = packing.group_runs(samples, bound)
    assert runs[0][0] == 0 and runs[-1][1] == len(samples)
    assert all(a < b for a, b in runs) and all(b == c for (_, b), (c, _) in zip(runs, runs[1:]))
    assert len(runs) >= 5
    group_bytes = max(len(encode_samples(samples[a:b])) for a, b in _group_spans(samples, 0, len(samples)))
    for i, (a, b) in enumerate(runs):
        if a:
            assert samples[a]["group_id"] != samples[a - 1]["group_id"], f"run {i} starts inside a group"
        size = len(encode_samples(samples[a:b]))
        assert size <= bound + group_bytes + 1024, (i, size)
        if i < len(runs) - 1:
            assert size >= 0.9 * bound, f"run {i} is {size} bytes, cut well before the {bound}-byte bound"
            last = _group_spans(samples, a, b)[-1]
            if last[0] > a:  # without its last group the run was still under the bound
                assert len(encode_samples(samples[a:last[0]])) < 1.1 * bound
    # pack() seals exactly those runs, and its table says so.
    sealed = packing.pack(3, samples, {"step": 3}, bound)
    assert sealed.table == [(b - a, len(c)) for (a, b), c in zip(runs, sealed.chunks)]
    assert sealed.num_samples == len(samples) and sealed.nbytes == sum(len(c) for c in sealed.chunks)
    joined = [s for c in sealed.chunks for s in samples_of(decode_chunk(c))]
    assert [s["group_id"] for s in joined] == [s["group_id"] for s in samples]
    assert [s["completion_token_ids"].tolist() for s in joined] == [s["completion_token_ids"].tolist() for s in samples]


def test_a_group_larger_than_the_bound_is_a_chunk_by_itself():
    rng = random.Random(1)
    samples = _grouped_samples(rng, 3, tokens=(10, 20))
    huge = [{"group_id": "huge", "completion_token_ids": np.arange(5000, dtype=np.int32)} for _ in range(4)]
    samples = samples[:3] + huge + samples[3:]
    # The first three samples may be in the same group as more: find the huge group's span.
    runs = packing.group_runs(samples, 4 << 10)
    start = samples.index(huge[0])
    covering = [r for r in runs if r[0] <= start < r[1]]
    assert len(covering) == 1
    a, b = covering[0]
    assert all(samples[i]["group_id"] == "huge" for i in range(start, b)) and b == start + 4
    assert packing.group_runs([], 1024) == [(0, 0)]
    assert packing.group_runs(huge, 1) == [(0, 4)]  # one group: never cut


def test_pieces_cover_exactly_the_range_with_correct_whole_flags():
    rng = random.Random(0)
    for _ in range(200):
        table = [(rng.randrange(0, 6), rng.randrange(8, 100) * 8) for _ in range(rng.randrange(1, 8))]
        total = sum(n for n, _ in table)
        start = rng.randrange(0, total + 1)
        stop = rng.randrange(start, total + 1)
        got = packing.pieces(table, start, stop)
        firsts = np.concatenate([[0], np.cumsum([n for n, _ in table])]).tolist()
        covered = [firsts[p.index] + i for p in got for i in range(p.start, p.stop)]
        assert covered == list(range(start, stop)), (table, start, stop, got)
        for p in got:
            n = table[p.index][0]
            assert 0 <= p.start < p.stop <= n
            assert p.whole == (p.start == 0 and p.stop == n)
        assert [p.index for p in got] == sorted({p.index for p in got})


def test_pieces_for_a_share_have_at_most_two_partial_chunks():
    table = [(4, 800)] * 10  # 40 samples
    for world in (1, 2, 4, 5, 8, 10, 20, 40):
        for rank in range(world):
            start, stop = packing.share_range(40, rank, world)
            got = packing.pieces(table, start, stop)
            assert sum(p.stop - p.start for p in got) == stop - start
            assert sum(not p.whole for p in got) <= 2
            if (stop - start) % 4 == 0:
                assert all(p.whole for p in got)


def test_share_range_splits_evenly_or_raises():
    assert [packing.share_range(12, r, 4) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 12)]
    assert packing.share_range(12, 0, 1) == (0, 12)
    assert packing.share_range(0, 1, 2) == (0, 0)
    for total, world in ((10, 4), (16, 3), (1, 2)):
        with pytest.raises(ValueError, match=f"{total} samples cannot be split evenly over world_size={world}"):
            packing.share_range(total, 0, world)

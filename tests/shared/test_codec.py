"""The three body encodings carry the same values; the arrays form never changes a value."""

from __future__ import annotations

import math
import random

import msgpack
import numpy as np
import pytest

from shared import codec


def _batch(rng: random.Random, samples: int = 5) -> dict:
    out = []
    for i in range(samples):
        n = rng.randrange(0, 40)
        out.append({
            "prompt_id": f"p{i}", "group_id": "g", "reward": 0.5, "rewards": {"a": 1.0},
            "prompt_token_ids": [rng.randrange(200_000) for _ in range(rng.randrange(1, 30))],
            "completion_token_ids": [rng.randrange(200_000) for _ in range(n)],
            "completion_logprobs": [-rng.expovariate(1.0) for _ in range(n)],
            "loss_mask": [rng.randrange(2) for _ in range(n)],
            "finish_reason": "stop", "versions": [3, 4],
        })
    return {"step": 3, "samples": out, "stats": {"num_samples": samples, "rewards_mean": {"a": 1.0}}}


def test_msgpack_round_trip_matches_json():
    batch = _batch(random.Random(0))
    assert codec.unpack(codec.pack(batch)) == batch
    assert codec.decode(codec.MSGPACK, codec.pack(batch)) == codec.decode(codec.JSON, codec.dumps_json(batch))


@pytest.mark.parametrize("seed", range(5))
def test_arrays_form_round_trips_every_value_exactly(seed):
    batch = _batch(random.Random(seed))
    data = codec.pack_arrays(batch)
    decoded = codec.unpack(data)
    sample = decoded["samples"][0]
    assert isinstance(sample["completion_token_ids"], np.ndarray) and sample["completion_token_ids"].dtype == np.int32
    assert sample["completion_logprobs"].dtype == np.float64  # lossless: the logprobs as received
    assert sample["loss_mask"].dtype == np.uint8
    assert not sample["completion_token_ids"].flags.writeable  # zero-copy views of the body
    assert codec.plain(decoded) == batch
    # Re-encoding a decoded batch (what the sampler does for rank shares) gives the same bytes.
    assert codec.pack_arrays(decoded) == data
    # Transcoding to the other forms gives exactly what encoding the lists would.
    assert codec.pack(decoded) == codec.pack(batch)
    assert codec.dumps_json(decoded) == codec.dumps_json(batch)


def test_with_arrays_gives_what_unpack_gives_and_packs_to_the_same_bytes():
    batch = _batch(random.Random(2))
    typed = codec.with_arrays(batch)
    assert batch["samples"][0]["completion_token_ids"].__class__ is list  # the input is untouched
    decoded = codec.unpack(codec.pack_arrays(batch))
    for mine, theirs in zip(typed["samples"], decoded["samples"]):
        for field in codec.ARRAY_FIELDS:
            assert mine[field].dtype == theirs[field].dtype and (mine[field] == theirs[field]).all()
    assert codec.pack_arrays(typed) == codec.pack_typed(typed) == codec.pack_arrays(batch)


def test_arrays_form_is_smaller_or_close_and_fields_outside_the_set_stay_lists():
    batch = _batch(random.Random(1))
    decoded = codec.unpack(codec.pack_arrays(batch))
    assert decoded["samples"][0]["versions"] == [3, 4]
    assert len(codec.pack_arrays(batch)) < 1.2 * len(codec.pack(batch))


def test_values_a_type_cannot_hold_keep_the_list():
    batch = {"samples": [{
        "prompt_token_ids": [1, 2**40],             # beyond int32: int64
        "completion_token_ids": [1, 2**64 - 1],     # beyond int64: stays a list
        "completion_logprobs": [-0.5, None, -math.inf],  # None cannot be a float64: stays a list
        "loss_mask": [1, 300],                      # beyond uint8: int32
    }]}
    sample = codec.unpack(codec.pack_arrays(batch))["samples"][0]
    assert sample["prompt_token_ids"].dtype == np.int64
    assert sample["completion_token_ids"] == [1, 2**64 - 1]
    assert sample["completion_logprobs"] == [-0.5, None, -math.inf]
    assert sample["loss_mask"].dtype == np.int32
    assert codec.plain(sample) == batch["samples"][0]


def test_any_msgpack_decoder_reads_the_arrays_form():
    # A client without Tandem's codec sees ext values whose bytes are the little-endian array.
    raw = msgpack.unpackb(codec.pack_arrays({"samples": [{"completion_token_ids": [7, 300]}]}))
    ext = raw["samples"][0]["completion_token_ids"]
    assert ext.code == 1 and np.frombuffer(ext.data, "<i4").tolist() == [7, 300]


def test_unknown_ext_codes_are_left_as_ext_values():
    data = msgpack.packb({"x": msgpack.ExtType(99, b"abc"), "y": msgpack.ExtType(1, b"abc")})
    decoded = codec.unpack(data)
    assert decoded["x"] == msgpack.ExtType(99, b"abc")
    assert decoded["y"] == msgpack.ExtType(1, b"abc")  # 3 bytes is no whole number of int32s


def test_accept_negotiation():
    assert codec.negotiate("application/vnd.tandem+msgpack") == codec.ARRAYS
    assert codec.negotiate("application/vnd.tandem+msgpack, application/json;q=0.5") == codec.ARRAYS
    assert codec.negotiate("application/msgpack") == codec.MSGPACK
    assert codec.negotiate("application/x-msgpack, */*") == codec.MSGPACK
    assert codec.negotiate("application/json") == codec.JSON
    assert codec.negotiate(None) == codec.JSON
    assert codec.negotiate("text/html") == codec.JSON

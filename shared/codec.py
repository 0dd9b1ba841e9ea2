"""Body encodings for the sampler API: JSON (the default), msgpack, and msgpack with typed arrays.

* `application/json`: the contract's structure (docs/sampler-api.md, Batch body).
* `application/msgpack`: the same structure as msgpack; every number is a msgpack number.
* `application/vnd.tandem+msgpack` ("arrays"): the same structure again, except that a
  sample's token-aligned number lists (`ARRAY_FIELDS`) travel as msgpack ext values, each
  holding one little-endian typed array (`EXT_DTYPES`). A decoder turns each into a
  read-only numpy array without touching its numbers one by one, which is what makes a
  large batch cheap to hand over: packing and unpacking ~130,000 Python numbers per MiB
  cost ~15 ms on each side, copying the same bytes well under 1 ms. A list that does not
  fit its type losslessly (a `None`, a float among token ids, an id beyond int64) stays an
  ordinary list, so the format never changes a value.

The sampler stores sealed batches in the arrays form and serves the other two by
transcoding; any msgpack decoder reads all three (an unknown ext arrives as an ext value).
JSON goes through orjson, which also writes numpy arrays natively; non-finite floats, which
JSON cannot carry, are written as null.
"""

from __future__ import annotations

import functools
import json
import struct
from typing import Any

import msgpack
import numpy as np

try:
    import orjson
except ImportError:  # pragma: no cover - orjson is a declared dependency
    orjson = None

JSON = "application/json"
MSGPACK = "application/msgpack"
ARRAYS = "application/vnd.tandem+msgpack"
FRAMES = "application/vnd.tandem.batch"  # the chunked batch form, shared/chunks.py

# msgpack ext type code -> numpy dtype of the little-endian array it carries.
EXT_DTYPES: dict[int, np.dtype] = {
    1: np.dtype("<i4"), 2: np.dtype("<i8"), 3: np.dtype("<f8"), 4: np.dtype("<f4"), 5: np.dtype("u1"),
}
_EXT_CODES = {dtype: code for code, dtype in EXT_DTYPES.items()}

# Per-token sample fields sent as typed arrays, with the struct codes to try in order
# ('B' uint8, 'i' int32, 'q' int64, 'd' float64); the first that holds every value wins.
ARRAY_FIELDS: dict[str, tuple[str, ...]] = {
    "prompt_token_ids": ("i", "q"),
    "completion_token_ids": ("i", "q"),
    "completion_logprobs": ("d",),
    "loss_mask": ("B", "i", "q"),
}
_STRUCT_EXT = {"B": 5, "i": 1, "q": 2, "d": 3}


@functools.lru_cache(maxsize=1024)
def _struct(code: str, count: int) -> struct.Struct:
    # struct.pack of a whole list is ~2.5x faster than array() or numpy from a list.
    return struct.Struct(f"<{count}{code}")


# --- msgpack ---------------------------------------------------------------------------

def _as_plain(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot serialize {type(obj).__name__}")


def _as_ext(obj: Any) -> Any:
    if isinstance(obj, np.ndarray) and obj.ndim == 1:
        code = _EXT_CODES.get(obj.dtype.newbyteorder("<"))
        if code is not None:
            base = obj.base
            if isinstance(base, bytes) and obj.dtype == EXT_DTYPES[code] and obj.nbytes == len(base):
                return msgpack.ExtType(code, base)  # a whole-bytes view (with_arrays made it): no copy
            return msgpack.ExtType(code, obj.astype(EXT_DTYPES[code], copy=False).tobytes())
    return _as_plain(obj)


def _from_ext(code: int, data: bytes) -> Any:
    dtype = EXT_DTYPES.get(code)
    if dtype is None or len(data) % dtype.itemsize:
        return msgpack.ExtType(code, data)
    return np.frombuffer(data, dtype)


def pack(obj: Any) -> bytes:
    """Plain msgpack: every number a msgpack number (numpy arrays become lists)."""
    return msgpack.packb(obj, use_bin_type=True, default=_as_plain)


def unpack(data: bytes) -> Any:
    """Either msgpack form; typed arrays come back as read-only numpy arrays."""
    return msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=_from_ext)


def _typed(values: list, codes: tuple[str, ...]) -> Any:
    for code in codes:
        try:
            data = _struct(code, len(values)).pack(*values)
        except struct.error:  # a value this type cannot hold (None, a float, out of range)
            continue
        return np.frombuffer(data, EXT_DTYPES[_STRUCT_EXT[code]])
    return values


def typed_fields(name: str, values: list[Any]) -> list[Any]:
    """`[typed_field(name, v) for v in values]`, with the lists converted together when every
    one is a list that the field's first type holds: one buffer, of which each gets a read-only
    view (the same dtype and values as its own conversion; a group's completions convert in
    one step instead of one each)."""
    codes = ARRAY_FIELDS.get(name)
    if codes is None or len(values) < 2 or not all(type(v) is list for v in values):
        return [typed_field(name, v) for v in values]
    code = codes[0]
    flat = [x for v in values for x in v]
    try:
        data = _struct(code, len(flat)).pack(*flat)
    except struct.error:  # some list needs another type, or none holds it: each its own
        return [typed_field(name, v) for v in values]
    whole = np.frombuffer(data, EXT_DTYPES[_STRUCT_EXT[code]])
    out = []
    at = 0
    for v in values:
        out.append(whole[at:at + len(v)])
        at += len(v)
    return out


_ONES: dict[int, np.ndarray] = {}


def typed_field(name: str, values: Any) -> Any:
    """What `with_arrays` makes of a sample's `name` value: for a list in one of the
    `ARRAY_FIELDS`, the typed array that holds it exactly (else the list itself); any other
    value as it is."""
    if type(values) is not list:
        return values
    codes = ARRAY_FIELDS.get(name)
    return values if codes is None else _typed(values, codes)


def ones_mask(count: int) -> np.ndarray:
    """`typed_field("loss_mask", [1] * count)`: the same read-only uint8 array, made once per
    length (arrays from this module are never written to, so samples may share one)."""
    mask = _ONES.get(count)
    if mask is None:
        if len(_ONES) >= 4096:  # lengths are bounded by max_tokens; never grow without bound
            _ONES.clear()
        mask = _ONES[count] = np.frombuffer(b"\x01" * count, EXT_DTYPES[_STRUCT_EXT["B"]])
    return mask


def with_arrays(batch: dict[str, Any]) -> dict[str, Any]:
    """`batch` with each sample's `ARRAY_FIELDS` lists as read-only numpy arrays (a list no
    type holds exactly stays a list): what `pack_arrays` sends and `unpack` gives back.
    A new batch dict, and a new dict for each sample with a list to convert (a sample with
    none is the same dict); the input is not modified."""
    samples = batch.get("samples")
    if not isinstance(samples, list):
        return batch
    typed_samples = []
    for sample in samples:
        typed = sample
        for field, codes in ARRAY_FIELDS.items():
            values = sample.get(field)
            if type(values) is list:
                if typed is sample:
                    typed = dict(sample)
                typed[field] = _typed(values, codes)
        typed_samples.append(typed)
    return {**batch, "samples": typed_samples}


def pack_arrays(batch: dict[str, Any]) -> bytes:
    """The arrays form of a batch (`{"step", "samples", ...}`); the input is not modified."""
    return pack_typed(with_arrays(batch))


def pack_typed(batch: dict[str, Any]) -> bytes:
    """`pack_arrays` for a batch whose arrays are numpy arrays already (what `with_arrays`
    returns, or a decoded batch): the same bytes, without copying every sample again."""
    return msgpack.packb(batch, use_bin_type=True, default=_as_ext)


# --- JSON ------------------------------------------------------------------------------

def dumps_json(obj: Any) -> bytes:
    if orjson is not None:
        return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY, default=_as_plain)
    return json.dumps(obj, separators=(",", ":"), allow_nan=False, default=_as_plain).encode()


def loads_json(data: bytes | str) -> Any:
    return orjson.loads(data) if orjson is not None else json.loads(data)


# --- negotiation -----------------------------------------------------------------------

def negotiate(accept: str | None) -> str:
    """The media type to answer with for an Accept header: FRAMES (shared/chunks.py; `GET
    /batch` only), ARRAYS, MSGPACK or JSON."""
    accept = (accept or "").lower()
    if FRAMES in accept:
        return FRAMES
    if ARRAYS in accept:
        return ARRAYS
    if MSGPACK in accept or "application/x-msgpack" in accept:
        return MSGPACK
    return JSON


def encode(obj: Any, media_type: str) -> bytes:
    if media_type == ARRAYS:
        return pack_arrays(obj)
    if media_type == MSGPACK:
        return pack(obj)
    return dumps_json(obj)


def decode(content_type: str | None, data: bytes) -> Any:
    if content_type and "msgpack" in content_type.lower():
        return unpack(data)
    return loads_json(data)


def plain(obj: Any) -> Any:
    """`obj` with numpy arrays turned into lists (for comparisons, hashing and JSON by hand)."""
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [plain(v) for v in obj]
    if isinstance(obj, (np.ndarray, np.generic)):
        return obj.tolist()
    return obj

"""A chunk's content in columns (shared/chunks.py lays them out and reads them back): how
sample dicts become columns, and a range of samples of columns.

What goes in which kind of column is the chunk format's (shared/chunks.py, its docstring);
this module finds it a column at a time: a column's types are checked once per distinct type,
not per sample, since per-sample Python work was most of the time of packing a batch.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shared.codec import ARRAY_FIELDS, EXT_DTYPES, _typed

# dtype -> ext code; the little-endian dtypes compare (and hash) equal to native ones here.
_CODES = {dtype: code for code, dtype in EXT_DTYPES.items()}
_I8 = np.dtype("<i8")


@dataclass
class Columns:
    """One chunk's content in columns, before it is laid out (encode) or after (decode).

    `arrays`: field -> (values, offsets), where values may also be a list of per-sample arrays
    (what `columns_of` makes: `encode_chunk` joins them straight into the chunk); `numbers`: key -> array; `texts`: key -> (UTF-8
    bytes as a uint8 array, offsets); `lists`: key -> list; `absent`: key -> sample indices
    without the key."""

    n: int
    arrays: dict[str, tuple[np.ndarray | list[np.ndarray], np.ndarray]] = field(default_factory=dict)
    numbers: dict[str, np.ndarray] = field(default_factory=dict)
    texts: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    lists: dict[str, list] = field(default_factory=dict)
    absent: dict[str, list[int]] = field(default_factory=dict)


def _offsets(lengths: list[int] | np.ndarray) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, _I8)
    np.cumsum(lengths, out=out[1:])
    return out


def _array_column(values: list[Any], codes: tuple[str, ...]) -> list[np.ndarray] | None:
    """Each sample's array for one token field, or None when some value has no exact type.
    Types and dtypes are checked per distinct one, not per sample (a column of numpy arrays
    usually has one dtype): per-sample Python work was most of packing's time (~7 us a
    sample, 117k samples a GiB, against ~1 ms a GiB of copying)."""
    types = set(map(type, values))
    if all(issubclass(kind, np.ndarray) for kind in types):
        if values and set(map(_NDIM, values)) != {1}:
            return None
        for dtype in set(map(_DTYPE, values)):
            # (A big-endian array is accepted too; its chunk column is little-endian.)
            if dtype not in _CODES and dtype.newbyteorder("<") not in _CODES:
                return None
        return values
    if not all(kind is list or issubclass(kind, np.ndarray) for kind in types):
        return None
    out = []
    for value in values:  # lists (a JSON body's): each converted, as `with_arrays` would
        if type(value) is list:
            value = _typed(value, codes)
            if not isinstance(value, np.ndarray):
                return None
        elif value.ndim != 1 or (value.dtype not in _CODES and value.dtype.newbyteorder("<") not in _CODES):
            return None
        out.append(value)
    return out


_NDIM, _DTYPE = operator.attrgetter("ndim"), operator.attrgetter("dtype")


def _one_kind(arrays: list[np.ndarray]) -> bool:
    """A column has one dtype: ints and floats in one field would round ids past 2**53, so
    such a field travels as exact lists instead."""
    kinds = {dtype.kind for dtype in set(map(_DTYPE, arrays))}
    return not ("f" in kinds and kinds & {"i", "u"})


def _lengths(values: list[Any]) -> np.ndarray:
    return np.fromiter(map(len, values), _I8, len(values))


def _text_column(values: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """UTF-8 bytes back to back, and offsets. Short ASCII strings (ids, finish reasons) are
    encoded in one piece, their byte lengths being their character lengths (measured: ~40%
    less time for 455 ids); long texts are faster encoded one by one (joining 1,500-character
    strings first took ~3x as long)."""
    if values and len(values[0]) <= 64:
        joined = "".join(values)
        if joined.isascii():
            return np.frombuffer(joined.encode(), np.uint8), _offsets(_lengths(values))
    encoded = list(map(str.encode, values))
    return np.frombuffer(b"".join(encoded), np.uint8), _offsets(_lengths(encoded))


def _by_key(samples: list[dict[str, Any]]) -> tuple[dict[str, list[Any]], dict[str, list[int]]]:
    """Each key's values in the samples that have it (keys in order of first appearance), and
    the indices of the samples that lack each key that some lack."""
    n = len(samples)
    first = samples[0] if samples else {}
    # The usual chunk: every sample has the first one's keys and no other (each has at least
    # them, so the same total count means exactly them). Then a column is one C-level pass.
    if sum(map(len, samples)) == n * len(first):
        try:
            return {key: list(map(operator.itemgetter(key), samples)) for key in first}, {}
        except KeyError:
            pass
    keys: dict[str, None] = {}
    for sample in samples:
        keys.update(dict.fromkeys(sample))
    present, absent = {}, {}
    for key in keys:
        present[key] = [s[key] for s in samples if key in s]
        if len(present[key]) < n:
            absent[key] = [i for i, s in enumerate(samples) if key not in s]
    return present, absent


def columns_of(samples: list[dict[str, Any]]) -> Columns:
    """The columns of `samples` (sample dicts with lists or numpy arrays in the token fields)."""
    cols = Columns(len(samples))
    by_key, cols.absent = _by_key(samples)
    for key, present in by_key.items():
        codes = ARRAY_FIELDS.get(key)
        if codes is not None:
            arrays = _array_column(present, codes)
            if arrays is not None and _one_kind(arrays):
                cols.arrays[key] = (arrays, _offsets(_lengths(arrays)))
                continue
        kinds = set(map(type, present))
        if kinds == {float}:
            cols.numbers[key] = np.array(present, "<f8")
            continue
        if kinds == {int}:
            try:  # numpy refuses (OverflowError) a value outside int64
                cols.numbers[key] = np.array(present, "<i8")
                continue
            except OverflowError:
                pass
        if kinds == {str}:
            cols.texts[key] = _text_column(present)
        elif any(issubclass(kind, (np.ndarray, np.generic)) for kind in kinds):
            cols.lists[key] = [v.tolist() if isinstance(v, (np.ndarray, np.generic)) else v for v in present]
        else:
            cols.lists[key] = present
    return cols


def _slice_pairs(values: np.ndarray, offsets: np.ndarray, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    a, b = int(offsets[start]), int(offsets[stop])
    return values[a:b], offsets[start:stop + 1] - a


def slice_columns(cols: Columns, start: int, stop: int) -> Columns:
    """Samples start..stop-1 of `cols` (views where possible)."""
    out = Columns(stop - start)
    present_index = {}
    for key, missing in cols.absent.items():
        # Positions in the key's own column (it only holds samples that have the key).
        have = np.setdiff1d(np.arange(cols.n), missing)
        lo, hi = np.searchsorted(have, start), np.searchsorted(have, stop)
        present_index[key] = (int(lo), int(hi))
        kept = [i - start for i in missing if start <= i < stop]
        if kept:
            out.absent[key] = kept

    def span(key: str) -> tuple[int, int]:
        return present_index.get(key, (start, stop))

    for key, (values, offsets) in cols.arrays.items():
        out.arrays[key] = _slice_pairs(values, offsets, *span(key))
    for key, values in cols.numbers.items():
        lo, hi = span(key)
        out.numbers[key] = values[lo:hi]
    for key, (values, offsets) in cols.texts.items():
        out.texts[key] = _slice_pairs(values, offsets, *span(key))
    for key, values in cols.lists.items():
        lo, hi = span(key)
        out.lists[key] = values[lo:hi]
    return out

"""Body encodings for the sampler API: JSON (the default) and msgpack.

msgpack carries the same structure as JSON; it exists because a large batch of token
ids decodes several times faster from msgpack than from JSON.

JSON goes through orjson when it is installed (a dependency): encoding a 1 MiB batch of
token ids with the standard library took ~15x longer and blocked the sampler's event loop
meanwhile (bench/results/PROFILE.md). Non-finite floats, which JSON cannot carry, are
written as null by orjson.
"""

from __future__ import annotations

import json
from typing import Any

import msgpack

try:
    import orjson
except ImportError:  # pragma: no cover - orjson is a declared dependency
    orjson = None

JSON = "application/json"
MSGPACK = "application/msgpack"


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def dumps_json(obj: Any) -> bytes:
    if orjson is not None:
        return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS)
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def loads_json(data: bytes | str) -> Any:
    return orjson.loads(data) if orjson is not None else json.loads(data)


def wants_msgpack(accept: str | None) -> bool:
    """True when an Accept header prefers msgpack over JSON."""
    if not accept:
        return False
    accept = accept.lower()
    return MSGPACK in accept or "application/x-msgpack" in accept


def decode(content_type: str | None, data: bytes) -> Any:
    if content_type and "msgpack" in content_type.lower():
        return unpack(data)
    return loads_json(data)

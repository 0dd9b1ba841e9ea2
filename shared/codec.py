"""Body encodings for the sampler API: JSON (the default) and msgpack.

msgpack carries the same structure as JSON; it exists because a large batch of token
ids decodes several times faster from msgpack than from JSON.
"""

from __future__ import annotations

import json
from typing import Any

import msgpack

JSON = "application/json"
MSGPACK = "application/msgpack"


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def dumps_json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def wants_msgpack(accept: str | None) -> bool:
    """True when an Accept header prefers msgpack over JSON."""
    if not accept:
        return False
    accept = accept.lower()
    return MSGPACK in accept or "application/x-msgpack" in accept


def decode(content_type: str | None, data: bytes) -> Any:
    if content_type and "msgpack" in content_type.lower():
        return unpack(data)
    return json.loads(data)

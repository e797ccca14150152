"""Lines between a thin client and a worker: one JSON object per line.

orjson writes and reads them fast, but holds integers only within
[-2**63, 2**64-1]: it refuses to write a larger one, and reads one as a float.
User JSON -- a conversation a fork's verdict carries, an interrupt's response
-- may hold any integer validation accepts (up to 4 300 digits), and SPEC
section 4 round-trips it exactly. So a line orjson cannot write is written by
the standard library behind a marker byte, and read back by it: exact either
way, at orjson's speed for every usual line. (Found by a review: a thin
client's fork of such a conversation applied, but its verdict could not be
sent, so the call waited out its timeout and said OUTCOME_UNKNOWN.)
"""

from __future__ import annotations

import json
from typing import Any

import orjson

# A line is otherwise a JSON object, which starts with "{": this byte cannot begin one.
_EXACT = b"="


def dumps(value: Any) -> bytes:
    """`value` as one line (no trailing newline). TypeError if it is not JSON."""
    try:
        return orjson.dumps(value)
    except TypeError:
        # An int beyond 64 bits (anything else that is not JSON fails here as well).
        return _EXACT + json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def loads(line: bytes) -> Any:
    """What `dumps` wrote (ValueError if it is not a line of ours)."""
    if line[:1] == _EXACT:
        return json.loads(line[1:])
    return orjson.loads(line)


def loads_exact(raw: bytes) -> Any:
    """Stored JSON (a record, a verdict), read exactly: the standard library, which
    keeps an int of any size an int (orjson would make it a float)."""
    return json.loads(raw)

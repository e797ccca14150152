"""Delivery log offsets: `"<partition>.<kafka offset>.<chunk index>.<tag>"`.

Chunk i of the record at Kafka offset X of partition p has the opaque offset
`p.X.i.tag`, tag = 8 hex digits of a hash of the run id, so an offset of
another run is recognised, and a reader seeks to X and skips to i.
"""

from __future__ import annotations

import functools
import hashlib
import re
from typing import Any

from ..kernel.errors import INVALID_OFFSET, ThreadLogError

Offset = str
OFFSET_SHAPE = re.compile(r"^(0|[1-9][0-9]{0,9})\.(0|[1-9][0-9]{0,18})\.(0|[1-9][0-9]{0,9})\.([0-9a-f]{8})\Z")
LAST = 2**62  # "every chunk of this record" when used as a chunk index


@functools.lru_cache(maxsize=4096)
def run_tag(run_id: str) -> str:
    return hashlib.blake2b(run_id.encode("utf-8"), digest_size=4).hexdigest()


def encode_offset(run_id: str, partition: int, kafka_offset: int, index: int) -> Offset:
    return f"{partition}.{kafka_offset}.{index}.{run_tag(run_id)}"


def parse_offset(run_id: str, partition: int, offset: Any) -> tuple[int, int]:
    """(Kafka offset, chunk index) of an offset string minted for this run, else INVALID_OFFSET.

    Only the shape and the run are checked here; whether the position exists
    is the run index's answer (`DeliveryLog._require_position`).
    """
    if not isinstance(offset, str):
        raise ThreadLogError(INVALID_OFFSET, f"an offset is a str, got {type(offset).__name__}")
    m = OFFSET_SHAPE.match(offset)
    if m is None:
        raise ThreadLogError(INVALID_OFFSET, f"malformed offset {offset[:80]!r}")
    p, x, i, tag = int(m[1]), int(m[2]), int(m[3]), m[4]
    if tag != run_tag(run_id) or p != partition:
        raise ThreadLogError(INVALID_OFFSET, f"offset {offset!r} was not minted by the log of run {run_id!r}")
    return x, i

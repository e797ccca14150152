"""The delivery record format (`threadlog.Delivery`), owned here and only here.

Every record of `<ns>.deliveries` is one of four kinds, keyed by its run id:
`chunks` (one append's whole batch), `upsert` (replacements of chunk
positions), `close`, and `claim` (a proposal the run index grants an epoch).
Writers build them with the functions below, the producer fills the fields a
kind does not use (`encodable`), and the run index fold and readers read
them back (`record_size`, `decode_chunks`): one place knows the shape.
"""

from __future__ import annotations

import json
import time
from typing import Any

import orjson

from .errors import invalid_argument
from .validation import dumps, json_problem

CHUNKS = "chunks"
UPSERT = "upsert"
CLOSE = "close"
CLAIM = "claim"
RULES = 2  # the rules version a writer of these records follows

# The largest floor a claim may name: the largest epoch every client reads
# exactly (JavaScript's integers), so `runs.claim` never names more (it caps
# what it read there). Why a bound at all: tried (a review), a claim record
# forged with floor 2**63-1 was granted 2**63, which no Avro long holds -- every
# later claim of the run failed INVALID_MESSAGE, and raised the fence on the way
# (fencing out the driver too). Below it, grants outlast any run (2**63 - 2**53).
CLAIM_FLOOR_MAX = 2**53 - 1


def _now_ms() -> float:
    return time.time() * 1000.0


def written(run_id: str, epoch: int, kind: str, **fields: Any) -> dict:
    """A record of `kind` by driver `epoch` of the run (chunks, upsert, close)."""
    return {"runId": run_id, "epoch": epoch, "kind": kind, "writtenAt": _now_ms(), **fields}


def claim(run_id: str, floor: int) -> dict:
    """A claim proposal: the run index grants max(fence, floor) + 1."""
    return {"runId": run_id, "kind": CLAIM, "epoch": floor, "writtenAt": _now_ms()}


def encodable(record: dict) -> dict:
    """`record` with the fields its kind leaves out, as the schema wants them.

    fastavro would write a missing bytes field's JSON default ("") as a str and fail.
    """
    return {"batch": b"", "count": 0, "chunks": [], "rules": RULES, **record}


def record_size(rec: dict) -> int:
    """How many chunks a chunks record holds.

    A v2 record carries the whole batch as one JSON array (`batch`) and its
    length (`count`), so neither this fold nor a reader decodes chunk by chunk;
    records written before v2 (and batches orjson cannot round-trip) hold one
    JSON text per chunk in `chunks`.
    """
    return rec["count"] if rec.get("batch") else len(rec["chunks"])


def chunks_record(chunks: Any, label: str) -> tuple[dict, int]:
    """(fields of a chunks record holding `chunks`, how many); INVALID_ARGUMENT
    unless every chunk is a JSON object.

    Fast path (appends are hot): the whole batch as ONE JSON array by orjson,
    proven plain JSON by decoding it back and comparing -- NaN (orjson writes
    null), a tuple, a datetime or anything else orjson coerced compares unequal,
    and what it refuses (a non-str key, an int beyond 64 bits, a lone surrogate)
    raises. Readers then parse the record in one orjson call. Only otherwise
    does the slow, precise walk run, to say what is wrong -- or to accept what
    plain JSON holds but orjson cannot round-trip (tuples, big ints), stored as
    one text per chunk and parsed by `json`.
    """
    if not isinstance(chunks, (list, tuple)):
        raise invalid_argument(f"{label} must be a list of chunk dicts, got {type(chunks).__name__}")
    n = len(chunks)
    try:
        if n and all(isinstance(chunk, dict) for chunk in chunks):
            batch = orjson.dumps(chunks)
            if orjson.loads(batch) == list(chunks):
                return {"batch": batch, "count": n}, n
    except (TypeError, ValueError, RecursionError):  # orjson's errors subclass these
        pass
    return {"chunks": [chunk_text(chunk, f"{label}[{i}]") for i, chunk in enumerate(chunks)]}, n


def decode_chunks(rec: dict) -> list | None:
    """Every chunk value of a chunks record, in order (None where a text is not JSON);
    None if the record is corrupt as a whole."""
    batch = rec.get("batch")
    if batch:
        try:
            values = orjson.loads(batch)
        except orjson.JSONDecodeError:
            try:
                values = json.loads(batch)  # what orjson refuses but plain JSON allows
            except ValueError:
                return None
        return values if isinstance(values, list) and len(values) == rec["count"] else None
    texts = rec["chunks"]
    try:
        return json.loads("[" + ",".join(texts) + "]")  # one parse per record, not per chunk
    except ValueError:
        return [parse_or_none(text) for text in texts]


def chunk_text(chunk: Any, label: str) -> str:
    if not isinstance(chunk, dict):
        raise invalid_argument(f"{label} must be a dict (a JSON object), got {type(chunk).__name__}")
    problem = json_problem(chunk, label)
    if problem:
        raise invalid_argument(problem)
    return dumps(chunk)


def parse_or_none(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None

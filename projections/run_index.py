"""The run index: what every record of `<ns>.deliveries` means, folded in partition order.

This is the one place that decides whether a delivery record stands (SPEC 11,
"Fencing"). A record of run R at Kafka offset X, written by driver epoch e:

- a **claim** is a proposal (written by `runs.claim`): it is *granted* the
  epoch max(fence, its floor) + 1, which becomes R's fence. The grant is
  decided here, by the fold, so an epoch is never handed out twice and no
  epoch exists that this partition did not grant: a forged claim record is
  just another claim, never a way to name an epoch;
- a **chunks**, **upsert** or **close** record *stands* unless
  e < the greatest claim epoch of R before X (`RUN_CLAIM_LOST`), or
  e > that epoch (an epoch never granted: `RUN_CLAIM_LOST` too), or R's log
  was closed before X (`RUN_LOG_CLOSED`), checked in that order; an upsert
  also needs every target to be a standing chunk position of R
  (`INVALID_OFFSET`, only a forged record can fail that);
- the first standing close closes the log.

Readers yield exactly the chunks of standing chunks records, and `append`
returns only after this fold has passed its record and found it standing, so
an acknowledged chunk is never dropped and a dropped one was never
acknowledged. Because Kafka's read_committed order is the order of this fold,
a claim whose transaction is still open before X holds the fold (and so the
appender) back until it commits or aborts.

Keys (tags `dlv?`):
- `dlvR run` -> JSON run state `{seen, first?, fence, claimAt?, closedAt?, reps}`:
  seen = offset of the run's first record of any kind, first = offset of the
  first standing chunks/close record (where `"-1"` seeks), fence = greatest
  claim epoch so far, reps = standing upserts count;
- `dlvK run offset` -> JSON verdict of each chunks/upsert/close record of the
  run: `{"n": count}` (standing chunks), `{"u": count}` (standing upsert),
  `{"close": 1}` (the close), or `{"drop": CODE}`;
- `dlvU run offset index` -> the JSON text that replaces that chunk position
  (latest standing upsert wins).
"""

from __future__ import annotations

import json
import struct
from typing import Any

from threadlog.errors import CORRUPT_RECORD, INVALID_OFFSET, RUN_CLAIM_LOST, RUN_LOG_CLOSED

from .keys import key
from .reader import StateReader
from .view import View

RUN = b"dlvR"
REC = b"dlvK"
REP = b"dlvU"

CHUNKS = "chunks"
UPSERT = "upsert"
CLOSE = "close"
CLAIM = "claim"


def run_key(run_id: str) -> bytes:
    return key(RUN, run_id)


def rec_key(run_id: str, offset: int) -> bytes:
    return key(REC, run_id) + struct.pack(">Q", offset)


def rep_key(run_id: str, offset: int, index: int) -> bytes:
    return key(REP, run_id) + struct.pack(">QI", offset, index)


def rep_prefix(run_id: str) -> bytes:
    return key(REP, run_id)


def verdict(fence: int, closed_at: int | None, offset: int, epoch: int) -> str | None:
    """Why a record of epoch `epoch` at `offset` is dropped, or None if it stands.

    The claim is checked first: a superseded driver learns it lost the run
    even when the log was also closed (SPEC: RUN_CLAIM_LOST before RUN_LOG_CLOSED).
    An epoch above the fence was never granted by a claim: a driver that made
    it up (or a forged record) holds nothing.
    """
    if epoch < fence or epoch > fence:
        return RUN_CLAIM_LOST
    if closed_at is not None and closed_at < offset:
        return RUN_LOG_CLOSED
    return None


def record_size(rec: dict) -> int:
    """How many chunks a chunks record holds.

    A v2 record carries the whole batch as one JSON array (`batch`) and its
    length (`count`), so neither this fold nor a reader decodes chunk by chunk;
    records written before v2 (and batches orjson cannot round-trip) hold one
    JSON text per chunk in `chunks`.
    """
    return rec["count"] if rec.get("batch") else len(rec["chunks"])


def _dump(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def fold_record(view: View, offset: int, rec: dict) -> str | None:
    """Fold one decoded `threadlog.Delivery` at `offset`.

    Returns None when the record stands (or is a claim / an unknown kind),
    else the code of why it is dropped.
    """
    run_id = rec["runId"]
    kind = rec["kind"]
    state = view.get_json(run_key(run_id))
    if state is None:
        state = {"fence": 0, "reps": 0, "seen": offset}
        view.put_json(run_key(run_id), state)
    if kind == CLAIM:
        # The grant: one more than any epoch this run's log (or the run record
        # the claimer read: the floor) ever had.
        granted = max(state["fence"], rec["epoch"]) + 1
        state["fence"] = granted
        state["claimAt"] = offset
        view.put_json(run_key(run_id), state)
        view.put(rec_key(run_id, offset), _dump({"claim": granted}))
        return None
    if kind not in (CHUNKS, UPSERT, CLOSE):
        return None  # a newer writer's kind: not ours to interpret
    code = verdict(state["fence"], state.get("closedAt"), offset, rec["epoch"])
    if code is None and kind == CHUNKS and rec.get("batch") and rec["count"] <= 0:
        code = CORRUPT_RECORD  # a batch that says it holds nothing: forged, never positioned
    if code is None and kind == UPSERT:
        code = _check_targets(view, run_id, rec)
    if code is not None:
        view.put(rec_key(run_id, offset), _dump({"drop": code}))
        return code
    if kind == CHUNKS:
        view.put(rec_key(run_id, offset), _dump({"n": record_size(rec)}))
    elif kind == UPSERT:
        for target, text in zip(rec["targets"], rec["chunks"], strict=True):
            view.put(rep_key(run_id, target["offset"], target["index"]), text.encode("utf-8"))
        view.put(rec_key(run_id, offset), _dump({"u": len(rec["chunks"])}))
        state["reps"] = state.get("reps", 0) + 1
    else:
        view.put(rec_key(run_id, offset), _dump({"close": 1}))
        state["closedAt"] = offset
    state.setdefault("first", offset)
    view.put_json(run_key(run_id), state)
    return None


def _check_targets(view: View, run_id: str, rec: dict) -> str | None:
    targets = rec["targets"]
    if len(targets) != len(rec["chunks"]):
        return INVALID_OFFSET
    seen = set()
    for t in targets:
        pos = (t["offset"], t["index"])
        if pos in seen:
            return INVALID_OFFSET
        seen.add(pos)
        standing = chunk_count(view, run_id, t["offset"])
        if standing is None or not 0 <= t["index"] < standing:
            return INVALID_OFFSET
    return None


# -- reads (View or Store: any StateReader) --------------------------
def run_state(reader: StateReader, run_id: str) -> dict | None:
    return reader.get_json(run_key(run_id))


def record_verdict(reader: StateReader, run_id: str, offset: int) -> dict | None:
    """The fold's verdict on the run's record at `offset`, None if it is not one."""
    return reader.get_json(rec_key(run_id, offset))


def chunk_count(reader: StateReader, run_id: str, offset: int) -> int | None:
    """Number of chunks of a standing chunks record of the run at `offset`, else None."""
    v = reader.get_json(rec_key(run_id, offset))
    return v.get("n") if v else None


def replacement(reader: StateReader, run_id: str, offset: int, index: int) -> str | None:
    raw = reader.get(rep_key(run_id, offset, index))
    return None if raw is None else raw.decode("utf-8")

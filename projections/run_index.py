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
import math
import struct
from typing import Any

from threadlog.kernel.delivery_records import CHUNKS, CLAIM, CLAIM_FLOOR_MAX, CLOSE, UPSERT, record_size
from threadlog.kernel.errors import CORRUPT_RECORD, INVALID_OFFSET, RUN_CLAIM_LOST, RUN_LOG_CLOSED
from threadlog.kernel.validation import dumps

from .keys import key
from .reader import StateReader
from .store import Store
from .view import View

RUN = b"dlvR"
REC = b"dlvK"
REP = b"dlvU"



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


def _dump(value: Any) -> bytes:
    return dumps(value).encode()  # the one canonical JSON (threadlog/kernel/validation.py)


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
        if rec["epoch"] > CLAIM_FLOOR_MAX:
            # No client names such a floor (see CLAIM_FLOOR_MAX): dropped, no grant.
            view.put(rec_key(run_id, offset), _dump({"drop": CORRUPT_RECORD}))
            return CORRUPT_RECORD
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


def verdicts_between(reader: Store, run_id: str, lo: int, hi: int) -> list[tuple[int, dict]]:
    """(offset, verdict) of the run's records at offsets lo <= x < hi, ascending."""
    prefix = key(REC, run_id)
    out = []
    for k, v in reader.scan(prefix, rec_key(run_id, lo)):
        x = struct.unpack(">Q", k[len(prefix):])[0]
        if x >= hi:
            break
        out.append((x, json.loads(v)))
    return out


def replacements_between(reader: Store, run_id: str, lo: int, hi: int) -> list[tuple[int, int, str]]:
    """(offset, index, text) of the replaced chunk positions of records at lo <= x < hi."""
    page, _ = replacements_page(reader, run_id, lo, hi, None, math.inf)  # one page: everything
    return [(x, i, text.decode("utf-8")) for x, i, text in page]


def replacements_page(reader: Store, run_id: str, lo: int, hi: int, after: tuple[int, int] | None,
                      budget: float) -> tuple[list[tuple[int, int, bytes]], tuple[int, int] | None]:
    """A page of `replacements_between`: (offset, index, UTF-8 text) after position
    `after` (None: from `lo`), up to `budget` bytes as the answer carries them
    (always at least one item), and the position to ask after next (None:
    nothing is left).

    Why pages: the replaced texts of a range of records have no bound of their
    own -- each chunk position of one record may be replaced by a text as large
    as a record -- while one answer to a thin reader is bounded (48 MiB). Counted
    as answered (base64 and each entry's frame), not as stored: millions of
    two-byte texts made a 107 MiB page of an 8 MiB budget (a review).
    """
    prefix = rep_prefix(run_id)
    if after is None:
        start = rep_key(run_id, lo, 0)
    elif after[1] + 1 < 1 << 32:
        start = rep_key(run_id, after[0], after[1] + 1)
    else:
        start = rep_key(run_id, after[0] + 1, 0)
    out: list[tuple[int, int, bytes]] = []
    size = 0
    for k, v in reader.scan(prefix, start):
        x, i = struct.unpack(">QI", k[len(prefix):])
        if x >= hi:
            return out, None
        if out and size >= budget:
            return out, (out[-1][0], out[-1][1])
        out.append((x, i, v))
        size += answered_size(v)
    return out, None


# Bytes of one page entry's frame, `[x,i,""],` with the longest x and i.
_ENTRY_FRAME = len('[18446744073709551615,4294967295,""],')


def answered_size(text: bytes) -> int:
    """Bytes a replaced text takes in a paged answer: base64, and its entry's frame."""
    return (len(text) + 2) // 3 * 4 + _ENTRY_FRAME


def replacement(reader: StateReader, run_id: str, offset: int, index: int) -> str | None:
    raw = reader.get(rep_key(run_id, offset, index))
    return None if raw is None else raw.decode("utf-8")


# -- one run, folded by a reader (thin clients) ------------------------------
class _Memory:
    """The store a one-run fold reads under its View: a dict."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}

    def get(self, k: bytes) -> bytes | None:
        return self.data.get(k)


class RunFold:
    """`fold_record` over ONE run's records from a known state on.

    A thin client's live reader gets the run's state as of Kafka offset A from
    the owner of the partition, then folds the run's own records at and after
    A itself, with this same fold: a record's verdict depends only on the
    run's records before it (fence, close), so the reader drops exactly what
    the owner drops without folding the rest of the partition. Upserts need
    older chunk positions this fold does not hold; their verdict here may
    differ, and readers never act on it (a position is yielded once, in order,
    before any upsert of it is read).
    """

    def __init__(self, run_id: str, state: dict | None) -> None:
        self.run_id = run_id
        self._judged: dict[int, str | None] = {}  # a record handed back and read again is folded once
        self._memory = _Memory()
        if state is not None:
            self._memory.data[run_key(run_id)] = _dump(state)

    def judge(self, offset: int, rec: dict) -> str | None:
        """Fold the run's record at `offset`; why it is dropped, None if it stands."""
        if offset in self._judged:
            return self._judged[offset]
        if len(self._judged) > 4096:
            self._judged.clear()  # only the last few are ever asked again
        self._judged[offset] = dropped = self._fold(offset, rec)
        return dropped

    def _fold(self, offset: int, rec: dict) -> str | None:
        view = View(self._memory)  # type: ignore[arg-type]  # only get() is read
        try:
            dropped = fold_record(view, offset, rec)
        except Exception:
            return CORRUPT_RECORD  # the owner skips it too (logged there), it changes nothing
        state = view.buffer.get(run_key(self.run_id))
        if state is not None:  # only the run's state is kept: memory stays flat on long runs
            self._memory.data[run_key(self.run_id)] = state
        return dropped


def decided(reader: StateReader, run_id: str, offset: int, kind: str, epoch: int) -> tuple[dict | None, int]:
    """(the verdict on the run's record at `offset`, the run's fence), for its writer.

    Call once the fold has passed `offset` (any kind) or reached it (a chunks
    record): a chunks record's verdict depends only on the records BEFORE it
    (the claim fence and the close), so it is known as soon as the fold has
    folded up to it -- usually at once -- instead of when the fold reaches the
    record itself (measured: that wait was two thirds of an append). The fold
    decides the same verdict later, by the same `verdict`, so readers and the
    writer never disagree. Order matters: the state is read BEFORE the
    record's own verdict is looked up. The fold writes a batch atomically, so
    if the record is still unfolded after the state was read, that state is
    exactly the fold of everything before it. None: not a record of the run.
    """
    state = run_state(reader, run_id) or {"fence": 0, "reps": 0}
    folded = record_verdict(reader, run_id, offset)
    if folded is None and kind == CHUNKS:
        code = verdict(state["fence"], state.get("closedAt"), offset, epoch)
        folded = {} if code is None else {"drop": code}
    return folded, state["fence"]

"""Runs: records on their thread's partition, plus global indexes every host folds.

State (tags are prefix-free among themselves and against other domains):
- `runR` (thread, run) -> the run record (JSON, exactly what `get` returns);
- `runI` (run) -> thread: where a run lives, for commands and reads naming only a run id;
- `runE` (thread, run) -> the greatest driver epoch the run ever had, claimed or
  written by `update` -- kept apart from the record so that clearing or lowering
  `driverEpoch` never lets `claim` hand an epoch out twice;
- `runD` (detachedSince, run, thread) -> b"": the running, detached runs, ordered
  by `detachedSince`, so `list_reclaimable` reads a range instead of every run;
- `runH` (heartbeatAt, run, thread) -> b"": the running runs that are NOT
  detached but had a driver heartbeat (or claim), ordered by `heartbeatAt`: a
  host that died stops heartbeating, and its runs age into this range.
A run is in at most one of the two (`records.quiet_since` decides which).
"""

from __future__ import annotations

import json

from threadlog.kernel.records import apply_patch, quiet_since

from .. import global_ids
from ..fold import EventMeta, folds
from ..keys import dec_num, dec_str, key
from ..reader import StateReader
from ..view import View
from . import presence

RUN_RECORD = b"runR"
RUN_INDEX = b"runI"
RUN_EPOCH = b"runE"
RUN_DETACHED = b"runD"
RUN_HEARTBEAT = b"runH"


def record_key(thread_id: str, run_id: str) -> bytes:
    return key(RUN_RECORD, thread_id, run_id)


def thread_prefix(thread_id: str) -> bytes:
    return key(RUN_RECORD, thread_id)


def index_key(run_id: str) -> bytes:
    return key(RUN_INDEX, run_id)


def epoch_key(thread_id: str, run_id: str) -> bytes:
    return key(RUN_EPOCH, thread_id, run_id)


def detached_key(detached_since: float, run_id: str, thread_id: str) -> bytes:
    return key(RUN_DETACHED, detached_since, run_id, thread_id)


def heartbeat_key(heartbeat_at: float, run_id: str, thread_id: str) -> bytes:
    return key(RUN_HEARTBEAT, heartbeat_at, run_id, thread_id)


def quiet_records(view: StateReader, cutoff: float) -> list[bytes]:
    """The stored records the reclaim indexes (`runD`, `runH`) list as quiet
    since `cutoff` or earlier. A query (projections/queries.py): one request
    per owner through a thin client. The indexes are hints (a record moves
    between them): the reader decides with `quiet_since`, exactly."""
    found = []
    for tag in (RUN_DETACHED, RUN_HEARTBEAT):
        for k, _ in view.scan(tag):
            since, pos = dec_num(k, len(tag))
            # The key orders by the double nearest the time; rounding is
            # monotonic, so a key past the cutoff's double is past the cutoff.
            if since > float(cutoff):
                break
            run_id, pos = dec_str(k, pos)
            thread_id, _ = dec_str(k, pos)
            raw = view.get(record_key(thread_id, run_id))
            if raw is not None:
                found.append(raw)
    return found


def max_epoch(view: StateReader, thread_id: str, run_id: str) -> int:
    return decode_epoch(view.get(epoch_key(thread_id, run_id)))


def decode_epoch(raw: bytes | None) -> int:
    """The greatest epoch a run was granted, from its `epoch_key` value (0: none)."""
    return 0 if raw is None else int(raw)


def _raise_epoch(view: View, thread_id: str, run_id: str, epoch: int) -> None:
    if epoch > max_epoch(view, thread_id, run_id):
        view.put(epoch_key(thread_id, run_id), str(epoch).encode())


def _quiet_key(record: dict) -> bytes | None:
    """The record's entry in `runD` or `runH`, or None (not a reclaim candidate)."""
    found = quiet_since(record)
    if found is None:
        return None
    field, since = found
    make = detached_key if field == "detachedSince" else heartbeat_key
    return make(since, record["runId"], record["threadId"])


def _put(view: View, old: dict | None, new: dict) -> None:
    """Store `new` and keep the reclaim indexes in step with it (one place)."""
    thread_id, run_id = new["threadId"], new["runId"]
    stale = None if old is None else _quiet_key(old)
    fresh = _quiet_key(new)
    if stale is not None and stale != fresh:
        view.delete(stale)
    if fresh is not None:
        view.put(fresh, b"")
    view.put_json(record_key(thread_id, run_id), new)


@folds("threadlog.evt.RunCreated")
def run_created(view: View, meta: EventMeta, ev: dict) -> None:
    record = {"runId": ev["runId"], "threadId": ev["threadId"], "status": ev["status"],
              "startedAt": ev["startedAt"]}
    existed = view.get(record_key(ev["threadId"], ev["runId"])) is not None
    _put(view, None, record)
    view.put(index_key(ev["runId"]), ev["threadId"].encode("utf-8"))
    if not existed:
        presence.add(view, ev["threadId"], presence.RUN)
        global_ids.mark(view, meta, global_ids.RUN, ev["runId"], ev["threadId"], True)


@folds("threadlog.evt.RunUpdated")
def run_updated(view: View, meta: EventMeta, ev: dict) -> None:
    old = view.get_json(record_key(ev["threadId"], ev["runId"]))
    if old is None:
        return  # the decider never emits this; a fold stays total anyway
    patch = json.loads(ev["patch"])
    _put(view, old, apply_patch(old, patch))
    if isinstance(patch.get("driverEpoch"), int):
        _raise_epoch(view, ev["threadId"], ev["runId"], patch["driverEpoch"])


@folds("threadlog.evt.RunClaimed")
def run_claimed(view: View, meta: EventMeta, ev: dict) -> None:
    old = view.get_json(record_key(ev["threadId"], ev["runId"]))
    if old is None:
        return
    new = {**old, "driverEpoch": ev["epoch"]}
    # Claims of rules 3 carried their time and set heartbeatAt; claims of rules 4
    # (and those judged before heartbeats existed) carry none and leave it alone
    # (processors/handlers/runs.py `claim` says why).
    if ev.get("at") is not None:
        new["heartbeatAt"] = ev["at"]
    if ev.get("clearsHeartbeat"):  # rules 6 (processors/handlers/runs.py `claim`)
        new.pop("heartbeatAt", None)
    _put(view, old, new)
    _raise_epoch(view, ev["threadId"], ev["runId"], ev["epoch"])


@folds("threadlog.evt.RunHeartbeat")
def run_heartbeat(view: View, meta: EventMeta, ev: dict) -> None:
    """The current driver is alive (attached: detachedSince cleared) or detaches
    (detachedSince := the heartbeat's time)."""
    old = view.get_json(record_key(ev["threadId"], ev["runId"]))
    if old is None:
        return
    new = {**old, "heartbeatAt": ev["at"]}
    if ev.get("detached"):
        new["detachedSince"] = ev["at"]
    else:
        new.pop("detachedSince", None)
    _put(view, old, new)

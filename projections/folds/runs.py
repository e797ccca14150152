"""Runs: records on their thread's partition, plus global indexes every host folds.

State (tags are prefix-free among themselves and against other domains):
- `runR` (thread, run) -> the run record (JSON, exactly what `get` returns);
- `runI` (run) -> thread: where a run lives, for commands and reads naming only a run id;
- `runE` (thread, run) -> the greatest driver epoch the run ever had, claimed or
  written by `update` -- kept apart from the record so that clearing or lowering
  `driverEpoch` never lets `claim` hand an epoch out twice;
- `runD` (detachedSince, run, thread) -> b"": the running, detached runs, ordered
  by `detachedSince`, so `list_reclaimable` reads a range instead of every run.
"""

from __future__ import annotations

import json

from threadlog.records import apply_patch

from .. import global_ids
from ..fold import EventMeta, folds
from ..keys import key
from ..reader import StateReader
from ..view import View
from . import presence

RUN_RECORD = b"runR"
RUN_INDEX = b"runI"
RUN_EPOCH = b"runE"
RUN_DETACHED = b"runD"


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


def thread_of(view: StateReader, run_id: str) -> str | None:
    raw = view.get(index_key(run_id))
    return None if raw is None else raw.decode("utf-8")


def max_epoch(view: StateReader, thread_id: str, run_id: str) -> int:
    raw = view.get(epoch_key(thread_id, run_id))
    return 0 if raw is None else int(raw)


def _raise_epoch(view: View, thread_id: str, run_id: str, epoch: int) -> None:
    if epoch > max_epoch(view, thread_id, run_id):
        view.put(epoch_key(thread_id, run_id), str(epoch).encode())


def _reclaimable(record: dict) -> bool:
    return record.get("status") == "running" and record.get("detachedSince") is not None


def _put(view: View, old: dict | None, new: dict) -> None:
    """Store `new` and keep the detached index in step with it (one place)."""
    thread_id, run_id = new["threadId"], new["runId"]
    if old is not None and _reclaimable(old):
        view.delete(detached_key(old["detachedSince"], run_id, thread_id))
    if _reclaimable(new):
        view.put(detached_key(new["detachedSince"], run_id, thread_id), b"")
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
    _put(view, old, {**old, "driverEpoch": ev["epoch"]})
    _raise_epoch(view, ev["threadId"], ev["runId"], ev["epoch"])

"""Interrupts: records on their thread's partition, plus global indexes every host folds.

- `intR` (thread, interrupt) -> the interrupt record (JSON, what `get` returns);
- `intI` (interrupt) -> thread: insert-if-absent and resolve/cancel by id;
- `intB` (run, thread, interrupt) -> b"": a run's interrupts (list_by_run).
"""

from __future__ import annotations

import json

from .. import global_ids
from ..fold import EventMeta, folds
from ..keys import key, split
from ..reader import StateReader
from ..view import View
from . import presence

INTERRUPT_RECORD = b"intR"
INTERRUPT_INDEX = b"intI"
INTERRUPT_BY_RUN = b"intB"


def record_key(thread_id: str, interrupt_id: str) -> bytes:
    return key(INTERRUPT_RECORD, thread_id, interrupt_id)


def thread_prefix(thread_id: str) -> bytes:
    return key(INTERRUPT_RECORD, thread_id)


def index_key(interrupt_id: str) -> bytes:
    return key(INTERRUPT_INDEX, interrupt_id)


def by_run_key(run_id: str, thread_id: str, interrupt_id: str) -> bytes:
    return key(INTERRUPT_BY_RUN, run_id, thread_id, interrupt_id)


def run_prefix(run_id: str) -> bytes:
    return key(INTERRUPT_BY_RUN, run_id)


def split_by_run(k: bytes) -> tuple[str, str, str]:
    run_id, thread_id, interrupt_id = split(INTERRUPT_BY_RUN, k, "sss")
    return run_id, thread_id, interrupt_id


def records_of_run(view: StateReader, run_id: str) -> list[bytes]:
    """The stored records the by-run index names for `run_id`. A query
    (projections/queries.py): one request per owner through a thin client,
    where the index and then each record were a round trip each. The index is
    a hint: the reader keeps the records whose runId is `run_id`."""
    found = []
    for k, _ in view.scan(run_prefix(run_id)):
        _, thread_id, interrupt_id = split_by_run(k)
        raw = view.get(record_key(thread_id, interrupt_id))
        if raw is not None:
            found.append(raw)
    return found


@folds("threadlog.evt.InterruptCreated")
def interrupt_created(view: View, meta: EventMeta, ev: dict) -> None:
    thread_id, interrupt_id = ev["threadId"], ev["interruptId"]
    if view.get(record_key(thread_id, interrupt_id)) is not None:
        return  # insert-if-absent: never overwritten (the decider never emits this)
    view.put_json(record_key(thread_id, interrupt_id), {
        "interruptId": interrupt_id, "runId": ev["runId"], "threadId": thread_id, "status": "pending",
        "requestedAt": ev["requestedAt"], "payload": json.loads(ev["payload"]),
    })
    view.put(index_key(interrupt_id), thread_id.encode("utf-8"))
    global_ids.mark(view, meta, global_ids.INTERRUPT, interrupt_id, thread_id, True)
    view.put(by_run_key(ev["runId"], thread_id, interrupt_id), b"")
    presence.add(view, thread_id, presence.INTERRUPT)


@folds("threadlog.evt.InterruptDecided")
def interrupt_decided(view: View, meta: EventMeta, ev: dict) -> None:
    k = record_key(ev["threadId"], ev["interruptId"])
    record = view.get_json(k)
    if record is None or record.get("status") != "pending":
        return  # the first decision is final
    record["status"] = ev["status"]
    record["resolvedAt"] = ev["resolvedAt"]
    if ev.get("response") is not None:
        record["response"] = json.loads(ev["response"])
    view.put_json(k, record)

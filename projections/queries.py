"""Named read-only queries of a partition's state, run where the state is.

Kafka Streams' interactive queries: a thin client asks the owner of a
partition to run one of these over its store and answer the result, where
reading the keys itself would cost a round trip per dependent step (a
LangGraph tuple: the head names the record, the record names the channel
values). An embedded client runs the same function over its own store, so
there is one definition of each query.

A query takes `store` (a read surface of the partitions' state: `get(key)`,
`get_json(key)`, `scan(prefix)`) and keyword arguments that are JSON values, and returns
JSON values and bytes in lists and dicts (`to_wire` / `from_wire` carry the
bytes over the query service's JSON lines; no answer holds a dict whose one
key is "$b" of its own). It never writes. Asked about several partitions
owned by several workers, each owner answers for its own: the caller merges.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

from .folds import agent_sessions, checkpoints, interrupts, langgraph, runs

QUERIES: dict[str, Callable[..., Any]] = {
    "agents.items": agent_sessions.read_items,
    "checkpoints.get": checkpoints.find_record,
    "interrupts.of_run": interrupts.records_of_run,
    "langgraph.history": langgraph.read_history,
    "langgraph.tuple": langgraph.read_tuple,
    "runs.quiet": runs.quiet_records,
}

_BYTES = "$b"  # {"$b": base64}: bytes in a query's answer


def to_wire(value: Any) -> Any:
    if isinstance(value, bytes):
        return {_BYTES: base64.b64encode(value).decode("ascii")}
    if isinstance(value, dict):
        return {k: to_wire(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_wire(v) for v in value]
    return value


def from_wire(value: Any) -> Any:
    if isinstance(value, dict):
        if len(value) == 1 and _BYTES in value:
            return base64.b64decode(value[_BYTES])
        return {k: from_wire(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_wire(v) for v in value]
    return value

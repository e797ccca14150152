"""Rebuild a store from offset 0 of `<ns>.events`, with progress.

A rebuild is a judge starting from nothing: it judges every proposal again
and, the rules being deterministic, reaches the verdicts every other judge
reached (tests/test_judging.py compares them).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from confluent_kafka.admin import AdminClient
from threadlog.projections.barrier import LatestOffsets, ReadBarrier
from threadlog.projections.fold import load_all
from threadlog.projections.partition_stores import PartitionStores, hold_slot, slot_holder
from threadlog.schemas import default_codec

from threadlog.kernel import kafka_config
from threadlog.kernel.errors import STORE_IN_USE, ThreadLogError
from threadlog.kernel.topics import Topics, require_topics

from .handlers import load_all as load_handlers
from .judge import Judge


def rebuild(
    bootstrap: str,
    namespace: str,
    store_path: str | Path,
    progress: Callable[[str], None] = print,
    timeout: float = 600.0,
    kafka: kafka_config.Props | None = None,
    request_timeout: float = 30.0,
) -> dict:
    """Drop the state at `store_path` (a directory of per-partition stores) and
    judge every proposal again. Returns stats.

    Never creates topics: an unknown namespace is NAMESPACE_NOT_FOUND, raised
    before the store is touched. A store a live process holds (its slot lock)
    is STORE_IN_USE, also before anything is touched: dropping it under a
    running judge would corrupt what that process serves.
    """
    slot = hold_slot(store_path)
    if slot is None:
        pid = slot_holder(store_path)
        by = f" (pid {pid})" if pid is not None else ""
        raise ThreadLogError(STORE_IN_USE, f"store {store_path} is in use by a live process{by}; "
                                           "stop it first, or rebuild another slot with --store")
    try:
        return _rebuild(bootstrap, namespace, store_path, progress, timeout, kafka, request_timeout)
    finally:
        slot.release()


def _rebuild(bootstrap: str, namespace: str, store_path: str | Path, progress: Callable[[str], None],
             timeout: float, kafka: kafka_config.Props | None, request_timeout: float) -> dict:
    load_all()
    load_handlers()
    topics = Topics(namespace)
    trap = kafka_config.ErrorTrap((kafka or {}).get("error_cb"))
    admin = AdminClient(kafka_config.base(bootstrap, f"{namespace}.rebuild.admin", kafka, trap))
    try:
        layout = require_topics(admin, topics, request_timeout)
    except ThreadLogError as exc:
        raise trap.explain(exc, admin, kafka) from None
    PartitionStores(store_path, topics.events).destroy()
    store = PartitionStores(store_path, topics.events)
    follower = Judge(bootstrap, topics.events, layout.events, store, default_codec(), f"{namespace}.rebuild",
                     kafka=kafka)
    ends: LatestOffsets | None = None
    started = time.monotonic()
    try:
        ends = LatestOffsets(bootstrap, f"{namespace}.rebuild", kafka)
        barrier = ReadBarrier(ends, follower)
        targets = barrier.end_offsets_sync()
        total = sum(targets.values())
        follower.start()
        deadline = started + timeout
        while True:
            done = sum(min(follower.applied(p), t) for p, t in targets.items())
            progress(f"rebuild {namespace}: {done}/{total} offsets folded")
            if done >= total:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"rebuild did not finish in {timeout}s")
            try:
                follower.wait_sync(targets, timeout=1.0)
            except Exception:
                pass
        return {"offsets": total, "seconds": time.monotonic() - started, "skipped": follower.stats["poison"]}
    finally:
        if ends is not None:
            ends.close()
        follower.stop()
        store.close()

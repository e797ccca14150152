"""Rebuild a store from offset 0 of `<ns>.events`, with progress.

A rebuild is a judge starting from nothing: it judges every proposal again
and, the rules being deterministic, reaches the verdicts every other judge
reached (tests/test_judging.py compares them).
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from confluent_kafka import Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient
from threadlog.projections import incarnation
from threadlog.projections.barrier import LatestOffsets, ReadBarrier
from threadlog.projections.fold import load_all
from threadlog.projections.partition_stores import PartitionStores, hold_slot, slot_held, slot_holder
from threadlog.projections.store import leftover
from threadlog.schemas import default_codec

from threadlog.kernel import kafka_config
from threadlog.kernel.errors import STORE_IN_USE, ThreadLogError, invalid_argument, unavailable
from threadlog.kernel.topics import Topics, require_topics
from threadlog.kernel.validation import judging_problem

from .handlers import load_all as load_handlers
from .judge import Judge


def rebuild(
    bootstrap: str,
    namespace: str,
    store_path: str | Path,
    progress: Callable[[str], None] = print,
    timeout: float = 600.0,  # seconds without progress before giving up
    kafka: kafka_config.Props | None = None,
    request_timeout: float = 30.0,
) -> dict:
    """Drop the state at `store_path` (a directory of per-partition stores) and
    judge every proposal again. Returns stats (`store`: the slot rebuilt, its
    real path).

    Never creates topics: an unknown namespace is NAMESPACE_NOT_FOUND, raised
    before the store is touched; so are a path that is not a store
    (INVALID_ARGUMENT) and a log whose first records were deleted (UNAVAILABLE).
    A store a live process holds (its slot lock) is STORE_IN_USE, also before
    anything is touched: dropping it under a running judge would corrupt what
    that process serves. A refused rebuild leaves not even a `<store>.lock`.
    """
    if not (timeout > 0 and math.isfinite(timeout)):
        raise invalid_argument(f"the stall timeout must be a positive number of seconds, got {timeout!r}")
    # Held by the name given (its locks: that name's and, for a symlink, the real
    # directory's -- `_lock_names`), rebuilt at the real directory: taken as
    # given, a symlink to a slot was never dropped, and "." planted `./.lock`
    # inside the store (a review).
    given = Path(os.path.abspath(store_path))
    store_path = given.resolve()
    problem = judging_problem()  # before anything is dropped (threadlog/kernel/validation.py)
    if problem is not None:
        raise invalid_argument(problem)
    # Every refusal before the slot is held: holding it creates `<store>.lock` (and
    # the store's folder), which a refused rebuild left behind. A live holder is
    # asked first without creating anything, so STORE_IN_USE needs no broker.
    if slot_held(given):
        _in_use(given)
    _require_store_layout(store_path)
    _require_namespace(store_path, namespace)
    load_all()
    load_handlers()
    topics = Topics(namespace)
    trap = kafka_config.ErrorTrap((kafka or {}).get("error_cb"))
    admin = AdminClient(kafka_config.base(bootstrap, f"{namespace}.rebuild.admin", kafka, trap))
    try:
        try:
            layout = require_topics(admin, topics, request_timeout)
        except ThreadLogError as exc:
            raise trap.explain(exc, admin, kafka) from None
        _require_whole_log(bootstrap, topics.events, layout.events, kafka, request_timeout)
        slot = hold_slot(given)
        if slot is None:  # taken since it was asked
            _in_use(given)
        try:
            # Again, held: what is deleted is what was checked.
            _require_store_layout(store_path)
            _require_namespace(store_path, namespace)
            return _rebuild(bootstrap, store_path, progress, timeout, kafka, request_timeout, topics, admin,
                            layout.events)
        finally:
            slot.release()
    finally:
        kafka_config.dispose(admin)


def _in_use(store_path: str | Path) -> NoReturn:
    pid = slot_holder(store_path)
    by = f" (pid {pid})" if pid is not None else ""
    raise ThreadLogError(STORE_IN_USE, f"store {store_path} is in use by a live process{by}; "
                                       "stop it first, or rebuild another slot with --store")


# What a store directory holds (projections/partition_stores.py, threadlog/runtime.py,
# projections/incarnation.py), a marker a crash left half written, and a slot of
# the older one-store layout (RocksDB's own files). What else a crash leaves
# there is `store.leftover`.
_STORE_ENTRY = re.compile(rf"events-\d+|deliveries|{re.escape(incarnation.MARKER)}(\.tmp)?"
                          r"|CURRENT|IDENTITY|LOCK|LOG(\.old\..*)?|MANIFEST-\d+|OPTIONS-\d+|\d+\.(sst|log|blob)")


def _require_store_layout(path: Path) -> None:
    """Refuse a `--store` that is not a store: the rebuild deletes it whole first.
    A typo or a parent folder (a namespace's, holding live slots and their locks)
    was deleted, whatever it held."""
    if not path.exists():
        return
    if not path.is_dir():
        raise invalid_argument(f"store {path} is not a directory")
    strangers = sorted(e.name for e in path.iterdir() if not (_STORE_ENTRY.fullmatch(e.name) or leftover(e.name)))
    if strangers:
        shown = ", ".join(strangers[:5]) + (", ..." if len(strangers) > 5 else "")
        raise invalid_argument(f"{path} is not a threadlog store (it holds {shown}); a rebuild deletes its store "
                               "first: give an empty directory or a store (a slot-N of the namespace)")


def _require_namespace(path: Path, namespace: str) -> None:
    """Refuse a `--store` folded from another namespace's topics (its marker says
    which): the rebuild deleted that namespace's state and folded this one's
    into its slot, where its own worker or client would find it emptied (a
    review). A slot of this namespace's older incarnation (deleted and created
    again) is rebuilt, as it should be."""
    others = incarnation.namespaces_of(path) - {namespace}
    if others:
        raise invalid_argument(f"store {path} holds the state of namespace {', '.join(map(repr, sorted(others)))}, "
                               f"not {namespace!r}: rebuild it with that --namespace, or give another --store")


def _require_whole_log(bootstrap: str, topic: str, partitions: int, kafka: kafka_config.Props | None,
                       timeout: float) -> None:
    """Every events partition still starts at offset 0: a rebuild of what is left
    would judge other verdicts, not the same ones -- refused before the store goes."""
    consumer = Consumer(kafka_config.consumer(bootstrap, f"{topic}.rebuild.bounds", kafka))
    try:
        for p in range(partitions):
            low, _ = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout)
            if low > 0:
                raise unavailable(f"{topic}[{p}] no longer starts at offset 0 (first kept: {low}): records "
                                  "were deleted, so a rebuild cannot reach the same verdicts; the store is kept",
                                  retryable=False)
    except KafkaException as exc:
        raise unavailable(f"could not read where {topic} starts: {exc}") from None
    finally:
        consumer.close()


def _rebuild(bootstrap: str, store_path: str | Path, progress: Callable[[str], None], timeout: float,
             kafka: kafka_config.Props | None, request_timeout: float, topics: Topics, admin: AdminClient,
             partitions: int) -> dict:
    """The rebuild itself: the slot held, every refusal past."""
    namespace = topics.namespace
    ids = incarnation.topic_ids(admin, [topics.events, topics.deliveries], request_timeout)
    PartitionStores(store_path, topics.events).destroy()
    if ids is not None:
        # The marker went with the directory: without it the next open would take
        # this state as it is, even after the namespace is deleted and created again.
        incarnation.settle(Path(store_path), ids)
    store = PartitionStores(store_path, topics.events)
    follower = Judge(bootstrap, topics.events, partitions, store, default_codec(), f"{namespace}.rebuild",
                     kafka=kafka)
    ends: LatestOffsets | None = None
    started = time.monotonic()
    try:
        ends = LatestOffsets(bootstrap, f"{namespace}.rebuild", kafka)
        barrier = ReadBarrier(ends, follower)
        targets = barrier.end_offsets_sync()
        total = sum(targets.values())
        follower.start()
        # `timeout` bounds a stall, not the rebuild: a large namespace takes as long
        # as it takes while it moves (a fixed deadline failed big rebuilds, after
        # the old store was gone).
        last, moved_at = -1, time.monotonic()
        while True:
            done = sum(min(follower.applied(p), t) for p, t in targets.items())
            progress(f"rebuild {namespace}: {done}/{total} offsets folded")
            if done >= total:
                break
            if done > last:
                last, moved_at = done, time.monotonic()
            elif time.monotonic() - moved_at > timeout:
                raise unavailable(f"rebuild made no progress for {timeout:.0f}s at {done}/{total} offsets (a "
                                  "partition whose proposals need newer judging rules waits for an upgraded "
                                  "judge; see the log); run it again to start over")
            try:
                follower.wait_sync(targets, timeout=1.0)
            except Exception:
                pass
        return {"offsets": total, "seconds": time.monotonic() - started, "skipped": follower.stats["poison"],
                "store": str(store_path)}
    finally:
        if ends is not None:
            ends.close()
        follower.stop()
        store.close()

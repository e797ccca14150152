"""Partitions taken over are restored off the judge's thread.

Why: a restore reads a snapshot as large as the partition's state. Run inside
the assignment callback, it ran inside the consumer's poll, and a restore
longer than librdkafka's `max.poll.interval.ms` (300 s by default) made the
worker leave its group mid-restore; meanwhile no partition at all was judged,
not even those it already owned. So the judge assigns at once only what it can
judge at once (a local store with a position); each other partition is filled
here, into a store no read sees (`PartitionStores.fresh`), and handed to the
judge when its restore ends (`finished`, on the judge's thread), which then
assigns it from the restored position. Until then the partition is not owned
here: its callers get NOT_OWNER and retry, as during any rebalance.

A partition revoked mid-restore is left to finish: its store is closed, not
served, and kept on disk, so a return resumes from it (`PartitionStores.open`
destroys one a death left without a position). Given back meanwhile, the same
restore goes on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from threadlog.projections.partition_stores import PartitionStores
from threadlog.projections.snapshots import RestoreInfo
from threadlog.projections.store import Store

from threadlog.kernel.errors import ThreadLogError

log = logging.getLogger("threadlog.judge")

# (partition, the empty store to fill, cancelled when the owner stops) -> what was
# restored, or None when the partition has no snapshot (it is folded from offset 0).
Restorer = Callable[[int, Store, threading.Event], RestoreInfo | None]

PARALLEL = 4  # snapshots read side by side: the wait for one's records overlaps another's decoding


@dataclass
class _Job:
    future: Future[tuple[Store | None, RestoreInfo | None]]
    wanted: bool = True  # still assigned here (a revoke unsets it, an assignment sets it again)


class Restores:
    """The restores under way, by partition. Every method but the restore itself
    runs on the judge's thread (or after it ended, `close`)."""

    def __init__(self, stores: PartitionStores, restore: Restorer) -> None:
        self.stores = stores
        self.restore = restore
        self._jobs: dict[int, _Job] = {}
        self._cancel = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=PARALLEL, thread_name_prefix="restore")

    @property
    def partitions(self) -> list[int]:
        """Partitions being restored and still assigned here."""
        return sorted(p for p, job in self._jobs.items() if job.wanted)

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def __contains__(self, partition: int) -> bool:
        return partition in self._jobs

    def start(self, partition: int) -> None:
        """Restore `partition` (assigned here) unless a restore of it still runs."""
        job = self._jobs.get(partition)
        if job is not None:
            job.wanted = True  # given back before its restore ended: that one goes on
            return
        self._jobs[partition] = _Job(self._pool.submit(self._fill, partition))

    def drop(self, partition: int) -> bool:
        """`partition` was revoked: True if it was being restored (so it is not
        in the consumer's assignment, and not served). The restore finishes."""
        job = self._jobs.get(partition)
        if job is None:
            return False
        job.wanted = False
        return True

    def finished(self) -> list[tuple[int, RestoreInfo | None]]:
        """Partitions whose restore ended and that are still assigned here, each
        now served by `stores` (restored, or empty to be folded from offset 0)."""
        out = []
        for p in [p for p, job in self._jobs.items() if job.future.done()]:
            job = self._jobs.pop(p)
            store, info = job.future.result()
            if not job.wanted:
                if store is not None:
                    store.close()
                continue
            if store is None:
                self.stores.replace(p)
            else:
                self.stores.adopt(p, store)
            out.append((p, info))
        return out

    def _fill(self, p: int) -> tuple[Store | None, RestoreInfo | None]:
        """On a restore thread: `p`'s snapshot into a fresh store; (None, None) when it failed."""
        store = None
        try:
            store = self.stores.fresh(p)
            return store, self.restore(p, store, self._cancel)
        except Exception as exc:
            # Folding from offset 0 is slower, never wrong (and never onto a partial restore).
            # Any failure, not only ours: a snapshot that does not decode, an I/O error.
            if not self._cancel.is_set():
                log.warning("no snapshot restore of partition %d (%s): folding it from offset 0", p, exc,
                            exc_info=not isinstance(exc, ThreadLogError))
            if store is not None:
                store.close()  # keys without a position: destroyed by the next open, never folded onto
            return None, None

    def cancel(self) -> None:
        """The owner stops: what runs ends at its next read (any thread may call this)."""
        self._cancel.set()

    def close(self) -> None:
        """Once the judge's thread is gone: cancel what runs, wait for it, close what it filled."""
        self._cancel.set()
        self._pool.shutdown(wait=True)
        for job in self._jobs.values():
            store, _info = job.future.result()
            if store is not None:
                store.close()
        self._jobs.clear()

"""`threadlog.connect(...)`: a blocking client for Django, Flask and scripts.

It is a thin shell over the async API: each client owns ONE event loop on ONE
daemon thread, opens `threadlog.open(...)` there, and every blocking method
hands its coroutine to that loop and waits for the answer. The async client
therefore only ever runs on its own loop (as it would in an async app), while
any number of OS threads call the blocking methods at once.

Bounds. Every call of the async API bounds itself (each step within the
client's request timeout, `request_timeout_ms`, 30 s by default) and its own
error comes through: `UNAVAILABLE` when nothing was written, `OUTCOME_UNKNOWN`
when a write's fate is unknown. A blocking call waits for it up to four times the
request timeout plus 5 s (a fork is two proposals, a drive more); past that the call is
cancelled on the loop and raises `OUTCOME_UNKNOWN`, or `UNAVAILABLE` for a read
(it wrote nothing). `history` and `state_at` are not cut so: they judge the
thread's partition again, which takes as long as its history, and every wait
inside is bounded. A delivery reader applies
the request timeout itself to
each step: a `next()` that gets no chunk within the timeout raises UNAVAILABLE,
and the caller resumes with `read(<last offset it holds>)`; the first step of a
`"-1"` read may also take `first_chunk_wait_ms` (then RUN_NOT_FOUND). A streamed
blob `put` applies it to the hand-off of each chunk; its commit, after the body's
end, is waited for as any call. `close()` cancels calls in flight: UNAVAILABLE,
or OUTCOME_UNKNOWN for one with a write sent and not yet judged.
Opening waits at most the request timeout plus `_OPEN_GRACE_S` (topic creation
is bounded by the request timeout; the group's first assignment by open itself).

Processes. A client belongs to the process that connected it. In a child of
`os.fork` (gunicorn `--preload`, Celery prefork) its loop thread does not
exist: calls raise `UNAVAILABLE` at once and `close()` only forgets it;
connect in the child (e.g. in gunicorn's `post_fork`).
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import contextlib
import os
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable, Iterator, Mapping
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from .background_open import BackgroundOpen, require_same_process
from .blob_gc import DEFAULT_GRACE_MS, GcReport
from .kernel.errors import OUTCOME_UNKNOWN, ThreadLogError, unavailable
from .producers.proposals import track_unsettled
from .types import (
    Artifact,
    ArtifactInput,
    Blob,
    BlobInfo,
    BlobListPage,
    BlobRange,
    BlobReference,
    Checkpoint,
    CheckpointInput,
    DeliveryChunk,
    DeliveryEntry,
    DeliveryOffset,
    DeliveryPosition,
    GenerationRun,
    GenerationRunPatch,
    Interrupt,
    InterruptInput,
    Run,
    RunPatch,
    RunStatus,
    Timestamp,
    WriterLike,
)

if TYPE_CHECKING:
    # Only what the public API hands out (`threadlog.open`'s client, its leases
    # and delivery logs); nothing below reaches into how they work.
    from .client import ThreadLog
    from .delivery import DeliveryLog
    from .stores.checkpoints import WriterLease
    from .stores.run_driver import RunDriver

__all__ = [
    "SyncArtifactStore",
    "SyncBlobStore",
    "SyncCheckpointStore",
    "SyncDeliveryLog",
    "SyncDeliveryReader",
    "SyncGenerationRunStore",
    "SyncInterruptStore",
    "SyncMessageStore",
    "SyncMetadataStore",
    "SyncRunDriver",
    "SyncRunStore",
    "SyncThreadLog",
    "SyncWriterLease",
    "connect",
]

T = TypeVar("T")

# Opening = topic creation (bounded by the request timeout inside open) +
# consumers starting and, for external clients, finding a worker: the request
# timeout alone would refuse slow but healthy opens.
_OPEN_GRACE_S = 30.0
# A blob chunk handed to the loop waits in a queue this deep: enough to keep
# the producer busy while the caller's iterator makes the next chunk, small
# enough that a large body is never held in memory.
_FEED_DEPTH = 4


class _End:
    """The end of a streamed blob body."""


_END = _End()


class SyncThreadLog:
    """A blocking client: the stores of `threadlog.open`, with blocking methods.

    Use as `with threadlog.connect(...) as tl:` or call `close()`. Safe to share
    between OS threads; never call it from inside its own loop (a callback that
    the async client runs), which would wait for itself.
    """

    def __init__(self, timeout_s: float, first_chunk_wait_s: float = 0.0) -> None:
        # Built by `connect`; the stores exist from the start so that a call
        # after close() raises UNAVAILABLE instead of AttributeError.
        self.request_timeout: float = timeout_s
        self.first_chunk_wait: float = first_chunk_wait_s  # a "-1" read's first step may wait this too
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name="threadlog-sync-loop", daemon=True)
        self._lock = threading.Lock()
        # Calls in flight (tasks on the loop) and readers not yet finished: what
        # close() must cancel and finish before the async client goes away.
        self._tasks: set[asyncio.Task[Any]] = set()
        self._readers: weakref.WeakSet[SyncDeliveryReader] = weakref.WeakSet()
        self._closed = False
        # The process this client's loop thread runs in. Why: after os.fork (gunicorn
        # --preload, Celery prefork) the child has no loop thread, and its calls
        # waited out the whole backstop (125 s by default) to say OUTCOME_UNKNOWN.
        self._pid = os.getpid()
        self._tl: ThreadLog | None = None
        self.messages = SyncMessageStore(self)
        self.checkpoints = SyncCheckpointStore(self)
        self.runs = SyncRunStore(self)
        self.interrupts = SyncInterruptStore(self)
        self.generation_runs = SyncGenerationRunStore(self)
        self.metadata = SyncMetadataStore(self)
        self.artifacts = SyncArtifactStore(self)
        self.blobs = SyncBlobStore(self)

    # -- the loop thread ------------------------------------------------------------------
    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    def _start(self, opener: Awaitable[ThreadLog]) -> None:
        self._thread.start()
        opening = BackgroundOpen(self._loop)
        try:
            tl = opening.wait(self._submit(opening.run(opener)), self.request_timeout + _OPEN_GRACE_S)
        except BaseException:
            self._closed = True
            if not opening.abandoned:  # the open failed: nothing else stops the loop
                self._stop_loop()
            raise
        if tl is None:
            # The loop thread lives on until open returns, then closes what it
            # opened and stops (threadlog/background_open.py).
            with self._lock:
                self._closed = True
            raise unavailable(f"could not open within {self.request_timeout + _OPEN_GRACE_S:.0f} s")
        self._tl = tl

    def _stop_loop(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(self.request_timeout)

    # -- running calls ----------------------------------------------------------------------
    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a threadlog sync client was called from its own event loop; "
                               "it would wait for itself (use the async client there)")
        require_same_process(self._pid, coro)
        with self._lock:
            if self._closed:
                coro.close()
                raise unavailable("this client is closed")
            # Under the lock: once close() has set _closed, nothing new reaches the loop.
            return asyncio.run_coroutine_threadsafe(self._tracked(coro), self._loop)

    async def _tracked(self, coro: Coroutine[Any, Any, T]) -> T:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        unsettled = track_unsettled()
        try:
            return await coro
        except asyncio.CancelledError:
            if self._closed and unsettled.n:
                # Cancelled by close() with a proposal sent and not judged: it may
                # still apply, as the async client's close answers (not UNAVAILABLE).
                raise ThreadLogError(OUTCOME_UNKNOWN, "the client was closed while a write of this call was "
                                                      "in flight: it may still apply") from None
            raise
        finally:
            self._tasks.discard(task)

    def _wait(self, fut: concurrent.futures.Future[T], what: str = "the call", *, backstop: bool = False,
              extra: float = 0.0, read: bool = False, total: bool = True) -> T:
        """The result of `fut`, waiting at most the request timeout (UNAVAILABLE).

        `backstop`: a call that bounds itself (every API call does: each step
        within the request timeout). Waiting only one timeout raced the call's
        own deadline and answered UNAVAILABLE -- "nothing was written" -- for a
        write that may still apply, or for a fork (two proposals) still under
        way. So the wait is longer, and the call's own error comes through
        (OUTCOME_UNKNOWN when a write's fate is unknown); if even that long
        passes, the outcome is unknown too. `extra`: seconds the call may wait on
        purpose before its own deadlines start (a "-1" read's first chunk).
        `read`: the call writes nothing, so giving up on it is UNAVAILABLE.
        `total` False: no limit on the whole call, whose every wait is bounded
        and whose work grows with the data (re-judging a partition, a read):
        it ends UNAVAILABLE only if the loop is gone."""
        limit = (self.request_timeout * 4 + 5.0 if backstop else self.request_timeout) + extra
        try:
            done, _ = concurrent.futures.wait([fut], limit) if total else self._unbounded(fut)
        except BaseException:
            fut.cancel()  # e.g. KeyboardInterrupt in the waiting thread: do not leave the call running
            raise
        if not done:
            fut.cancel()
            if not total:  # the loop is gone
                raise unavailable(f"{what} did not finish: the client was closed")
            if backstop and read:
                raise unavailable(f"{what} did not finish within {limit:g} s (a read: nothing was written)")
            if backstop:
                raise ThreadLogError(OUTCOME_UNKNOWN, f"{what} did not finish within {limit:g} s: "
                                                      "a write may still apply")
            raise unavailable(f"{what} did not finish within the request timeout ({self.request_timeout:g} s)")
        try:
            return fut.result()
        except concurrent.futures.CancelledError:
            why = "the client was closed" if self._closed else "cancelled on the loop"
            raise unavailable(f"{what} did not finish: {why}") from None

    def _unbounded(self, fut: concurrent.futures.Future[T]) -> tuple[set[Any], set[Any]]:
        """Wait for `fut` however long its call takes, while the loop runs: a close()
        that gave up on the call stops the loop with the call still pending, and
        its future is then never done (a review: a blocking history waiting
        forever after close)."""
        while True:
            done, pending = concurrent.futures.wait([fut], self.request_timeout)
            if done or not self._thread.is_alive():
                return done, pending

    def _run(self, coro: Coroutine[Any, Any, T], *, read: bool = False) -> T:
        return self._wait(self._submit(coro), backstop=True, read=read)

    def _async(self) -> ThreadLog:
        # Only read on the loop thread, after open succeeded.
        assert self._tl is not None
        return self._tl

    # -- lifecycle --------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Cancel calls in flight (they raise UNAVAILABLE, or OUTCOME_UNKNOWN when a
        write they sent is not judged yet), close the async client, stop the loop
        thread. Closing twice is harmless."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("a threadlog sync client cannot be closed from its own event loop")
        if os.getpid() != self._pid:
            # A forked child: the loop and connections are the parent's, not ours to
            # close. Not under the lock, which a parent's thread may have held at the fork.
            self._closed = True
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
        done = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
        try:
            finished, _ = concurrent.futures.wait([done], self.request_timeout)
            if finished:
                done.result()
        finally:
            self._stop_loop()
        if not finished:
            raise unavailable(f"close did not finish within the request timeout ({self.request_timeout:g} s)")

    async def _shutdown(self) -> None:
        # Every call submitted before _closed was set has registered its task by
        # now (its first step was queued before this coroutine's). Cancelled, its
        # waiting thread gets UNAVAILABLE ("the client was closed").
        tasks = builtins.list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=self.request_timeout)
        # Readers left mid-iteration hold subscriptions of the async client:
        # finish them while it is still open.
        with self._lock:  # readers are registered from callers' threads
            readers = builtins.list(self._readers)
        for reader in readers:
            await reader._finish()
        if self._tl is not None:
            await self._tl.close()
        await self._loop.shutdown_asyncgens()

    def __enter__(self) -> SyncThreadLog:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- delivery logs (SPEC 11) -------------------------------------------------------------------
    def delivery(self, run_id: str, epoch: int | None = None) -> SyncDeliveryLog:
        """The delivery log of `run_id`, written as driver `epoch` (None counts as 0)."""

        async def make() -> DeliveryLog:
            return self._async().delivery(run_id, epoch)

        return SyncDeliveryLog(self, self._run(make(), read=True))

    # -- time travel --------------------------------------------------------------------------------
    def history(self, thread_id: str) -> builtins.list[dict[str, Any]]:
        """`ThreadLog.history`: the thread's proposals with their verdicts. It takes as long as
        judging the thread's partition again takes: each wait inside is bounded by the request
        timeout, the whole call is not (it grows with the partition's history)."""

        async def call() -> builtins.list[dict[str, Any]]:
            return await self._async().history(thread_id)

        return self._wait(self._submit(call()), "history", total=False)

    def state_at(self, thread_id: str, at: int | datetime | None = None) -> dict[str, Any]:
        """`ThreadLog.state_at`: the thread's state after offset `at`, or at time `at` (as long
        as `history` takes)."""

        async def call() -> dict[str, Any]:
            return await self._async().state_at(thread_id, at)

        return self._wait(self._submit(call()), "state_at", total=False)


class _SyncStore:
    def __init__(self, client: SyncThreadLog) -> None:
        self._c = client

    def _run(self, coro: Coroutine[Any, Any, T], *, read: bool = False) -> T:
        return self._c._run(coro, read=read)

    def _tl(self) -> ThreadLog:
        return self._c._async()


# -- stores -----------------------------------------------------------------------------------------
# Each method builds its coroutine on the loop thread (`async def` bodies run
# there), so nothing of the async client is touched from a caller's thread.


class SyncMessageStore(_SyncStore):
    def load_thread(self, thread_id: str) -> builtins.list[Any]:
        async def call() -> builtins.list[Any]:
            return await self._tl().messages.load_thread(thread_id)

        return self._run(call(), read=True)

    def save_thread(self, thread_id: str, messages: builtins.list[Any]) -> None:
        async def call() -> None:
            await self._tl().messages.save_thread(thread_id, messages)

        self._run(call())


class SyncWriterLease:
    """A granted writer lease with blocking `renew()` and `release()`.

    Accepted as `writer=` by the checkpoint store (it has `thread_id`,
    `owner_token` and `fence`); `expires_at` follows `renew()`.
    """

    def __init__(self, store: SyncCheckpointStore, lease: WriterLease) -> None:
        self._store = store
        self._lease = lease
        self.thread_id: str = lease.thread_id
        self.owner_token: str = lease.owner_token
        self.fence: int = lease.fence
        self.renew_after_ms: int = lease.renew_after_ms

    @property
    def expires_at(self) -> float:
        return self._lease.expires_at

    @property
    def lost(self) -> bool:
        """True once the lease is known lost (a refused renewal, or expired before one got through)."""
        return self._lease.lost

    @property
    def lost_reason(self) -> str | None:
        return self._lease.lost_reason

    @property
    def auto_renew(self) -> bool:
        """True while the lease renews itself (on the client's loop thread)."""
        return self._lease.auto_renew

    def renew(self) -> float:
        """Extend the lease; `WRITER_LOST` unless it is still current. Returns the new `expires_at`."""

        async def call() -> float:
            return await self._lease.renew()

        return self._store._run(call())

    def release(self) -> None:
        """End the lease if it is still current; silent for a stale lease."""

        async def call() -> None:
            await self._lease.release()

        self._store._run(call())

    def __repr__(self) -> str:
        return (f"SyncWriterLease(thread_id={self.thread_id!r}, fence={self.fence}, "
                f"expires_at={self.expires_at!r}, renew_after_ms={self.renew_after_ms}, lost={self.lost})")


class SyncCheckpointStore(_SyncStore):
    def acquire_writer(self, thread_id: str, *, auto_renew: bool = True, steal: bool = False) -> SyncWriterLease:
        """See `CheckpointStore.acquire_writer`: the background renewal runs on
        this client's loop thread, so it goes on between blocking calls."""

        async def call() -> WriterLease:
            return await self._tl().checkpoints.acquire_writer(thread_id, auto_renew=auto_renew, steal=steal)

        return SyncWriterLease(self, self._run(call()))

    def append(self, *, checkpoint: CheckpointInput | Checkpoint, expected_head_id: str | None,
               writer: WriterLike) -> str:
        async def call() -> str:
            return await self._tl().checkpoints.append(checkpoint=checkpoint, expected_head_id=expected_head_id,
                                                       writer=writer)

        return self._run(call())

    def delete_head(self, *, thread_id: str, checkpoint_id: str, writer: WriterLike) -> None:
        async def call() -> None:
            await self._tl().checkpoints.delete_head(thread_id=thread_id, checkpoint_id=checkpoint_id,
                                                     writer=writer)

        self._run(call())

    def fork_from_checkpoint(self, *, source_thread_id: str, source_checkpoint_id: str, destination_thread_id: str,
                             destination_checkpoint_id: str, created_at: Timestamp,
                             writer: WriterLike) -> Checkpoint:
        async def call() -> Checkpoint:
            return await self._tl().checkpoints.fork_from_checkpoint(
                source_thread_id=source_thread_id, source_checkpoint_id=source_checkpoint_id,
                destination_thread_id=destination_thread_id, destination_checkpoint_id=destination_checkpoint_id,
                created_at=created_at, writer=writer)

        return self._run(call())

    def get(self, checkpoint_id: str) -> Checkpoint | None:
        async def call() -> Checkpoint | None:
            return await self._tl().checkpoints.get(checkpoint_id)

        return self._run(call(), read=True)

    def list(self, thread_id: str) -> builtins.list[Checkpoint]:
        async def call() -> builtins.list[Checkpoint]:
            return await self._tl().checkpoints.list(thread_id)

        return self._run(call(), read=True)

    def get_head(self, thread_id: str) -> str | None:
        async def call() -> str | None:
            return await self._tl().checkpoints.get_head(thread_id)

        return self._run(call(), read=True)

    def list_blob_references(self) -> builtins.list[BlobReference]:
        async def call() -> builtins.list[BlobReference]:
            return await self._tl().checkpoints.list_blob_references()

        return self._run(call(), read=True)


class SyncRunStore(_SyncStore):
    def create_or_resume(self, *, run_id: str, thread_id: str, started_at: Timestamp,
                         status: RunStatus | None = None) -> Run:
        async def call() -> Run:
            return await self._tl().runs.create_or_resume(run_id=run_id, thread_id=thread_id,
                                                          started_at=started_at, status=status)

        return self._run(call())

    def update(self, run_id: str, patch: RunPatch) -> None:
        async def call() -> None:
            await self._tl().runs.update(run_id, patch)

        self._run(call())

    def get(self, run_id: str) -> Run | None:
        async def call() -> Run | None:
            return await self._tl().runs.get(run_id)

        return self._run(call(), read=True)

    def list_by_thread(self, thread_id: str) -> builtins.list[Run]:
        async def call() -> builtins.list[Run]:
            return await self._tl().runs.list_by_thread(thread_id)

        return self._run(call(), read=True)

    def find_active_run(self, thread_id: str) -> Run | None:
        async def call() -> Run | None:
            return await self._tl().runs.find_active_run(thread_id)

        return self._run(call(), read=True)

    def list_reclaimable(self, *, now: Timestamp, ttl_ms: float) -> builtins.list[Run]:
        async def call() -> builtins.list[Run]:
            return await self._tl().runs.list_reclaimable(now=now, ttl_ms=ttl_ms)

        return self._run(call(), read=True)

    def claim(self, run_id: str) -> int:
        async def call() -> int:
            return await self._tl().runs.claim(run_id)

        return self._run(call())

    def drive(self, run_id: str, *, heartbeat_ms: float = 5_000) -> SyncRunDriver:
        """See `RunStore.drive`: the heartbeat runs on this client's loop thread,
        so it goes on between blocking calls (and stops at `close()`)."""

        async def call() -> RunDriver:
            return await self._tl().runs.drive(run_id, heartbeat_ms=heartbeat_ms)

        driver = self._run(call())
        return SyncRunDriver(self, driver, SyncDeliveryLog(self._c, driver.log))


class SyncRunDriver:
    """A run driver with blocking `heartbeat()`, `detach()` and `close()`; `log` is a `SyncDeliveryLog`."""

    def __init__(self, store: SyncRunStore, driver: RunDriver, log: SyncDeliveryLog) -> None:
        self._store = store
        self._driver = driver
        self.run_id: str = driver.run_id
        self.thread_id: str = driver.thread_id
        self.epoch: int = driver.epoch
        self.heartbeat_ms: float = driver.heartbeat_ms
        self.log = log

    @property
    def heartbeat_at(self) -> float | None:
        return self._driver.heartbeat_at

    @property
    def lost(self) -> bool:
        """True once a heartbeat was refused `RUN_CLAIM_LOST` (a later claim superseded this driver)."""
        return self._driver.lost

    @property
    def lost_reason(self) -> str | None:
        return self._driver.lost_reason

    @property
    def heartbeating(self) -> bool:
        return self._driver.heartbeating

    def heartbeat(self) -> float:
        async def call() -> float:
            return await self._driver.heartbeat()

        return self._store._run(call())

    def detach(self) -> float | None:
        async def call() -> float | None:
            return await self._driver.detach()

        return self._store._run(call())

    def close(self) -> None:
        """Stop heartbeating. Harmless after the client was closed (its close
        stopped the heartbeats), as the async driver's close is."""
        if self._store._c.closed:
            return

        async def call() -> None:
            await self._driver.close()

        self._store._run(call())

    def __enter__(self) -> SyncRunDriver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Sync{self._driver!r}"


class SyncInterruptStore(_SyncStore):
    def create(self, record: InterruptInput) -> None:
        async def call() -> None:
            await self._tl().interrupts.create(record)

        self._run(call())

    def resolve(self, interrupt_id: str, response: Any = None) -> Interrupt | None:
        async def call() -> Interrupt | None:
            return await self._tl().interrupts.resolve(interrupt_id, response)

        return self._run(call())

    def cancel(self, interrupt_id: str) -> Interrupt | None:
        async def call() -> Interrupt | None:
            return await self._tl().interrupts.cancel(interrupt_id)

        return self._run(call())

    def get(self, interrupt_id: str) -> Interrupt | None:
        async def call() -> Interrupt | None:
            return await self._tl().interrupts.get(interrupt_id)

        return self._run(call(), read=True)

    def list(self, thread_id: str) -> builtins.list[Interrupt]:
        async def call() -> builtins.list[Interrupt]:
            return await self._tl().interrupts.list(thread_id)

        return self._run(call(), read=True)

    def list_pending(self, thread_id: str) -> builtins.list[Interrupt]:
        async def call() -> builtins.list[Interrupt]:
            return await self._tl().interrupts.list_pending(thread_id)

        return self._run(call(), read=True)

    def list_by_run(self, run_id: str) -> builtins.list[Interrupt]:
        async def call() -> builtins.list[Interrupt]:
            return await self._tl().interrupts.list_by_run(run_id)

        return self._run(call(), read=True)

    def list_pending_by_run(self, run_id: str) -> builtins.list[Interrupt]:
        async def call() -> builtins.list[Interrupt]:
            return await self._tl().interrupts.list_pending_by_run(run_id)

        return self._run(call(), read=True)


class SyncGenerationRunStore(_SyncStore):
    def create_or_resume(self, *, run_id: str, thread_id: str, activity: str, provider: str, model: str,
                         started_at: Timestamp, status: RunStatus | None = None) -> GenerationRun:
        async def call() -> GenerationRun:
            return await self._tl().generation_runs.create_or_resume(
                run_id=run_id, thread_id=thread_id, activity=activity, provider=provider, model=model,
                started_at=started_at, status=status)

        return self._run(call())

    def update(self, run_id: str, patch: GenerationRunPatch) -> None:
        async def call() -> None:
            await self._tl().generation_runs.update(run_id, patch)

        self._run(call())

    def get(self, run_id: str) -> GenerationRun | None:
        async def call() -> GenerationRun | None:
            return await self._tl().generation_runs.get(run_id)

        return self._run(call(), read=True)

    def find_latest_for_thread(self, thread_id: str) -> GenerationRun | None:
        async def call() -> GenerationRun | None:
            return await self._tl().generation_runs.find_latest_for_thread(thread_id)

        return self._run(call(), read=True)


class SyncMetadataStore(_SyncStore):
    def get(self, namespace: str, key: str) -> Any:
        async def call() -> Any:
            return await self._tl().metadata.get(namespace, key)

        return self._run(call(), read=True)

    def set(self, namespace: str, key: str, value: Any) -> None:
        async def call() -> None:
            await self._tl().metadata.set(namespace, key, value)

        self._run(call())

    def delete(self, namespace: str, key: str) -> None:
        async def call() -> None:
            await self._tl().metadata.delete(namespace, key)

        self._run(call())


class SyncArtifactStore(_SyncStore):
    def save(self, record: ArtifactInput | Artifact) -> None:
        async def call() -> None:
            await self._tl().artifacts.save(record)

        self._run(call())

    def get(self, artifact_id: str) -> Artifact | None:
        async def call() -> Artifact | None:
            return await self._tl().artifacts.get(artifact_id)

        return self._run(call(), read=True)

    def list(self, run_id: str) -> builtins.list[Artifact]:
        async def call() -> builtins.list[Artifact]:
            return await self._tl().artifacts.list(run_id)

        return self._run(call(), read=True)

    def list_for_thread(self, thread_id: str) -> builtins.list[Artifact]:
        async def call() -> builtins.list[Artifact]:
            return await self._tl().artifacts.list_for_thread(thread_id)

        return self._run(call(), read=True)

    def delete(self, artifact_id: str) -> None:
        async def call() -> None:
            await self._tl().artifacts.delete(artifact_id)

        self._run(call())

    def delete_for_run(self, run_id: str) -> None:
        async def call() -> None:
            await self._tl().artifacts.delete_for_run(run_id)

        self._run(call())


SyncBlobBody = bytes | bytearray | memoryview | str | Iterable[bytes]


class _Feed:
    """Chunks of a streamed blob body, carried from the caller's thread to the put
    running on the loop. The caller's iterable is consumed in the caller's thread
    (it may read a file or a cursor bound to that thread) and never blocks the loop."""

    def __init__(self) -> None:
        # Only touched on the loop thread (asyncio.Queue binds to it on first use).
        self._queue: asyncio.Queue[Any] = asyncio.Queue(_FEED_DEPTH)
        # Done once the put asks for its first chunk: it checked its arguments.
        self.reading: concurrent.futures.Future[None] = concurrent.futures.Future()

    async def push(self, item: Any) -> None:
        await self._queue.put(item)

    async def chunks(self) -> AsyncIterator[Any]:
        if not self.reading.done():
            self.reading.set_result(None)
        while True:
            item = await self._queue.get()
            if item is _END:
                return
            yield item


class SyncBlobStore(_SyncStore):
    def put(self, key: str, body: SyncBlobBody, *, content_type: str | None = None,
            custom_metadata: Mapping[str, str] | None = None, expected_length: int | None = None) -> BlobInfo:
        """Store `body` (bytes-like, str, or a sync iterable of byte chunks, read in
        the calling thread); each chunk hand-off waits at most the request
        timeout, the commit as any call (see the module doc)."""
        if isinstance(body, (bytes, bytearray, memoryview, str, Mapping)) or not isinstance(body, Iterable):
            # Whole bodies, and anything the store refuses (a dict, an int, ...), go as they are.
            async def whole() -> BlobInfo:
                return await self._tl().blobs.put(key, body, content_type=content_type,
                                                  custom_metadata=custom_metadata, expected_length=expected_length)

            return self._run(whole())
        return self._put_streamed(key, body, content_type, custom_metadata, expected_length)

    def _put_streamed(self, key: str, body: Iterable[Any], content_type: str | None,
                      custom_metadata: Mapping[str, str] | None, expected_length: int | None) -> BlobInfo:
        feed = _Feed()

        async def put() -> BlobInfo:
            return await self._tl().blobs.put(key, feed.chunks(), content_type=content_type,
                                              custom_metadata=custom_metadata, expected_length=expected_length)

        put_fut = self._c._submit(put())
        try:
            # The caller's iterator is not touched before the put asks for a chunk: a
            # put refused up front (a bad key or length) read 3 chunks of it first.
            both: builtins.list[concurrent.futures.Future[Any]] = [feed.reading, put_fut]
            done, _ = concurrent.futures.wait(both, self._c.request_timeout,
                                              return_when=concurrent.futures.FIRST_COMPLETED)
            if not done:
                raise unavailable(f"the blob put did not start within the request timeout "
                                  f"({self._c.request_timeout:g} s)")
            for chunk in body if not put_fut.done() else ():
                # A copy of a mutable chunk. Why: up to _FEED_DEPTH chunks wait in the
                # queue after the caller's iterator moved on, and an iterator that
                # reuses its buffer (readinto) had overwritten them: a review stored a
                # 24 MiB blob of the right size and the wrong bytes, with no error.
                if isinstance(chunk, (bytearray, memoryview)):
                    chunk = bytes(chunk)
                if not self._hand_over(feed, chunk, put_fut):
                    break  # the put ended early (refused): its result says why
            else:
                self._hand_over(feed, _END, put_fut)
            # From here the put bounds itself (flush, commit, each within the request
            # timeout) and may commit: one timeout would race its deadlines and say
            # UNAVAILABLE -- "nothing written" -- for a blob that is stored.
            return self._c._wait(put_fut, "the blob put", backstop=True)
        except BaseException:
            # The caller's iterator failed, a hand-off timed out or the caller was
            # interrupted: the put must not commit a truncated body.
            put_fut.cancel()
            raise

    def _hand_over(self, feed: _Feed, item: Any, put_fut: concurrent.futures.Future[BlobInfo]) -> bool:
        """Queue one chunk for the put; False if the put ended instead of taking it."""
        push_fut = self._c._submit(feed.push(item))
        both: builtins.list[concurrent.futures.Future[Any]] = [push_fut, put_fut]
        done, _ = concurrent.futures.wait(both, self._c.request_timeout,
                                          return_when=concurrent.futures.FIRST_COMPLETED)
        if push_fut in done:
            if not push_fut.cancelled():
                push_fut.result()
                return True
            # Cancelled on the loop: the client is closing. The put ends too (its body
            # is cut short), and its result says how as a ThreadLogError -- reading the
            # hand-off's own result raised concurrent.futures.CancelledError instead.
            put_fut.cancel()
            return False
        push_fut.cancel()
        if put_fut in done:
            return False
        raise unavailable(f"the blob put took no chunk within the request timeout ({self._c.request_timeout:g} s)")

    def get(self, key: str, *, range: BlobRange | None = None) -> Blob | None:
        async def call() -> Blob | None:
            return await self._tl().blobs.get(key, range=range)

        return self._run(call(), read=True)

    def head(self, key: str) -> BlobInfo | None:
        async def call() -> BlobInfo | None:
            return await self._tl().blobs.head(key)

        return self._run(call(), read=True)

    def delete(self, key: str) -> None:
        async def call() -> None:
            await self._tl().blobs.delete(key)

        self._run(call())

    def list(self, *, prefix: str | None = None, cursor: str | None = None,
             limit: int | None = None) -> BlobListPage:
        async def call() -> BlobListPage:
            return await self._tl().blobs.list(prefix=prefix, cursor=cursor, limit=limit)

        return self._run(call(), read=True)

    def gc(self, *, grace_ms: int = DEFAULT_GRACE_MS, dry_run: bool = False) -> GcReport:
        async def call() -> GcReport:
            return await self._tl().blobs.gc(grace_ms=grace_ms, dry_run=dry_run)

        # No limit on the whole sweep: its every step is bounded, and its work grows
        # with the namespace. Tried (a review): 9 000 blobs at a 4 s request timeout,
        # cut at 21 s -- cancelled with fences up, OUTCOME_UNKNOWN for a sweep that worked.
        return self._c._wait(self._c._submit(call()), "gc", total=False)


# -- delivery (SPEC 11) ---------------------------------------------------------------------------------
class SyncDeliveryLog:
    """One run's delivery log with blocking methods; `read` is a blocking iterator."""

    def __init__(self, client: SyncThreadLog, log: DeliveryLog) -> None:
        self._c = client
        self._log = log
        self.run_id: str = log.run_id
        self.epoch: int = log.epoch

    def append(self, chunks: builtins.list[DeliveryChunk]) -> builtins.list[DeliveryOffset]:
        async def call() -> builtins.list[DeliveryOffset]:
            return await self._log.append(chunks)

        return self._c._run(call())

    def upsert(self, entries: Iterable[DeliveryEntry]) -> builtins.list[DeliveryOffset]:
        async def call() -> builtins.list[DeliveryOffset]:
            return await self._log.upsert(entries)

        return self._c._run(call())

    def close(self) -> None:
        async def call() -> None:
            await self._log.close()

        self._c._run(call())

    def snapshot(self) -> builtins.list[DeliveryEntry]:
        async def call() -> builtins.list[DeliveryEntry]:
            return await self._log.snapshot()

        return self._c._run(call(), read=True)

    def read(self, after: DeliveryPosition, *, follow: bool = True) -> SyncDeliveryReader:
        """A blocking iterator of (offset, chunk) strictly after `after`; errors
        surface at the first `next()`; ends when the log is closed (or, with
        `follow=False`, at what is stored when the iteration starts)."""
        # "-1" waits up to first_chunk_wait_ms for a first chunk before RUN_NOT_FOUND
        # (SPEC 11): the first step may take that long before its request timeout.
        first_wait = self._c.first_chunk_wait if after == "-1" else 0.0
        return SyncDeliveryReader(self._c, lambda: self._log.read(after, follow=follow), first_wait)


class SyncDeliveryReader(Iterator[DeliveryEntry]):
    """The blocking side of `read`: each `next()` waits for the next chunk, at most
    the request timeout (then UNAVAILABLE: resume with `read(last offset)`); the
    first of a `"-1"` read also `first_chunk_wait_ms` (then RUN_NOT_FOUND).
    Close it (or use `with`) when leaving before the log ends. One reader is
    iterated by one thread at a time; any number of readers may run at once.
    `close()` may come from another thread: a `next()` waiting then ends the
    iteration (StopIteration)."""

    def __init__(self, client: SyncThreadLog, make: Callable[[], AsyncIterator[DeliveryEntry]],
                 first_wait: float = 0.0) -> None:
        self._c = client
        self._make = make
        self._first_wait = first_wait  # extra time of the first step only
        self._it: AsyncIterator[DeliveryEntry] | None = None
        self._finished = False
        self._closing = False
        self._step_fut: concurrent.futures.Future[DeliveryEntry | None] | None = None  # a next() in flight
        # A next() starting and a close() from another thread agree under this on
        # whether the step is on the loop (close cuts it) or never starts.
        self._step_lock = threading.Lock()
        with client._lock:
            client._readers.add(self)

    def __iter__(self) -> SyncDeliveryReader:
        return self

    async def _step(self) -> DeliveryEntry | None:
        if self._closing:
            return None  # closed while this step was on its way: never read again
        if self._it is None:
            self._it = self._make()  # created on the loop, so the loop finalizes it
        try:
            return await self._it.__anext__()
        except StopAsyncIteration:
            return None  # a coroutine cannot hand StopAsyncIteration through a future

    def __next__(self) -> DeliveryEntry:
        try:
            with self._step_lock:
                if self._finished:
                    raise StopIteration
                extra, self._first_wait = self._first_wait, 0.0
                self._step_fut = self._c._submit(self._step())
            item = self._c._wait(self._step_fut, "the delivery read", extra=extra)
        except StopIteration:
            raise
        except BaseException as exc:
            # An error or a timeout ends the iteration (a timed-out step was
            # cancelled inside the async iterator, which closed it).
            self._finished = True
            if self._closing and isinstance(exc, Exception):
                raise StopIteration from None  # close() from another thread cut this step: the end
            raise
        finally:
            self._step_fut = None
        if item is None:
            self._finished = True
            raise StopIteration
        return item

    async def _finish(self) -> None:
        it, self._it = self._it, None
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            await aclose()

    def close(self) -> None:
        """Stop reading: releases what the reader holds on the loop. Harmless
        after the end, after an error and after the client was closed."""
        with self._step_lock:
            self._finished = self._closing = True
            step = self._step_fut
        if step is not None:
            # A next() of another thread waits on the loop: cut it (its async
            # iterator then ends), else aclose() found the generator running.
            step.cancel()
        if self._it is None or self._c.closed:
            return  # never started, or the client's close finished it
        # RuntimeError: the cut step had not unwound yet ("already running"); it
        # finishes the iterator itself.
        with contextlib.suppress(ThreadLogError, RuntimeError):
            self._c._run(self._finish())

    def __enter__(self) -> SyncDeliveryReader:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def connect(
    bootstrap_servers: str = "127.0.0.1:9092",
    namespace: str = "threadlog",
    processors: str = "embedded",
    lease_duration_ms: int = 120_000,
    renew_after_ms: int = 45_000,
    clock: Callable[[], float] | None = None,
    first_chunk_wait_ms: int = 5_000,
    state_dir: str | None = None,
    *,
    partitions: int = 4,
    request_timeout_ms: int = 30_000,
    kafka: Mapping[str, Any] | None = None,
    create_topics: bool = True,
    replication_factor: int | None = None,
    min_insync_replicas: int | None = None,
    delivery_retention_ms: int = 7 * 24 * 3600 * 1000,
) -> SyncThreadLog:
    """Open a namespace with a blocking client (the arguments of `threadlog.open`).

    Bad options raise `ThreadLogError(INVALID_ARGUMENT)` here, before any thread starts.
    """
    from . import open as open_async  # the public entry point (imported here: threadlog imports this module)

    opener = open_async(
        bootstrap_servers, namespace, processors, lease_duration_ms, renew_after_ms, clock,
        first_chunk_wait_ms, state_dir, partitions=partitions, request_timeout_ms=request_timeout_ms,
        kafka=kafka, create_topics=create_topics, replication_factor=replication_factor,
        min_insync_replicas=min_insync_replicas, delivery_retention_ms=delivery_retention_ms,
    )
    client = SyncThreadLog(request_timeout_ms / 1000.0, first_chunk_wait_ms / 1000.0)

    async def opened() -> ThreadLog:
        return await opener

    client._start(opened())
    return client

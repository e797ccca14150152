"""`threadlog.open(...)`: the entry point (SPEC section 2)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Generator, Iterable, Mapping
from datetime import datetime
from typing import Any

from .config import Options
from .delivery import DeliveryLog, DeliveryService
from .kernel.errors import ThreadLogError, unavailable
from .producers.proposals import ProposalBus, Verdicts
from .producers.pump import settle_threadsafe
from .projections.partition_stores import PartitionStores
from .projections.store import Store
from .remote import RemoteStore, RemoteVerdicts
from .runtime import Runtime
from .session import Session
from .stores.artifacts import ArtifactStore
from .stores.blobs import BlobStore
from .stores.checkpoints import CheckpointStore
from .stores.generation_runs import GenerationRunStore
from .stores.interrupts import InterruptStore
from .stores.messages import MessageStore
from .stores.metadata import MetadataStore
from .stores.runs import RunStore

log = logging.getLogger("threadlog.client")


class ThreadLog:
    """A connected client. Use as `async with threadlog.open(...) as tl:`."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.runtime = Runtime(opts)
        # What the stores get of this client (threadlog/session.py), not the client.
        self.session = session = Session(opts, self.runtime)
        self.messages = MessageStore(session)
        self.runs = RunStore(session)
        self.interrupts = InterruptStore(session)
        self.generation_runs = GenerationRunStore(session)
        self.metadata = MetadataStore(session)
        self.artifacts = ArtifactStore(session)
        self.checkpoints = CheckpointStore(session)
        self.blobs = BlobStore(session, references=self.checkpoints.list_blob_references)

    # -- lifecycle ---------------------------------------------------------------
    async def start(self) -> ThreadLog:
        # The loop this client serves on (its futures and pumps are bound to it):
        # code that hops onto it from other threads (integrations' sync methods) asks here.
        self.loop: asyncio.AbstractEventLoop = asyncio.get_running_loop()
        try:
            await _on_own_thread(self._start_sync)
        except ThreadLogError:
            await _on_own_thread(self._stop_sync)
            raise
        except Exception as exc:
            await _on_own_thread(self._stop_sync)
            raise unavailable(f"cannot open namespace {self.opts.namespace!r}: {exc}") from exc
        return self

    def _start_sync(self) -> None:
        self.runtime.start()
        assert self.runtime.layout is not None
        assert self.runtime.seen_offsets is not None
        verdicts: Verdicts
        if self.runtime.query is not None:  # thin: a worker judges
            verdicts = RemoteVerdicts(self.runtime.query)
            self.session.reads = RemoteStore(self.runtime.query)
        else:
            assert self.runtime.judge is not None
            verdicts = self.runtime.judge
            self.session.reads = self.runtime.store
        self.session.bus = ProposalBus(
            bootstrap=self.opts.bootstrap_servers,
            topics=self.runtime.topics,
            layout=self.runtime.layout,
            codec=self.runtime.codec,
            client_id=self.runtime.client_id,
            verdicts=verdicts,
            end_offsets=self.runtime.seen_offsets.end_offsets,
            clock=self.opts.clock,
            timeout=self.opts.request_timeout,
            kafka=self.opts.kafka,
            headers=self.runtime.record_headers(self.runtime.topics.events, verdicts.reply_header),
        )
        # The run index it reads (if folded here) is the runtime's, started with it.
        self.session.delivery = DeliveryService(self.session)

    def _stop_sync(self) -> None:
        if self._delivery is not None:
            self._delivery.stop()
        self.blobs.close()
        if self.bus is not None:
            self.bus.close()
        self.runtime.stop()

    async def close(self) -> None:
        if self.session.closed:
            return
        self.session.closed = True
        self.checkpoints._stop_renewals()  # background lease renewals end with the client
        self.runs._stop_background()  # and so do run drivers' heartbeats and unfinished claims
        await asyncio.to_thread(self._stop_sync)

    async def __aenter__(self) -> ThreadLog:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # -- delivery logs (SPEC 11) ------------------------------------------------------
    def delivery(self, run_id: str, epoch: int | None = None) -> DeliveryLog:
        """The delivery log of `run_id`, written as driver `epoch` (None counts as 0)."""
        return DeliveryLog(self.session, run_id, epoch)

    # -- time travel (processors/time_travel.py) --------------------------------------
    async def history(self, thread_id: str) -> list[dict[str, Any]]:
        """The thread's proposals in offset order of its partition, each with its
        verdict: `{"offset", "type", "proposalId", "decidedAt", "verdict": {"ok",
        "code", "message"}}` (code and message only when refused). Computed by
        judging the thread's partition again from offset 0 (verdicts are a
        function of the log), so it covers the whole history, not just the
        verdicts the live judge still keeps."""
        from .processors import time_travel

        return await time_travel.history(self, thread_id)

    async def state_at(self, thread_id: str, at: int | datetime | None = None) -> dict[str, Any]:
        """The thread's state as it was right after the record at offset `at` of
        its partition (an int), or after the last record decided at or before
        `at` (a datetime; naive means UTC), or now (None): `{"threadId",
        "partition", "offset", "decidedAt", "head", "checkpoints", "runs",
        "interrupts", "transcript"}`, records shaped as the stores return them.
        `offset` is the last record included (None: before the first)."""
        from .processors import time_travel

        return await time_travel.state_at(self, thread_id, at)

    # -- what the session holds, for callers of the client ------------------------------
    @property
    def bus(self) -> ProposalBus | None:
        return self.session.bus

    @property
    def _delivery(self) -> DeliveryService | None:
        return self.session.delivery

    @property
    def _closed(self) -> bool:
        return self.session.closed

    def _check_open(self) -> None:
        self.session.check_open()

    async def send(self, type_name: str, key: str, payload: dict) -> Any:
        return await self.session.send(type_name, key, payload)

    @property
    def state(self) -> Store | PartitionStores | RemoteStore:
        """What the stores read after a barrier: this process's store (embedded), or a worker's (thin)."""
        return self.session.state

    async def read_barrier(self, keys: Iterable[str] | None) -> None:
        await self.session.read_barrier(keys)


async def _on_own_thread(fn: Callable[[], Any]) -> Any:
    """`await asyncio.to_thread(fn)`, on a daemon thread of its own.

    Why not the loop's default executor: its threads are joined at interpreter
    exit. An open its waiter gave up on (a `ThreadLogSaver` or blocking client
    timing out on an unreachable cluster) goes on until the cluster is reached
    or the request timeout passes, so a script that caught the error and ended
    took ~30 s more to exit, and the open's cleanup, asked once the executor
    had shut down, raised `RuntimeError: cannot schedule new futures after
    shutdown` (a review). A daemon thread does not hold the exit."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()

    def run() -> None:
        try:
            value = fn()
        except BaseException as exc:  # handed to the awaiting task
            settle_threadsafe(loop, fut, exc, None)
        else:
            settle_threadsafe(loop, fut, None, value)

    threading.Thread(target=run, name="threadlog-open", daemon=True).start()
    return await fut


def require_connected(tl: Any, who: str, instead: str) -> None:
    """Refuse anything but a connected asyncio client where an integration takes one.

    Why: the easy mistakes -- a bootstrap address, `threadlog.open(...)` not
    awaited, the blocking client of `threadlog.connect` -- were accepted and
    failed later, deep inside, as `AttributeError: ... has no attribute 'opts'`
    (an OpenAI Agents session only at its first use, inside `Runner.run`).
    `instead`: what the caller likely meant."""
    if isinstance(tl, ThreadLog):
        return
    if isinstance(tl, _Opener):
        got = "threadlog.open(...) not awaited: use `tl = await threadlog.open(...)` or `async with`"
    elif isinstance(tl, str):
        got = f"the string {tl!r}, not a client"
    else:
        got = f"a {type(tl).__module__}.{type(tl).__qualname__}"
    raise TypeError(f"{who} takes a connected threadlog.ThreadLog (the asyncio client); got {got}. {instead}")


class _Opener:
    """Both `async with open(...)` and `await open(...)` work."""

    def __init__(self, opts: Options) -> None:
        self._opts = opts
        self._tl: ThreadLog | None = None

    def __await__(self) -> Generator[Any, None, ThreadLog]:
        return ThreadLog(self._opts).start().__await__()

    async def __aenter__(self) -> ThreadLog:
        self._tl = await ThreadLog(self._opts).start()
        return self._tl

    async def __aexit__(self, *exc: Any) -> None:
        if self._tl is not None:
            await self._tl.close()


def open(
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
) -> _Opener:
    """Open a namespace; bad options raise `ThreadLogError(INVALID_ARGUMENT)` here.

    `processors="embedded"` (the default): this process judges every partition
    itself -- a full replica, which folds the namespace's whole history before
    its first read. `processors="external"`: a thin client; proposals still go
    straight to Kafka, but verdicts, read barriers and reads are served by a
    `threadlog worker` found in `<ns>.members` (threadlog/remote.py); calls
    fail with `UNAVAILABLE` after `request_timeout_ms` when no worker answers.

    `kafka`: librdkafka properties for every client threadlog creates (security,
    timeouts...); the ones threadlog needs for correctness are refused.
    `create_topics=False`: the namespace must exist (`NAMESPACE_NOT_FOUND`).
    `replication_factor` / `min_insync_replicas` of new topics: default
    min(3, brokers) / min(2, replication factor); existing topics are checked
    (also with `create_topics=False`, when given).
    `delivery_retention_ms`: `retention.ms` of a new `deliveries` topic (7
    days); an existing one keeps its own, as `partitions`.
    """
    opts = Options(
        bootstrap_servers=bootstrap_servers,
        namespace=namespace,
        processors=processors,
        lease_duration_ms=lease_duration_ms,
        renew_after_ms=renew_after_ms,
        clock=clock,
        first_chunk_wait_ms=first_chunk_wait_ms,
        state_dir=state_dir,
        partitions=partitions,
        request_timeout_ms=request_timeout_ms,
        kafka=kafka or {},
        create_topics=create_topics,
        replication_factor=replication_factor,
        min_insync_replicas=min_insync_replicas,
        delivery_retention_ms=delivery_retention_ms,
    )
    return _Opener(opts)

"""`Session`: what the stores and delivery logs use of a client, and nothing more.

The store facades (threadlog/stores/), delivery logs (threadlog/delivery/) and
the blob sweep (threadlog/blob_gc.py) get this, not the `ThreadLog`: they
propose (`send`), read after a barrier (`read_barrier`, `state`), and reach the
runtime's topics and settings. Narrow on purpose: a store cannot reach another
store or the client's lifecycle, and nothing below the client imports it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .config import Options
from .kernel.errors import unavailable
from .projections.partition_stores import PartitionStores
from .projections.queries import QUERIES
from .projections.store import Store
from .remote import NoQueries, RemoteStore, off_loop
from .runtime import Runtime

if TYPE_CHECKING:
    from .delivery.service import DeliveryService
    from .producers.proposals import ProposalBus


class Session:
    def __init__(self, opts: Options, runtime: Runtime) -> None:
        self.opts = opts
        self.runtime = runtime
        self.bus: ProposalBus | None = None  # set when the client starts
        self.delivery: DeliveryService | None = None
        self.reads: Store | PartitionStores | RemoteStore | None = None
        self.closed = False

    @property
    def watched(self) -> bool:
        """Would this client learn that its namespace was deleted and created again
        (projections/incarnation.py)? Not when the topic ids could not be read."""
        return self.runtime.watch is not None

    def check_open(self) -> None:
        if self.closed:
            raise unavailable("this ThreadLog is closed")
        if self.runtime.failed is not None:
            raise unavailable(self.runtime.failed)

    async def send(self, type_name: str, key: str, payload: dict, timeout: float | None = None) -> Any:
        """Propose and await the verdict, within `timeout` s (None: the request timeout)."""
        self.check_open()
        assert self.bus is not None
        return await self.bus.send(type_name, key, payload, timeout)

    async def tombstone_blob_chunks(self, keys: list[tuple[str, int | None]]) -> None:
        """Write tombstones for chunk keys (and the partition each was read on) of a
        blob version a judged abandon gave up."""
        self.check_open()
        assert self.bus is not None
        await self.bus.tombstone_blob_chunks(keys)

    def left_of(self, began: float) -> float:
        """What is left of one request timeout for a call that began at `began`
        (time.monotonic()): the steps of one call share it."""
        return max(0.1, self.opts.request_timeout - (time.monotonic() - began))

    @property
    def state(self) -> Store | PartitionStores | RemoteStore:
        """What the stores read after a barrier: this process's store (embedded), or a worker's (thin)."""
        if self.reads is None:
            raise unavailable("the threadlog client is not started")
        return self.reads

    async def read_barrier(self, keys: Iterable[str] | None) -> None:
        """Wait for every write acknowledged before this call on the partitions of
        `keys` (all partitions when None)."""
        self.check_open()
        partitions = self._partitions(keys)
        if self.runtime.query is not None:
            # The worker asks the broker for end offsets after our request arrived
            # and answers once its judge passed them (processors/query_server.py).
            await self.runtime.query.barrier(partitions)
            return
        barrier = self.runtime.barrier
        assert barrier is not None
        await barrier.wait(partitions)

    async def read(self, k: bytes, keys: Iterable[str] | None, barrier: bool = True) -> bytes | None:
        """The value at `k`, which lives in the state of the partitions of `keys`
        (any partition when None), after a read barrier on those partitions
        unless `barrier` is False (the call passed one already).

        A thin client reads barrier and value in one request per owner and
        never blocks the caller's loop on it (`self.state.get` does)."""
        self.check_open()
        query = self.runtime.query
        if query is not None:
            return await query.read(k, self._partitions(keys), barrier)
        if barrier:
            await self.read_barrier(keys)
        return self.state.get(k)

    async def read_many(self, ks: Sequence[bytes], keys: Iterable[str] | None,
                        barrier: bool = True) -> list[bytes | None]:
        """The values at `ks`, in that order, as `read` reads one: through a thin
        client one request per owner (not one per key), awaited. Not one
        snapshot: a reader of several keys checks that they agree."""
        self.check_open()
        query = self.runtime.query
        if query is not None:
            return await query.read_many(list(ks), self._partitions(keys), barrier)
        if barrier:
            await self.read_barrier(keys)
        state = self.state
        return [state.get(k) for k in ks]

    async def query(self, name: str, keys: Iterable[str] | None, args: Mapping[str, Any],
                    barrier: bool = True, fallback: bool = True) -> list[Any]:
        """The answers of the named query (projections/queries.py) over the state
        of the partitions of `keys` (all when None), after a read barrier there
        unless `barrier` is False: through a thin client one request per owner,
        each answering for its partitions (the caller merges); embedded, one
        answer over this process's store. A worker of an earlier version runs
        none: the query then reads the keys through it, off the caller's loop
        (one request per key read), or, with `fallback` False, NoQueries is
        raised for the caller to read them its own way (in batches)."""
        self.check_open()
        query = self.runtime.query
        if query is not None:
            try:
                return await query.query(name, dict(args), self._partitions(keys), barrier)
            except NoQueries:
                if not fallback:
                    raise
        if barrier:
            await self.read_barrier(keys)
        return [await off_loop(self.state, functools.partial(QUERIES[name], self.state, **args))]

    async def scan(self, prefix: bytes, keys: Iterable[str] | None) -> list[tuple[bytes, bytes]]:
        """Every (key, value) under `prefix` in the state of the partitions of
        `keys` (all when None), ascending, with no barrier (the call passed one);
        through a thin client awaited, never blocking the caller's loop."""
        self.check_open()
        query = self.runtime.query
        if query is not None:
            return await query.scan(prefix, self._partitions(keys))
        return list(self.state.scan(prefix))

    async def lease_setting(self, thread_id: str) -> tuple[int, int]:
        """(lease_duration_ms, renew_after_ms) for a writer lease of `thread_id`.

        SPEC 4: the lease length is the setting of the processor that decides the
        grant. The judge is a pure fold and reads the length from the proposal
        (every judge must grant the same lease), so the proposer puts the decider's
        setting there: embedded, this process's own; thin, the one the worker that
        owns the thread's partition announced in `<ns>.members` (`threadlog worker
        --lease-duration-ms`), or this client's own if that worker announced none.
        While no worker has announced the partition (one just started, a
        rebalance), this waits for one: the grant is that worker's to judge."""
        query = self.runtime.query
        if query is not None:
            owner = await query.announced_owner(self.runtime.partition_of(thread_id))
            if owner.lease is not None:
                return owner.lease
        return self.opts.lease_duration_ms, self.opts.renew_after_ms

    def _partitions(self, keys: Iterable[str] | None) -> list[int] | None:
        return None if keys is None else sorted({self.runtime.partition_of(k) for k in keys})

"""`Session`: what the stores and delivery logs use of a client, and nothing more.

The store facades (threadlog/stores/), delivery logs (threadlog/delivery/) and
the blob sweep (threadlog/blob_gc.py) get this, not the `ThreadLog`: they
propose (`send`), read after a barrier (`read_barrier`, `state`), and reach the
runtime's topics and settings. Narrow on purpose: a store cannot reach another
store or the client's lifecycle, and nothing below the client imports it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .config import Options
from .kernel.errors import unavailable
from .projections.partition_stores import PartitionStores
from .projections.store import Store
from .remote import RemoteStore
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

    def check_open(self) -> None:
        if self.closed:
            raise unavailable("this ThreadLog is closed")

    async def send(self, type_name: str, key: str, payload: dict) -> Any:
        self.check_open()
        assert self.bus is not None
        return await self.bus.send(type_name, key, payload)

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

    def _partitions(self, keys: Iterable[str] | None) -> list[int] | None:
        return None if keys is None else sorted({self.runtime.partition_of(k) for k in keys})

"""What every store facade shares: the command bus, the read barrier, the store."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from ..kernel.errors import unavailable
from ..projections.partition_stores import PartitionStores
from ..projections.store import Store
from ..remote import RemoteStore, off_loop

if TYPE_CHECKING:
    from ..session import Session

_T = TypeVar("_T")


class StoreFacade:
    def __init__(self, session: Session) -> None:
        self._session = session  # the client's narrow side (threadlog/session.py), not the client

    @property
    def _store(self) -> Store | PartitionStores | RemoteStore:
        # Embedded: this process's RocksDB; thin: the same reads served by a worker.
        return self._session.state

    async def _send(self, type_name: str, key: str, payload: dict) -> Any:
        return await self._session.send(type_name, key, payload)

    async def _resolve_elsewhere(self, result: Any, get: Callable[[str], Awaitable[Any]], ident: str) -> Any:
        """A create-or-resume of an id that lives on another thread's partition is
        answered "elsewhere" by the judge (it reads no other partition's records);
        the record is then read here, after a read barrier, like any `get`."""
        if isinstance(result, dict) and "$elsewhere" in result:
            found = await get(ident)
            if found is None:  # pragma: no cover - an id index never loses a record
                raise unavailable(f"{ident!r} is held by thread {result['$elsewhere']!r} but cannot be read")
            return found
        return result

    async def _read(self, k: bytes, *keys: str) -> bytes | None:
        """The value at `k` after a read barrier on the partitions of `keys` (all
        when none): one request per owner through a thin client."""
        return await self._session.read(k, keys or None)

    async def _read_on(self, k: bytes, thread_id: str) -> bytes | None:
        """The value at `k` in the state of `thread_id`'s partition, with no
        barrier (the call passed one already)."""
        return await self._session.read(k, (thread_id,), barrier=False)

    async def _off_loop(self, read: Callable[..., _T], *args: Any) -> _T:
        """Run a synchronous read of the state (a lazily merged scan: blobs.list):
        through a thin client on a pool thread, never holding the caller's loop
        on its round trips."""
        return await off_loop(self._store, read, *args)

    async def _scan(self, prefix: bytes, *keys: str) -> list[tuple[bytes, bytes]]:
        """Every (key, value) under `prefix` in the state of the partitions of
        `keys` (all when none), ascending (no barrier: the call passed one);
        through a thin client awaited, one request per owner and page."""
        return await self._session.scan(prefix, keys or None)

    async def _thread_by(self, index_key: bytes) -> str | None:
        """The thread an id index entry names (None: no such id), after a read
        barrier on every partition (an id's entry lives on its thread's)."""
        raw = await self._read(index_key)
        return None if raw is None else raw.decode("utf-8")

    async def _read_barrier(self, *keys: str) -> None:
        """Wait for every acknowledged write to the partitions of `keys`
        (all partitions when no key is given)."""
        await self._session.read_barrier(keys or None)

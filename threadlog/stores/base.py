"""What every store facade shares: the command bus, the read barrier, the store."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from ..kernel.errors import unavailable
from ..projections.partition_stores import PartitionStores
from ..projections.store import Store
from ..remote import RemoteStore, off_loop

if TYPE_CHECKING:
    from ..session import Session

_T = TypeVar("_T")


class Home(NamedTuple):
    """Where an id lives (`StoreFacade._home`)."""

    thread_id: str
    fresh: bool  # found after a read barrier on every partition (False: remembered)


# Homes remembered per store facade; past this many the memory starts over.
MAX_HOMES = 65_536


class StoreFacade:
    def __init__(self, session: Session) -> None:
        self._session = session  # the client's narrow side (threadlog/session.py), not the client
        # id index key -> the thread that holds it, for ids whose holding never
        # ends (`_home`). Dies with the client; a namespace deleted and made again
        # under it stops the client (projections/incarnation.py, thin ones too),
        # so no call follows an entry of the old namespace for longer than the
        # watch's period.
        self._homes: dict[bytes, str] = {}

    @property
    def _store(self) -> Store | PartitionStores | RemoteStore:
        # Embedded: this process's RocksDB; thin: the same reads served by a worker.
        return self._session.state

    async def _send(self, type_name: str, key: str, payload: dict, timeout: float | None = None) -> Any:
        return await self._session.send(type_name, key, payload, timeout=timeout)

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

    async def _read_on(self, k: bytes, thread_id: str, barrier: bool = False) -> bytes | None:
        """The value at `k` in the state of `thread_id`'s partition, with no
        barrier unless asked (by default the call passed one already)."""
        return await self._session.read(k, (thread_id,), barrier=barrier)

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

    async def _home(self, index_key: bytes) -> Home | None:
        """Where a run, generation run or interrupt lives (None: no such id).

        Those ids are held for good: no rule deletes one or moves it to another
        thread (projections/folds: their global-id marks are only ever "held").
        So once an index entry is read, it is remembered, and later calls on the
        id skip the read barrier on every partition and the index read -- a
        round trip to every owner plus a ListOffsets round, most of the cost of
        `runs.update` or `interrupts.resolve`. Reads of the record that follow
        still pass a barrier on the thread's own partition (`_read_at`);
        proposals need none (judged in log order after every acknowledged write).
        Not for artifacts: a deleted artifact id may come back on another thread.

        Only an index read is remembered, never the thread a create named: under
        the documented limitation (two first writes of one id on two partitions
        both accepted) every client then follows the copy the index names, as
        before. A client that looked the id up between those two acceptances
        keeps the first copy it found.
        """
        thread_id = self._homes.get(index_key)
        if thread_id is not None:
            return Home(thread_id, False)
        thread_id = await self._thread_by(index_key)
        if thread_id is None:
            return None  # not remembered: the id may be created at any time
        self._remember(index_key, thread_id)
        return Home(thread_id, True)

    def _remember(self, index_key: bytes, thread_id: str) -> None:
        """Note where a held-for-good id lives (`_home`) -- unless nothing would tell
        this client its namespace was created again (the topic ids could not be
        read at open: no watch), which would make the note wrong for good."""
        if not self._session.watched:
            return
        if len(self._homes) >= MAX_HOMES:
            self._homes.clear()
        self._homes[index_key] = thread_id

    async def _read_at(self, k: bytes, home: Home) -> bytes | None:
        """The value at `k` on `home`'s partition, after a barrier there unless
        `_home` just passed one on every partition."""
        return await self._read_on(k, home.thread_id, barrier=not home.fresh)

    async def _read_barrier(self, *keys: str) -> None:
        """Wait for every acknowledged write to the partitions of `keys`
        (all partitions when no key is given)."""
        await self._session.read_barrier(keys or None)

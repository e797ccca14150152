"""What every store facade shares: the command bus, the read barrier, the store."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..projections.store import Store

if TYPE_CHECKING:
    from ..client import ThreadLog


class StoreFacade:
    def __init__(self, tl: ThreadLog) -> None:
        self._tl = tl

    @property
    def _store(self) -> Store:
        store = self._tl.runtime.store
        assert store is not None
        return store

    async def _send(self, type_name: str, key: str, payload: dict) -> Any:
        return await self._tl.send(type_name, key, payload)

    async def _read_barrier(self, *keys: str) -> None:
        """Wait for every acknowledged write to the partitions of `keys`
        (all partitions when no key is given)."""
        await self._tl.read_barrier(keys or None)

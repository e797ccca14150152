"""The read surface every state holder shares, for annotations.

A fold's `View`, one partition's `Store`, a worker's `PartitionStores` and a thin
client's `RemoteStore` all answer `get` / `get_json` / `scan`; the read helpers of
the folds and the store facades take any of them. Imports nothing of the package,
so every module can use it without cycles.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol


class StateReader(Protocol):
    def get(self, k: bytes, /) -> bytes | None: ...

    def get_json(self, k: bytes, /) -> Any: ...

    def scan(self, prefix: bytes, /) -> Iterator[tuple[bytes, bytes]]: ...

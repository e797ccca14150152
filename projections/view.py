"""A write buffer over the store: what a fold or a decision reads and writes.

Folds and deciders never touch RocksDB directly. They read through a `View`
(buffered writes first, then the store) and write into its buffer; whoever owns
the view decides when the buffer reaches the store (`Store.apply`), or drops it
(an aborted transaction).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from threadlog.validation import dumps

from .store import Store


def _dump(value: Any) -> bytes:
    return dumps(value).encode()  # the one canonical JSON (threadlog/validation.py)


def overlay_scan(base: Iterator[tuple[bytes, bytes]], layers: list[dict[bytes, bytes | None]],
                 prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
    """`base` under `prefix` with buffered writes applied, lowest layer first (None deletes)."""
    merged = dict(base)
    for layer in layers:
        for k, v in layer.items():
            if k.startswith(prefix):
                if v is None:
                    merged.pop(k, None)
                else:
                    merged[k] = v
    for k in sorted(merged):
        yield k, merged[k]


class View:
    def __init__(self, store: Store, buffer: dict[bytes, bytes | None] | None = None) -> None:
        self.store = store
        self.buffer: dict[bytes, bytes | None] = {} if buffer is None else buffer

    def get(self, k: bytes) -> bytes | None:
        if k in self.buffer:
            return self.buffer[k]
        return self.store.get(k)

    def get_json(self, k: bytes) -> Any:
        raw = self.get(k)
        return None if raw is None else json.loads(raw)

    def put(self, k: bytes, v: bytes) -> None:
        self.buffer[k] = v

    def put_json(self, k: bytes, value: Any) -> None:
        self.buffer[k] = _dump(value)

    def delete(self, k: bytes) -> None:
        self.buffer[k] = None

    def scan(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        """Merged, ascending scan of buffer and store under `prefix`."""
        return overlay_scan(self.store.scan(prefix), [self.buffer], prefix)

    def child(self) -> _ChildView:
        """A view whose writes stay separate until `merge` (one command's effects)."""
        return _ChildView(self)


class _ChildView(View):
    def __init__(self, parent: View) -> None:
        super().__init__(parent.store)
        self.parent = parent

    def get(self, k: bytes) -> bytes | None:
        if k in self.buffer:
            return self.buffer[k]
        return self.parent.get(k)

    def scan(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        return overlay_scan(self.parent.scan(prefix), [self.buffer], prefix)

    def merge(self) -> None:
        self.parent.buffer.update(self.buffer)

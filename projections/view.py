"""A write buffer over the store: what a fold or a decision reads and writes.

Folds and deciders never touch RocksDB directly. They read through a `View`
(buffered writes first, then the store) and write into its buffer; whoever owns
the view decides when the buffer reaches the store (`Store.apply`), or drops it
(an aborted transaction).
"""

from __future__ import annotations

import json
from bisect import bisect_left, insort
from collections.abc import Iterator
from typing import Any

from threadlog.kernel.validation import dumps

from .store import Store


def _dump(value: Any) -> bytes:
    return dumps(value).encode()  # the one canonical JSON (threadlog/kernel/validation.py)


def overlay_scan(base: Iterator[tuple[bytes, bytes]], layers: list[list[tuple[bytes, bytes | None]]]
                 ) -> Iterator[tuple[bytes, bytes]]:
    """`base` with buffered writes applied, lowest layer first (None deletes).

    Each layer holds only the buffered writes under the scanned prefix (see
    `View._buffered`); with none, the base iterator is returned as it is.
    """
    if not any(layers):
        return base
    merged = dict(base)
    for layer in layers:
        for k, v in layer:
            if v is None:
                merged.pop(k, None)
            else:
                merged[k] = v
    return iter([(k, merged[k]) for k in sorted(merged)])


class View:
    def __init__(self, store: Store, buffer: dict[bytes, bytes | None] | None = None) -> None:
        self.store = store
        self.buffer: dict[bytes, bytes | None] = {} if buffer is None else buffer
        # The buffered keys, ascending. Why: a judge's view buffers a whole
        # fetched batch (thousands of keys) and a decision scans a few prefixes;
        # filtering the whole buffer per scan made a batch quadratic. Only
        # put/delete change the buffer, so they keep this list.
        self._keys: list[bytes] = sorted(self.buffer)

    def get(self, k: bytes) -> bytes | None:
        if k in self.buffer:
            return self.buffer[k]
        return self.store.get(k)

    def get_json(self, k: bytes) -> Any:
        raw = self.get(k)
        return None if raw is None else json.loads(raw)

    def put(self, k: bytes, v: bytes | None) -> None:
        if k not in self.buffer:
            insort(self._keys, k)
        self.buffer[k] = v

    def put_json(self, k: bytes, value: Any) -> None:
        self.put(k, _dump(value))

    def delete(self, k: bytes) -> None:
        self.put(k, None)

    def _buffered(self, prefix: bytes) -> list[tuple[bytes, bytes | None]]:
        """The buffered writes under `prefix`, ascending."""
        keys = self._keys
        i = bisect_left(keys, prefix)
        out = []
        while i < len(keys) and keys[i].startswith(prefix):
            out.append((keys[i], self.buffer[keys[i]]))
            i += 1
        return out

    def scan(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        """Merged, ascending scan of buffer and store under `prefix`."""
        return overlay_scan(self.store.scan(prefix), [self._buffered(prefix)])

    def has_prefix(self, prefix: bytes) -> bool:
        """Is any key under `prefix` present? Stops at the first one found. (A
        scan merges the whole prefix into memory as soon as one write under it
        is buffered: asked per decision of a large prefix, that was the cost.)"""
        return next(self._present(prefix), None) is not None

    def _present(self, prefix: bytes) -> Iterator[bytes]:
        """Keys present under `prefix`, unordered, lazily: buffered puts, then the
        layers below minus what this buffer deletes."""
        buffered = self._buffered(prefix)
        yield from (k for k, v in buffered if v is not None)
        gone = {k for k, v in buffered if v is None}
        yield from (k for k in self._below(prefix) if k not in gone)

    def _below(self, prefix: bytes) -> Iterator[bytes]:
        return (k for k, _ in self.store.scan(prefix))

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
        return overlay_scan(self.parent.scan(prefix), [self._buffered(prefix)])

    def _below(self, prefix: bytes) -> Iterator[bytes]:
        return self.parent._present(prefix)

    def merge(self) -> None:
        for k, v in self.buffer.items():
            self.parent.put(k, v)

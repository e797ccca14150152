"""`projections.view.View`: buffered writes over a real RocksDB store, scanned by prefix.

A judge's view buffers a whole fetched batch and every decision scans a few
prefixes through it, so the view keeps its buffered keys sorted and a scan
visits only its prefix's (and `has_prefix` stops at the first key). These tests drive random writes, deletes, child
views and merges against a plain dict model: any scan that misses, repeats or
misorders a key, or shows a deleted one, fails.
"""

from __future__ import annotations

import random

import pytest
from threadlog.projections.store import Store
from threadlog.projections.view import View

PREFIXES = [b"a", b"ab", b"abc", b"b", b"b\x00", b"\xff"]


def _model_scan(model: dict[bytes, bytes | None], prefix: bytes) -> list[tuple[bytes, bytes]]:
    return sorted((k, v) for k, v in model.items() if k.startswith(prefix) and v is not None)


def _random_key(rng: random.Random) -> bytes:
    return rng.choice(PREFIXES) + bytes(rng.randrange(4) for _ in range(rng.randrange(3)))


@pytest.fixture
def store(tmp_path):
    opened = Store(tmp_path / "state")
    yield opened
    opened.close()


@pytest.mark.parametrize("seed", range(6))
def test_scans_through_buffers_and_children_match_a_model(store: Store, seed: int) -> None:
    rng = random.Random(seed)
    base = {_random_key(rng): bytes([rng.randrange(256)]) for _ in range(40)}
    store.apply(dict(base), {})
    model: dict[bytes, bytes | None] = dict(base)
    view = View(store)
    for _ in range(300):
        op = rng.random()
        k = _random_key(rng)
        if op < 0.45:
            v = bytes([rng.randrange(256)])
            view.put(k, v)
            model[k] = v
        elif op < 0.65:
            view.delete(k)
            model[k] = None
        elif op < 0.8:
            # One decision's writes: a child view, merged or dropped.
            child = view.child()
            pending = dict(model)
            for _ in range(rng.randrange(6)):
                ck = _random_key(rng)
                if rng.random() < 0.7:
                    cv = bytes([rng.randrange(256)])
                    child.put(ck, cv)
                    pending[ck] = cv
                else:
                    child.delete(ck)
                    pending[ck] = None
                prefix = rng.choice(PREFIXES)
                assert list(child.scan(prefix)) == _model_scan(pending, prefix)
                assert child.has_prefix(prefix) == bool(_model_scan(pending, prefix))
                assert child.get(ck) == pending[ck]
            if rng.random() < 0.6:
                child.merge()
                model = pending
        prefix = rng.choice(PREFIXES)
        assert list(view.scan(prefix)) == _model_scan(model, prefix), prefix
        assert view.has_prefix(prefix) == bool(_model_scan(model, prefix)), prefix
        assert view.get(k) == model.get(k)
    # What reaches the store is exactly the buffer: the model, deletes included.
    store.apply(view.buffer, {})
    for prefix in PREFIXES:
        assert list(store.scan(prefix)) == _model_scan(model, prefix)


def test_a_grandchild_merges_through_its_parent(store: Store) -> None:
    store.apply({b"k1": b"a", b"k2": b"b"}, {})
    view = View(store)
    child = view.child()
    grandchild = child.child()
    grandchild.put(b"k3", b"c")
    grandchild.delete(b"k1")
    assert list(child.scan(b"k")) == [(b"k1", b"a"), (b"k2", b"b")]  # not merged yet
    grandchild.merge()
    assert list(child.scan(b"k")) == [(b"k2", b"b"), (b"k3", b"c")]
    assert list(view.scan(b"k")) == [(b"k1", b"a"), (b"k2", b"b")]  # the child is not merged yet
    child.merge()
    assert list(view.scan(b"k")) == [(b"k2", b"b"), (b"k3", b"c")]


def test_a_view_built_on_a_buffer_scans_it(store: Store) -> None:
    store.apply({b"a1": b"x", b"a2": b"y"}, {})
    view = View(store, {b"a3": b"z", b"a1": None})
    assert list(view.scan(b"a")) == [(b"a2", b"y"), (b"a3", b"z")]

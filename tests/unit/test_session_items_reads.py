"""`get_items` reads one state of a session while the judge keeps adding to it.

The owner's query (`agent_sessions.read_items`) and the thin client's batched
reads both read the positions, then the items, then the positions again; the
judge applies batches from another thread in between. Tried (a review): a
writer adding items as fast as it could made 9 of 121 reads of a thin client
fail UNAVAILABLE ("kept changing"), since any change meant reading again. An
add writes only positions at or past `next`, so items read across adds are
still one state; only a pop or a clear (`cut`) spoils a read. Real RocksDB
stores, the real folds; the racing writer is the fold applied between reads.
"""

from __future__ import annotations

from collections.abc import Callable

import orjson
from threadlog.projections.fold import EventMeta
from threadlog.projections.folds import agent_sessions as state
from threadlog.projections.store import Store
from threadlog.projections.view import View

S = "s"
META = EventMeta(key="agents:s", seq=0, decidedAt=0.0, commandId="c", type="t")


def fold(store: Store, handler: Callable, ev: dict) -> None:
    view = View(store)
    handler(view, META, ev)
    store.apply(view.buffer, {})


def add(store: Store, *texts: str) -> None:
    fold(store, state.items_added, {"sessionId": S, "first": state.read_meta(View(store), S)["next"],
                                    "items": list(texts)})


def pop(store: Store) -> None:
    fold(store, state.item_popped, {"sessionId": S, "position": state.read_meta(View(store), S)["next"] - 1})


class Racing:
    """A read surface of `store` where each item read lets the judge apply the next of `writes` first."""

    def __init__(self, store: Store, writes: list[Callable[[], None]]) -> None:
        self.store, self.writes = store, writes

    def get(self, k: bytes) -> bytes | None:
        if k.startswith(state.item_prefix(S)) and self.writes:
            self.writes.pop(0)()
        return self.store.get(k)

    def get_json(self, k: bytes):  # pragma: no cover - read_items reads raw
        raise AssertionError

    def scan(self, prefix: bytes):  # pragma: no cover
        raise AssertionError


def test_adds_between_the_reads_leave_one_state_read_at_once(tmp_path):
    store = Store(tmp_path / "s")
    add(store, '"a"', '"b"', '"c"')
    racing = Racing(store, [lambda n=n: add(store, f'"new{n}"') for n in range(100)])
    # Before: every try saw `rev` move (an add per item read), and 8 tries gave None.
    assert state.read_items(racing, S, None) == ['"a"', '"b"', '"c"']
    assert len(racing.writes) == 97  # one try: three items, three adds
    assert state.read_items(racing, S, 2) == ['"new1"', '"new2"']  # the latest two as of its first read


def test_a_pop_and_an_add_between_the_reads_are_read_again_never_mixed(tmp_path):
    store = Store(tmp_path / "s")
    add(store, '"a"', '"b"', '"c"')
    # Two pops and an add of two rewrite positions 1 and 2 after the reader read
    # "a" and "b": it reads "z" at 2. Taken as one state, a, b, z was never the
    # session's (a, b, c before; a, y, z after), though `next` is 3 again.
    racing = Racing(store, [lambda: None, lambda: None, lambda: (pop(store), pop(store), add(store, '"y"', '"z"'))])
    assert state.read_items(racing, S, None) == ['"a"', '"y"', '"z"']  # read again, after them
    assert state.decode_meta(store.get(state.meta_key(S)))["cut"] == 2


def test_state_folded_before_cut_existed_is_judged_by_rev_alone(tmp_path):
    store = Store(tmp_path / "s")
    add(store, '"a"')
    store.apply({state.meta_key(S): orjson.dumps({"first": 0, "next": 1, "rev": 1})}, {})  # an older fold's
    before = state.decode_meta(store.get(state.meta_key(S)))
    add(store, '"b"')
    after = state.decode_meta(store.get(state.meta_key(S)))
    assert "cut" not in before and after["cut"] == 0
    assert not state.same_items(before, after)  # unknown whether something was removed: read again
    assert state.same_items(after, after)

"""OpenAI Agents SDK sessions (threadlog.integrations.openai_agents): an ordered list of items per session.

A session's items occupy the contiguous positions `[first, next)`: `add_items`
appends at `next`, `pop_item` removes `next - 1`, `clear_session` removes all
and sets `first = next`. Contiguity is what lets `get_items(limit)` read the
latest N items with N point lookups and `pop_item` find the newest item
without a reverse scan (a `View` scans forward only). Positions are never
reset, so an item key is never reused by a clear (a reader straddling a clear
cannot mix old and new items at one position).

`META` carries `rev`, bumped by every change, and `cut`, bumped by every pop
and clear: a reader outside the judge reads `META`, then items, then `META`
again (the judge applies batches from another thread; a read of several keys
is not one snapshot). The items read are one state of the session -- the one
the first `META` describes -- if nothing was removed in between (`same_items`):
an add writes only positions at or past `next`, and only a pop or a clear
takes an item away (a pop's position is then written again by the next add).
Judged by `rev` alone, a session with a busy writer failed its readers
(UNAVAILABLE after every retry: a review).

Items are stored as the JSON text they arrived as: they round-trip exactly.
Every key starts with its tag and the session id, so the folds of the
session's partition (key `agents:<session id>`) are its only writers.
"""

from __future__ import annotations

import orjson

from ..fold import EventMeta, folds
from ..keys import key
from ..reader import StateReader
from ..view import View

# The NUL after "oa" keeps these tags from prefixing (or being prefixed by) any
# other domain's tag.
META = b"oa\x00m"  # (session) -> {"first", "next", "rev", "cut"} (no "cut": folded by an older version)
ITEM = b"oa\x00i"  # (session, position) -> item JSON text

EMPTY: dict[str, int] = {"first": 0, "next": 0, "rev": 0, "cut": 0}


def meta_key(session: str) -> bytes:
    return key(META, session)


def item_key(session: str, position: int) -> bytes:
    return key(ITEM, session, float(position))


def item_prefix(session: str) -> bytes:
    return key(ITEM, session)


def read_meta(view: View, session: str) -> dict[str, int]:
    """The session's positions in `view`."""
    return decode_meta(view.get(meta_key(session)))


def decode_meta(raw: bytes | None) -> dict[str, int]:
    """The session's positions, as stored at `meta_key` (None: an empty session)."""
    return dict(EMPTY) if raw is None else orjson.loads(raw)


def same_items(before: dict[str, int], after: dict[str, int]) -> bool:
    """Are the items `before` describes still there, unchanged, in `after`? (See the
    module's docstring.) Without `cut` (a state an older version folded) only an
    unchanged `rev` says so."""
    if after["rev"] == before["rev"]:
        return True
    cut = before.get("cut")
    return cut is not None and after.get("cut") == cut and after["first"] == before["first"]


def _put_meta(view: View, session: str, first: int, nxt: int, rev: int, cut: int) -> None:
    view.put_json(meta_key(session), {"first": first, "next": nxt, "rev": rev, "cut": cut})


@folds("threadlog.evt.AgentSessionItemsAdded")
def items_added(view: View, meta: EventMeta, ev: dict) -> None:
    session = ev["sessionId"]
    m = read_meta(view, session)
    # The judge decided the positions; the event names the first one so a
    # rebuild writes the same keys whatever it finds.
    position = ev["first"]
    for text in ev["items"]:
        view.put(item_key(session, position), text.encode("utf-8"))
        position += 1
    # The judge appends at `next` (ev["first"] == m["next"]): `first` stays.
    _put_meta(view, session, m["first"], position, m["rev"] + 1, m.get("cut", 0))


@folds("threadlog.evt.AgentSessionItemPopped")
def item_popped(view: View, meta: EventMeta, ev: dict) -> None:
    session = ev["sessionId"]
    m = read_meta(view, session)
    view.delete(item_key(session, ev["position"]))
    _put_meta(view, session, m["first"], ev["position"], m["rev"] + 1, m.get("cut", 0) + 1)


@folds("threadlog.evt.AgentSessionCleared")
def session_cleared(view: View, meta: EventMeta, ev: dict) -> None:
    session = ev["sessionId"]
    m = read_meta(view, session)
    for k, _ in list(view.scan(item_prefix(session))):
        view.delete(k)
    # Positions go on from `next`: a cleared position is never reused.
    _put_meta(view, session, m["next"], m["next"], m["rev"] + 1, m.get("cut", 0) + 1)


# A query's answer is one line of JSON: larger item lists are read key by key.
ITEMS_QUERY_BYTES = 8 * 1024 * 1024
ITEMS_QUERY_READS = 8


def read_items(store: StateReader, session: str, limit: int | None) -> list[str] | None:
    """The JSON texts of the latest `limit` items (every item when None), oldest
    first, as one state of the session: what `get_items` reads, run where the
    state is (projections/queries.py). None if the session kept changing, or
    its items pass ITEMS_QUERY_BYTES: the caller reads them key by key.

    Why at the owner: a reader of the keys through a thin client makes a round
    trip per 64 items and checks `rev` after them all; a session written to
    meanwhile made it read again, and a review's busy session failed 5 reads of
    12 (UNAVAILABLE after 16 tries). Here each try is a few point lookups, and
    adds meanwhile do not spoil it (`same_items`)."""
    for _ in range(ITEMS_QUERY_READS):
        meta = decode_meta(store.get(meta_key(session)))
        first = meta["first"] if limit is None else max(meta["first"], meta["next"] - limit)
        texts: list[str] = []
        size = 0
        for position in range(first, meta["next"]):
            raw = store.get(item_key(session, position))
            if raw is None:
                break  # removed since the positions were read: read again
            size += len(raw)
            if size > ITEMS_QUERY_BYTES:
                return None
            texts.append(raw.decode("utf-8"))
        else:
            if same_items(meta, decode_meta(store.get(meta_key(session)))):
                return texts
    return None

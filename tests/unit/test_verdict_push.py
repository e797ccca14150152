"""`processors.verdict_push.VerdictPush` over real sockets (a socketpair).

The judge's thread writes pushed verdicts itself, so a write must never block
it: what a socket does not take at once waits in a backlog, sent in order at
the next push or flush; a subscriber that does not read is dropped once its
backlog passes the bound (its client then asks). Tried here: a burst far
larger than the socket buffers, read back whole and in order; a reader that
stops reading; a token subscribed twice; an unknown token.
"""

from __future__ import annotations

import socket

import orjson
from threadlog.processors import verdict_push
from threadlog.processors.verdict_push import VerdictPush


def _read_frames(sock: socket.socket, push: VerdictPush, want: int) -> list[list]:
    """Read frames until `want` verdicts arrived, flushing the backlog as the judge's idle turns do."""
    sock.settimeout(5)
    buf = b""
    items: list[list] = []
    while len(items) < want:
        push.flush()
        try:
            chunk = sock.recv(1 << 16)
        except TimeoutError:
            raise AssertionError(f"only {len(items)} of {want} verdicts arrived") from None
        assert chunk, "connection closed"
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            items.extend(orjson.loads(line)["push"])
    return items


def test_a_burst_larger_than_the_socket_arrives_whole_and_in_order():
    push = VerdictPush()
    judge_end, client_end = socket.socketpair()
    try:
        judge_end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        push.subscribe(b"tok", judge_end)
        assert push.active
        verdict = {"ok": True, "result": "x" * 200}
        for batch in range(5):  # 5 batches of 500 verdicts: ~1.2 MB, far over the buffer
            push.push([(b"tok", 0, batch * 500 + n, verdict) for n in range(500)])
        assert push.backlogged  # the socket could not take it all at once; nothing blocked
        items = _read_frames(client_end, push, 2500)
        assert [o for _, o, _ in items] == list(range(2500))
        assert all(v == verdict for _, _, v in items)
        assert not push.backlogged and push.pushed == 2500 and push.dropped == 0
    finally:
        push.close()
        client_end.close()


def test_a_subscriber_that_stops_reading_is_dropped(monkeypatch):
    monkeypatch.setattr(verdict_push, "MAX_BACKLOG", 64 * 1024)
    push = VerdictPush()
    judge_end, client_end = socket.socketpair()
    try:
        push.subscribe(b"tok", judge_end)
        for batch in range(100):
            push.push([(b"tok", 1, batch * 100 + n, {"ok": True, "result": "y" * 500}) for n in range(100)])
            if not push.active:
                break
        assert push.dropped == 1 and not push.active and not push.backlogged
        # Its connection was shut down: the client sees the end of the stream (and asks).
        client_end.settimeout(5)
        while client_end.recv(1 << 16):
            pass
    finally:
        push.close()
        client_end.close()


def test_the_newest_subscription_of_a_token_wins_and_unknown_tokens_are_skipped():
    push = VerdictPush()
    a_judge, a_client = socket.socketpair()
    b_judge, b_client = socket.socketpair()
    try:
        push.subscribe(b"tok", a_judge)
        push.subscribe(b"tok", b_judge)  # the same client reconnected (or a stranger took it)
        push.push([(b"tok", 0, 7, {"ok": True}), (b"other", 0, 8, {"ok": True})])
        assert _read_frames(b_client, push, 1) == [[0, 7, {"ok": True}]]
        a_client.settimeout(5)
        assert a_client.recv(100) == b""  # the older one was closed
        push.unsubscribe(b"tok", a_judge)  # the older connection's end arrives late: changes nothing
        assert push.active
        push.unsubscribe(b"tok", b_judge)
        assert not push.active
    finally:
        push.close()
        a_client.close()
        b_client.close()


def test_idle_subscribers_hear_a_beat_at_most_every_beat_interval():
    push = VerdictPush()
    judge_end, client_end = socket.socketpair()
    try:
        push.subscribe(b"tok", judge_end, b'{"id": 0, "ok": true}\n')
        push.beat()
        push.beat()  # within BEAT_S of the first: nothing
        client_end.settimeout(5)
        got = b""
        while got.count(b"\n") < 2:
            got += client_end.recv(1 << 16)
        assert got == b'{"id": 0, "ok": true}\n' + verdict_push.BEAT  # the greeting first, one beat
        client_end.setblocking(False)
        try:
            extra = client_end.recv(1 << 16)
        except BlockingIOError:
            extra = b""
        assert extra == b""
    finally:
        push.close()
        client_end.close()

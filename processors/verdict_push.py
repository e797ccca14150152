"""Verdicts pushed from the judge's thread to the proposers that wait for them.

A thin client's proposal carries a reply token in a record header
(`REPLY_HEADER`); the client opens one connection to each worker and sends
`push {reply}` on it (processors/query_server.py). From then on, whenever
the judge decides a proposal carrying that token, it writes the verdict to
that connection itself, right after the batch is stored.

Why the judge's thread writes, not the worker's event loop: asking for a
verdict cost a request through the worker's loop and a reply through it
again, and each of those waited for the GIL behind the judge thread (which
hands it over only at CPython's 5 ms switch interval): ~17 of the 21 ms a
thin client waited for a verdict at 16 callers. A socket write of a few
hundred bytes from the thread that just decided costs neither.

What a token is not: a credential. Anyone may put any token on a record;
the worst a forger gets is that the token's holder is told the verdict of
an offset it never wrote, which it ignores (it only waits for offsets its own
producer was acknowledged). Verdicts are a function of the log, so nothing
pushed here can differ from what `verdicts` would answer.

Nothing here may block the judge: sockets are non-blocking, and a connection
that cannot take a whole frame at once (a client that stopped reading) is
shut down -- its client learns the rest by asking (`verdicts`), as before.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterable

import orjson

from threadlog.kernel.topics import REPLY_HEADER

log = logging.getLogger("threadlog.push")


def reply_of(headers: list[tuple[str, bytes | None]] | None) -> bytes | None:
    """The reply token of a record's headers, if it carries one."""
    if headers:
        for name, value in headers:
            if name == REPLY_HEADER:
                return value
    return None


class VerdictPush:
    """Subscribers by reply token; `push` runs on the judge's thread."""

    def __init__(self) -> None:
        # One lock for subscribing, dropping and sending: a socket is closed only
        # under it, so the judge never writes to a descriptor number that was
        # closed and reused by another connection meanwhile.
        self._lock = threading.Lock()
        self._subs: dict[bytes, socket.socket] = {}
        self.pushed = 0  # verdicts written (stats)
        self.dropped = 0  # subscribers shut down because they could not take a frame

    @property
    def active(self) -> bool:
        """Anyone subscribed (the judge reads record headers only then)."""
        return bool(self._subs)

    def subscribe(self, token: bytes, sock: socket.socket) -> None:
        """Push the verdicts of records carrying `token` to `sock` (a duplicate
        descriptor of the connection, owned here from now on)."""
        sock.setblocking(False)
        with self._lock:
            old = self._subs.pop(token, None)
            self._subs[token] = sock
        if old is not None:
            _close(old)  # the same client reconnected: the new connection wins

    def unsubscribe(self, token: bytes, sock: socket.socket) -> None:
        with self._lock:
            if self._subs.get(token) is sock:
                del self._subs[token]
            _close(sock)

    def push(self, verdicts: Iterable[tuple[bytes, int, int, dict]]) -> None:
        """On the judge's thread, after the batch is stored: (token, p, offset, verdict)."""
        frames: dict[bytes, list[list]] = {}
        for token, p, offset, verdict in verdicts:
            frames.setdefault(token, []).append([p, offset, verdict])
        if not frames:
            return
        with self._lock:
            for token, items in frames.items():
                sock = self._subs.get(token)
                if sock is None:
                    continue  # not subscribed here (any more): it asks
                frame = orjson.dumps({"push": items}) + b"\n"
                try:
                    sent = sock.send(frame)
                except OSError:  # gone, or its buffer is full (BlockingIOError)
                    sent = -1
                if sent == len(frame):
                    self.pushed += len(items)
                    continue
                # A partial frame cannot be completed without blocking the judge:
                # end the stream; the client asks for what it still waits for.
                log.info("push connection dropped (%s of %d bytes sent)", sent, len(frame))
                self.dropped += 1
                del self._subs[token]
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                _close(sock)

    def close(self) -> None:
        with self._lock:
            subs, self._subs = self._subs, {}
            for sock in subs.values():
                _close(sock)


def _close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:  # pragma: no cover
        pass

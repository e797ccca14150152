"""Verdicts pushed from the judge's thread to the proposers that wait for them.

A thin client's proposal carries a reply token in a record header
(`REPLY_HEADER`); the client opens one connection to each owner of the
partitions it writes to and sends `push {secret}` on it
(processors/query_server.py), where the token is `reply_token(secret)`. From
then on, whenever the judge decides a proposal carrying that token, it
writes the verdict to that connection itself, right after the batch is stored.

Why the judge's thread writes, not the worker's event loop: asking for a
verdict cost a request through the worker's loop and a reply through it
again, and each of those waited for the GIL behind the judge thread (which
hands it over only at CPython's 5 ms switch interval): ~17 of the 21 ms a
thin client waited for a verdict at 16 callers. A socket write of a few
hundred bytes from the thread that just decided costs neither.

Why a secret and its hash: the token is on every record, readable by anyone
who reads `events`; were it what a subscriber names, a reader could take a
client's pushes away (the newest subscription of a token wins, so that a
client that reconnects is served at once). Only the client knows the secret.
Anyone may still put any token on a record: the worst a forger gets is that
the token's holder is told the verdict of an offset it never wrote, which it
ignores (it only waits for offsets its own producer was acknowledged).
Verdicts are a function of the log, so nothing pushed here can differ from
what `verdicts` would answer.

Nothing here may block the judge: sockets are non-blocking. What a socket
does not take at once (a large burst, a client slow to read) waits in that
subscriber's backlog, sent first at the next push or at the judge's next
idle turn (`flush`); a subscriber whose backlog passes `MAX_BACKLOG` is shut
down -- its client learns the rest by asking (`verdicts`), as before.
"""

from __future__ import annotations

import hashlib
import logging
import socket
import threading
import time
from collections.abc import Iterable

from threadlog.kernel import wire

log = logging.getLogger("threadlog.push")

# An idle subscriber gets an empty frame this often: a client that hears
# nothing for a few beats takes the connection for dead (a crashed host or a
# partition sends no FIN) and asks until it reconnects.
BEAT_S = 2.0
BEAT = b'{"push":[]}\n'


def reply_token(secret: str) -> bytes:
    """The header value of a client's proposals, from the secret it subscribes with."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()[:32].encode("ascii")


MAX_BACKLOG = 4 * 1024 * 1024  # bytes waiting for one subscriber's socket before it is dropped


class _Subscriber:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.out = bytearray()  # frames (or their tails) the socket did not take yet


class VerdictPush:
    """Subscribers by reply token; `push` and `flush` run on the judge's thread."""

    def __init__(self) -> None:
        # One lock for subscribing, dropping and sending: a socket is closed only
        # under it, so the judge never writes to a descriptor number that was
        # closed and reused by another connection meanwhile.
        self._lock = threading.Lock()
        self._subs: dict[bytes, _Subscriber] = {}
        self._backlogged: set[bytes] = set()
        self._beat_at = 0.0
        self.pushed = 0  # verdicts written (stats)
        self.dropped = 0  # subscribers shut down because they did not read

    @property
    def active(self) -> bool:
        """Anyone subscribed (the judge reads record headers only then)."""
        return bool(self._subs)

    @property
    def backlogged(self) -> bool:
        return bool(self._backlogged)

    def subscribe(self, token: bytes, sock: socket.socket, greeting: bytes = b"") -> None:
        """Push the verdicts of records carrying `token` to `sock` (a duplicate
        descriptor of the connection, owned here from now on), after `greeting`
        (the answer to the `push` request: sent under the same lock as every
        push, so nothing can come before it)."""
        sock.setblocking(False)
        with self._lock:
            old = self._subs.pop(token, None)
            self._backlogged.discard(token)
            if old is not None:
                # The same client reconnected: the newest connection wins, and the
                # old one is ended (its reader must see the end, not silence).
                self._drop(token, old, "replaced", count=False)
            sub = self._subs[token] = _Subscriber(sock)
            sub.out += greeting
            self._send(token, sub)

    def unsubscribe(self, token: bytes, sock: socket.socket) -> None:
        with self._lock:
            sub = self._subs.get(token)
            if sub is not None and sub.sock is sock:
                del self._subs[token]
                self._backlogged.discard(token)
            _close(sock)

    def push(self, verdicts: Iterable[tuple[bytes, int, int, dict]]) -> None:
        """On the judge's thread, after the batch is stored: (token, p, offset, verdict)."""
        frames: dict[bytes, list[list]] = {}
        for token, p, offset, verdict in verdicts:
            frames.setdefault(token, []).append([p, offset, verdict])
        self._write(frames, "push")

    def push_deliveries(self, answers: Iterable[tuple[bytes, list]]) -> None:
        """On the run index's thread, after its batch is stored: (token, [d, x, verdict, fence, state])
        -- what `dlv_verdict` would answer about the delivery record at (d, x)."""
        frames: dict[bytes, list[list]] = {}
        for token, item in answers:
            frames.setdefault(token, []).append(item)
        self._write(frames, "dlv")

    def _write(self, frames: dict[bytes, list[list]], kind: str) -> None:
        if not frames:
            return
        with self._lock:
            for token, items in frames.items():
                sub = self._subs.get(token)
                if sub is None:
                    continue  # not subscribed here (any more): it asks
                try:
                    frame = wire.dumps({kind: items})
                except (TypeError, ValueError):
                    # Never fails the judge's batch or other clients' frames: this
                    # client asks for these verdicts after its grace (and is told why).
                    log.exception("a %s frame could not be written as JSON: not pushed", kind)
                    continue
                sub.out += frame + b"\n"
                self.pushed += len(items)
                self._send(token, sub)

    def flush(self) -> None:
        """Send what sockets did not take before (the judge's idle turns)."""
        with self._lock:
            for token in list(self._backlogged):
                sub = self._subs.get(token)
                if sub is not None:
                    self._send(token, sub)

    def _send(self, token: bytes, sub: _Subscriber) -> None:
        try:
            sent = sub.sock.send(sub.out)
        except BlockingIOError:
            sent = 0
        except OSError:  # the client went away
            self._drop(token, sub, "gone")
            return
        del sub.out[:sent]
        if not sub.out:
            self._backlogged.discard(token)
        elif len(sub.out) > MAX_BACKLOG:
            self._drop(token, sub, f"{len(sub.out)} bytes unread")
        else:
            self._backlogged.add(token)

    def beat(self) -> None:
        """An empty frame to every subscriber, every BEAT_S at most (the judge's idle turns)."""
        now = time.monotonic()
        if now - self._beat_at < BEAT_S:
            return
        self._beat_at = now
        with self._lock:
            for token, sub in list(self._subs.items()):
                sub.out += BEAT
                self._send(token, sub)

    def _drop(self, token: bytes, sub: _Subscriber, why: str, count: bool = True) -> None:
        log.info("push connection dropped (%s): its client asks for its verdicts", why)
        if count:
            self.dropped += 1
        if self._subs.get(token) is sub:
            del self._subs[token]
            self._backlogged.discard(token)
        try:
            sub.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        _close(sub.sock)

    def close(self) -> None:
        with self._lock:
            subs, self._subs = self._subs, {}
            self._backlogged.clear()
            for sub in subs.values():
                _close(sub.sock)


def _close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:  # pragma: no cover
        pass

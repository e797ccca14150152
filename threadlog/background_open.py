"""Opening a client on a background event-loop thread, for a waiter that may give up.

The blocking client (`threadlog.connect`) and the blocking LangGraph saver
each run a `ThreadLog` on a loop thread of their own and wait for its open
with a timeout. Cancelling an open midway stranded what it had started
(followers, pumps, the state slot's lock: the next open then took another slot
and folded the namespace again). So the open is never cancelled: whoever
finishes last owns the client. If the waiter was still waiting, it takes the
client; if it gave up first, the open closes the client it made and stops the
loop, whose thread then ends.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from collections.abc import Awaitable, Coroutine
from typing import TYPE_CHECKING, Any

from .kernel.errors import unavailable

if TYPE_CHECKING:
    from .client import ThreadLog

log = logging.getLogger("threadlog.open")

FORKED = ("this client was connected in another process (before os.fork): its loop thread and "
          "connections are not in this one; connect again here")


def require_same_process(pid: int, coro: Coroutine[Any, Any, Any] | None = None) -> None:
    """UNAVAILABLE at once in a process other than `pid`, the one whose loop thread
    serves the client (`coro`, the call that will not run, is closed first).

    Why: after os.fork (gunicorn --preload, Celery prefork) the child has no
    loop thread; a call handed to the parent's loop never started, and waited
    out its whole timeout to say OUTCOME_UNKNOWN ("a write may still apply")
    for a write never sent (a review, both blocking clients)."""
    if os.getpid() != pid:
        if coro is not None:
            coro.close()
        raise unavailable(FORKED)


class BackgroundOpen:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        # The open (on the loop) and the waiter (another thread) agree under this
        # lock on who owns what the open returns.
        self._lock = threading.Lock()
        self._abandoned = False
        self.opened: ThreadLog | None = None

    async def run(self, opener: Awaitable[ThreadLog]) -> None:
        """Run on the loop: open; if the waiter gave up meanwhile, close it and stop the loop."""
        abandoned = False
        try:
            try:
                tl = await opener
            except Exception as exc:
                with self._lock:
                    if not self._abandoned:
                        raise  # the waiter's to raise
                # Nobody waits for it (the waiter already raised UNAVAILABLE): said
                # here, not as asyncio's "Task exception was never retrieved" once
                # the loop, stopped below, drops the task (a review).
                log.info("an open given up on by its caller failed: %s", exc)
                return
            with self._lock:
                abandoned = self._abandoned
                if not abandoned:
                    self.opened = tl
            if abandoned:
                await tl.close()
        finally:
            with self._lock:
                abandoned = self._abandoned
            if abandoned:
                self._loop.stop()

    def wait(self, fut: concurrent.futures.Future[None], timeout: float) -> ThreadLog | None:
        """From the waiter's thread: wait for `fut` (`run` on the loop) at most
        `timeout` s. The client, or None: the waiter gave up (the open goes on
        and closes itself). Raises what the open raised."""
        try:
            done, _ = concurrent.futures.wait([fut], timeout)
        except BaseException:
            # Interrupted while waiting (KeyboardInterrupt): nobody will take the
            # client, so the open closes it itself; the caller must not stop the loop.
            self.give_up()
            raise
        if not done and self.give_up():
            return None
        if done:
            fut.result()
        assert self.opened is not None  # (or it finished between the wait and give_up)
        return self.opened

    @property
    def abandoned(self) -> bool:
        """The waiter gave up: the open closes what it opens and stops the loop itself."""
        with self._lock:
            return self._abandoned

    def give_up(self) -> bool:
        """The waiter stops waiting. True: the open had not finished, and now
        closes what it opens itself; False: it finished in the instant between
        the wait and this call, and `opened` is the waiter's."""
        with self._lock:
            if self.opened is not None:
                return False
            self._abandoned = True
            return True

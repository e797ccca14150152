"""Serve a producer's delivery callbacks from a background thread."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from confluent_kafka import Producer


def settle(fut: asyncio.Future, exc: BaseException | None, value: Any) -> None:
    """Complete an awaited produce (on the caller's loop: call_soon_threadsafe), once."""
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)


class ProducerPump:
    """librdkafka calls delivery callbacks only from `poll`/`flush`: this thread
    polls, so an awaited produce completes without the caller polling."""

    def __init__(self, producer: Producer, name: str) -> None:
        self.producer = producer
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.producer.poll(0.05)

    def stop(self, flush_timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.producer.flush(flush_timeout)

"""A catch-up fetch cancelled by its client closing is UNAVAILABLE, not a CancelledError.

Tried (a review): closing a client shuts its read executor down with
`cancel_futures=True`; a reader whose next batch was queued there got the
job's CancelledError. That is no Exception, so an SSE stream took it for its
own cancellation and ended with no last bytes (uvicorn: "returned without
completing response") instead of the cut a closing client sends.

No broker: a real librdkafka consumer (never polled) from the real pool, the
real executor; the job stays queued behind a blocker until it is cancelled.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from threadlog.delivery.reader import ConsumerPool, Fetcher
from threadlog.kernel.errors import ThreadLogError


async def submitted(fetcher: Fetcher, seconds: float = 10.0) -> None:
    """Until the fetcher's job is on the executor (bounded: a bug fails, never hangs)."""
    deadline = asyncio.get_running_loop().time() + seconds
    while fetcher._job is None:
        assert asyncio.get_running_loop().time() < deadline, "the fetch was never submitted"
        await asyncio.sleep(0.001)


@pytest.fixture
async def queued():
    """A fetcher whose first job waits on a one-thread executor, behind a blocker."""
    executor = ThreadPoolExecutor(max_workers=1)
    release = threading.Event()
    executor.submit(release.wait, 30)  # the one thread, busy: the fetch waits in the queue
    pool = ConsumerPool("127.0.0.1:1", "cancel-test")
    svc = SimpleNamespace(executor=executor, pool=pool, topic="ns.deliveries", timeout=5.0,
                          closing=threading.Event())
    fetcher = Fetcher(svc, "run", 0, 0)  # type: ignore[arg-type]
    batch = asyncio.ensure_future(fetcher.next_batch(10))
    try:
        await submitted(fetcher)  # a real consumer was taken and assigned first
        yield svc, batch
    finally:
        release.set()
        fetcher.release()
        executor.shutdown(wait=True)
        pool.close()


async def test_a_fetch_the_closing_client_cancelled_is_unavailable(queued):
    svc, batch = queued
    svc.closing.set()
    svc.executor.shutdown(wait=False, cancel_futures=True)
    with pytest.raises(ThreadLogError) as err:
        await asyncio.wait_for(batch, 10)
    assert err.value.code == "UNAVAILABLE"


async def test_a_reader_cancelled_itself_is_still_cancelled(queued):
    _, batch = queued
    batch.cancel()
    with pytest.raises(asyncio.CancelledError):
        await batch

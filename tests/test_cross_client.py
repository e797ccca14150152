"""Read-your-writes across clients (SPEC section 2: every read reflects every
write acknowledged before it began, whichever process made it)."""

from __future__ import annotations

import asyncio

from support import within


async def test_second_client_reads_first_clients_write_immediately(open_client):
    a = await open_client()
    b = await open_client()
    for n in range(20):
        await within(a.messages.save_thread(f"t{n % 3}", [{"n": n}]))
        # No retry, no sleep: the very first read must see it.
        assert await within(b.messages.load_thread(f"t{n % 3}")) == [{"n": n}]
        await within(b.messages.save_thread(f"t{n % 3}", [{"n": -n}]))
        assert await within(a.messages.load_thread(f"t{n % 3}")) == [{"n": -n}]


async def test_an_external_client_and_another_host_agree(open_client):
    deciding = await open_client()
    external = await open_client(processors="external")
    await within(external.messages.save_thread("t", ["from external"]))
    assert await within(deciding.messages.load_thread("t")) == ["from external"]
    assert await within(external.messages.load_thread("t")) == ["from external"]


async def test_concurrent_writers_on_many_threads_all_land(open_client):
    a = await open_client()
    b = await open_client()

    async def writer(client, tag):
        for n in range(15):
            await client.messages.save_thread(f"{tag}-{n}", [tag, n])

    await within(asyncio.gather(writer(a, "a"), writer(b, "b")), 60)
    for tag in ("a", "b"):
        for n in range(15):
            for client in (a, b):
                assert await within(client.messages.load_thread(f"{tag}-{n}")) == [tag, n]


async def test_a_remembered_run_is_read_fresh_after_another_clients_writes(open_client, monkeypatch):
    """A client remembers where a run and an interrupt live (they never move),
    and skips finding them again; its reads still see every write another
    client acknowledged before they began: each passes a barrier on the
    thread's partition (asserted, since a fold may be quick enough to hide a
    missing one)."""
    a = await open_client()
    b = await open_client()
    await within(a.runs.create_or_resume(run_id="r", thread_id="t", started_at=1))
    await within(a.interrupts.create({"interruptId": "i", "threadId": "t", "runId": "r", "requestedAt": 2,
                                      "payload": {}}))
    assert (await within(b.runs.get("r")))["status"] == "running"
    assert (await within(b.interrupts.get("i")))["status"] == "pending"
    barriers: list[tuple[str, ...] | None] = []
    real_barrier = b.session.read_barrier

    async def read_barrier(keys):
        barriers.append(None if keys is None else tuple(keys))
        await real_barrier(keys)

    monkeypatch.setattr(b.session, "read_barrier", read_barrier)
    for n in range(5):
        await within(a.runs.update("r", {"usage": {"n": n}}))
        barriers.clear()
        assert (await within(b.runs.get("r")))["usage"] == {"n": n}
        assert barriers == [("t",)]  # remembered: the thread's partition only, with its barrier
        await within(b.runs.update("r", {"usage": {"n": -n}}))
        assert (await within(a.runs.get("r")))["usage"] == {"n": -n}
    await within(a.interrupts.resolve("i", "yes"))
    barriers.clear()
    assert (await within(b.interrupts.get("i")))["response"] == "yes"
    assert barriers == [("t",)]
    await within(a.runs.update("r", {"status": "completed"}))
    assert (await within(b.runs.get("r")))["status"] == "completed"

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

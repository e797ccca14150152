"""Concurrency on a real broker: racing writers on one head, racing lease grants,
racing forks, and read-your-writes between two processes."""

from __future__ import annotations

import asyncio

from checkpoint_helpers import checkpoint, threads_on_distinct_partitions
from support import within

import threadlog
from threadlog import ThreadLogError
from threadlog.kernel.partitioning import partition_for


async def outcomes(calls) -> tuple[list, list[ThreadLogError]]:
    results = await within(asyncio.gather(*calls, return_exceptions=True), 60)
    unexpected = [r for r in results if isinstance(r, BaseException) and not isinstance(r, ThreadLogError)]
    assert not unexpected, unexpected
    return ([r for r in results if not isinstance(r, BaseException)],
            [r for r in results if isinstance(r, ThreadLogError)])


async def test_twenty_racing_appends_on_one_head_exactly_one_wins(open_client):
    a = await open_client()
    b = await open_client()
    lease = await within(a.checkpoints.acquire_writer("t"))
    await within(a.checkpoints.append(checkpoint=checkpoint("base", "t"), expected_head_id=None, writer=lease))
    writer = threadlog.Writer("t", lease.owner_token, lease.fence)
    calls = [
        (a if n % 2 else b).checkpoints.append(checkpoint=checkpoint(f"racer-{n}", "t", "base", created_at=100 + n),
                                               expected_head_id="base", writer=writer)
        for n in range(20)
    ]
    won, lost = await outcomes(calls)
    assert len(won) == 1 and len(lost) == 19
    assert {e.code for e in lost} == {"SANDBOX_SNAPSHOT_STALE_HEAD"}
    for client in (a, b):
        assert await within(client.checkpoints.get_head("t")) == won[0]
        assert [c["id"] for c in await within(client.checkpoints.list("t"))] == ["base", won[0]]
        assert await within(client.checkpoints.get(won[0])) == checkpoint(won[0], "t", "base",
                                                                           created_at=100 + int(won[0].split("-")[1]))


async def test_ten_racing_acquires_grant_exactly_one_lease(open_client):
    a = await open_client()
    b = await open_client()
    won, lost = await outcomes([(a if n % 2 else b).checkpoints.acquire_writer("t") for n in range(10)])
    assert len(won) == 1 and len(lost) == 9
    assert {e.code for e in lost} == {"SANDBOX_SNAPSHOT_WRITER_CONFLICT"}
    assert won[0].fence == 1
    # The one lease works; nobody else got a token.
    assert await within(b.checkpoints.append(checkpoint=checkpoint("c1", "t"), expected_head_id=None,
                                             writer=won[0])) == "c1"
    await within(won[0].release())
    assert (await within(a.checkpoints.acquire_writer("t"))).fence == 2


async def test_racing_first_writes_of_one_id_on_one_partition_admit_one(tl):
    # Threads on one partition are decided by one decider, in log order: a racing
    # duplicate id across them is caught. (Across partitions this is the
    # documented, non-linearized case; see README.)
    p = partition_for("anchor", tl.runtime.layout.events)
    threads = [t for t in (f"same-part-{n}" for n in range(400)) if partition_for(t, tl.runtime.layout.events) == p]
    threads = threads[:10]
    assert len(threads) == 10
    leases = await within(asyncio.gather(*[tl.checkpoints.acquire_writer(t) for t in threads]))
    won, lost = await outcomes([
        tl.checkpoints.append(checkpoint=checkpoint("one-id", t), expected_head_id=None, writer=w)
        for t, w in zip(threads, leases, strict=True)
    ])
    assert won == ["one-id"] and {e.code for e in lost} == {"SANDBOX_SNAPSHOT_DUPLICATE_ID"}
    owner = (await within(tl.checkpoints.get("one-id")))["threadId"]
    heads = {t: await within(tl.checkpoints.get_head(t)) for t in threads}
    assert heads == {t: ("one-id" if t == owner else None) for t in threads}


async def test_racing_forks_into_one_destination_create_one_root(open_client):
    a = await open_client()
    b = await open_client()
    sources = threads_on_distinct_partitions(a, 4, prefix="src")
    for n, s in enumerate(sources):
        w = await within(a.checkpoints.acquire_writer(s))
        await within(a.checkpoints.append(checkpoint=checkpoint(f"s{n}", s, conversation=[n]),
                                          expected_head_id=None, writer=w))
    dest = "destination"
    dw = await within(b.checkpoints.acquire_writer(dest))
    calls = [
        (a if n % 2 else b).checkpoints.fork_from_checkpoint(
            source_thread_id=s, source_checkpoint_id=f"s{n}", destination_thread_id=dest,
            destination_checkpoint_id=f"root-{n}-{k}", created_at=n, writer=dw)
        for n, s in enumerate(sources) for k in range(3)
    ]
    won, lost = await outcomes(calls)
    assert len(won) == 1 and len(lost) == len(calls) - 1
    assert {e.code for e in lost} == {"SANDBOX_SNAPSHOT_FORK_DESTINATION_NOT_EMPTY"}
    root = won[0]
    n = int(root["id"].split("-")[1])
    for client in (a, b):
        assert await within(client.checkpoints.list(dest)) == [root]
        assert await within(client.messages.load_thread(dest)) == [n]


async def test_two_clients_see_each_others_appends_immediately(open_client):
    a = await open_client()
    b = await open_client()
    threads = threads_on_distinct_partitions(a, 4)
    leases = {t: await within(a.checkpoints.acquire_writer(t)) for t in threads}
    heads: dict[str, str | None] = dict.fromkeys(threads)
    for n in range(12):
        t = threads[n % len(threads)]
        writer, reader = (a, b) if n % 2 == 0 else (b, a)
        cid = f"c{n}"
        await within(writer.checkpoints.append(checkpoint=checkpoint(cid, t, heads[t], created_at=n),
                                               expected_head_id=heads[t], writer=leases[t]))
        heads[t] = cid
        # No retry, no sleep: the other process's very first read sees it.
        assert await within(reader.checkpoints.get_head(t)) == cid
        assert (await within(reader.checkpoints.get(cid)))["threadId"] == t
        assert (await within(reader.checkpoints.list(t)))[-1]["id"] == cid
    deleted = heads[threads[0]]
    await within(b.checkpoints.delete_head(thread_id=threads[0], checkpoint_id=deleted, writer=leases[threads[0]]))
    assert await within(a.checkpoints.get(deleted)) is None
    assert await within(a.checkpoints.get_head(threads[0])) != deleted


async def test_parallel_chains_on_many_threads_all_land(open_client):
    a = await open_client()
    b = await open_client()

    async def chain(client, t: str, length: int) -> list[str]:
        lease = await client.checkpoints.acquire_writer(t)
        head = None
        for n in range(length):
            head = await client.checkpoints.append(checkpoint=checkpoint(f"{t}/{n}", t, head, created_at=n),
                                                   expected_head_id=head, writer=lease)
        return [f"{t}/{n}" for n in range(length)]

    threads = [f"chain-{n}" for n in range(12)]
    expected = await within(asyncio.gather(*[chain(a if n % 2 else b, t, 6) for n, t in enumerate(threads)]), 90)
    for client in (a, b):
        for t, ids in zip(threads, expected, strict=True):
            listed = await within(client.checkpoints.list(t))
            assert [c["id"] for c in listed] == ids
            assert [c["parentCheckpointId"] for c in listed] == [None, *ids[:-1]]
            assert await within(client.checkpoints.get_head(t)) == ids[-1]

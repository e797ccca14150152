"""The decider's state survives restarts; projections rebuild from offset 0."""

from __future__ import annotations

from support import read_topic, within
from threadlog.projections.rebuild import rebuild


def _seqs_by_key(bootstrap, tl) -> dict[str, list[int]]:
    codec = tl.runtime.codec
    out: dict[str, list[int]] = {}
    for msg in read_topic(bootstrap, tl.runtime.topics.events, tl.runtime.layout.events):
        _, env = codec.decode(msg.value(), expect="threadlog.Event")
        out.setdefault(env["key"], []).append(env["seq"])
    return out


async def test_decider_restarted_between_writes_resumes_from_its_state(open_client, tmp_path, bootstrap):
    state = str(tmp_path / "host-1")
    first = await open_client(state_dir=state)
    await within(first.messages.save_thread("t", ["one"]))
    await first.close()
    # Same host, same store: the restarted decider resumes from its stored positions.
    again = await open_client(state_dir=state)
    await within(again.messages.save_thread("t", ["one", "two"]))
    assert await within(again.messages.load_thread("t")) == ["one", "two"]
    await again.close()
    # A new host with an empty store must fold the log before deciding: the
    # per-thread sequence continues instead of starting over.
    new_host = await open_client(state_dir=str(tmp_path / "host-2"))
    await within(new_host.messages.save_thread("t", ["one", "two", "three"]))
    assert await within(new_host.messages.load_thread("t")) == ["one", "two", "three"]
    assert _seqs_by_key(bootstrap, new_host)["t"] == [1, 2, 3]


async def test_full_rebuild_from_offset_zero_yields_the_same_reads(open_client, tmp_path, bootstrap, namespace):
    state = tmp_path / "host"
    tl = await open_client(state_dir=str(state))
    expected = {}
    for n in range(30):
        tid = f"thread-{n % 7}"
        expected[tid] = [{"n": n, "text": "é" * n}]
        await within(tl.messages.save_thread(tid, expected[tid]))
    before = {tid: await within(tl.messages.load_thread(tid)) for tid in expected}
    assert before == expected
    store_path = tl.runtime.store.path
    await tl.close()

    lines: list[str] = []
    stats = rebuild(bootstrap, namespace, store_path, progress=lines.append)
    assert stats["offsets"] > 0 and stats["skipped"] == 0
    assert lines and lines[-1].endswith(f"{stats['offsets']}/{stats['offsets']} offsets folded")

    reopened = await open_client(state_dir=str(state), processors="external")
    assert reopened.runtime.store.path == store_path
    assert {tid: await within(reopened.messages.load_thread(tid)) for tid in expected} == before
    # And a host that never saw the namespace folds it from zero to the same reads.
    fresh = await open_client(state_dir=str(tmp_path / "fresh"), processors="external")
    assert {tid: await within(fresh.messages.load_thread(tid)) for tid in expected} == before
    assert all(seqs == list(range(1, len(seqs) + 1)) for seqs in _seqs_by_key(bootstrap, fresh).values())

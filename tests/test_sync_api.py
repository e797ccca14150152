"""The blocking client `threadlog.connect(...)` end to end, on a real broker.

A representative part of the suite driven through the sync API: every store,
the delivery log as a blocking iterator, error codes, the request-timeout
bound, close semantics, and use from several OS threads at once. No asyncio
here: these tests are what a Django view, a Flask route or a script does.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import import_module

import pytest
from checkpoint_helpers import LaggingFollower, artifact, checkpoint, file_key
from support import in_forked_child

import threadlog
from threadlog import ThreadLogError, sync

# Every wait in a test is bounded; the client bounds each call by its request
# timeout too, so this only catches a test that waits on a thread that hangs.
WAIT = 60


@pytest.fixture
def connect(bootstrap, namespace, tmp_path):
    """Factory: `connect(**options)` opens a blocking client, closed after the test."""
    opened: list[threadlog.SyncThreadLog] = []
    slots = itertools.count()

    def factory(**kwargs) -> threadlog.SyncThreadLog:
        kwargs.setdefault("namespace", namespace)
        # A state dir per client: two clients of a test are two hosts.
        kwargs.setdefault("state_dir", str(tmp_path / f"sync-{next(slots)}"))
        client = threadlog.connect(bootstrap, **kwargs)
        opened.append(client)
        return client

    yield factory
    for client in reversed(opened):
        client.close()


@pytest.fixture
def tl(connect):
    return connect()


def code_of(call, *args, **kwargs) -> str:
    with pytest.raises(ThreadLogError) as err:
        call(*args, **kwargs)
    return err.value.code


def ui(mid: str, role: str, text: str) -> dict:
    """A UIMessage, the shape @tanstack/ai-client's hydrate() takes."""
    return {"id": mid, "role": role, "parts": [{"type": "text", "content": text}]}


# -- lifecycle ----------------------------------------------------------------------------
def test_connect_is_a_context_manager_with_one_loop_thread(bootstrap, namespace, tmp_path):
    before = set(threading.enumerate())
    with threadlog.connect(bootstrap, namespace=namespace, state_dir=str(tmp_path / "s")) as tl:
        assert isinstance(tl, threadlog.SyncThreadLog)
        loops = [t for t in set(threading.enumerate()) - before if t.name == "threadlog-sync-loop"]
        assert len(loops) == 1
        tl.messages.save_thread("t", [ui("m1", "user", "hi")])
        assert tl.messages.load_thread("t") == [ui("m1", "user", "hi")]
    assert tl.closed
    assert not loops[0].is_alive()
    assert code_of(tl.messages.load_thread, "t") == "UNAVAILABLE"
    tl.close()  # closing twice is harmless


@pytest.mark.parametrize("options", [
    {"namespace": "bad namespace!"},
    {"renew_after_ms": 5_000, "lease_duration_ms": 5_000},
    {"lease_duration_ms": 0},
])
def test_bad_options_are_refused_by_connect_before_any_thread_starts(bootstrap, options):
    def loops() -> int:
        return sum(t.name == "threadlog-sync-loop" for t in threading.enumerate())

    before = loops()
    assert code_of(threadlog.connect, bootstrap, **options) == "INVALID_ARGUMENT"
    assert loops() == before


def test_an_unreachable_cluster_fails_connect_within_its_bound(tmp_path):
    def loops() -> int:
        return sum(t.name == "threadlog-sync-loop" for t in threading.enumerate())

    before = loops()
    started = time.monotonic()
    # Port 1 refuses connections: topic creation gives up after the request timeout.
    assert code_of(threadlog.connect, "127.0.0.1:1", namespace="nobody-home", request_timeout_ms=1_500,
                   state_dir=str(tmp_path / "s")) == "UNAVAILABLE"
    assert time.monotonic() - started < 1.5 + 30  # the request timeout + connect's grace for opening
    assert loops() == before  # the loop thread was stopped


# -- messages ---------------------------------------------------------------------------------
def test_messages_round_trip_ui_messages(tl):
    transcript = [
        ui("m1", "system", "You are terse."),
        ui("m2", "user", "héllo — 你好 🌍"),
        {"id": "m3", "role": "assistant", "parts": [{"type": "text", "content": "hi"},
                                                    {"type": "tool-call", "id": "c1", "arguments": "{}"}]},
    ]
    assert tl.messages.load_thread("thread-1") == []
    tl.messages.save_thread("thread-1", transcript)
    loaded = tl.messages.load_thread("thread-1")
    assert loaded == transcript
    loaded[0]["id"] = "mutated"  # a fresh copy
    tl.messages.save_thread("thread-1", transcript[:1])  # replaces the whole transcript
    assert tl.messages.load_thread("thread-1") == transcript[:1]
    assert code_of(tl.messages.save_thread, "", []) == "INVALID_ARGUMENT"


# -- checkpoints ----------------------------------------------------------------------------------
def test_checkpoint_lease_append_cas_and_head(tl):
    lease = tl.checkpoints.acquire_writer("thread-a")
    assert (lease.thread_id, lease.fence) == ("thread-a", 1)
    assert lease.renew_after_ms == 45_000 and lease.expires_at > 0
    assert code_of(tl.checkpoints.acquire_writer, "thread-a") == "SANDBOX_SNAPSHOT_WRITER_CONFLICT"
    old_expiry = lease.expires_at
    assert lease.renew() >= old_expiry and lease.expires_at >= old_expiry

    assert tl.checkpoints.append(checkpoint=checkpoint("c1", "thread-a"), expected_head_id=None, writer=lease) == "c1"
    # The head is c1: an append that expects no head loses the compare-and-set.
    assert code_of(tl.checkpoints.append, checkpoint=checkpoint("c2", "thread-a"), expected_head_id=None,
                   writer=lease) == "SANDBOX_SNAPSHOT_STALE_HEAD"
    assert code_of(tl.checkpoints.append, checkpoint=checkpoint("c2", "thread-a", parent=None), expected_head_id="c1",
                   writer=lease) == "SANDBOX_SNAPSHOT_PARENT_MISMATCH"
    assert code_of(tl.checkpoints.append, checkpoint=checkpoint("c1", "thread-a", parent="c1"), expected_head_id="c1",
                   writer=lease) == "SANDBOX_SNAPSHOT_DUPLICATE_ID"
    assert tl.checkpoints.append(checkpoint=checkpoint("c2", "thread-a", parent="c1", created_at=20),
                                 expected_head_id="c1", writer=lease) == "c2"
    assert tl.checkpoints.get_head("thread-a") == "c2"
    assert [c["id"] for c in tl.checkpoints.list("thread-a")] == ["c1", "c2"]
    assert tl.checkpoints.get("c1")["parentCheckpointId"] is None
    assert tl.checkpoints.list_blob_references() == [{"key": file_key("a"), "references": 2}]

    tl.checkpoints.delete_head(thread_id="thread-a", checkpoint_id="c2", writer=lease)
    assert tl.checkpoints.get_head("thread-a") == "c1"
    assert code_of(tl.checkpoints.delete_head, thread_id="thread-a", checkpoint_id="c2",
                   writer=lease) == "SANDBOX_SNAPSHOT_NOT_HEAD"

    lease.release()
    lease.release()  # a stale lease is left alone, silently
    assert code_of(tl.checkpoints.append, checkpoint=checkpoint("c3", "thread-a", parent="c1"), expected_head_id="c1",
                   writer=lease) == "SANDBOX_SNAPSHOT_WRITER_LOST"
    assert code_of(lease.renew) == "SANDBOX_SNAPSHOT_WRITER_LOST"
    # A plain Writer value works too; the fence is never reused.
    again = tl.checkpoints.acquire_writer("thread-a")
    assert again.fence == 2
    writer = threadlog.Writer(again.thread_id, again.owner_token, again.fence)
    assert tl.checkpoints.append(checkpoint=checkpoint("c3", "thread-a", parent="c1"), expected_head_id="c1",
                                 writer=writer) == "c3"


def test_checkpoint_fork_copies_the_selected_checkpoint(tl):
    src = tl.checkpoints.acquire_writer("src")
    tl.checkpoints.append(checkpoint=checkpoint("s1", "src", label="first"), expected_head_id=None, writer=src)
    tl.checkpoints.append(checkpoint=checkpoint("s2", "src", parent="s1", created_at=20), expected_head_id="s1",
                          writer=src)
    dst = tl.checkpoints.acquire_writer("dst")
    # A writer of the source thread cannot fork into the destination.
    assert code_of(tl.checkpoints.fork_from_checkpoint, source_thread_id="src", source_checkpoint_id="s1",
                   destination_thread_id="dst", destination_checkpoint_id="d1", created_at=30,
                   writer=src) == "SANDBOX_SNAPSHOT_WRITER_LOST"
    assert code_of(tl.checkpoints.fork_from_checkpoint, source_thread_id="src", source_checkpoint_id="nope",
                   destination_thread_id="dst", destination_checkpoint_id="d1", created_at=30,
                   writer=dst) == "SANDBOX_SNAPSHOT_FORK_SOURCE_NOT_FOUND"
    root = tl.checkpoints.fork_from_checkpoint(source_thread_id="src", source_checkpoint_id="s1",
                                               destination_thread_id="dst", destination_checkpoint_id="d1",
                                               created_at=30, writer=dst)
    source = tl.checkpoints.get("s1")
    assert root == {"id": "d1", "threadId": "dst", "parentCheckpointId": None, "createdAt": 30,
                    "reason": "fork-root", "files": source["files"], "conversation": source["conversation"],
                    "artifacts": source["artifacts"]}
    assert tl.checkpoints.get_head("dst") == "d1"
    assert tl.messages.load_thread("dst") == source["conversation"]
    assert tl.checkpoints.get_head("src") == "s2"  # the source is unchanged
    assert code_of(tl.checkpoints.fork_from_checkpoint, source_thread_id="src", source_checkpoint_id="s1",
                   destination_thread_id="dst", destination_checkpoint_id="d2", created_at=40,
                   writer=dst) == "SANDBOX_SNAPSHOT_FORK_DESTINATION_NOT_EMPTY"


# -- runs, generation runs, interrupts ------------------------------------------------------------------
def test_runs_create_update_claim(tl):
    run = tl.runs.create_or_resume(run_id="run-1", thread_id="thread-r", started_at=1000)
    assert run == {"runId": "run-1", "threadId": "thread-r", "status": "running", "startedAt": 1000}
    # Idempotent: an existing run comes back unchanged, arguments ignored.
    assert tl.runs.create_or_resume(run_id="run-1", thread_id="thread-r", started_at=5, status="failed") == run
    tl.runs.update("run-1", {"usage": {"tokens": 12}, "detachedSince": 1500})
    assert tl.runs.get("run-1")["usage"] == {"tokens": 12}
    assert [r["runId"] for r in tl.runs.list_reclaimable(now=2000, ttl_ms=500)] == ["run-1"]
    assert tl.runs.find_active_run("thread-r")["runId"] == "run-1"
    assert code_of(tl.runs.update, "run-1", {"colour": "red"}) == "INVALID_ARGUMENT"
    assert code_of(tl.runs.update, "run-1", {"status": "sleeping"}) == "INVALID_ARGUMENT"

    assert tl.runs.claim("run-1") == 1
    assert tl.runs.claim("run-1") == 2
    assert tl.runs.get("run-1")["driverEpoch"] == 2
    assert code_of(tl.runs.claim, "no-such-run") == "RUN_NOT_FOUND"

    tl.runs.update("run-1", {"status": "completed", "finishedAt": 3000, "detachedSince": None})
    done = tl.runs.get("run-1")
    assert done["status"] == "completed" and "detachedSince" not in done
    assert code_of(tl.runs.claim, "run-1") == "RUN_TERMINAL"
    assert tl.runs.find_active_run("thread-r") is None
    assert [r["runId"] for r in tl.runs.list_by_thread("thread-r")] == ["run-1"]


def test_generation_runs(tl):
    g = tl.generation_runs.create_or_resume(run_id="gen-1", thread_id="thread-g", activity="image",
                                            provider="openai", model="gpt-image-1", started_at=10)
    assert g["status"] == "running"
    tl.generation_runs.update("gen-1", {"status": "completed", "result": {"url": "https://x/y.png"}})
    assert tl.generation_runs.find_latest_for_thread("thread-g")["result"] == {"url": "https://x/y.png"}
    assert tl.generation_runs.get("nope") is None


def test_interrupts_create_resolve_cancel(tl):
    base = {"runId": "run-i", "threadId": "thread-i", "payload": {"question": "deploy?"}}
    tl.interrupts.create({"interruptId": "i1", "requestedAt": 10, **base})
    tl.interrupts.create({"interruptId": "i2", "requestedAt": 20, **base})
    assert [i["interruptId"] for i in tl.interrupts.list_pending("thread-i")] == ["i1", "i2"]
    resolved = tl.interrupts.resolve("i1", {"approved": True})
    assert resolved["status"] == "resolved" and resolved["response"] == {"approved": True}
    assert "resolvedAt" in resolved
    assert tl.interrupts.cancel("i1") == resolved  # the first decision is final
    assert tl.interrupts.cancel("i2")["status"] == "cancelled"
    assert tl.interrupts.resolve("unknown") is None
    assert [i["status"] for i in tl.interrupts.list_by_run("run-i")] == ["resolved", "cancelled"]
    assert tl.interrupts.list_pending_by_run("run-i") == []
    assert code_of(tl.interrupts.create, {"interruptId": "i3", "requestedAt": 1, "status": "pending",
                                          **base}) == "INVALID_ARGUMENT"


# -- metadata, artifacts ---------------------------------------------------------------------------------
def test_metadata(tl):
    tl.metadata.set("a:b", "c", {"v": 1})
    tl.metadata.set("a", "b:c", [1, 2])
    assert tl.metadata.get("a:b", "c") == {"v": 1}
    assert tl.metadata.get("a", "b:c") == [1, 2]
    tl.metadata.delete("a:b", "c")
    tl.metadata.delete("a:b", "c")  # silent when absent
    assert tl.metadata.get("a:b", "c") is None
    assert code_of(tl.metadata.set, "ns", "k", float("nan")) == "INVALID_ARGUMENT"


def test_artifacts(tl):
    record = {"artifactId": "art-1", "runId": "run-a", "threadId": "thread-x", "name": "report.pdf",
              "mimeType": "application/pdf", "size": 3, "createdAt": 5, "sourceUrl": None}
    tl.artifacts.save(record)
    stored = tl.artifacts.get("art-1")
    assert stored == {k: v for k, v in record.items() if v is not None}  # None on input = absent
    tl.artifacts.save({**record, "artifactId": "art-2", "createdAt": 4, "blobKey": "blobs/art-2"})
    assert [a["artifactId"] for a in tl.artifacts.list("run-a")] == ["art-2", "art-1"]
    assert [a["artifactId"] for a in tl.artifacts.list_for_thread("thread-x")] == ["art-2", "art-1"]
    tl.artifacts.delete("art-2")
    assert tl.artifacts.get("art-2") is None
    tl.artifacts.delete_for_run("run-a")
    assert tl.artifacts.list("run-a") == []
    assert code_of(tl.artifacts.save, {**record, "extra": 1}) == "INVALID_ARGUMENT"


# -- blobs -------------------------------------------------------------------------------------------------
def test_blob_put_get_range_list_delete(tl):
    info = tl.blobs.put("docs/a.txt", "héllo", content_type="text/plain", custom_metadata={"lang": "fr"})
    assert info["size"] == len("héllo".encode()) and info["contentType"] == "text/plain"
    got = tl.blobs.get("docs/a.txt")
    assert got["body"] == "héllo".encode() and "range" not in got
    part = tl.blobs.get("docs/a.txt", range={"offset": 1, "length": 100})
    assert part["body"] == "héllo".encode()[1:] and part["range"] == {"offset": 1, "length": 5}
    assert part["size"] == 6
    assert code_of(tl.blobs.get, "docs/a.txt", range={"offset": 6}) == "INVALID_ARGUMENT"
    assert code_of(tl.blobs.get, "missing", range={"offset": -1}) == "INVALID_ARGUMENT"
    assert tl.blobs.head("docs/a.txt") == info
    tl.blobs.put("docs/b.txt", b"b")
    tl.blobs.put("other", bytearray(b"o"))
    page = tl.blobs.list(prefix="docs/", limit=1)
    assert [o["key"] for o in page["objects"]] == ["docs/a.txt"] and page["truncated"] is True
    rest = tl.blobs.list(prefix="docs/", cursor=page["cursor"])
    assert [o["key"] for o in rest["objects"]] == ["docs/b.txt"] and "truncated" not in rest
    tl.blobs.delete("docs/a.txt")
    tl.blobs.delete("docs/a.txt")  # silent when absent
    assert tl.blobs.get("docs/a.txt") is None


def test_blob_put_streams_a_sync_iterable_larger_than_one_message(tl):
    piece = os.urandom(256 * 1024)
    read_by: set[str] = set()

    def body():
        # A generator of the caller's thread, as a file read or a DB cursor would be.
        for _ in range(10):
            read_by.add(threading.current_thread().name)
            yield piece

    info = tl.blobs.put("big", body(), expected_length=1)  # the length is only a hint
    assert info["size"] == 10 * len(piece)
    assert read_by == {threading.current_thread().name}
    assert tl.blobs.get("big")["body"] == piece * 10
    tail = tl.blobs.get("big", range={"offset": 10 * len(piece) - 3})
    assert tail["body"] == piece[-3:] and tail["range"] == {"offset": 10 * len(piece) - 3, "length": 3}
    # Any iterable of byte chunks: a list, a tuple of memoryviews.
    assert tl.blobs.put("list", [b"ab", b"cd"])["size"] == 4
    assert tl.blobs.get("list")["body"] == b"abcd"


def test_bad_blob_streams_are_refused_and_store_nothing(tl):
    assert code_of(tl.blobs.put, "s", iter([b"ok", "a str chunk"])) == "INVALID_ARGUMENT"
    assert code_of(tl.blobs.put, "d", {"not": "a body"}) == "INVALID_ARGUMENT"
    assert code_of(tl.blobs.put, "n", 42) == "INVALID_ARGUMENT"

    def failing():
        yield b"first"
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        tl.blobs.put("f", failing())
    assert tl.blobs.list()["objects"] == []


# -- delivery ------------------------------------------------------------------------------------------------
def test_delivery_append_read_across_a_close_and_snapshot(tl):
    log = tl.delivery("run-d")
    [o0, o1] = log.append([{"type": "TEXT", "delta": "he"}, {"type": "TEXT", "delta": "llo"}])
    assert log.append([]) == []
    with ThreadPoolExecutor(1) as pool:
        # A reader in another thread, from the start: it gets what is there, then
        # what comes, and its iteration ends when the log is closed.
        reading = pool.submit(lambda: list(tl.delivery("run-d").read("-1")))
        [o2] = log.append([{"type": "DONE"}])
        log.close()
        got = reading.result(WAIT)
    assert got == [(o0, {"type": "TEXT", "delta": "he"}), (o1, {"type": "TEXT", "delta": "llo"}),
                   (o2, {"type": "DONE"})]
    assert len({o0, o1, o2}) == 3
    assert log.snapshot() == got
    assert list(log.read(o0)) == got[1:]  # strictly after the cursor
    assert list(log.read("now")) == []  # a closed log ends at once
    assert code_of(log.append, [{"late": True}]) == "RUN_LOG_CLOSED"
    log.close()  # closing twice is harmless
    assert tl.delivery("never-ran").snapshot() == []


def test_delivery_rejoin_from_the_start_on_a_new_client(connect):
    writer = connect()
    log = writer.delivery("run-rejoin")
    offsets = log.append([{"n": 0}, {"n": 1}])
    writer.close()  # the first host goes away, its log still open

    reader = connect()  # another host: its own full replica
    seen = []
    ready = threading.Event()  # the reader holds both chunks written before the close

    with ThreadPoolExecutor(1) as pool:
        def follow():
            for offset, chunk in reader.delivery("run-rejoin").read("-1"):
                seen.append((offset, chunk))
                if len(seen) == 2:
                    ready.set()
            return seen

        following = pool.submit(follow)
        assert ready.wait(WAIT)
        third = connect()  # a new driver host finishes the run
        [o2] = third.delivery("run-rejoin").append([{"n": 2}])
        third.delivery("run-rejoin").close()
        got = following.result(WAIT)
    assert got == [(offsets[0], {"n": 0}), (offsets[1], {"n": 1}), (o2, {"n": 2})]


def test_delivery_fencing_upsert_and_offset_errors(tl):
    tl.runs.create_or_resume(run_id="run-f", thread_id="thread-f", started_at=1)
    first = tl.delivery("run-f", epoch=tl.runs.claim("run-f"))
    [a] = first.append([{"n": 0}])
    second = tl.delivery("run-f", epoch=tl.runs.claim("run-f"))
    assert code_of(first.append, [{"n": "zombie"}]) == "RUN_CLAIM_LOST"
    assert second.upsert([(a, {"n": "replaced"})]) == [a]
    assert second.snapshot() == [(a, {"n": "replaced"})]
    assert code_of(second.upsert, [("0.999.0.bad", {})]) == "INVALID_OFFSET"
    assert code_of(next, second.read("not-an-offset")) == "INVALID_OFFSET"
    other = tl.delivery("run-other")
    other.append([{"x": 1}])
    assert code_of(next, other.read(a)) == "INVALID_OFFSET"  # minted for another run
    assert code_of(tl.delivery, "") == "INVALID_ARGUMENT"


def test_read_from_start_of_a_silent_run_raises_run_not_found(connect):
    tl = connect(first_chunk_wait_ms=300)
    reader = tl.delivery("silent").read("-1")
    assert code_of(next, reader) == "RUN_NOT_FOUND"
    assert next(reader, "ended") == "ended"  # an error ends the iteration


# -- bounds and close -----------------------------------------------------------------------------------------
def test_an_idle_reader_is_bounded_by_the_request_timeout_and_resumes(connect):
    tl = connect(request_timeout_ms=2_000)
    log, o0, reader = past_first_chunk(tl, "run-idle")
    started = time.monotonic()
    assert code_of(next, reader) == "UNAVAILABLE"  # no chunk came within the request timeout
    assert 1.9 <= time.monotonic() - started < 20
    assert next(reader, "ended") == "ended"
    # The documented recovery: read again after the last offset held.
    [o1] = log.append([{"n": 1}])
    with log.read(o0) as resumed:
        assert next(resumed) == (o1, {"n": 1})


def test_close_cancels_calls_in_flight_with_unavailable(connect):
    tl = connect()
    log = tl.delivery("run-shutdown")
    log.append([{"n": 0}])
    reader = log.read("-1")
    next(reader)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(next, reader)  # parks on the live feed: the log is open
        tl.close()
        with pytest.raises(ThreadLogError) as err:
            waiting.result(WAIT)
    assert err.value.code == "UNAVAILABLE"
    assert code_of(log.append, [{"n": 1}]) == "UNAVAILABLE"
    assert code_of(tl.delivery, "run-shutdown") == "UNAVAILABLE"


# -- several OS threads -----------------------------------------------------------------------------------------
def test_many_os_threads_share_one_client(tl):
    tl.runs.create_or_resume(run_id="run-shared", thread_id="thread-shared", started_at=1)

    def work(n: int) -> tuple[int, int]:
        thread = f"thread-{n}"
        transcript = [ui(f"m{n}-{i}", "user", f"message {i} of {n}") for i in range(3)]
        tl.messages.save_thread(thread, transcript)
        assert tl.messages.load_thread(thread) == transcript
        tl.metadata.set("workers", str(n), {"n": n})
        lease = tl.checkpoints.acquire_writer(thread)
        tl.checkpoints.append(checkpoint=checkpoint(f"cp-{n}", thread), expected_head_id=None, writer=lease)
        return n, tl.runs.claim("run-shared")

    with ThreadPoolExecutor(8) as pool:
        results = [f.result(WAIT) for f in [pool.submit(work, n) for n in range(16)]]
    # Claims from 16 threads: every epoch handed out exactly once.
    assert sorted(epoch for _, epoch in results) == list(range(1, 17))
    assert all(tl.metadata.get("workers", str(n)) == {"n": n} for n in range(16))
    assert all(tl.checkpoints.get_head(f"thread-{n}") == f"cp-{n}" for n in range(16))


def test_readers_and_writers_on_different_threads(tl):
    runs = [f"run-{n}" for n in range(4)]

    def drive(run_id: str) -> list:
        log = tl.delivery(run_id)
        offsets = [log.append([{"run": run_id, "i": i}])[0] for i in range(5)]
        log.close()
        return offsets

    def read(run_id: str) -> list:
        return [offset for offset, _ in tl.delivery(run_id).read("-1")]

    # Readers first: each waits (bounded by first_chunk_wait_ms) for its run's first chunk.
    with ThreadPoolExecutor(8) as pool:
        readers = [pool.submit(read, r) for r in runs]
        drivers = [pool.submit(drive, r) for r in runs]
        written = [d.result(WAIT) for d in drivers]
        assert [r.result(WAIT) for r in readers] == written


def test_artifact_helper_shape_is_accepted_in_a_checkpoint(tl):
    # Checkpoint artifacts (inside a checkpoint) are a different record from tl.artifacts.
    lease = tl.checkpoints.acquire_writer("thread-art")
    cp = checkpoint("ca", "thread-art", artifacts=[artifact()])
    tl.checkpoints.append(checkpoint=cp, expected_head_id=None, writer=lease)
    assert tl.checkpoints.get("ca")["artifacts"] == [artifact()]


# -- parity ---------------------------------------------------------------------------------------------------------
def _public(cls: type) -> set[str]:
    return {name for name in dir(cls) if not name.startswith("_") and callable(getattr(cls, name))}


@pytest.mark.parametrize(("async_cls", "sync_cls"), [
    ("stores.messages.MessageStore", "SyncMessageStore"),
    ("stores.checkpoints.CheckpointStore", "SyncCheckpointStore"),
    ("stores.runs.RunStore", "SyncRunStore"),
    ("stores.interrupts.InterruptStore", "SyncInterruptStore"),
    ("stores.generation_runs.GenerationRunStore", "SyncGenerationRunStore"),
    ("stores.metadata.MetadataStore", "SyncMetadataStore"),
    ("stores.artifacts.ArtifactStore", "SyncArtifactStore"),
    ("stores.blobs.BlobStore", "SyncBlobStore"),
    ("stores.checkpoints.WriterLease", "SyncWriterLease"),
    ("stores.run_driver.RunDriver", "SyncRunDriver"),
])
def test_the_sync_stores_have_the_async_stores_methods(async_cls, sync_cls):
    module, _, name = async_cls.rpartition(".")
    async_methods = _public(getattr(import_module(f"threadlog.{module}"), name))
    if name == "BlobStore":
        async_methods.discard("close")  # plumbing of ThreadLog.close(), not a user method
    assert _public(getattr(sync, sync_cls)) == async_methods


def test_the_sync_delivery_log_has_the_spec_methods():
    assert _public(sync.SyncDeliveryLog) == {"append", "read", "snapshot", "close", "upsert"}


def _lag_judge(tl: threadlog.SyncThreadLog, seconds: float) -> None:
    """Hold the embedded judge for `seconds` (it folds nothing meanwhile)."""
    inner = tl._async()

    async def lag() -> None:
        await LaggingFollower(inner, seconds).__aenter__()

    asyncio.run_coroutine_threadsafe(lag(), tl._loop).result(10)


def _warm(tl: threadlog.SyncThreadLog, *more) -> None:
    """One write through (and each of `more`), so the producers have their ids and
    the judge its partitions: with a 1 s request timeout, the first write of a
    fresh client on a loaded machine can itself time out (then it is tried
    again, within a bound)."""
    for write in (lambda: tl.messages.save_thread("warm", []), *more):
        deadline = time.monotonic() + 30
        while True:
            try:
                write()
                break
            except ThreadLogError as exc:
                if exc.code not in ("OUTCOME_UNKNOWN", "UNAVAILABLE") or time.monotonic() > deadline:
                    raise


def test_a_write_whose_verdict_is_late_is_outcome_unknown_not_unavailable(connect):
    """Tried: a blocking acquire_writer while the judge lags longer than the request
    timeout. The proposal is written, so UNAVAILABLE ("nothing was written") was
    wrong: the blocking wait raced the call's own deadline. The call's own
    OUTCOME_UNKNOWN comes through, and the grant does apply later."""
    tl = connect(request_timeout_ms=1_000)
    _warm(tl)
    _lag_judge(tl, 3.0)
    assert code_of(tl.checkpoints.acquire_writer, "t", auto_renew=False) == "OUTCOME_UNKNOWN"
    deadline = time.monotonic() + 15
    while code_of(tl.checkpoints.acquire_writer, "t", auto_renew=False) != "SANDBOX_SNAPSHOT_WRITER_CONFLICT":
        assert time.monotonic() < deadline, "the late grant never applied"
        time.sleep(0.2)


def test_a_call_bounded_by_itself_is_not_cut_at_one_request_timeout(connect):
    """A fork is two proposals, each within the request timeout: the blocking wait
    of one timeout cut such calls short with UNAVAILABLE ("nothing was written")
    while they went on. Tried with a call that takes 1.5 request timeouts."""
    tl = connect(request_timeout_ms=1_000)

    async def two_steps() -> str:
        await asyncio.sleep(0.75)
        await asyncio.sleep(0.75)
        return "both applied"

    assert tl._run(two_steps()) == "both applied"


# -- found by a review of the blocking client (2026-12-03) ----------------------------------------------------
def _events_end(tl: threadlog.SyncThreadLog) -> int:
    """How many records the namespace's events topic holds (every partition), asked
    through the client's own end-offset rounds (not its judge, which may be held)."""
    ends = asyncio.run_coroutine_threadsafe(tl._async().runtime.barrier.end_offsets(), tl._loop).result(WAIT)
    return sum(ends.values())


def test_a_streamed_blob_put_whose_commit_is_late_is_outcome_unknown(connect):
    """Tried: a blob put from a sync iterable whose commit verdict comes after the
    request timeout. The wait after the body's end was one request timeout, so it
    said UNAVAILABLE ("nothing written") while the commit went on and stored the
    blob. It is now OUTCOME_UNKNOWN, as for a whole body, and the blob appears."""
    tl = connect(request_timeout_ms=1_000)
    _warm(tl, lambda: tl.blobs.put("warm", b"w"))  # the chunk producer too

    def body():
        yield b"hello "
        _lag_judge(tl, 3.0)  # from the body's end on, the commit is judged late
        yield b"world"

    assert code_of(tl.blobs.put, "late", body()) == "OUTCOME_UNKNOWN"
    deadline = time.monotonic() + 20
    while tl.blobs.head("late") is None:
        assert time.monotonic() < deadline, "the late commit never applied"
        time.sleep(0.2)
    assert tl.blobs.head("late")["size"] == len(b"hello world")


def test_close_under_a_write_in_flight_says_outcome_unknown_and_the_write_applies(connect):
    """Tried: close() while a blocking save_thread's proposal is in Kafka and its
    verdict not yet known. The call said UNAVAILABLE ("nothing was written"), and
    the transcript was then stored. It now says OUTCOME_UNKNOWN, as the async
    client's close does; a call that sent nothing still says UNAVAILABLE
    (test_close_cancels_calls_in_flight_with_unavailable)."""
    tl = connect()
    tl.messages.save_thread("warm", [])
    before = _events_end(tl)
    _lag_judge(tl, 10.0)  # longer than finding the proposal in the log below can take
    with ThreadPoolExecutor(1) as pool:
        saving = pool.submit(tl.messages.save_thread, "t1", [ui("m1", "user", "hi")])
        deadline = time.monotonic() + 20
        while _events_end(tl) == before:  # its proposal is written
            assert time.monotonic() < deadline, "the proposal never reached the log"
            time.sleep(0.05)
        tl.close()
        with pytest.raises(ThreadLogError) as err:
            saving.result(WAIT)
    assert err.value.code == "OUTCOME_UNKNOWN", err.value
    with connect() as other:
        assert other.messages.load_thread("t1") == [ui("m1", "user", "hi")]


def test_a_first_chunk_wait_longer_than_the_request_timeout_is_kept(connect):
    """Tried: first_chunk_wait_ms above request_timeout_ms. A blocking read("-1")
    gave up after one request timeout (UNAVAILABLE): a silent run never got its
    RUN_NOT_FOUND, and a first chunk arriving within the wait was missed."""
    tl = connect(request_timeout_ms=1_000, first_chunk_wait_ms=5_000)
    _warm(tl, lambda: tl.delivery("warm").append([{"n": 0}]))  # the delivery producer too
    started = time.monotonic()
    assert code_of(next, tl.delivery("silent").read("-1")) == "RUN_NOT_FOUND"
    assert time.monotonic() - started >= 4.9
    log = tl.delivery("late")
    reader = log.read("-1")
    appended: list[object] = []

    def append_late() -> None:
        try:
            appended.append(log.append([{"n": 1}]))
        except ThreadLogError as exc:  # seen by the assertion below, not lost in the timer's thread
            appended.append(exc)

    later = threading.Timer(1.5, append_late)  # after one request timeout, well within the wait
    later.start()
    try:
        _offset, chunk = next(reader)
    finally:
        later.join(WAIT)
    assert chunk == {"n": 1}, appended
    reader.close()


def test_connect_takes_every_option_of_open(bootstrap, namespace, tmp_path):
    """`connect` lacked kafka=, create_topics=, replication_factor= and
    min_insync_replicas= (a TypeError): no blocking client for a secured cluster."""
    with pytest.raises(ThreadLogError) as err:
        threadlog.connect(bootstrap, namespace=namespace, state_dir=str(tmp_path), create_topics=False)
    assert err.value.code == "NAMESPACE_NOT_FOUND"
    with pytest.raises(ThreadLogError) as err:  # passed through to open, which refuses it
        threadlog.connect(bootstrap, namespace=namespace, state_dir=str(tmp_path), kafka={"acks": "1"})
    assert err.value.code == "INVALID_ARGUMENT" and "acks" in err.value.message
    with threadlog.connect(bootstrap, namespace=namespace, state_dir=str(tmp_path), replication_factor=1,
                           min_insync_replicas=1, kafka={"client.id": "sync-test"}) as tl:
        tl.metadata.set("ns", "k", 1)
        assert tl.metadata.get("ns", "k") == 1


def test_a_run_driver_closed_after_its_client_closes_quietly(connect):
    """As the async driver: leaving `with tl.runs.drive(r)` after the client was
    closed raised UNAVAILABLE."""
    tl = connect()
    tl.runs.create_or_resume(run_id="r1", thread_id="t1", started_at=1)
    tl.runs.claim("r1")
    driver = tl.runs.drive("r1")
    tl.close()
    driver.close()  # no error
    assert not driver.heartbeating


def test_close_under_a_delivery_append_in_flight_says_outcome_unknown(connect):
    """Tried (a review of the fix above): close() while a blocking delivery append's
    record is written and its run-index verdict not yet learned: UNAVAILABLE,
    though the chunk was stored. Delivery records count as sent writes too."""
    tl = connect()
    tl.delivery("warm").append([{"n": 0}])
    svc = tl._async()._delivery
    decide = svc.runs.decide
    deciding = threading.Event()

    async def slow_decide(*args, **kwargs):
        deciding.set()  # the record is written: its verdict is awaited
        await asyncio.sleep(30)  # cancelled by close()
        return await decide(*args, **kwargs)

    svc.runs.decide = slow_decide
    with ThreadPoolExecutor(1) as pool:
        appending = pool.submit(tl.delivery("r1").append, [{"n": 1}])
        assert deciding.wait(WAIT)
        tl.close()
        with pytest.raises(ThreadLogError) as err:
            appending.result(WAIT)
    assert err.value.code == "OUTCOME_UNKNOWN", err.value
    with connect() as other:
        assert [c for _, c in other.delivery("r1").snapshot()] == [{"n": 1}]


def in_thread(call) -> tuple[threading.Thread, list[object]]:
    """Start `call()` in another thread; its result or exception lands in the list."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:  # what the calling thread gets is the point
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def until_a_task_more(client, before: int, thread: threading.Thread, outcome: list[object]) -> None:
    """Wait (bounded) until the other thread's call is on the loop, waiting (no event says so)."""
    deadline = time.monotonic() + WAIT
    while len(client._tasks) <= before:
        assert time.monotonic() < deadline and thread.is_alive(), outcome
        time.sleep(0.01)


def past_first_chunk(tl, run_id: str):
    """A run's log with one chunk, and a reader that has read it: (log, its offset, reader)."""
    log = tl.delivery(run_id)
    [o0] = log.append([{"n": 0}])
    reader = log.read("-1")
    assert next(reader) == (o0, {"n": 0})
    return log, o0, reader


def test_a_streamed_blob_put_cut_by_close_raises_a_threadlog_error(tl):
    # Tried (a review): close() while a streamed put's chunk hand-off waited (the
    # feed full, the put not taking more): the caller got the hand-off's
    # concurrent.futures.CancelledError, which `except ThreadLogError` misses.
    # Made deterministic here: a put whose body is never read (a feed nobody
    # consumes) and a hand-off into its full queue.
    blobs = tl.blobs
    feed = sync._Feed()
    for _ in range(sync._FEED_DEPTH):  # the queue full: the next push waits
        blobs._c._run(feed.push(b"x"))
    never = blobs._c._submit(asyncio.Event().wait())  # a put that takes no chunk
    before = len(blobs._c._tasks)
    caller, outcome = in_thread(lambda: blobs._hand_over(feed, b"y", never))
    until_a_task_more(blobs._c, before, caller, outcome)
    tl.close()
    caller.join(WAIT)
    assert not caller.is_alive()
    # The hand-off says the put ended; the put's own wait then raises a ThreadLogError.
    assert outcome == [False] and never.cancelled()
    with pytest.raises(ThreadLogError) as err:
        blobs._c._wait(never, "the blob put", backstop=True)
    assert err.value.code == "UNAVAILABLE" and "closed" in err.value.message


def test_a_reader_closed_from_another_thread_ends_the_next_waiting_in_its_own(connect):
    # Tried (a review): a thread blocked in next() on a live log, and close() of
    # the reader from another (an SSE watchdog): close raised RuntimeError
    # ("aclose(): asynchronous generator is already running") and the blocked
    # next() went on waiting until the request timeout.
    tl = connect(request_timeout_ms=30_000)
    log, o0, reader = past_first_chunk(tl, "run-watched")
    before = len(tl._tasks)
    waiting, outcome = in_thread(lambda: next(reader, "ended"))
    until_a_task_more(tl, before, waiting, outcome)  # its step is on the loop
    reader.close()  # from this thread
    waiting.join(10)  # well inside the 30 s request timeout
    assert not waiting.is_alive() and outcome == ["ended"]
    assert next(reader, "ended") == "ended"
    # The client is unharmed: another reader of the same log reads it.
    with log.read("-1") as again:
        assert next(again) == (o0, {"n": 0})


def test_a_reader_closed_as_its_next_starts_in_another_thread_reads_nothing_more(connect, monkeypatch):
    # Tried (a review): close() from another thread in the instant between a
    # next()'s check and its step reaching the loop: the step then started a new
    # read from the beginning (the first chunk again, and a live iterator left
    # behind), or blocked until the request timeout. The instant is widened here.
    tl = connect(request_timeout_ms=30_000)
    _, _, reader = past_first_chunk(tl, "run-race")
    entered = threading.Event()
    submit = tl._submit

    def slow_submit(coro):
        entered.set()
        time.sleep(0.3)  # the window a close() from another thread fell into
        return submit(coro)

    monkeypatch.setattr(tl, "_submit", slow_submit)
    waiting, outcome = in_thread(lambda: next(reader, "ended"))
    assert entered.wait(WAIT)
    monkeypatch.setattr(tl, "_submit", submit)
    reader.close()
    waiting.join(10)  # well inside the 30 s request timeout
    assert not waiting.is_alive() and outcome == ["ended"]
    assert reader._it is None  # no read left behind


# -- found by a review of the blocking client (2026-12-04) ----------------------------------------------------
def test_a_streamed_put_from_an_iterator_reusing_its_buffer_stores_every_chunk(tl):
    """Tried (a review): a body read with readinto into one buffer, yielding views
    of it. Up to 4 chunks waited in the hand-off queue while the iterator went on
    overwriting the buffer: the blob stored had the right size and the wrong
    bytes, with no error (the async put copies each chunk before asking the
    next). Each chunk is copied at the hand-off now. (24 MiB: more than the put
    keeps in flight, so it waits for acknowledgements while chunks queue.)"""
    data = os.urandom(24 * 1024 * 1024 + 123)

    def reads():
        buf = bytearray(64 * 1024)
        for start in range(0, len(data), len(buf)):
            n = len(data[start:start + len(buf)])
            buf[:n] = data[start:start + n]
            yield memoryview(buf)[:n]

    tl.blobs.put("reused", reads())
    got = tl.blobs.get("reused")
    assert got is not None and got["size"] == len(data)
    assert bytes(got["body"]) == data


def test_a_streamed_put_refused_up_front_reads_nothing_of_the_body(tl):
    """Tried (a review): a streamed put with expected_length -1 (INVALID_ARGUMENT)
    pulled 3 chunks of the caller's iterator before raising, where the async
    put pulls none; an iterator may read a socket or a cursor."""
    pulled: list[int] = []

    def body():
        for n in range(10):
            pulled.append(n)
            yield b"x" * 1024

    assert code_of(tl.blobs.put, "refused", body(), expected_length=-1) == "INVALID_ARGUMENT"
    assert pulled == []
    assert tl.blobs.head("refused") is None


def test_a_read_cut_by_the_backstop_is_unavailable_not_outcome_unknown(connect, monkeypatch):
    """Tried (a review): a read that ran past the blocking wait's backstop (4
    request timeouts + 5 s) raised OUTCOME_UNKNOWN, "a write may still apply",
    for a call that writes nothing."""
    # Backstop: 9 s. At 250 ms (6 s) the fixture's close -- bounded by one request
    # timeout -- did not finish once on a loaded machine (CI, 2026-12-06): an error
    # in teardown, not this test's; as in the next test.
    tl = connect(request_timeout_ms=1_000)
    store = tl._async().checkpoints

    async def slow_get(checkpoint_id):
        await asyncio.sleep(30)

    monkeypatch.setattr(store, "get", slow_get)
    started = time.monotonic()
    assert code_of(tl.checkpoints.get, "c") == "UNAVAILABLE"
    assert time.monotonic() - started < 15


def test_history_is_not_cut_by_the_backstop_while_it_progresses(connect, monkeypatch):
    """Tried (a review): history re-judges the thread's partition from offset 0,
    which grows with the partition; the blocking wait cut it at 4 request
    timeouts + 5 s with OUTCOME_UNKNOWN (80 000 records at a 1 s timeout). Its
    every wait inside is bounded, so the blocking call waits for it."""
    # Backstop: 9 s. (At 250 ms, the fixture's close -- bounded by one request
    # timeout -- sometimes did not finish on a loaded machine: an error, not this test's.)
    tl = connect(request_timeout_ms=1_000)
    client = tl._async()

    async def long_history(thread_id):
        for _ in range(12):  # 12 s of progress, each step well within a timeout of its own
            await asyncio.sleep(1)
        return [{"thread": thread_id}]

    monkeypatch.setattr(client, "history", long_history)
    assert tl.history("t") == [{"thread": "t"}]


def test_a_client_used_after_os_fork_fails_at_once_in_the_child(tl):
    """Tried (a review): gunicorn --preload / Celery prefork. The child has no loop
    thread: its calls waited out the whole backstop (125 s by default), then said
    OUTCOME_UNKNOWN even for a read, and its close() waited a request timeout
    for UNAVAILABLE. The child's calls are UNAVAILABLE at once; its close()
    forgets the client; the parent's client goes on."""
    tl.metadata.set("ns", "k", 1)

    def child() -> str:
        started = time.monotonic()
        try:
            tl.metadata.get("ns", "k")
            outcome = "no error"
        except ThreadLogError as exc:
            outcome = exc.code
        elapsed = time.monotonic() - started
        tl.close()
        return f"{outcome} {elapsed:.3f} {tl.closed}"

    code, elapsed, closed = in_forked_child(child).split()
    assert code == "UNAVAILABLE" and float(elapsed) < 1.0 and closed == "True"
    assert tl.metadata.get("ns", "k") == 1


def test_a_history_in_flight_ends_when_close_gives_up_on_it(connect, monkeypatch):
    """Tried (a review of the unbounded history wait): close() cancels the call,
    waits a request timeout for it, gives up and stops the loop. The history,
    still pending there, never completed its future, and the thread that
    called it waited forever. It now ends UNAVAILABLE once the loop is gone."""
    tl = connect(request_timeout_ms=1_000)
    client = tl._async()

    entered = threading.Event()

    async def slow_to_stop(thread_id):
        entered.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(60)
        await asyncio.sleep(5)  # stopping takes longer than close() waits

    monkeypatch.setattr(client, "history", slow_to_stop)
    outcome: list[str] = []

    def call() -> None:
        try:
            tl.history("t")
            outcome.append("returned")
        except ThreadLogError as exc:
            outcome.append(exc.code)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    assert entered.wait(WAIT)  # the call runs on the loop
    assert code_of(tl.close) == "UNAVAILABLE"  # close gave up on the call
    caller.join(10)
    assert not caller.is_alive() and outcome == ["UNAVAILABLE"]

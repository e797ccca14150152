"""Builders shared by the checkpoint tests."""

from __future__ import annotations

import copy
import time

from threadlog.kernel.partitioning import partition_for


def file_key(ch: str) -> str:
    return f"sandbox-files/sha256/{ch * 64}"


def artifact_key(ch: str) -> str:
    return f"sandbox-artifacts/sha256/{ch * 64}"


def checkpoint(cid: str, thread: str, parent: str | None = None, created_at: float = 10, **overrides) -> dict:
    cp = {
        "id": cid,
        "threadId": thread,
        "parentCheckpointId": parent,
        "createdAt": created_at,
        "reason": "automatic",
        "files": [
            {"path": "src", "kind": "dir"},
            {"path": "src/a.txt", "kind": "file", "blobKey": file_key("a"), "size": 1},
        ],
        "conversation": [{"role": "user", "content": f"at {cid}"}],
        "artifacts": [],
    }
    cp.update(copy.deepcopy(overrides))
    return cp


def artifact(aid: str = "art-1", ch: str = "b", **overrides) -> dict:
    art = {"artifactId": aid, "name": "report.pdf", "mimeType": "application/pdf", "size": 3,
           "blobKey": artifact_key(ch), "createdAt": 5}
    art.update(overrides)
    return art


async def thread_state(tl, thread: str) -> dict:
    """Everything observable about one thread and the blob references."""
    return {
        "head": await tl.checkpoints.get_head(thread),
        "checkpoints": await tl.checkpoints.list(thread),
        "transcript": await tl.messages.load_thread(thread),
        "references": await tl.checkpoints.list_blob_references(),
    }


def threads_on_distinct_partitions(tl, count: int, prefix: str = "thread") -> list[str]:
    """`count` thread ids whose events land on pairwise different partitions."""
    partitions = tl.runtime.layout.events
    out: dict[int, str] = {}
    n = 0
    while len(out) < min(count, partitions):
        tid = f"{prefix}-{n}"
        out.setdefault(partition_for(tid, partitions), tid)
        n += 1
    return list(out.values())


class MutableClock:
    """An injectable decider clock (epoch ms) that tests move by hand."""

    def __init__(self, now: float | None = None) -> None:
        self.now = time.time() * 1000.0 if now is None else now

    def __call__(self) -> float:
        return self.now

    def advance(self, ms: float) -> None:
        self.now += ms


async def refused(call, code: str):
    """Await `call`, which must fail with `ThreadLogError` of `code`; returns the error."""
    from support import within

    from threadlog import ThreadLogError

    try:
        await within(call)
    except ThreadLogError as exc:
        assert exc.code == code, f"expected {code}, got {exc.code}: {exc.message}"
        assert exc.message, "a refusal says what was wrong"
        return exc
    raise AssertionError(f"expected a refusal with {code}, but the call succeeded")


async def threads_owned_by(clients: list, prefix: str = "owned") -> list[str]:
    """One thread id per client, on pairwise different partitions. (Round 1 split
    partitions between the clients' deciders; in Core v2 every client judges
    every partition, so different partitions are what the tests need.)"""
    return threads_on_distinct_partitions(clients[0], len(clients), prefix)


class LaggingFollower:
    """Holds a client's store lock so its judge cannot fold anything (fault
    injection: a judge that lags behind the log), for at most `seconds`.

    A proposal that must see another partition's facts is judged as of the
    positions it names, so a lagging judge waits for them instead of judging
    against its store as it is."""

    def __init__(self, client, seconds: float) -> None:
        self.lock = client.runtime.store.lock
        self.seconds = seconds

    async def __aenter__(self) -> LaggingFollower:
        import asyncio

        await asyncio.to_thread(self.lock.acquire)
        asyncio.get_running_loop().call_later(self.seconds, self.release)
        return self

    def release(self) -> None:
        if self.lock.locked():
            self.lock.release()

    async def __aexit__(self, *exc) -> None:
        pass  # released by the timer: the judge under test is waiting for it

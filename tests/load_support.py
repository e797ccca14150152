"""A mixed client load for fault tests (broker kills, outages): every call timed and recorded.

`Load` drives one client: transcript saves on two threads and checkpoint
appends through a writer. It records every call (how long it took, its error
code) and every acknowledged write; a write whose outcome is not known (an
error) is remembered as 'maybe': it may appear later, but is never required.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from checkpoint_helpers import checkpoint

import threadlog
from threadlog.kernel.errors import STALE_HEAD, ThreadLogError

# A call that has not ended after this long is recorded as a hang (and not waited for).
HANG_AFTER = 40.0


@dataclass
class Call:
    op: str
    started: float
    took: float
    code: str | None  # None: succeeded
    message: str = ""

    @property
    def ended(self) -> float:
        return self.started + self.took


@dataclass
class Calls:
    """Every call of one load, timed, with its outcome."""

    calls: list[Call] = field(default_factory=list)

    async def call(self, op: str, coro) -> tuple[bool, Any]:
        t0 = time.monotonic()
        try:
            result = await asyncio.wait_for(coro, HANG_AFTER)
        except ThreadLogError as exc:
            self.calls.append(Call(op, t0, time.monotonic() - t0, exc.code, exc.message))
            return False, exc
        except TimeoutError:
            self.calls.append(Call(op, t0, time.monotonic() - t0, "HANG", "no answer"))
            return False, None
        self.calls.append(Call(op, t0, time.monotonic() - t0, None))
        return True, result


@dataclass
class Load(Calls):
    """One client's load: transcript saves on two threads, checkpoint appends with a writer."""

    tl: Any = None
    name: str = ""
    acked_version: dict[str, int] = field(default_factory=dict)  # transcript thread -> greatest acked version
    tried_versions: dict[str, set[int]] = field(default_factory=dict)
    acked_cps: list[str] = field(default_factory=list)
    maybe_cps: set[str] = field(default_factory=set)
    head: str | None = None
    head_known: bool = True
    writer: Any = None
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    n: int = 0

    @property
    def threads(self) -> list[str]:
        return [f"{self.name}-talk-0", f"{self.name}-talk-1"]

    @property
    def cp_thread(self) -> str:
        return f"{self.name}-cp"

    async def setup(self) -> None:
        # The lease outlives any outage here (auto-renewal is not what these tests are about).
        self.writer = await asyncio.wait_for(self.tl.checkpoints.acquire_writer(self.cp_thread, auto_renew=False), 30)

    async def step(self) -> None:
        self.n += 1
        n = self.n
        for t in self.threads:
            self.tried_versions.setdefault(t, set()).add(n)
            ok, _ = await self.call("save_thread", self.tl.messages.save_thread(t, transcript(t, n)))
            if ok:
                self.acked_version[t] = n
        if not self.head_known:
            ok, head = await self.call("get_head", self.tl.checkpoints.get_head(self.cp_thread))
            if not ok:
                return
            # An append of unknown outcome may have applied: the head says which.
            assert head == self.head or head in self.maybe_cps, (head, self.head, self.maybe_cps)
            if head != self.head:
                self.acked_cps.append(head)
            self.head, self.head_known = head, True
        cid = f"{self.name}-c{n}"
        cp = checkpoint(cid, self.cp_thread, self.head, created_at=float(n))
        ok, res = await self.call("append", self.tl.checkpoints.append(checkpoint=cp, expected_head_id=self.head,
                                                                        writer=self.writer))
        if ok:
            self.acked_cps.append(cid)
            self.head = cid
        else:
            self.maybe_cps.add(cid)
            self.head_known = False
            if isinstance(res, ThreadLogError) and res.code == STALE_HEAD:
                pass  # an earlier unknown append applied first: re-read the head next step

    async def run(self) -> None:
        while not self.stop.is_set():
            await self.step()
            await asyncio.sleep(0.05)  # a steady load, not a busy loop


def transcript(thread: str, n: int) -> list[dict]:
    return [{"role": "user", "content": f"{thread} v{n}"}, {"role": "assistant", "content": f"v{n}"}]


def version(messages: list[dict]) -> int:
    return int(messages[-1]["content"][1:]) if messages else 0


async def load_running(load: Load, steps: int = 3, timeout: float = 60) -> None:
    """Until the load acknowledged `steps` more checkpoints (bounded)."""
    want = len(load.acked_cps) + steps
    deadline = time.monotonic() + timeout
    while len(load.acked_cps) < want:
        assert time.monotonic() < deadline, f"load made no progress in {timeout}s: {load.calls[-5:]}"
        await asyncio.sleep(0.05)


async def verify_loads(tl: Any, loads: list[Load]) -> None:
    """Nothing acknowledged is lost; each checkpoint chain unbroken (read through `tl`)."""
    for load in loads:
        for t, v in load.acked_version.items():
            got = version(await asyncio.wait_for(tl.messages.load_thread(t), 60))
            # A later save of unknown outcome may have applied on top; an older one never
            # overtakes an acked one (one idempotent producer keeps a partition's order).
            assert got >= v and got in load.tried_versions[t], (t, got, v)
        cps = await asyncio.wait_for(tl.checkpoints.list(load.cp_thread), 60)
        ids = [c["id"] for c in cps]
        missing = [c for c in load.acked_cps if c not in ids]
        assert not missing, f"acknowledged checkpoints lost: {missing}"
        assert set(ids) <= set(load.acked_cps) | load.maybe_cps, ids
        parents = [c["parentCheckpointId"] for c in cps]
        assert parents == [None, *ids[:-1]], f"chain broken: {list(zip(ids, parents, strict=True))}"
        head = await asyncio.wait_for(tl.checkpoints.get_head(load.cp_thread), 60)
        assert head == (ids[-1] if ids else None)


async def verify_from_fresh_client(bootstrap: str, ns: str, loads: list[Load], state_dir: Path) -> None:
    """`verify_loads` through a client opened now (it judges the whole log itself)."""
    async with threadlog.open(bootstrap, namespace=ns, state_dir=str(state_dir), request_timeout_ms=30_000) as fresh:
        await verify_loads(fresh, loads)

"""Where a delivery log's verdicts come from: the run index here, or its owner.

`threadlog.delivery` writes records and reads them from Kafka by offset; what
it asks the run index (projections/run_index.py) goes through one of these:

- `LocalRuns` (embedded clients): this process folds every partition of
  `<ns>.deliveries` (the runtime's `DeliveryIndex`) and reads the verdicts
  from its store.
- `RemoteRuns` (thin clients): no process folds the whole topic to serve the
  runs it touches. The owner of the run's partition (a worker) judges every
  record and answers the writer's verdict and a reader's starting state
  (processors/query_server.py, ops `dlv_*`). A live reader tails the run's
  partition (one `DeliveryTail` per process) and judges the run's new records
  itself with the same fold (`run_index.RunFold`), from the state the owner
  gave it as of offset `at`: records before `at` are judged by the owner,
  records from `at` on by the reader, in offset order.

A `Reading` is one reader's view: the run's state after a read barrier, and
how to judge each record it meets.
"""

from __future__ import annotations

import base64
import time
from typing import Any, Protocol

from .kernel.kafka_config import Consumed
from .kernel.partitioning import owner_partition
from .projections import run_index
from .projections.barrier import ReadBarrier
from .projections.delivery_follower import DeliveryIndex, Item, Subscription
from .projections.delivery_tail import DeliveryTail
from .projections.store import Store
from .remote import QueryClient, RemoteVerdicts
from .schemas import Codec

DEFAULT_STATE = {"fence": 0, "reps": 0}


class Reading(Protocol):
    """A reader's start: the run's `state` (None: no record yet) as of Kafka offset
    `at`, which covers every write acknowledged before the read began."""

    state: dict | None
    at: int

    async def judge(self, msgs: list[Consumed], decode: Any) -> list[tuple[Consumed, dict | None]]:
        """Each of the run's messages (in offset order) with its verdict (None: not the run's)."""
        ...

    def judge_item(self, item: Item) -> str | bool | None:
        """A live item's drop code (None: it stands); False: already covered by `state`."""
        ...

    def replacement(self, offset: int, index: int) -> str | None: ...

    def has_reps(self) -> bool:
        """Whether any upsert of the run is known (else no replacement is looked up)."""
        ...


class _LocalReading:
    def __init__(self, store: Store, run_id: str, state: dict | None, at: int) -> None:
        self.state = state
        self.at = at
        self.store = store
        self.run_id = run_id

    async def judge(self, msgs: list[Consumed], decode: Any) -> list[tuple[Consumed, dict | None]]:
        return [(m, run_index.record_verdict(self.store, self.run_id, m.offset())) for m in msgs]

    def judge_item(self, item: Item) -> str | bool | None:
        return item.dropped

    def replacement(self, offset: int, index: int) -> str | None:
        return run_index.replacement(self.store, self.run_id, offset, index)

    def has_reps(self) -> bool:
        return bool((run_index.run_state(self.store, self.run_id) or {}).get("reps", 0))


class LocalRuns:
    """The run index folded by this process (every partition)."""

    remote = False

    def __init__(self, index: DeliveryIndex, barrier: ReadBarrier, store: Store) -> None:
        self.index = index
        self.barrier = barrier
        self.store = store

    def known(self, run_id: str) -> dict:
        return run_index.run_state(self.store, run_id) or dict(DEFAULT_STATE)

    async def decide(self, run_id: str, partition: int, offset: int, kind: str, epoch: int,
                     timeout: float) -> tuple[dict | None, int]:
        await self.index.wait({partition: offset if kind == run_index.CHUNKS else offset + 1}, timeout)
        return run_index.decided(self.store, run_id, offset, kind, epoch)

    async def reading(self, run_id: str, partition: int) -> Reading:
        await self.barrier.wait([partition])
        # State and position of one instant, as the owner's dlv_state reads them (a
        # fold batch is atomic under the lock): read apart, a close folded in between
        # was behind the position and missing from the state, and a reader from
        # "now" waited for a close it would never meet.
        with self.store.lock:
            at = self.store.offset(self.index.topic, partition)
            state = run_index.run_state(self.store, run_id)
        return _LocalReading(self.store, run_id, state, at)

    async def counts(self, run_id: str, partition: int, offsets: list[int]) -> dict[int, int | None]:
        await self.barrier.wait([partition])
        return {x: run_index.chunk_count(self.store, run_id, x) for x in offsets}

    async def subscribe(self, run_id: str, partition: int) -> Subscription:
        return self.index.subscribe(run_id, partition)

    def unsubscribe(self, sub: Subscription) -> None:
        self.index.unsubscribe(sub)

    def stop(self) -> None:
        """The runtime owns the index."""

    def halt(self, reason: str) -> None:
        """The runtime halts the index (`Runtime._incarnation_changed`)."""


def _as_verdict(rec: dict, dropped: str | None) -> dict:
    """A record judged by a reader, in the shape the owner's fold stores."""
    if dropped is not None:
        return {"drop": dropped}
    kind = rec["kind"]
    if kind == run_index.CHUNKS:
        return {"n": run_index.record_size(rec)}
    if kind == run_index.CLOSE:
        return {"close": 1}
    if kind == run_index.UPSERT:
        return {"u": len(rec["chunks"])}
    return {}  # a claim (its grant matters only to the claimer) or a newer kind


class _RemoteReading:
    def __init__(self, runs: RemoteRuns, run_id: str, partition: int, state: dict | None, at: int) -> None:
        self.state = state
        self.at = at
        self.runs = runs
        self.run_id = run_id
        self.partition = partition
        self.fold = run_index.RunFold(run_id, state)
        # The replaced texts of the records of the batch judged last (below `at`).
        self.reps: dict[tuple[int, int], str] = {}

    async def judge(self, msgs: list[Consumed], decode: Any) -> list[tuple[Consumed, dict | None]]:
        """Verdicts of a fetched batch, and its records' replaced texts in `reps`,
        which the reader reads before it judges the next batch. Only this batch's:
        kept for every batch, a reader replaying a run whose every chunk was
        upserted held the whole run's texts until it ended, each SSE join a copy
        (a review)."""
        self.reps = {}
        before = [m.offset() for m in msgs if m.offset() < self.at]
        owner: dict[int, dict] = {}
        if before:
            owner = await self._owner_verdicts(before[0], before[-1] + 1)
        out: list[tuple[Consumed, dict | None]] = []
        for m in msgs:
            if m.offset() < self.at:
                out.append((m, owner.get(m.offset())))
                continue
            try:
                rec = decode(m)
            except Exception:
                out.append((m, None))  # undecodable: the owner's fold skips it too
                continue
            if rec["runId"] != self.run_id:
                out.append((m, None))
                continue
            out.append((m, _as_verdict(rec, self.fold.judge(m.offset(), rec))))
        return out

    async def _owner_verdicts(self, lo: int, hi: int) -> dict[int, dict]:
        """The owner's verdicts of the run's records at lo <= x < hi, and their
        replaced texts into `reps`: a page at a time (the texts of a range have
        no bound of their own; one answer has)."""
        args: dict[str, Any] = {"run": self.run_id, "lo": lo, "hi": hi, "paged": True}
        answer = await self.runs.ask("dlv_verdicts", self.partition, args)
        owner = {int(x): v for x, v in answer["v"]}
        while True:
            if "r" in answer:  # a worker before pages answered everything at once
                self.reps.update({(int(x), int(i)): text for x, i, text in answer["r"]})
                return owner
            self.reps.update({(int(x), int(i)): base64.b64decode(t64).decode("utf-8")
                              for x, i, t64 in answer["r64"]})
            if answer["more"] is None:
                return owner
            answer = await self.runs.ask("dlv_verdicts", self.partition, {**args, "after": answer["more"]})

    def judge_item(self, item: Item) -> str | bool | None:
        if item.offset < self.at:
            return False
        return self.fold.judge(item.offset, item.record)

    def replacement(self, offset: int, index: int) -> str | None:
        return self.reps.get((offset, index))

    def has_reps(self) -> bool:
        return bool(self.reps)


class RemoteRuns:
    """The run index at the owners of the partitions (a thin client)."""

    remote = True

    def __init__(self, query: QueryClient, tail: DeliveryTail, events_partitions: int, timeout: float,
                 pushed: RemoteVerdicts | None = None) -> None:
        self.query = query
        self.pushed = pushed  # where the owners' pushed answers arrive (threadlog/remote.py)
        self.tail = tail
        self.events_partitions = events_partitions
        self.timeout = timeout
        # The fence and close each run's writer last learned: a precheck only
        # (the verdict after writing is the one that counts).
        self._known: dict[str, dict] = {}

    async def ask(self, op: str, partition: int, args: dict, timeout: float | None = None) -> Any:
        owner = owner_partition(partition, self.events_partitions)
        answers = await self.query.acall(op, {**args, "d": partition}, [owner], timeout)
        (answer,) = answers.values()
        return answer

    def known(self, run_id: str) -> dict:
        return self._known.get(run_id) or dict(DEFAULT_STATE)

    def _learn(self, run_id: str, state: dict | None) -> None:
        if state is not None:
            if len(self._known) > 10_000:
                self._known.clear()
            self._known[run_id] = state

    async def decide(self, run_id: str, partition: int, offset: int, kind: str, epoch: int,
                     timeout: float) -> tuple[dict | None, int]:
        # `timeout` is what the caller's write left of its request timeout: the
        # push's grace and the question after it share it (not a fresh one each).
        deadline = time.monotonic() + timeout
        answer = None
        if self.pushed is not None:  # pushed by the owner's run index, or asked when it was not
            owner = owner_partition(partition, self.events_partitions)
            answer = await self.query.on_loop(self.pushed.delivery_answer(partition, offset, owner, timeout))
        if answer is None:
            answer = await self.ask("dlv_verdict", partition, {"run": run_id, "x": offset, "kind": kind,
                                                               "epoch": epoch},
                                    max(0.1, deadline - time.monotonic()))
        self._learn(run_id, answer.get("state"))
        return answer["verdict"], int(answer["fence"])

    async def reading(self, run_id: str, partition: int) -> Reading:
        answer = await self.ask("dlv_state", partition, {"run": run_id})
        self._learn(run_id, answer["state"])
        return _RemoteReading(self, run_id, partition, answer["state"], int(answer["at"]))

    async def counts(self, run_id: str, partition: int, offsets: list[int]) -> dict[int, int | None]:
        answer = await self.ask("dlv_state", partition, {"run": run_id, "xs": offsets})
        return {int(x): n for x, n in answer["counts"].items()}

    async def subscribe(self, run_id: str, partition: int) -> Subscription:
        return await self.tail.subscribe(run_id, partition)

    def unsubscribe(self, sub: Subscription) -> None:
        self.tail.unsubscribe(sub)

    def stop(self) -> None:
        self.tail.stop()

    def halt(self, reason: str) -> None:
        self.tail.halt(reason)


def runs_for(rt: Any, codec: Codec, pushed: RemoteVerdicts | None = None) -> LocalRuns | RemoteRuns:
    """The run index access of a runtime's role."""
    if rt.deliveries is not None:
        return LocalRuns(rt.deliveries, rt.delivery_barrier, rt.index_store)
    assert rt.query is not None and rt.layout is not None
    tail = DeliveryTail(rt.opts.bootstrap_servers, rt.topics.deliveries, codec, rt.client_id,
                        rt.opts.request_timeout, kafka=rt.opts.kafka)
    return RemoteRuns(rt.query, tail, rt.layout.events, rt.opts.request_timeout, pushed)

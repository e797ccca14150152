"""Time travel: a thread's state as it was at any point of its partition's log.

Verdicts are a function of the log prefix (processors/judge.py), so the state
of a partition after offset O is whatever a judge starting from nothing
reaches by judging offsets 0..O. That is exactly what this module does, into
a throwaway store:

- read the thread's partition of `<ns>.events` with a plain consumer
  (`assign`, from offset 0 to an end fixed before reading; every wait bounded);
- judge every record of it with `judge_record` -- the judge's own step, not a
  copy -- into a fresh `Store` in a temporary directory (deleted after);
- read the thread's records back with the stores' own read code
  (`threadlog/stores/*`) pointed at that temporary store.

Cross-partition rules ("is this checkpoint id held on another thread?") look
at other partitions only as of the positions a proposal names (`seen`,
projections/global_ids.py). Those answers never change, so they are asked of
the LIVE state's versioned id index: in an embedded client the live stores of
this process (after the live judge reached the position), in a thin client
the owning worker (query op `holders`). Nothing deletes entries of that index
(releases are written as entries of their own), so "who held id X on
partition q as of offset n" has the same answer today as when the real judge
asked it, and the replay reaches the real judge's verdicts.

Limits: the whole partition is judged from offset 0 for each call (cost grows
with the partition's history, not the thread's); a partition whose oldest
records were deleted (retention changed from the default infinite) cannot be
replayed and says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import math
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from threadlog.projections.folds import langgraph as lg
from threadlog.projections.global_ids import holders_as_of
from threadlog.projections.queries import QUERIES
from threadlog.projections.store import Store
from threadlog.projections.view import View
from threadlog.schemas import Codec

from threadlog.kernel import kafka_config
from threadlog.kernel.errors import invalid_argument, unavailable
from threadlog.kernel.validation import require_id

from .handlers import NOT_THREAD_KEYED
from .handlers.rules_floor import MARKER_TYPE
from .judge import Others, Record, _Blocked, clock_key, judge_record, read_clock

if TYPE_CHECKING:
    from threadlog.client import ThreadLog

# State reaches the temporary store every this many records (one write batch).
FLUSH_EVERY = 2_000
# Records asked of the consumer per poll.
BATCH = 1_000
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class Step:
    """One record of the partition, as judged by the replay."""

    offset: int
    key: str | None  # the proposal's key (a thread id, `blob:<key>`...); None if undecodable
    type: str | None  # the proposal's payload type, e.g. threadlog.cmd.AppendCheckpoint
    proposal_id: str | None
    decided_at: float | None  # decision time, ms since the epoch (None: no proposal had a time yet)
    verdict: dict  # the full verdict, as the judge stores it

    def entry(self) -> dict:
        """What `ThreadLog.history` returns for this record."""
        v: dict[str, Any] = {"ok": bool(self.verdict.get("ok"))}
        if not v["ok"]:
            v["code"] = self.verdict.get("code")
            v["message"] = self.verdict.get("message")
        if "duplicateOf" in self.verdict:  # a re-sent proposal: answered with the first verdict
            v["duplicateOf"] = self.verdict["duplicateOf"]["o"]
        return {"offset": self.offset, "type": self.type, "proposalId": self.proposal_id,
                "decidedAt": self.decided_at, "verdict": v}


# -- reading the partition -------------------------------------------------------------------
class PartitionReader:
    """The records of one events partition, from offset 0 to a fixed end."""

    def __init__(self, bootstrap: str, topic: str, partition: int, client_id: str,
                 kafka: kafka_config.Props | None, timeout: float) -> None:
        self.topic = topic
        self.partition = partition
        self.timeout = timeout
        self._consumer = Consumer(kafka_config.consumer(bootstrap, f"{client_id}.timetravel", kafka,
                                                        **{"enable.partition.eof": True}))

    def bounds(self) -> tuple[int, int]:
        """(first offset kept, end offset) of the partition, asked now."""
        try:
            low, high = self._consumer.get_watermark_offsets(TopicPartition(self.topic, self.partition),
                                                             timeout=self.timeout)
        except KafkaException as exc:
            raise unavailable(f"cannot read the offsets of {self.topic}[{self.partition}]: "
                              f"{kafka_config.error_text(exc)}") from None
        return int(low), int(high)

    def records(self, end: int, stop: threading.Event | None = None) -> Iterator[Record]:
        """Offsets 0 .. end-1, in order. UNAVAILABLE when nothing arrives for `timeout`,
        or once `stop` is set (before the next record, or within a second of
        waiting for one): what judges them stops with it."""
        if end <= 0:
            return
        self._consumer.assign([TopicPartition(self.topic, self.partition, 0)])
        nxt = 0
        quiet_since = time.monotonic()
        while nxt < end:
            if stop is not None and stop.is_set():
                raise unavailable("time travel was cancelled")
            msgs = self._consumer.consume(BATCH, timeout=min(1.0, self.timeout))
            now = time.monotonic()
            if not msgs:
                if now - quiet_since > self.timeout:
                    raise unavailable(f"reading {self.topic}[{self.partition}]: nothing arrived for "
                                      f"{self.timeout:g}s at offset {nxt} (end {end})")
                continue
            quiet_since = now
            for msg in cast("list[kafka_config.Consumed]", msgs):  # consume() sets offsets
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        if msg.offset() >= end:
                            # The end was passed without a record at end-1: the last
                            # offsets are a transaction's marker or aborted records,
                            # which no read_committed consumer yields (the classic
                            # barrier bug, projections/barrier.py). Waiting for end-1
                            # stalled a whole timeout, then failed.
                            return
                        continue
                    raise unavailable(f"reading {self.topic}[{self.partition}]: {err.str()}")
                if msg.offset() < nxt:
                    continue
                if msg.offset() >= end:
                    return
                if stop is not None and stop.is_set():
                    raise unavailable("time travel was cancelled")
                ts_type, ts = msg.timestamp()
                yield Record(self.partition, msg.offset(), msg.value(), ts if ts_type != 0 else None)
                nxt = msg.offset() + 1

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._consumer.close()


# -- judging it again --------------------------------------------------------------------------
def _describe(codec: Codec, value: bytes | None) -> tuple[str | None, str | None, str | None]:
    """(key, type, proposal id) of a record, Nones when it is not a proposal."""
    try:
        _, env = codec.decode(value, expect="threadlog.Proposal")
        return str(env["key"]), str(env["type"]), str(env["proposalId"])
    except Exception:
        return None, None, None


def judge_into(store: Store, records: Iterator[Record], *, codec: Codec, partitions: int, topic: str,
               others: Others, until_ms: int | None = None, key: str | None = None) -> list[Step]:
    """Judge `records` (one partition, from offset 0) into the empty `store`;
    returns the steps judged (with `key`: only that key's, and the last one).

    With `until_ms` (whole milliseconds), stops before the first record
    decided in a later millisecond (decision time only moves forward on a
    partition) and leaves it out.
    """
    base = View(store)
    steps: list[Step] = []
    last: Step | None = None
    pending = 0
    position: dict[tuple[str, int], int] = {}
    for rec in records:
        child = base.child()
        try:
            verdict = judge_record(child, rec, codec=codec, partitions=partitions, progress={}, topic=topic,
                                   others=others)
        except _Blocked as blocked:  # only a proposal needing newer judging rules gets here
            raise unavailable(f"{topic}[{rec.partition}]@{rec.offset} cannot be judged by this version "
                              f"(it needs newer judging rules; blocked on {blocked.q})") from None
        raw = child.get(clock_key(rec.partition))
        decided = read_clock(raw)[0] if raw is not None else None
        # Millisecond precision: a time covers its whole millisecond. Decision
        # times carry fractions of one, and a time printed to the ms (inspect
        # events) fed back as --at-time otherwise fell just before the very
        # decision it showed, giving the state one proposal early.
        if until_ms is not None and decided is not None and math.floor(decided) > until_ms:
            break
        child.merge()
        rkey, ptype, pid = _describe(codec, rec.value)
        step = Step(rec.offset, rkey, ptype, pid, decided, verdict)
        if ptype != MARKER_TYPE:
            # A namespace's rules floor marker (decided at time 0) changes no state:
            # "the state before anything" stays before it.
            last = step
        if key is None or rkey == key:
            steps.append(step)
        position = {(topic, rec.partition): rec.offset + 1}
        pending += 1
        if pending >= FLUSH_EVERY:
            store.apply(base.buffer, position)
            base = View(store)
            pending = 0
    if base.buffer or position:
        store.apply(base.buffer, position)
    if key is not None and last is not None and (not steps or steps[-1] is not last):
        steps.append(last)
    # As stored (JSON), so they compare equal to `all_verdicts` of a live store.
    return [dataclasses.replace(st, verdict=json.loads(json.dumps(st.verdict))) for st in steps]


def live_others(tl: ThreadLog) -> Others:
    """`others` for `judge_record` answered from the live state's versioned id index.

    Embedded client: this process's stores, once its judge reached the asked
    position (bounded by the request timeout). Thin client: the partition's
    owner, query op `holders` (it waits the same way). Answers are about fixed
    positions, so they are cached for the replay's life."""
    rt = tl.runtime
    timeout = tl.opts.request_timeout
    cache: dict[tuple[int, str, str, int], list[str]] = {}
    ask: Callable[[int, str, str, int], list[str]]
    if rt.query is not None and rt.stores is None:
        query = rt.query

        def ask(q: int, kind: str, ident: str, need: int) -> list[str]:
            results = query.call_sync("holders", {"q": q, "kind": kind, "id": ident, "asof": need}, [q])
            (result,) = results.values()
            return sorted(str(t) for t in result["threads"])
    else:
        stores, judge = rt.stores, rt.judge
        assert stores is not None and judge is not None

        def ask(q: int, kind: str, ident: str, need: int) -> list[str]:
            judge.wait_sync({q: need}, timeout)
            return holders_as_of(stores.store_of(q), kind, ident, need)

    def others(q: int, kind: str, ident: str, need: int) -> list[str] | None:
        if need <= 0:
            return []
        question = (q, kind, ident, need)
        found = cache.get(question)
        if found is None:
            found = cache[question] = ask(q, kind, ident, need)
        return found

    return others


@dataclass
class Replayed:
    """A partition judged again up to some point, in a temporary store."""

    partition: int
    store: Store
    steps: list[Step]  # every record judged (with `key`: that key's, then the last record judged)
    end: int  # the partition's end offset when the replay began


def _target(at: Any) -> tuple[int | None, int | None]:
    """(offset, time in whole ms, rounded down) of an `at` argument: an offset, a datetime, or None (the latest)."""
    if at is None:
        return None, None
    if isinstance(at, bool):
        raise invalid_argument(f"at must be an offset (int >= 0) or a datetime, got {at!r}")
    if isinstance(at, int):
        if at < 0:
            raise invalid_argument(f"at must be an offset >= 0, got {at}")
        return at, None
    if isinstance(at, datetime):
        if at.tzinfo is None:
            at = at.replace(tzinfo=UTC)  # naive: UTC
        # Exact integer arithmetic: `timestamp() * 1000` of 12:00:00.503 may be
        # ...502.9999 and name the millisecond before the one asked for.
        return None, (at - _EPOCH) // timedelta(milliseconds=1)
    raise invalid_argument(f"at must be an offset (int >= 0) or a datetime, got {type(at).__name__}")


@contextlib.asynccontextmanager
async def replayed(tl: ThreadLog, partition: int, at: Any = None, key: str | None = None) -> AsyncIterator[Replayed]:
    """Judge `partition` again from offset 0 into a temporary store, up to and
    including offset `at` (an int), or the last record decided at or before
    `at` (a datetime), or everything written before the call (None). The
    store is deleted on exit. `key`: keep only the steps of records with that
    key (and the last one judged), not every record's."""
    tl._check_open()
    offset, until_ms = _target(at)
    rt = tl.runtime
    assert rt.layout is not None
    topic = rt.topics.events
    tmp = Path(tempfile.mkdtemp(prefix="threadlog-timetravel-"))
    store: Store | None = None
    judging: asyncio.Future[list[Step]] | None = None
    try:
        reader = PartitionReader(tl.opts.bootstrap_servers, topic, partition, rt.client_id, tl.opts.kafka,
                                 tl.opts.request_timeout)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        low, high = await asyncio.to_thread(reader.bounds)
        if low > 0:
            raise unavailable(f"{topic}[{partition}] no longer starts at offset 0 (first kept: {low}): its "
                              "history was deleted, so earlier states cannot be rebuilt", retryable=False)
        if offset is not None and offset >= high:
            raise invalid_argument(f"offset {offset} of {topic}[{partition}] is not written yet "
                                   f"(the partition ends at {high})")
        end = high if offset is None else offset + 1
        store = Store(tmp / f"events-{partition}")
        stop = threading.Event()
        judging = asyncio.ensure_future(asyncio.to_thread(
            judge_into, store, reader.records(end, stop), codec=rt.codec, partitions=rt.layout.events,
            topic=topic, others=live_others(tl), until_ms=until_ms, key=key))
        try:
            steps = await asyncio.shield(judging)
        except asyncio.CancelledError:
            # A thread cannot be cancelled: tell it to stop (at its next record, or
            # within a second of waiting for one), and wait until it has before the
            # cleanup below closes its store and reader. Before, a cancelled call
            # left the whole replay running (a review: a core busy after the call
            # was cut, once per retry), racing the cleanup.
            stop.set()
            await _settled(judging, tl.opts.request_timeout + 5.0)
            raise
        yield Replayed(partition, store, steps, high)
    finally:
        if judging is not None and not judging.done():
            # Still judging (slow to stop): the cleanup runs once it has stopped.
            judging.add_done_callback(functools.partial(_cleanup_after, reader, store, tmp))
        else:
            await asyncio.to_thread(_cleanup, reader, store, tmp)


async def _settled(fut: asyncio.Future[Any], timeout: float) -> None:
    """Wait (at most `timeout`) until `fut` is done, through further cancellations
    of the waiting task. Why: Ctrl-C in a blocking client cancels the call, then
    its client's close() cancels it again; the second cancellation ran the
    cleanup under the still-judging thread (a review: DbClosedError there)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not fut.done() and (left := deadline - loop.time()) > 0:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait({fut}, timeout=left)


def _cleanup_after(reader: PartitionReader, store: Store | None, tmp: Path, judging: asyncio.Future[Any]) -> None:
    if not judging.cancelled():
        judging.exception()  # retrieved: the call that wanted it was cancelled
    asyncio.get_running_loop().run_in_executor(None, _cleanup, reader, store, tmp)


def _cleanup(reader: PartitionReader, store: Store | None, tmp: Path) -> None:
    reader.close()
    if store is not None:
        store.close()
    shutil.rmtree(tmp, ignore_errors=True)


# -- reading the thread back, with the stores' own code ------------------------------------------
class _Frozen:
    """What the store facades need of a session (threadlog/session.py), over a
    replayed store: reads only, no barrier (the store does not move), no writes."""

    def __init__(self, tl: ThreadLog, store: Store) -> None:
        self.opts = tl.opts
        self.state = store
        self.closed = False
        self.delivery = None
        self.watched = False  # nothing is remembered across replayed states

    def check_open(self) -> None:
        pass

    async def read_barrier(self, keys: Any) -> None:
        return None

    async def read(self, k: bytes, keys: Any, barrier: bool = True) -> bytes | None:
        return self.state.get(k)

    async def scan(self, prefix: bytes, keys: Any) -> list[tuple[bytes, bytes]]:
        return list(self.state.scan(prefix))

    async def query(self, name: str, keys: Any, args: Any, barrier: bool = True) -> list[Any]:
        return [QUERIES[name](self.state, **args)]

    async def send(self, type_name: str, key: str, payload: dict) -> Any:
        raise invalid_argument("a state in the past is read-only")


async def thread_state(tl: ThreadLog, store: Store, thread_id: str) -> dict:
    """The thread's records in `store`, in the shapes `tl`'s stores return."""
    from threadlog.stores.checkpoints import CheckpointStore
    from threadlog.stores.interrupts import InterruptStore
    from threadlog.stores.messages import MessageStore
    from threadlog.stores.runs import RunStore

    frozen: Any = _Frozen(tl, store)
    return {
        "head": await CheckpointStore(frozen).get_head(thread_id),
        "checkpoints": await CheckpointStore(frozen).list(thread_id),
        "runs": await RunStore(frozen).list_by_thread(thread_id),
        "interrupts": await InterruptStore(frozen).list(thread_id),
        "transcript": await MessageStore(frozen).load_thread(thread_id),
        "langgraph": langgraph_summary(store, thread_id),
    }


def langgraph_summary(store: Store, thread_id: str) -> dict:
    """What the LangGraph saver (threadlog/integrations/langgraph.py) keeps of the
    thread: its checkpoints, by namespace, and how many pending writes.

    Why here: a LangGraph thread's checkpoints are not `tl.checkpoints` records,
    so `inspect thread` showed "checkpoints: 0" for a graph paused at an
    interrupt with three of them (a review): it read as empty. Ids ascend
    (LangGraph's checkpoint ids grow with time); values are left to the saver."""
    by_ns: dict[str, list[str]] = {}
    for k, _ in store.scan(lg.ckpt_prefix(thread_id)):
        _, ns, checkpoint_id = lg.split_ckpt_key(k)
        by_ns.setdefault(ns, []).append(checkpoint_id)
    writes = sum(1 for _ in store.scan(lg.write_prefix(thread_id)))
    return {"checkpoints": {ns: sorted(ids) for ns, ids in sorted(by_ns.items())}, "pendingWrites": writes}


# -- the API (ThreadLog.history / ThreadLog.state_at) ------------------------------------------
async def history(tl: ThreadLog, thread_id: str) -> list[dict]:
    require_id(thread_id, "thread_id")
    partition = tl.runtime.partition_of(thread_id)
    async with replayed(tl, partition, key=thread_id) as r:
        # Not the records of another domain keyed like the thread: `agents:<id>`,
        # `blob:<key>` are valid thread ids too, and a thread so named listed
        # a session's items or a blob's puts (found by reviews).
        return [s.entry() for s in r.steps if s.key == thread_id and s.type not in NOT_THREAD_KEYED]


async def state_at(tl: ThreadLog, thread_id: str, at: Any = None) -> dict:
    require_id(thread_id, "thread_id")
    partition = tl.runtime.partition_of(thread_id)
    async with replayed(tl, partition, at, key=thread_id) as r:
        last = r.steps[-1] if r.steps else None
        state = await thread_state(tl, r.store, thread_id)
    return {"threadId": thread_id, "partition": partition, "offset": None if last is None else last.offset,
            "decidedAt": None if last is None else last.decided_at, **state}


__all__ = ["PartitionReader", "Replayed", "Step", "history", "judge_into", "live_others", "replayed",
           "state_at", "thread_state"]

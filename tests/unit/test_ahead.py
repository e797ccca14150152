"""Id questions answered ahead of judging (processors/ahead.py), without a broker.

A worker answers "who holds checkpoint id X on partition q as of offset s"
once q is judged up to `settles_at(...) <= s` instead of s, when no fetched
record in between can mark X. Tried here: what each proposal type can mark;
the id read from an append's first bytes against a full decode; and, on
random logs judged for real (RocksDB, Avro, the judging step), that the
answer as of the earlier position is always the answer as of s -- for every
id, every partition, every judged and fetched position.
"""

from __future__ import annotations

import ast
import random
import uuid
from pathlib import Path

from checkpoint_helpers import checkpoint
from test_judging_rules import PARTITIONS, Log, acquire, append, codec
from threadlog.processors import ahead
from threadlog.processors.ahead import ANY, Ahead, marked_checkpoint
from threadlog.processors.handlers import HANDLERS
from threadlog.processors.judge import RULES, Record, judge_record
from threadlog.projections.global_ids import CHECKPOINT, holders_as_of
from threadlog.projections.store import Store
from threadlog.projections.view import View

from threadlog.kernel.checkpoint_rules import to_wire
from threadlog.kernel.partitioning import partition_for

ROOT = Path(__file__).resolve().parents[2]


class Fetched:
    """A judged record as the consumer hands it over (offset(), value())."""

    def __init__(self, rec: Record) -> None:
        self.rec = rec

    def offset(self) -> int:
        return self.rec.offset

    def value(self) -> bytes | None:
        return self.rec.value


def test_every_proposal_type_is_classified_and_only_appends_forks_and_deletions_mark_ids():
    classified = ahead.NO_CHECKPOINT_MARKS | ahead.MARKS_ANY | {ahead.APPEND}
    assert set(HANDLERS) == classified, set(HANDLERS) ^ classified
    assert not ahead.NO_CHECKPOINT_MARKS & (ahead.MARKS_ANY | {ahead.APPEND})


def test_checkpoint_ids_are_marked_only_where_the_classification_says():
    """The invariant the answers rest on, checked against the source: only the
    checkpoint folds mark checkpoint ids, and only the handlers of the types
    classified as marking them emit the events those folds fold."""
    marking_events = {"threadlog.evt.CheckpointAppended", "threadlog.evt.CheckpointForked",
                      "threadlog.evt.CheckpointHeadDeleted"}
    for path in (ROOT / "projections").rglob("*.py"):
        text = path.read_text()
        if "global_ids.CHECKPOINT" in text or "gid.CHECKPOINT" in text:
            assert path == ROOT / "projections/folds/checkpoints.py", path
    folds = ast.parse((ROOT / "projections/folds/checkpoints.py").read_text())
    for fn in [n for n in folds.body if isinstance(n, ast.FunctionDef)]:
        names = {d.args[0].value for d in fn.decorator_list
                 if isinstance(d, ast.Call) and getattr(d.func, "id", "") == "folds"}
        body = ast.unparse(fn)
        if "CHECKPOINT" in body or "_store(" in body:
            assert names <= marking_events, (fn.name, names)
    emitters: set[str] = set()
    for path in (ROOT / "processors/handlers").glob("*.py"):
        for fn in [n for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)]:
            if any(event in ast.unparse(fn) for event in marking_events):
                emitters |= {d.args[0].value for d in fn.decorator_list
                             if isinstance(d, ast.Call) and getattr(d.func, "id", "") == "handles"}
    assert emitters == ahead.MARKS_ANY | {ahead.APPEND}


def test_what_a_record_can_mark():
    log = Log()
    tok = "t" * 32
    assert marked_checkpoint(append(log, checkpoint("cp-1", "a"), None, tok, 1).value, codec, RULES) == "cp-1"
    assert marked_checkpoint(acquire(log, "a", tok).value, codec, RULES) is None
    delete = log.propose("threadlog.cmd.DeleteCheckpointHead", "a", {
        "threadId": "a", "checkpointId": "cp-1", "writer": {"threadId": "a", "ownerToken": tok, "fence": 1}})
    assert marked_checkpoint(delete.value, codec, RULES) is ANY
    assert marked_checkpoint(b"garbage", codec, RULES) is None  # refused by the judge: marks nothing
    assert marked_checkpoint(None, codec, RULES) is None
    newer = codec.encode("threadlog.Proposal", {
        "proposalId": "n", "key": "a", "type": "threadlog.cmd.SaveTranscript", "at": 1.0, "rules": RULES + 1,
        "seen": [], "payload": codec.encode("threadlog.cmd.SaveTranscript", {"threadId": "a", "messages": "[]"})})
    assert marked_checkpoint(newer, codec, RULES) is ANY  # never guessed at
    unknown = codec.encode("threadlog.Proposal", {
        "proposalId": "u", "key": "a", "type": "threadlog.cmd.NoSuchThing", "at": 1.0, "rules": 2, "seen": [],
        "payload": b""})
    assert marked_checkpoint(unknown, codec, RULES) is None  # refused: unknown proposal type
    # An append whose payload is not an AppendCheckpoint body cannot be read ahead.
    wrong = codec.encode("threadlog.Proposal", {
        "proposalId": "w", "key": "a", "type": ahead.APPEND, "at": 1.0, "rules": 2, "seen": [],
        "payload": codec.encode("threadlog.cmd.SaveTranscript", {"threadId": "a", "messages": "[]"})})
    assert marked_checkpoint(wrong, codec, RULES) is ANY
    truncated = codec.encode("threadlog.Proposal", {
        "proposalId": "t", "key": "a", "type": ahead.APPEND, "at": 1.0, "rules": 2, "seen": [],
        "payload": codec.encode(ahead.APPEND, {"checkpoint": to_wire(checkpoint("cp-2", "a")),
                                               "expectedHeadId": None,
                                               "writer": {"threadId": "a", "ownerToken": tok, "fence": 1}})[:12]})
    assert marked_checkpoint(truncated, codec, RULES) is ANY


def test_the_id_read_ahead_is_the_id_a_full_decode_reads():
    rng = random.Random(7)
    alphabet = "abcXYZ019-_/.é漢🙂"
    for n in range(300):
        cid = "".join(rng.choice(alphabet) for _ in range(rng.choice([1, 5, 63, 64, 65, 200])))
        payload = codec.encode(ahead.APPEND, {"checkpoint": to_wire(checkpoint(cid, "t")), "expectedHeadId": None,
                                              "writer": {"threadId": "t", "ownerToken": "x" * 32, "fence": 1}})
        assert ahead._append_id(payload, codec) == codec.decode(payload)[1]["checkpoint"]["id"] == cid, n


def _random_log(rng: random.Random, view: View) -> Log:
    """Proposals on 4 partitions -- appends drawing ids from a small shared pool
    (duplicates across threads and partitions), head deletions (ids released),
    transcripts, garbage -- each judged into `view` as it is written, so the
    next proposal's expected head is the real one."""
    threads = [f"t{n}" for n in range(10)]
    tok = "t" * 32
    log = Log()
    heads: dict[str, str | None] = dict.fromkeys(threads, None)
    parents: dict[tuple[str, str], str | None] = {}
    for t in threads:
        acquire(log, t, tok)
    done = 0  # records judged
    for _ in range(160):
        t = rng.choice(threads)
        roll = rng.random()
        step = None
        if roll < 0.65:
            cid = rng.choice(["x0", "x1", "x2", "x3", "x4", "x5", uuid.uuid4().hex])
            append(log, checkpoint(cid, t, heads[t]), heads[t], tok, 1)
            step = ("append", cid)
        elif roll < 0.8 and heads[t] is not None:
            log.propose("threadlog.cmd.DeleteCheckpointHead", t, {
                "threadId": t, "checkpointId": heads[t], "writer": {"threadId": t, "ownerToken": tok, "fence": 1}})
            step = ("delete", heads[t])
        elif roll < 0.9:
            log.propose("threadlog.cmd.SaveTranscript", t, {"threadId": t, "messages": "[1]"})
        else:
            log.raw(rng.randrange(PARTITIONS), b"garbage")
        progress = {p: log.ends[p] for p in range(PARTITIONS)}
        while done < len(log.records):
            verdict = judge_record(view, log.records[done], codec=codec, partitions=PARTITIONS, progress=progress)
            done += 1
        if step is not None:
            kind, cid = step
            if verdict["ok"] and kind == "append":
                parents[(t, cid)] = heads[t]
                heads[t] = cid
            elif verdict["ok"]:
                heads[t] = parents[(t, cid)]
    return log


def test_an_answer_settled_early_is_the_answer_as_of_the_position_asked(tmp_path):
    rng = random.Random(11)
    for round_ in range(3):
        store = Store(tmp_path / f"s{round_}")
        try:
            view = View(store)
            log = _random_log(rng, view)
            store.apply(view.buffer, {})
            ids = ["x0", "x1", "x2", "x3", "x4", "x5", "never"]

            def truth(q: int, cid: str, asof: int, store: Store = store) -> list[str]:
                # The versioned index of the whole log answers "as of" any position.
                return holders_as_of(store, CHECKPOINT, cid, asof, lambda th: partition_for(th, PARTITIONS) == q)

            earlier = some_held = 0
            for q in range(PARTITIONS):
                mine = [r for r in log.records if r.partition == q]
                held = {cid: [truth(q, cid, s) for s in range(len(mine) + 1)] for cid in ids}
                some_held += any(any(h) for h in held.values())
                for _ in range(40):
                    judged = rng.randint(0, len(mine))
                    fetched = rng.randint(judged, len(mine))
                    index = Ahead(codec, RULES)
                    index.reset(q, judged)
                    # Fetched in consumer batches; part of it judged meanwhile.
                    cut = rng.randint(judged, fetched)
                    index.fetched(q, [Fetched(r) for r in mine[judged:cut]])
                    index.fetched(q, [Fetched(r) for r in mine[judged:fetched]])  # a re-delivery is ignored
                    judged = rng.randint(judged, cut)
                    index.judged(q, judged)  # moved on meanwhile
                    for cid in ids:
                        for s in range(judged, len(mine) + 1):
                            t = index.settles_at(q, CHECKPOINT, cid, s)
                            assert t <= s
                            if s > fetched:
                                assert t == s  # beyond what is fetched nothing is known
                            # The worker waits until q is judged up to t (it is up to `judged`
                            # already), then reads the holders as of s from its store: a store
                            # at any position from there on must give the answer as of s.
                            for at in range(max(t, judged), s + 1):
                                assert held[cid][at] == held[cid][s], (q, cid, judged, fetched, s, t, at)
                            earlier += t < s and judged < s
            assert some_held >= 2  # pool ids held (and released) on several partitions
            assert earlier > 100  # the answers did come early, often
            assert index.settles_at(q, "run", "x0", 3) == 3  # other id kinds are not looked at ahead
        finally:
            store.close()

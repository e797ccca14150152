"""Cross-partition facts a worker's judge asks of the other partitions' owners.

A rule like "a checkpoint id is unique over every thread" is judged on the
proposal's partition as of the positions the proposal names on the others
(`seen`, projections/global_ids.py). When a worker owns only some partitions,
the answer for another partition q comes from q's owner: "who holds this id
on q as of offset n of q". The owner answers once it has judged q up to n, and
that answer never changes afterwards -- so it is cached here, a judge that
asks again (every retry of a waiting partition does) gets it at once, and the
verdict stays a function of fixed log positions whoever owns what.

`get` never blocks the judge: it returns None and starts the question; the
judge sets the waiting partition aside and decides it again once `settled`
says it may move (every answer here, or a failed question may be asked again;
processors/judge.py). A question that fails (owner gone mid-rebalance) is
asked again after a pause; the judge waits, it never guesses.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict

from threadlog.kernel.errors import ThreadLogError
from threadlog.remote import QueryClient

# Questions per `holders_many` request (the owner refuses more). Why bounded:
# they are answered on the owner's event loop, and one request of 1.5 M
# questions (a 40 MB line) held every other request of that worker for 10 s (a
# review). A proposal asks about its few ids on each other partition; `_many`
# splits anything larger.
MAX_HOLDERS = 10_000

log = logging.getLogger("threadlog.lookups")

# Answers kept (oldest dropped first). An answer is used by the proposal that
# asked it, and its retries; it must outlive the questions asked early
# (processors/judge.py MAX_EARLY, 50 000), no more: at ~350 B an answer, 200 000
# held ~70 MB per worker after a few hours of steady load (a soak helper).
MAX_CACHED = 100_000
RETRY_AFTER_S = 0.2

Question = tuple[int, str, str, int]  # (partition, kind, id, as of offset)


class Lookups:
    def __init__(self, query: QueryClient, max_cached: int = MAX_CACHED) -> None:
        self.query = query
        self.max_cached = max_cached
        self._answers: OrderedDict[Question, list[str]] = OrderedDict()
        self._asking: dict[Question, float] = {}  # question -> when it may be asked again
        self._lock = threading.Lock()
        self.asked = 0  # questions sent (operators, tests)
        self.requests = 0  # requests they went in
        # Questions sent and neither answered nor failed yet: a judge asks ahead
        # only while few are (processors/judge.py MAX_EARLY_IN_FLIGHT).
        self.in_flight = 0

    def settled(self, questions: list[Question]) -> bool:
        """Should a judge waiting on these questions decide again now: every one
        answered, or one not in flight (it failed and may be asked again, or was
        never asked) -- deciding again asks it."""
        now = time.monotonic()
        with self._lock:
            unanswered = [x for x in questions if x not in self._answers]
            return not unanswered or any(self._asking.get(x, 0.0) <= now for x in unanswered)

    def answered(self, questions: list[Question]) -> bool:
        """Is every one of these answered (cached)?"""
        with self._lock:
            return all(x in self._answers for x in questions)

    def get(self, q: int, kind: str, ident: str, asof: int) -> list[str] | None:
        question = (q, kind, ident, asof)
        with self._lock:
            found = self._answers.get(question)
            if found is not None:
                self._answers.move_to_end(question)
                return found
        try:
            self.ask([question])  # unless in flight (or failed a moment ago)
        except ThreadLogError:
            # Not asked: the query client is closed (the worker stopping while its
            # judge still runs). Unknown, as for any unanswered question: never
            # raised into the handler asking, where an error is a verdict -- one
            # no other judge reaches (a chaos helper's reading of the code).
            pass
        return None

    def ask(self, questions: list[Question]) -> None:
        """Start the questions of one proposal (those not answered nor in
        flight) in one go: one request per owner asked, however many partitions
        it carries -- the proposal needs every answer anyway. Why: a request
        costs both workers ~0.2 ms of CPU each way. Not the questions of several
        proposals in one request: the owner answers once all are settled, and
        one proposal's question can wait for another proposal to be judged."""
        now = time.monotonic()
        batch: list[Question] = []
        with self._lock:
            for question in questions:
                if question in self._answers or self._asking.get(question, 0.0) > now:
                    continue
                self._asking[question] = float("inf")
                self.asked += 1
                self.in_flight += 1
                batch.append(question)
        if batch:
            asking = self._ask(batch)
            try:
                self.query._run(asking)
            except BaseException:  # never started (the client closed): not in flight
                asking.close()
                self._failed(batch)
                raise

    async def _ask(self, questions: list[Question]) -> None:
        """`holders_many`, routed to the owners of the partitions asked about (a
        worker of an earlier version is asked one `holders` at a time)."""
        try:
            if len(questions) > 1 and self.query._supports("holders_many"):
                try:
                    answers = await self._many(questions)
                except ThreadLogError as exc:
                    if not self.query._unsupported(exc, "holders_many"):
                        raise
                    answers = [await self._one(x) for x in questions]
            else:
                answers = [await self._one(x) for x in questions]
        except ThreadLogError as exc:
            log.info("holders of %d ids on partitions %s not answered yet: %s", len(questions),
                     sorted({x[0] for x in questions}), exc.message)
            self._failed(questions)
            return
        except Exception:  # pragma: no cover - never let a question die silently
            log.exception("holders question failed")
            self._failed(questions)
            return
        except asyncio.CancelledError:  # the client closing: not in flight any more either
            self._failed(questions)
            raise
        with self._lock:
            self.in_flight -= len(questions)
            for question, threads in zip(questions, answers, strict=True):
                self._asking.pop(question, None)
                self._answers[question] = threads
            while len(self._answers) > self.max_cached:
                self._answers.popitem(last=False)

    async def _many(self, questions: list[Question]) -> list[list[str]]:
        # In requests of at most MAX_HOLDERS questions (what an owner answers at once).
        found: dict[Question, list[str]] = {}
        for part in await asyncio.gather(*(self._many_at_most(questions[i:i + MAX_HOLDERS])
                                           for i in range(0, len(questions), MAX_HOLDERS))):
            found.update(part)
        return [found[x] for x in questions]

    async def _many_at_most(self, questions: list[Question]) -> dict[Question, list[str]]:
        self.requests += 1
        asked = [[q, kind, ident, asof] for q, kind, ident, asof in questions]
        results = await self.query.call("holders_many", {"asked": asked}, sorted({x[0] for x in questions}))
        # Each owner answered the questions about its partitions, in the order asked.
        found: dict[Question, list[str]] = {}
        for parts, result in results.items():
            mine = [x for x in questions if x[0] in parts]
            for question, threads in zip(mine, result["threads"], strict=True):
                found[question] = [str(t) for t in threads]
        return found

    async def _one(self, question: Question) -> list[str]:
        self.requests += 1
        q, kind, ident, asof = question
        results = await self.query.call("holders", {"q": q, "kind": kind, "id": ident, "asof": asof}, [q])
        (result,) = results.values()
        return [str(t) for t in result["threads"]]

    def _failed(self, questions: list[Question]) -> None:
        with self._lock:
            self.in_flight -= len(questions)
            again = time.monotonic() + RETRY_AFTER_S
            for question in questions:
                self._asking[question] = again

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

import logging
import threading
import time
from collections import OrderedDict

from threadlog.kernel.errors import ThreadLogError
from threadlog.remote import QueryClient

log = logging.getLogger("threadlog.lookups")

MAX_CACHED = 200_000
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

    def settled(self, questions: list[Question]) -> bool:
        """Should a judge waiting on these questions decide again now: every one
        answered, or one not in flight (it failed and may be asked again, or was
        never asked) -- deciding again asks it."""
        now = time.monotonic()
        with self._lock:
            unanswered = [x for x in questions if x not in self._answers]
            return not unanswered or any(self._asking.get(x, 0.0) <= now for x in unanswered)

    def get(self, q: int, kind: str, ident: str, asof: int) -> list[str] | None:
        question = (q, kind, ident, asof)
        with self._lock:
            found = self._answers.get(question)
            if found is not None:
                self._answers.move_to_end(question)
                return found
            if self._asking.get(question, 0.0) > time.monotonic():
                return None  # asked (or failed) a moment ago
            self._asking[question] = float("inf")
            self.asked += 1
        self.query._run(self._ask(question))
        return None

    async def _ask(self, question: Question) -> None:
        q, kind, ident, asof = question
        try:
            results = await self.query.call("holders", {"q": q, "kind": kind, "id": ident, "asof": asof}, [q])
            (result,) = results.values()
            threads = [str(t) for t in result["threads"]]
        except ThreadLogError as exc:
            log.info("holders of %s %r on partition %d as of %d not answered yet: %s", kind, ident, q, asof,
                     exc.message)
            with self._lock:
                self._asking[question] = time.monotonic() + RETRY_AFTER_S
            return
        except Exception:  # pragma: no cover - never let a question die silently
            log.exception("holders question failed")
            with self._lock:
                self._asking[question] = time.monotonic() + RETRY_AFTER_S
            return
        with self._lock:
            self._asking.pop(question, None)
            self._answers[question] = threads
            while len(self._answers) > self.max_cached:
                self._answers.popitem(last=False)

"""langgraph-checkpoint-conformance against AsyncThreadLogSaver on a real broker.

Every test of the suite is its own pytest item (a failure names the test, and
each runs in a fresh namespace): the suite's ALL_*_TESTS lists are
parametrized here, and each item gets its saver from the suite's own
`@checkpointer_test` registration, so the factory is the one `validate()`
would use. The base capabilities (put, put_writes, get_tuple, list,
delete_thread) are the required 58 tests; delete_for_runs, copy_thread and
prune the optional 23. One more test runs the suite's own `validate()` over
everything once and checks its verdict.
"""

from __future__ import annotations

import pytest
from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.capabilities import (
    ALL_CAPABILITIES,
    BASE_CAPABILITIES,
    Capability,
    DetectedCapabilities,
)
from langgraph.checkpoint.conformance.spec.test_copy_thread import ALL_COPY_THREAD_TESTS
from langgraph.checkpoint.conformance.spec.test_delete_for_runs import ALL_DELETE_FOR_RUNS_TESTS
from langgraph.checkpoint.conformance.spec.test_delete_thread import ALL_DELETE_THREAD_TESTS
from langgraph.checkpoint.conformance.spec.test_get_tuple import ALL_GET_TUPLE_TESTS
from langgraph.checkpoint.conformance.spec.test_list import ALL_LIST_TESTS
from langgraph.checkpoint.conformance.spec.test_prune import ALL_PRUNE_TESTS
from langgraph.checkpoint.conformance.spec.test_put import ALL_PUT_TESTS
from langgraph.checkpoint.conformance.spec.test_put_writes import ALL_PUT_WRITES_TESTS

from threadlog.integrations.langgraph import AsyncThreadLogSaver

SUITES = {
    Capability.PUT: ALL_PUT_TESTS,
    Capability.PUT_WRITES: ALL_PUT_WRITES_TESTS,
    Capability.GET_TUPLE: ALL_GET_TUPLE_TESTS,
    Capability.LIST: ALL_LIST_TESTS,
    Capability.DELETE_THREAD: ALL_DELETE_THREAD_TESTS,
    Capability.DELETE_FOR_RUNS: ALL_DELETE_FOR_RUNS_TESTS,
    Capability.COPY_THREAD: ALL_COPY_THREAD_TESTS,
    Capability.PRUNE: ALL_PRUNE_TESTS,
}
CASES = [
    pytest.param(cap, fn, id=f"{'required' if cap in BASE_CAPABILITIES else 'optional'}-{cap.value}-{fn.__name__}")
    for cap, fns in SUITES.items()
    for fn in fns
]


def test_the_suite_is_the_expected_size():
    # If a new release of the suite adds tests, this says so instead of
    # silently reporting a different pass count.
    required = sum(len(SUITES[c]) for c in BASE_CAPABILITIES)
    optional = sum(len(SUITES[c]) for c in ALL_CAPABILITIES - BASE_CAPABILITIES)
    assert (required, optional) == (58, 23)


@pytest.fixture
async def registered(open_client):
    tl = await open_client()

    @checkpointer_test(name="AsyncThreadLogSaver")
    async def threadlog_saver():
        # A fresh saver per suite; the namespace (and its client) is fresh per test item.
        yield AsyncThreadLogSaver(tl)

    return threadlog_saver


async def test_every_capability_is_detected(registered):
    async with registered.create() as saver:
        detected = DetectedCapabilities.from_instance(saver)
    assert detected.missing == frozenset()


async def test_validate_reports_full_conformance(registered):
    """The suite's own runner, once over all of it (one namespace): its verdict is FULL."""
    report = await validate(registered)
    failures = {name: r.failures for name, r in report.results.items() if r.failures}
    assert failures == {}
    assert report.passed_all_base() and report.passed_all()
    assert report.conformance_level() == "FULL"
    assert sum(r.tests_passed for r in report.results.values()) == 81


@pytest.mark.parametrize(("capability", "conformance_test"), CASES)
async def test_conformance(registered, capability, conformance_test):
    async with registered.create() as saver:
        await conformance_test(saver)

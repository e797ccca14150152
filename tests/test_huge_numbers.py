"""Integers too large for a double, where a timestamp or a duration is expected.

Found by a differential review: 10**400 as `createdAt`, `started_at`, `ttl_ms`...
raised a bare OverflowError (`math.isfinite` of an int beyond a double's range)
instead of the ThreadLogError every bad input gets (SPEC section 3), while
2**64 was refused with a code. Each call is tried with both: the same code.
"""

from __future__ import annotations

import pytest
from checkpoint_helpers import artifact, checkpoint
from support import within

from threadlog import ThreadLogError
from threadlog.kernel.validation import is_finite, is_timestamp


def test_an_int_beyond_a_double_is_neither_finite_nor_a_timestamp():
    for big in (10**400, -(10**400)):
        assert not is_finite(big) and not is_timestamp(big)
    assert is_finite(2**64) and not is_timestamp(2**64) and is_timestamp(2**63 - 1)


async def _code(call) -> str:
    with pytest.raises(ThreadLogError) as err:
        await within(call)
    return err.value.code


async def test_timestamps_and_durations_beyond_a_double_are_refused_with_a_code(tl):
    lease = await within(tl.checkpoints.acquire_writer("t", auto_renew=False))
    await within(tl.runs.create_or_resume(run_id="r", thread_id="t", started_at=1))
    for big in (2**64, 10**400, -(10**400)):
        codes = [
            await _code(tl.checkpoints.append(checkpoint=checkpoint("c1", "t", created_at=big), expected_head_id=None,
                                              writer=lease)),
            await _code(tl.checkpoints.append(
                checkpoint=checkpoint("c1", "t", artifacts=[artifact("a", createdAt=big)]), expected_head_id=None,
                writer=lease)),
            await _code(tl.checkpoints.fork_from_checkpoint(
                source_thread_id="t", source_checkpoint_id="c0", destination_thread_id="d",
                destination_checkpoint_id="d1", created_at=big, writer=lease)),
            await _code(tl.runs.create_or_resume(run_id="r2", thread_id="t", started_at=big)),
            await _code(tl.runs.update("r", {"finishedAt": big})),
            await _code(tl.runs.list_reclaimable(now=big, ttl_ms=0)),
            await _code(tl.generation_runs.create_or_resume(run_id="g", thread_id="t", activity="chat", provider="p",
                                                            model="m", started_at=big)),
        ]
        entry = "SANDBOX_SNAPSHOT_INVALID_ENTRY"
        assert codes == [entry, entry, entry, "INVALID_ARGUMENT", "INVALID_ARGUMENT", "INVALID_ARGUMENT",
                         "INVALID_ARGUMENT"], (big, codes)
    # A duration of 2**64 ms is a number (a run quiet that long: none); 10**400 is no double.
    assert await within(tl.runs.list_reclaimable(now=1, ttl_ms=2**64)) == []
    assert await _code(tl.runs.list_reclaimable(now=1, ttl_ms=10**400)) == "INVALID_ARGUMENT"
    with pytest.raises(ThreadLogError) as err:
        await within(tl.runs.drive("r", heartbeat_ms=10**400))
    assert err.value.code == "INVALID_ARGUMENT"

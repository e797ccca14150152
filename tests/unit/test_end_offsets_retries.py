"""Which failed end-offsets requests a read barrier sends again (projections/barrier.py), no broker."""

from __future__ import annotations

import time

import pytest
from confluent_kafka import KafkaError, KafkaException
from threadlog.projections.barrier import EndOffsets

from threadlog import ThreadLogError


def _ends() -> EndOffsets:
    return EndOffsets(None, "ns.events", 4, timeout=5)  # type: ignore[arg-type]  # `_failed` reads no source


@pytest.mark.parametrize("code", [KafkaError._TIMED_OUT, KafkaError._TIMED_OUT_QUEUE])
def test_a_request_that_timed_out_is_sent_again_within_the_deadline(code):
    # Tried (a chaos helper): a read whose owner's request "timed out in queue"
    # (the owner frozen 2.5 s by SIGSTOP) failed UNAVAILABLE at once, deadline far off.
    assert _ends()._failed(KafkaException(KafkaError(code)), time.monotonic() + 5) is True


def test_past_the_deadline_a_timed_out_request_is_unavailable():
    with pytest.raises(ThreadLogError) as caught:
        _ends()._failed(KafkaException(KafkaError(KafkaError._TIMED_OUT_QUEUE)), time.monotonic() - 1)
    assert caught.value.code == "UNAVAILABLE" and "not answered" in caught.value.message


def test_an_error_no_retry_fixes_fails_at_once():
    with pytest.raises(ThreadLogError) as caught:
        _ends()._failed(KafkaException(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED)), time.monotonic() + 5)
    assert caught.value.code == "UNAVAILABLE"

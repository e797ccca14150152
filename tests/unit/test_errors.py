"""`ThreadLogError.retryable` (threadlog/kernel/errors.py): what a retry loop, or an
SSE stream choosing between "reconnect" and "give up", reads instead of parsing
messages. Tried: each code's default, an UNAVAILABLE that cannot pass, errors
pickled across processes (the blocking client, worker pools), a subclass."""

from __future__ import annotations

import pickle

import pytest
from threadlog.schemas.codec import CodecError

from threadlog.errors import (
    CODES,
    OUTCOME_UNKNOWN,
    STALE_HEAD,
    UNAVAILABLE,
    ThreadLogError,
    unavailable,
)


def test_only_unavailable_is_retryable_by_default():
    retryable = {code for code in CODES if ThreadLogError(code, "x").retryable}
    assert retryable == {UNAVAILABLE}
    # A blind re-send after an unknown outcome could be refused stale: read first.
    assert ThreadLogError(OUTCOME_UNKNOWN, "x").retryable is False


def test_an_unavailable_that_no_retry_can_cure_says_so():
    gone = unavailable("deliveries[0]@0 is gone (retention)", retryable=False)
    assert (gone.code, gone.retryable) == (UNAVAILABLE, False)
    assert unavailable("broker away").retryable is True


@pytest.mark.parametrize("err", [
    ThreadLogError(STALE_HEAD, "head moved"),
    unavailable("gone", retryable=False),
    unavailable("away"),
    CodecError("bad bytes"),
])
def test_errors_keep_code_message_and_retryable_through_pickle(err):
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err)
    assert (back.code, back.message, back.retryable, str(back)) == (err.code, err.message, err.retryable, str(err))

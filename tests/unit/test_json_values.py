"""The one JSON-value rule (threadlog/kernel/validation.py) that clients and
judges share: what it refuses is refused with a stable code before anything is
encoded or sent."""

from __future__ import annotations

import pytest
from checkpoint_helpers import checkpoint

from threadlog import ThreadLogError
from threadlog.kernel.checkpoint_rules import check_checkpoint, to_wire
from threadlog.kernel.validation import json_problem


def test_an_integer_too_long_for_json_text_is_refused_as_an_entry_not_an_encoder_crash():
    # Tried: a conversation holding 10**4300 (4301 digits). CPython encodes no such
    # int: it passed the checks, then `to_wire` raised a bare ValueError.
    cp = checkpoint("c1", "t", conversation=[{"role": "user", "n": 10**4300}])
    with pytest.raises(ThreadLogError) as err:
        check_checkpoint(cp)
    assert err.value.code == "SANDBOX_SNAPSHOT_INVALID_ENTRY" and "4300 digits" in err.value.message
    ok = checkpoint("c1", "t", conversation=[{"role": "user", "n": -(10**4300 - 1)}])  # 4300 digits: fine
    check_checkpoint(ok)
    to_wire(ok)
    assert json_problem([True, 2**63, 1.5, None, "x"]) is None

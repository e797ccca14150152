"""Lines between thin clients and workers (threadlog/kernel/wire.py), without a broker."""

from __future__ import annotations

import pytest

from threadlog.kernel import wire


@pytest.mark.parametrize("value", [
    {"push": [[0, 12, {"ok": True, "result": "cp-1"}]]},
    {"n": 2**64 - 1, "m": -(2**63)},  # orjson's range: its own line
    {"n": 2**64, "m": -(2**63) - 1, "s": "é\u2028\n", "deep": [[10**4000]]},  # beyond: exact, by the stdlib
])
def test_every_json_value_comes_back_exactly(value):
    line = wire.dumps(value)
    assert b"\n" not in line  # one line each
    back = wire.loads(line)
    assert back == value
    assert all(type(back[k]) is type(value[k]) for k in value)


def test_a_line_orjson_can_write_is_orjson_s():
    assert wire.dumps({"a": 1}) == b'{"a":1}'


def test_stored_json_is_read_exactly():
    assert wire.loads_exact(b'{"n": 18446744073709551616}') == {"n": 2**64}


def test_what_is_not_json_is_a_type_error():
    with pytest.raises(TypeError):
        wire.dumps({"b": b"bytes"})

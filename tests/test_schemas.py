"""The Avro protocol: single-object codec, evolution, compatibility check."""

from __future__ import annotations

import json
import random

import pytest
from fastavro.utils import generate_many
from hypothesis import given, settings
from hypothesis import strategies as st
from threadlog.schemas import Codec, CodecError, check_compatibility, default_codec, fingerprint64
from threadlog.schemas.codec import SCHEMA_DIR


def test_fingerprint_matches_the_avro_specification():
    # Avro spec: CRC-64-AVRO of the canonical form "string" is -8142146995180207161.
    fp = fingerprint64('"string"')
    assert int.from_bytes(fp, "little") == -8142146995180207161 % 2**64


def test_every_schema_is_compatible_with_its_frozen_version():
    assert check_compatibility() == []


@pytest.mark.parametrize("name", sorted(default_codec().current))
def test_codec_round_trips_generated_records(name):
    codec = default_codec()
    random.seed(name)
    for record in generate_many(codec.current[name].schema, 25):
        data = codec.encode(name, record)
        assert data[:2] == b"\xc3\x01"
        assert data[2:10] == codec.current[name].fingerprint
        got_name, got = codec.decode(data)
        assert got_name == name
        assert got == record


def test_decode_refuses_with_clear_errors():
    codec = default_codec()
    good = codec.encode("threadlog.Reply", {"commandId": "c", "clientId": "x", "ok": True})
    cases = {
        "bad marker": b"\x00\x00" + good[2:],
        "too short": good[:5],
        "unknown fingerprint": good[:2] + b"\x00" * 8 + good[10:],
        "truncated body": good[:-3],
        "trailing bytes": good + b"\x00\x00",
    }
    for why, data in cases.items():
        with pytest.raises(CodecError) as err:
            codec.decode(data)
        assert err.value.code == "INVALID_MESSAGE", why
    with pytest.raises(CodecError):
        codec.decode(None)
    with pytest.raises(CodecError):
        codec.decode(good, expect="threadlog.Event")
    with pytest.raises(CodecError):
        codec.encode("threadlog.Reply", {"commandId": "c"})  # missing required fields


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_crash_the_decoder(data):
    codec = default_codec()
    try:
        codec.decode(data)
    except CodecError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=60), st.integers(min_value=0))
def test_corrupted_valid_messages_decode_or_fail_cleanly(noise, where):
    codec = default_codec()
    good = codec.encode("threadlog.Event", {
        "key": "thread", "seq": 7, "decidedAt": 1.5, "commandId": "c", "type": "t", "payload": b"xyz"})
    pos = 10 + where % (len(good) - 10)
    data = good[:pos] + noise + good[pos + len(noise):]
    try:
        codec.decode(data)
    except CodecError:
        pass


# -- evolution, proven on schemas written for the purpose -----------------------

V1 = {"type": "record", "name": "Thing", "namespace": "demo",
      "fields": [{"name": "id", "type": "string"}, {"name": "n", "type": "long"}]}


def _write(tmp_path, current: dict, history: list[dict]):
    cur, hist = tmp_path / "avro", tmp_path / "avro" / "history"
    hist.mkdir(parents=True)
    (cur / "demo.Thing.avsc").write_text(json.dumps(current))
    for n, h in enumerate(history, 1):
        (hist / f"demo.Thing.v{n}.avsc").write_text(json.dumps(h))
    return cur, hist


def test_added_optional_field_is_compatible_and_old_data_resolves(tmp_path):
    v2 = {**V1, "fields": [*V1["fields"], {"name": "note", "type": ["null", "string"], "default": None}]}
    cur, hist = _write(tmp_path, v2, [V1])
    assert check_compatibility(cur, hist) == []
    # A writer still on v1 (another process, or an old event in the log) ...
    old_dir = tmp_path / "old"
    old_dir.mkdir()
    (old_dir / "demo.Thing.avsc").write_text(json.dumps(V1))
    data = Codec(old_dir, tmp_path / "none").encode("demo.Thing", {"id": "a", "n": 3})
    # ... is read into v2's shape by schema resolution, the fingerprint naming v1.
    assert Codec(cur, hist).decode(data) == ("demo.Thing", {"id": "a", "n": 3, "note": None})
    # And v2 data is readable by the v1 reader (forward): the new field is ignored.
    data2 = Codec(cur, hist).encode("demo.Thing", {"id": "b", "n": 4, "note": "x"})
    v1_reader = Codec(old_dir, hist)
    v1_reader._writers[Codec(cur, hist).current["demo.Thing"].fingerprint] = Codec(cur, hist).current["demo.Thing"]
    assert v1_reader.decode(data2) == ("demo.Thing", {"id": "b", "n": 4})


def test_added_required_field_is_not_backward_compatible(tmp_path):
    v2 = {**V1, "fields": [*V1["fields"], {"name": "must", "type": "string"}]}
    cur, hist = _write(tmp_path, v2, [V1])
    problems = check_compatibility(cur, hist)
    assert any("not backward compatible" in p for p in problems)


def test_removed_field_without_default_is_not_forward_compatible(tmp_path):
    v2 = {**V1, "fields": V1["fields"][:1]}
    cur, hist = _write(tmp_path, v2, [V1])
    problems = check_compatibility(cur, hist)
    assert any("not forward compatible" in p for p in problems)


def test_changed_type_is_refused(tmp_path):
    v2 = {**V1, "fields": [V1["fields"][0], {"name": "n", "type": "string"}]}
    cur, hist = _write(tmp_path, v2, [V1])
    assert check_compatibility(cur, hist)


def test_every_schema_file_names_its_full_name():
    for path in SCHEMA_DIR.glob("*.avsc"):
        raw = json.loads(path.read_text())
        full = raw["name"] if "." in raw["name"] else f"{raw['namespace']}.{raw['name']}"
        assert path.name == f"{full}.avsc"

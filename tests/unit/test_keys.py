"""Order-preserving RocksDB keys (projections/keys.py), without a broker.

`key` builds every key a fold or a judge reads or writes; it inlines the
string encoding for speed, so these pin it to `enc_str` / `enc_num` and to the
orders the store's scans rely on.
"""

from __future__ import annotations

import math
import random

from threadlog.projections.keys import dec_num, enc_num, enc_str, key, split


class Name(str):
    """A str subclass (an enum-like id type a caller may pass)."""


def test_key_is_the_tag_and_each_part_encoded():
    parts = ["thread-1", 12.5, "a\x00b", "", -3, "é/\u2028", 2**60, Name("sub")]
    expected = b"T" + b"".join(enc_str(p) if isinstance(p, str) else enc_num(p) for p in parts)
    assert key(b"T", *parts) == expected
    assert split(b"T", key(b"T", "a\x00b", 7, "c"), "sns") == ["a\x00b", 7.0, "c"]


def test_parts_never_run_into_the_next_one():
    assert key(b"T", "a:b", "c") != key(b"T", "a", "b:c")
    assert key(b"T", "a\x00", "b") != key(b"T", "a", "\x00b")
    # A prefix scan over the first parts returns exactly their children.
    assert key(b"T", "ab", "c").startswith(key(b"T", "ab"))
    assert not key(b"T", "abc", "d").startswith(key(b"T", "ab"))


def test_string_parts_order_as_their_utf8_bytes():
    rng = random.Random(7)
    alphabet = ["a", "b", "\x00", "\x01", "é", "\uffff", "\U0001f600", "/"]
    words = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 5))) for _ in range(300)]
    by_key = sorted(words, key=lambda w: key(b"T", w, "tail"))
    assert [w.encode("utf-8") for w in by_key] == sorted(w.encode("utf-8") for w in words)


def test_number_parts_order_numerically():
    values = [-math.inf, -1e300, -2**53, -1, -0.5, -1e-300, 0.0, 1e-300, 0.5, 1, 3, 2**53, 1e300, math.inf]
    encoded = [key(b"T", v) for v in values]
    assert encoded == sorted(encoded)
    for v in values:
        assert dec_num(enc_num(v))[0] == v
    assert enc_num(True) == enc_num(1.0)  # numbers travel as doubles, as before the inlining


def test_kept_string_parts_encode_the_same_as_fresh_ones():
    """`key` keeps the encodings of short string parts (a bounded dict, cleared
    when full): a part met again, a part after a clearing, a long part (never
    kept) and a str subclass equal to a kept str all encode as `enc_str` does."""
    import threadlog.projections.keys as keys

    long = "x" * keys._PART_MAX_BYTES
    for _ in range(2):  # the second round reads what the first kept
        for part in ["t-1", "a\x00b", long, Name("t-1"), "é"]:
            assert key(b"T", part, 1.0) == b"T" + enc_str(part) + enc_num(1.0)
    assert long not in keys._PARTS
    for n in range(keys._PARTS_MAX + 10):  # fills, clears, refills
        key(b"T", f"p{n}")
    assert len(keys._PARTS) <= keys._PARTS_MAX
    assert key(b"T", "p3") == b"T" + enc_str("p3")

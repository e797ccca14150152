"""Order-preserving binary keys for RocksDB.

A key is a short tag followed by encoded parts. Strings keep their UTF-8 byte
order (SPEC: "ordering by bytes"), numbers their numeric order, and a part can
never run into the next one, so `("a:b", "c")` and `("a", "b:c")` are different
keys and a prefix scan over the first parts returns exactly their children.
"""

from __future__ import annotations

import struct

_END = b"\x00\x01"
_ESC = b"\x00\xff"


def enc_str(value: str) -> bytes:
    raw = value.encode("utf-8")
    return (raw.replace(b"\x00", _ESC) if b"\x00" in raw else raw) + _END


def dec_str(data: bytes, pos: int = 0) -> tuple[str, int]:
    out = bytearray()
    while True:
        i = data.index(b"\x00", pos)
        out += data[pos:i]
        if data[i + 1] == 0xFF:
            out.append(0)
            pos = i + 2
            continue
        return out.decode("utf-8"), i + 2


def enc_num(value: float) -> bytes:
    """8 bytes whose unsigned order equals the numeric order of the double."""
    (bits,) = struct.unpack(">Q", struct.pack(">d", float(value)))
    bits = bits ^ 0xFFFFFFFFFFFFFFFF if bits & (1 << 63) else bits | (1 << 63)
    return struct.pack(">Q", bits)


def dec_num(data: bytes, pos: int = 0) -> tuple[float, int]:
    (bits,) = struct.unpack(">Q", data[pos : pos + 8])
    bits = bits & ~(1 << 63) if bits & (1 << 63) else bits ^ 0xFFFFFFFFFFFFFFFF
    return struct.unpack(">d", struct.pack(">Q", bits))[0], pos + 8


def key(tag: bytes, *parts: str | float) -> bytes:
    out = [tag]  # hot (dozens of keys per judged proposal): one join
    for part in parts:
        out.append(enc_str(part) if isinstance(part, str) else enc_num(part))
    return b"".join(out)


def split(tag: bytes, data: bytes, kinds: str) -> list:
    """Decode the parts after `tag`; kinds is a string of 's' (str) / 'n' (number)."""
    pos = len(tag)
    out: list = []
    for kind in kinds:
        value, pos = dec_str(data, pos) if kind == "s" else dec_num(data, pos)
        out.append(value)
    return out

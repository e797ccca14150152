"""Avro single-object encoding: marker, 64-bit schema fingerprint, binary body.

Every message threadlog writes carries the fingerprint of its writer schema,
so a reader resolves the exact schema it was written with and evolves it into
its own by Avro schema resolution. Anything that is not such a message -- a
wrong marker, an unknown fingerprint, a truncated or over-long body -- is a
`CodecError`, never a crash of the consumer that met it.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastavro import schemaless_reader, schemaless_writer
from fastavro.schema import load_schema, parse_schema, to_parsing_canonical_form

from threadlog.kernel.errors import INVALID_MESSAGE, ThreadLogError

MARKER = b"\xc3\x01"
HEADER_LEN = len(MARKER) + 8
SCHEMA_DIR = Path(__file__).with_name("avro")
HISTORY_DIR = SCHEMA_DIR / "history"

_EMPTY = 0xC15D213AA4D7A795
_TABLE: list[int] = []
for _i in range(256):
    _fp = _i
    for _ in range(8):
        _fp = (_fp >> 1) ^ (_EMPTY & -(_fp & 1))
    _TABLE.append(_fp)


def fingerprint64(canonical: str) -> bytes:
    """CRC-64-AVRO (Rabin) of a schema's parsing canonical form, little-endian."""
    fp = _EMPTY
    for byte in canonical.encode("utf-8"):
        fp = (fp >> 8) ^ _TABLE[(fp ^ byte) & 0xFF]
    return fp.to_bytes(8, "little")


class CodecError(ThreadLogError):
    def __init__(self, message: str) -> None:
        super().__init__(INVALID_MESSAGE, message)


@dataclass(frozen=True)
class SchemaVersion:
    name: str
    schema: Any  # parsed (fastavro) schema, fully expanded
    canonical: str
    fingerprint: bytes
    source: str  # file it came from


def _full_name(raw: dict) -> str:
    name = raw["name"]
    ns = raw.get("namespace")
    return name if "." in name or not ns else f"{ns}.{name}"


def load_current(schema_dir: Path = SCHEMA_DIR) -> dict[str, SchemaVersion]:
    """The schemas this code writes with: one per `<full name>.avsc`."""
    out: dict[str, SchemaVersion] = {}
    for path in sorted(schema_dir.glob("*.avsc")):
        parsed = load_schema(str(path))
        name = path.name[: -len(".avsc")]
        canonical = to_parsing_canonical_form(parsed)
        out[name] = SchemaVersion(name, parsed, canonical, fingerprint64(canonical), path.name)
    return out


def load_history(history_dir: Path = HISTORY_DIR) -> list[SchemaVersion]:
    """Frozen earlier versions (`<full name>.v<N>.avsc`, fully expanded)."""
    out: list[SchemaVersion] = []
    if not history_dir.is_dir():
        return out
    for path in sorted(history_dir.glob("*.avsc")):
        raw = json.loads(path.read_text())
        parsed = parse_schema(raw, _force=True)
        canonical = to_parsing_canonical_form(parsed)
        out.append(SchemaVersion(_full_name(raw), parsed, canonical, fingerprint64(canonical), path.name))
    return out


class Codec:
    """Encodes with the current schemas; decodes anything current or historical."""

    def __init__(self, schema_dir: Path = SCHEMA_DIR, history_dir: Path = HISTORY_DIR) -> None:
        self.current = load_current(schema_dir)
        self._writers: dict[bytes, SchemaVersion] = {}
        self._history = load_history(history_dir)
        for version in self._history:
            self._writers[version.fingerprint] = version
        for version in self.current.values():
            self._writers[version.fingerprint] = version

    def known(self, name: str) -> bool:
        return name in self.current

    def writer(self, fingerprint: bytes) -> SchemaVersion | None:
        """The schema (current or historical) with this fingerprint, if known."""
        return self._writers.get(fingerprint)

    def history_fingerprint(self, name: str, version: int) -> bytes | None:
        """The fingerprint of frozen version `version` of schema `name`, if frozen."""
        source = f"{name}.v{version}.avsc"
        return next((v.fingerprint for v in self._history if v.source == source), None)

    def fingerprints(self, name: str) -> set[bytes]:
        """Every version of schema `name` this codec decodes (frozen and current)."""
        return {fp for fp, v in self._writers.items() if v.name == name}

    def encode(self, name: str, record: dict) -> bytes:
        try:
            version = self.current[name]
        except KeyError:
            raise CodecError(f"no schema named {name!r}") from None
        buf = io.BytesIO()
        buf.write(MARKER)
        buf.write(version.fingerprint)
        try:
            schemaless_writer(buf, version.schema, record)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise CodecError(f"record does not match schema {name}: {exc}") from None
        return buf.getvalue()

    def decode(self, data: bytes | None, expect: str | None = None) -> tuple[str, dict]:
        """Return (schema full name, record) resolved to the current reader schema."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise CodecError("message has no value")
        data = bytes(data)
        if len(data) < HEADER_LEN or data[:2] != MARKER:
            raise CodecError("not an Avro single-object message (bad marker or too short)")
        writer = self._writers.get(data[2:HEADER_LEN])
        if writer is None:
            raise CodecError(f"unknown schema fingerprint {data[2:HEADER_LEN].hex()}")
        if expect is not None and writer.name != expect:
            raise CodecError(f"expected a {expect}, got a {writer.name}")
        reader = self.current.get(writer.name)
        buf = io.BytesIO(data)
        buf.seek(HEADER_LEN)
        try:
            if reader is None or reader.fingerprint == writer.fingerprint:
                record = schemaless_reader(buf, writer.schema, None)
            else:
                record = schemaless_reader(buf, writer.schema, reader.schema)
        except Exception as exc:  # fastavro raises many types on corrupt input
            raise CodecError(f"corrupt {writer.name} body: {type(exc).__name__}: {exc}") from None
        if buf.tell() != len(data):
            raise CodecError(f"{len(data) - buf.tell()} trailing bytes after a {writer.name}")
        if not isinstance(record, dict):
            raise CodecError(f"{writer.name} body is not a record")
        return writer.name, record


_default: Codec | None = None


def default_codec() -> Codec:
    global _default
    if _default is None:
        _default = Codec()
    return _default

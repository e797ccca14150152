"""Schema evolution: freeze released versions, prove each change compatible.

`schemas/avro/<full name>.avsc` is what the code writes today. Every released
version is frozen, fully expanded, as `schemas/avro/history/<name>.v<N>.avsc`;
readers keep decoding all of them. A change to a schema is allowed only if it
is both backward compatible (the new reader reads data written with the
previous version) and forward compatible (the previous reader reads data
written with the new version) -- the check below proves both by Avro schema
resolution on generated data, and the test suite runs it.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

from fastavro import schemaless_reader, schemaless_writer
from fastavro.schema import parse_schema
from fastavro.types import Schema
from fastavro.utils import generate_many

from .codec import HISTORY_DIR, SCHEMA_DIR, SchemaVersion, load_current, load_history

_PRIMITIVES = {"null", "boolean", "int", "long", "float", "double", "bytes", "string"}
_VERSION = re.compile(r"^(?P<name>.+)\.v(?P<n>\d+)\.avsc$")


def expanded_raw(name: str, schema_dir: Path = SCHEMA_DIR) -> dict:
    """The raw JSON of a schema with references to other files inlined once."""
    seen: set[str] = set()

    def full(n: str, ns: str | None) -> str:
        return n if "." in n or not ns else f"{ns}.{n}"

    def walk(node: Any, ns: str | None) -> Any:
        if isinstance(node, str):
            if node in _PRIMITIVES:
                return node
            ref = full(node, ns)
            if ref in seen:
                return ref
            path = schema_dir / f"{ref}.avsc"
            if not path.exists():
                return ref
            return walk(json.loads(path.read_text()), ns)
        if isinstance(node, list):
            return [walk(n, ns) for n in node]
        if isinstance(node, dict):
            t = node.get("type")
            if t in ("record", "enum", "fixed", "error"):
                node = dict(node)
                own_ns = node.get("namespace", ns)
                fname = full(node["name"], own_ns)
                node["name"] = fname
                node.pop("namespace", None)
                seen.add(fname)
                inner_ns = fname.rsplit(".", 1)[0] if "." in fname else None
                if "fields" in node:
                    node["fields"] = [
                        {**f, "type": walk(f["type"], inner_ns)} for f in node["fields"]
                    ]
                return node
            if t == "array":
                return {**node, "items": walk(node["items"], ns)}
            if t == "map":
                return {**node, "values": walk(node["values"], ns)}
            return {**node, "type": walk(t, ns)} if not isinstance(t, str) or t not in _PRIMITIVES else node
        return node

    return walk(json.loads((schema_dir / f"{name}.avsc").read_text()), None)


def history_versions(history_dir: Path = HISTORY_DIR) -> dict[str, list[tuple[int, SchemaVersion]]]:
    by_name: dict[str, list[tuple[int, SchemaVersion]]] = {}
    for version in load_history(history_dir):
        m = _VERSION.match(version.source)
        if not m:
            continue
        by_name.setdefault(version.name, []).append((int(m["n"]), version))
    for versions in by_name.values():
        versions.sort(key=lambda v: v[0])
    return by_name


def _resolves(writer: Schema, reader: Schema, samples: int, seed: int) -> str | None:
    import random

    random.seed(seed)
    try:
        data = list(generate_many(writer, samples))
    except Exception as exc:  # pragma: no cover - generator limits
        return f"cannot generate sample data: {exc}"
    for datum in data:
        buf = io.BytesIO()
        schemaless_writer(buf, writer, datum)
        buf.seek(0)
        try:
            schemaless_reader(buf, writer, reader)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
    return None


def check_compatibility(
    schema_dir: Path = SCHEMA_DIR, history_dir: Path = HISTORY_DIR, samples: int = 64
) -> list[str]:
    """Problems found; empty means every schema is compatible both ways with its last version."""
    problems: list[str] = []
    current = load_current(schema_dir)
    history = history_versions(history_dir)
    for name, curr in sorted(current.items()):
        versions = history.get(name)
        if not versions:
            problems.append(f"{name}: no frozen version (run `threadlog schemas freeze`)")
            continue
        n, prev = versions[-1]
        if prev.fingerprint == curr.fingerprint:
            continue
        back = _resolves(prev.schema, curr.schema, samples, seed=n)
        if back:
            problems.append(f"{name}: not backward compatible with v{n}: {back}")
        fwd = _resolves(curr.schema, prev.schema, samples, seed=n + 1)
        if fwd:
            problems.append(f"{name}: not forward compatible with v{n}: {fwd}")
    return problems


def freeze(schema_dir: Path = SCHEMA_DIR, history_dir: Path = HISTORY_DIR) -> list[str]:
    """Write a new history version of every schema that changed; return the files written."""
    history_dir.mkdir(parents=True, exist_ok=True)
    history = history_versions(history_dir)
    written = []
    for name, curr in sorted(load_current(schema_dir).items()):
        versions = history.get(name, [])
        if versions and versions[-1][1].fingerprint == curr.fingerprint:
            continue
        n = versions[-1][0] + 1 if versions else 1
        raw = expanded_raw(name, schema_dir)
        parse_schema(raw, _force=True)  # must stand alone
        path = history_dir / f"{name}.v{n}.avsc"
        path.write_text(json.dumps(raw, indent=2, ensure_ascii=False) + "\n")
        written.append(path.name)
    return written

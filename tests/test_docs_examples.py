"""Every example of docs/reference.md (and the README's first one) runs against a real broker.

A ```python block preceded by `<!-- test: KIND -->` is an example:
- `async`: the body of an async function given an open async client `tl`;
- `sync`: the body of a function given a blocking client `tl` (`threadlog.connect`);
- `script`: a whole program, run as written except that the broker address
  `"127.0.0.1:9092"` and `namespace="myapp"` become this test's broker and
  fresh namespace (state under tmp_path via THREADLOG_STATE_DIR).
Every ```python block of the reference must be marked, so no example goes
unproven. The completeness tests check the reference names every store method,
error code and public type, so it cannot silently fall behind the API.
"""

from __future__ import annotations

import asyncio
import inspect
import re
import textwrap
from pathlib import Path

import pytest

import threadlog
import threadlog.types
from threadlog.kernel.errors import CODES

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "reference.md"
README = ROOT / "README.md"

FENCE = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)
MARK = re.compile(r"<!-- test: (async|sync|script) -->\n$")


def _examples(path: Path) -> list[tuple[str, str, int, str]]:
    """(kind or None, heading, first code line, code) of every ```python block."""
    text = path.read_text(encoding="utf-8")
    out = []
    for m in FENCE.finditer(text):
        before = text[:m.start()]
        mark = MARK.search(before[-40:])
        headings = re.findall(r"^#+ (.+)$", before, re.M)
        heading = re.sub(r"[^A-Za-z0-9]+", "-", headings[-1] if headings else "top").strip("-").lower()
        line = before.count("\n") + 2  # the line after the ```python fence
        out.append((mark.group(1) if mark else None, heading, line, m.group(1)))
    return out


EXAMPLES = _examples(REFERENCE)


def _params(kind: str) -> list:
    return [pytest.param(line, code, id=f"{heading}-L{line}")
            for k, heading, line, code in EXAMPLES if k == kind]


def _compile_body(code: str, line: int, header: str) -> object:
    # Padded so that a failing example's traceback points at its line in the doc.
    src = "\n" * (line - 2) + header + "\n" + textwrap.indent(code, "    ")
    return compile(src, str(REFERENCE), "exec")


def test_every_python_block_of_the_reference_is_a_tested_example():
    unmarked = [line for kind, _, line, _ in EXAMPLES if kind is None]
    assert not unmarked, f"```python blocks without a <!-- test: ... --> mark at lines {unmarked}"
    assert {kind for kind, *_ in EXAMPLES} == {"async", "sync", "script"}


@pytest.mark.parametrize(("line", "code"), _params("async"))
async def test_async_example(tl, line, code):
    scope: dict = {}
    exec(_compile_body(code, line, "async def example(tl):"), scope)
    await asyncio.wait_for(scope["example"](tl), 60)


@pytest.fixture
def sync_tl(bootstrap, namespace, tmp_path):
    with threadlog.connect(bootstrap, namespace=namespace, state_dir=str(tmp_path / "sync")) as client:
        yield client


@pytest.mark.parametrize(("line", "code"), _params("sync"))
def test_sync_example(sync_tl, line, code):
    scope: dict = {}
    exec(_compile_body(code, line, "def example(tl):"), scope)
    scope["example"](sync_tl)


def _run_script(code: str, filename: str, bootstrap: str, namespace: str) -> None:
    assert code.count('"127.0.0.1:9092"') >= 1 and code.count('namespace="myapp"') >= 1
    code = code.replace('"127.0.0.1:9092"', repr(bootstrap)).replace('namespace="myapp"', f"namespace={namespace!r}")
    exec(compile(code, filename, "exec"), {"__name__": "__main__"})


@pytest.mark.parametrize(("line", "code"), _params("script"))
def test_script_example(bootstrap, namespace, tmp_path, monkeypatch, line, code):
    monkeypatch.setenv("THREADLOG_STATE_DIR", str(tmp_path / "state"))
    _run_script("\n" * (line - 1) + code, str(REFERENCE), bootstrap, namespace)


def test_readme_first_example(bootstrap, namespace, tmp_path, monkeypatch, capsys):
    [(_, _, line, code), *_] = _examples(README)
    monkeypatch.setenv("THREADLOG_STATE_DIR", str(tmp_path / "state"))
    _run_script("\n" * (line - 1) + code, str(README), bootstrap, namespace)
    # The transcript printed is in the UIMessage shape @tanstack/ai-client's hydrate() takes.
    printed = capsys.readouterr().out
    assert "'role': 'user'" in printed and "'parts': [{'type': 'text', 'content': 'hi'}]" in printed


# -- the reference covers the whole public API ---------------------------------------------------
STORES = {
    "messages": "threadlog.stores.messages.MessageStore",
    "checkpoints": "threadlog.stores.checkpoints.CheckpointStore",
    "runs": "threadlog.stores.runs.RunStore",
    "interrupts": "threadlog.stores.interrupts.InterruptStore",
    "generation_runs": "threadlog.stores.generation_runs.GenerationRunStore",
    "metadata": "threadlog.stores.metadata.MetadataStore",
    "artifacts": "threadlog.stores.artifacts.ArtifactStore",
    "blobs": "threadlog.stores.blobs.BlobStore",
}
# Called by ThreadLog.close(), not by users.
PLUMBING = {("blobs", "close")}


def public_methods(cls: type) -> set[str]:
    return {name for name, _ in inspect.getmembers(cls, inspect.isfunction) if not name.startswith("_")}


def _class(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(__import__(module, fromlist=[name]), name)


def test_the_reference_documents_every_store_method():
    doc = REFERENCE.read_text(encoding="utf-8")
    missing = [f"tl.{store}.{m}" for store, path in STORES.items() for m in sorted(public_methods(_class(path)))
               if (store, m) not in PLUMBING and f"tl.{store}.{m}(" not in doc]
    missing += [f"log.{m}" for m in ("append", "read", "snapshot", "close", "upsert") if f"log.{m}(" not in doc]
    missing += [f"lease.{m}" for m in ("renew", "release") if f"lease.{m}()" not in doc]
    assert not missing, f"not in docs/reference.md: {missing}"


def test_the_reference_documents_every_error_code():
    doc = REFERENCE.read_text(encoding="utf-8")
    assert not [code for code in sorted(CODES) if f"| `{code}` |" not in doc]


def test_the_reference_documents_every_public_type():
    doc = REFERENCE.read_text(encoding="utf-8")
    assert not [name for name in threadlog.types.__all__ if f"`{name}`" not in doc]


def test_record_types_know_their_optional_fields_at_run_time():
    # Tools that read TypedDicts at run time (pydantic, __required_keys__) see
    # what the reference says is optional.
    assert threadlog.Run.__required_keys__ == {"runId", "threadId", "status", "startedAt"}
    assert threadlog.Artifact.__optional_keys__ == {"blobKey", "sourceUrl"}
    assert threadlog.Interrupt.__optional_keys__ == {"resolvedAt", "response"}
    assert threadlog.Checkpoint.__optional_keys__ == {"label", "sourceRunId"}
    assert threadlog.Blob.__optional_keys__ == {"contentType", "customMetadata", "range"}
    assert threadlog.BlobListPage.__required_keys__ == {"objects"}

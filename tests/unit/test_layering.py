"""The kernel imports nothing of threadlog above it (threadlog/kernel/__init__.py).

Every module under threadlog/kernel/ is parsed, not imported: each `import` and
`from ... import` anywhere in it (module level, in functions, under
TYPE_CHECKING; relative ones resolved against the module's package) must name
the standard library, a third-party package or `threadlog.kernel...`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
KERNEL = REPO / "threadlog" / "kernel"


def _package_of(path: Path) -> list[str]:
    """The dotted package a module file under threadlog/ belongs to, as parts."""
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return parts[:-1]  # a package's __init__ and a plain module both live in their folder's package


def imported_names(source: str, package: list[str]) -> list[tuple[int, str]]:
    """(line, dotted name) of everything `source` imports; `package` resolves relative imports."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                up = node.level - 1
                if up > len(package) - 1:
                    raise AssertionError(f"line {node.lineno}: relative import beyond the top-level package")
                base = package[: len(package) - up]
            else:
                base = []
            module = [*base, *(node.module.split(".") if node.module else [])]
            # Each name is a submodule or an attribute of `module`: `from threadlog import kernel`
            # is the kernel, `from threadlog import client` is not.
            found.extend((node.lineno, ".".join([*module, alias.name])) for alias in node.names)
    return found


def violations(source: str, package: list[str]) -> list[str]:
    """Imports of `threadlog` outside `threadlog.kernel`, as "line N: name"."""
    bad = []
    for line, name in imported_names(source, package):
        parts = name.split(".")
        if parts[0] == "threadlog" and parts[:2] != ["threadlog", "kernel"]:
            bad.append(f"line {line}: {name}")
    return bad


def kernel_modules() -> list[Path]:
    return sorted(KERNEL.rglob("*.py"))


def test_the_kernel_holds_the_rule_and_format_modules():
    names = {p.stem for p in kernel_modules()}
    assert {"__init__", "errors", "validation", "checkpoint_rules", "records", "delivery_records", "topics",
            "kafka_config", "partitioning"} <= names, names


@pytest.mark.parametrize("path", kernel_modules(), ids=lambda p: str(p.relative_to(REPO)))
def test_a_kernel_module_imports_nothing_of_threadlog_outside_the_kernel(path):
    assert violations(path.read_text(), _package_of(path)) == []


@pytest.mark.parametrize(
    "source",
    [
        "import threadlog",
        "import threadlog.client",
        "from threadlog import client",
        "from threadlog.projections.store import Store",
        "from .. import client",
        "from ..session import Session",
        "from ..projections import store",
        "def f():\n    from ..runtime import Runtime\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..types import Run\n",
    ],
)
def test_the_check_catches_an_import_from_above_the_kernel(source):
    assert violations(source, ["threadlog", "kernel"]), source


@pytest.mark.parametrize(
    "source",
    [
        "import json\nfrom typing import Any",
        "from confluent_kafka import Producer\nimport orjson",
        "from . import validation\nfrom .errors import ThreadLogError",
        "from threadlog.kernel.errors import ThreadLogError\nimport threadlog.kernel.topics",
        "from threadlog import kernel",
        "from .. import kernel",
        "from ..kernel.records import decode_run",
    ],
)
def test_the_check_lets_the_standard_library_third_party_and_the_kernel_through(source):
    assert violations(source, ["threadlog", "kernel"]) == [], source


def test_the_public_errors_path_is_the_kernel_module():
    import threadlog
    import threadlog.errors
    import threadlog.kernel.errors as kernel_errors

    assert threadlog.errors.ThreadLogError is kernel_errors.ThreadLogError is threadlog.ThreadLogError
    assert threadlog.errors.CODES is kernel_errors.CODES
    public = {name for name in vars(threadlog.errors) if not name.startswith("_")}
    assert public == {name for name in vars(kernel_errors) if not name.startswith("_")}

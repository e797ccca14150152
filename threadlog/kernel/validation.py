"""Input validation shared by every store: ids, numbers, JSON values (SPEC section 1)."""

from __future__ import annotations

import json
import math
import re
from typing import Any, TypeGuard

from .errors import INVALID_ARGUMENT, ThreadLogError


def is_text(value: Any) -> TypeGuard[str]:
    """A str that encodes to UTF-8 (no lone surrogates): storable exactly."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def is_valid_id(value: Any) -> TypeGuard[str]:
    """A non-empty str that encodes to UTF-8 (no lone surrogates)."""
    return bool(value) and is_text(value)


def require_id(value: Any, label: str, code: str = INVALID_ARGUMENT) -> str:
    if not is_valid_id(value):
        raise ThreadLogError(code, f"{label} must be a non-empty well-formed Unicode string, got {value!r}")
    return value


def is_timestamp(value: Any) -> bool:
    """Epoch ms: a finite int or float (never bool); an int must fit the signed
    64-bit long it travels as (Avro `long`; keys order it as a double)."""
    if not is_finite(value):
        return False
    return not is_int(value) or -(2**63) <= value <= 2**63 - 1


def require_timestamp(value: Any, label: str, code: str = INVALID_ARGUMENT) -> int | float:
    """`value` if `is_timestamp`, else `code` (the caller's contract picks it)."""
    if not is_timestamp(value):
        raise ThreadLogError(code, f"{label} must be a finite number of epoch ms (an int within 64 bits, "
                                   f"or a float), got {value!r}")
    return value


def is_number(value: Any) -> bool:
    """int or float, never bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_finite(value: Any) -> bool:
    return is_number(value) and math.isfinite(value)


def is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


MAX_SAFE_INT = 2**53 - 1


def is_safe_size(value: Any) -> bool:
    return is_int(value) and 0 <= value <= MAX_SAFE_INT


def _check_json(value: Any, path: str) -> None:
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{path}: string is not valid Unicode (lone surrogate)") from None
        return
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{path}: {value!r} is not a JSON number")
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_json(item, f"{path}[{i}]")
        return
    if isinstance(value, dict):
        for k, item in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{path}: object key {k!r} is not a string")
            _check_json(k, f"{path}.<key>")
            _check_json(item, f"{path}.{k}")
        return
    raise ValueError(f"{path}: {type(value).__name__} is not a JSON value")


def json_problem(value: Any, path: str = "value") -> str | None:
    """Why `value` is not a JSON value, or None if it is one."""
    try:
        _check_json(value, path)
    except ValueError as exc:
        return str(exc)
    except RecursionError:
        return f"{path}: nested too deeply"
    return None


def _not_a_number(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


# json.loads accepts two things JSON does not: NaN/Infinity (refused by the parser
# through parse_constant) and lone surrogates, which only a \uD800-\uDFFF escape
# makes. The walk over every value (`json_problem`, ~17 ms per MB) runs only when
# the text holds such an escape.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def loads_json_value(text: str | bytes, label: str = "value") -> Any:
    """JSON text -> its value; ValueError saying why when it is not JSON."""
    try:
        value = json.loads(text, parse_constant=_not_a_number)
    except ValueError as exc:
        raise ValueError(f"{label} is not JSON text: {exc}") from None
    if _SURROGATE_ESCAPE.search(text if isinstance(text, str) else text.decode("utf-8", "replace")):
        problem = json_problem(value, label)
        if problem:
            raise ValueError(problem)
    return value


# Built once: `json.dumps` with options builds an encoder per call, a few us
# each, paid several times per judged proposal (its verdict, its record).
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def dumps(value: Any) -> str:
    """Canonical compact JSON; floats round-trip exactly (repr)."""
    return _ENCODER.encode(value)


def loads(text: str | bytes) -> Any:
    return json.loads(text)


def require_json(value: Any, label: str, code: str = INVALID_ARGUMENT) -> str:
    problem = json_problem(value, label)
    if problem:
        raise ThreadLogError(code, problem)
    return dumps(value)

"""Log output of the `threadlog` command: text (default) or one JSON object per line (`--log-format json`)."""

from __future__ import annotations

import json
import logging
import sys
import time
import traceback
from typing import Any

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Fields an access log line carries besides its message (threadlog/metrics.py, AccessLog).
_EXTRA = ("method", "path", "status", "duration_ms")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (UTC, ms), level, logger, message; `exception`
    (the traceback text) when the record has one; an access line's method, path,
    status and duration_ms."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for k in _EXTRA:
            if k in record.__dict__:
                out[k] = record.__dict__[k]
        if record.exc_info:
            out["exception"] = "".join(traceback.format_exception(*record.exc_info)).rstrip()
        elif record.exc_text:
            out["exception"] = record.exc_text
        if record.stack_info:
            out["stack"] = record.stack_info
        return json.dumps(out, ensure_ascii=False, default=str)


_json = False  # `configure`d for JSON lines (`say`)


def say(logger: str, level: int, text: str) -> None:
    """A command's own line for the operator on stderr: `text` as it is, or under
    `--log-format json` one JSON object like every other line (a review: a
    worker's warning and its exit line were plain text among JSON lines)."""
    if _json:
        logging.getLogger(logger).log(level, text)
    else:
        print(text, file=sys.stderr, flush=True)


def configure(verbose: bool, fmt: str = "text") -> None:
    """The root handler on stderr: INFO with -v, else WARNING; text or JSON lines."""
    global _json
    _json = fmt == "json"
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, handlers=[handler], force=True)

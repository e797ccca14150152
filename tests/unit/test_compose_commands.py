"""docker-compose.yml cannot run here (no Docker engine), but its threadlog
commands can be checked: each must parse with the CLI it runs (a flag the CLI
does not take made the worker container exit 2 and restart forever)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from threadlog.cli import build_parser

COMPOSE = Path(__file__).resolve().parents[2] / "docker-compose.yml"


def test_every_threadlog_command_in_docker_compose_parses():
    commands = [json.loads(m.group(1)) for m in re.finditer(r"command:\s*(\[.*?\])", COMPOSE.read_text(), re.S)]
    threadlog = [c for c in commands if c and c[0] == "threadlog"]
    assert threadlog, "docker-compose.yml runs no threadlog command"
    for command in threadlog:
        args = build_parser().parse_args(command[1:])  # exits 2 (SystemExit) on an unknown flag
        assert args.command == command[1]

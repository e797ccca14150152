"""Run `examples/*.py` scripts as child processes: read their stdout lines as they come, signal, stop."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


class ExampleProcess:
    """One example script; stderr goes to a file so a failure can show it."""

    def __init__(self, script: str, *args: str, log_dir: Path) -> None:
        self.cmd = [sys.executable, str(EXAMPLES / script), *args]
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{Path(script).stem}-{os.getpid()}-{id(self)}.stderr.log"
        self.proc: asyncio.subprocess.Process | None = None
        self.lines: list[str] = []
        self._new_line = asyncio.Event()
        self._reader: asyncio.Task | None = None

    async def start(self) -> ExampleProcess:
        self._stderr = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = await asyncio.create_subprocess_exec(*self.cmd, stdout=asyncio.subprocess.PIPE,
                                                         stderr=self._stderr)
        self._reader = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        while True:
            line = await self.proc.stdout.readline()
            self._new_line.set()
            if not line:
                return
            self.lines.append(line.decode(errors="replace").rstrip("\n"))

    def stderr(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    async def wait_for(self, text: str, timeout: float = 60) -> str:
        """The first stdout line containing `text` (bounded; fails if the process exits first)."""

        async def scan() -> str:
            seen = 0
            while True:
                for line in self.lines[seen:]:
                    if text in line:
                        return line
                seen = len(self.lines)
                assert self._reader is not None
                if self._reader.done():
                    await self.proc.wait()
                    raise AssertionError(f"{self.cmd[1]} exited ({self.proc.returncode}) before printing "
                                         f"{text!r}; stdout: {self.lines[-5:]}; stderr: {self.stderr()}")
                self._new_line.clear()
                await self._new_line.wait()

        try:
            return await asyncio.wait_for(scan(), timeout)
        except TimeoutError:
            raise AssertionError(f"{self.cmd[1]} printed no {text!r} within {timeout}s; "
                                 f"stdout: {self.lines[-5:]}; stderr: {self.stderr()}") from None

    async def finish(self, timeout: float = 60) -> list[str]:
        """Wait for a clean exit (code 0); its stdout lines."""
        assert self.proc is not None and self._reader is not None
        try:
            await asyncio.wait_for(asyncio.gather(self.proc.wait(), self._reader), timeout)
        except TimeoutError:
            raise AssertionError(f"{self.cmd[1]} did not finish within {timeout}s; stderr: {self.stderr()}") \
                from None
        assert self.proc.returncode == 0, f"{self.cmd[1]} exited {self.proc.returncode}: {self.stderr()}"
        return self.lines

    def last_json(self) -> dict:
        return json.loads(self.lines[-1])

    def kill(self) -> None:
        """SIGKILL: no cleanup of any kind runs in the process (a host dying)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 15)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        if getattr(self, "_stderr", None) is not None:
            self._stderr.close()


async def run_example(script: str, *args: str, log_dir: Path, timeout: float = 60) -> ExampleProcess:
    """Run a script to completion (code 0, within `timeout`)."""
    proc = await ExampleProcess(script, *args, log_dir=log_dir).start()
    try:
        await proc.finish(timeout)
    finally:
        await proc.stop()
    return proc

"""Run `threadlog worker` processes from tests: start, wait for output lines, signal, stop."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from threadlog.kernel import addresses

HERE = Path(__file__).resolve().parent


class WorkerProcess:
    """One `threadlog worker` process: a judge of the namespace with its own store."""

    def __init__(self, bootstrap: str, namespace: str, state_dir: Path, name: str, *extra: str) -> None:
        self.args = ["--bootstrap", bootstrap, "--namespace", namespace, "--state-dir", str(state_dir), *extra]
        self.state_dir = Path(state_dir)
        self.name = name
        self.log_path = Path(state_dir).with_suffix(".stderr.log")
        self.proc: asyncio.subprocess.Process | None = None
        self.lines: list[str] = []
        self._new_line = asyncio.Event()
        self._reader: asyncio.Task | None = None
        self.address: str | None = None  # its query service, "host:port"

    async def start(self, timeout: float = 60) -> WorkerProcess:
        Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        cmd = [sys.executable, "-m", "threadlog", "worker", *self.args]
        self._stderr = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE,
                                                         stderr=self._stderr, env=env)
        self._reader = asyncio.create_task(self._read())
        line = await self.wait_for("judging", timeout)
        if "serving queries at " in line:
            self.address = line.split("serving queries at ", 1)[1].split()[0]
        return self

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        while True:
            line = await self.proc.stdout.readline()
            if not line:
                self._new_line.set()
                return
            self.lines.append(line.decode(errors="replace").rstrip("\n"))
            self._new_line.set()

    async def wait_for(self, text: str, timeout: float = 60) -> str:
        """The first stdout line containing `text` (bounded; fails if the process exits first)."""

        async def scan() -> str:
            seen = 0
            while True:
                for line in self.lines[seen:]:
                    if text in line:
                        return line
                seen = len(self.lines)
                if self.proc is not None and self.proc.returncode is not None and self._reader.done():
                    raise AssertionError(f"worker {self.name} exited ({self.proc.returncode}) before "
                                         f"printing {text!r}; stderr: {self.stderr()[-2000:]}")
                self._new_line.clear()
                try:
                    await asyncio.wait_for(self._new_line.wait(), 0.5)
                except TimeoutError:
                    pass

        return await asyncio.wait_for(scan(), timeout)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    async def wait_exit(self, timeout: float = 60) -> int:
        assert self.proc is not None
        return await asyncio.wait_for(self.proc.wait(), timeout)

    def stderr(self) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")
        except OSError:
            return ""

    async def stop(self) -> None:
        """Graceful stop (SIGTERM), then SIGKILL if it does not exit in time. Idempotent."""
        if self.proc is None:
            return
        if self.proc.returncode is None:
            try:
                self.proc.send_signal(signal.SIGCONT)
                self.proc.send_signal(signal.SIGTERM)
                await asyncio.wait_for(self.proc.wait(), 20)
            except (TimeoutError, ProcessLookupError):
                try:
                    self.proc.kill()
                except ProcessLookupError:
                    pass
                await self.proc.wait()
        if self._reader is not None:
            await asyncio.wait_for(self._reader, 5)
        self._stderr.close()


async def ask_worker(address: str, op: str, args: dict | None = None, timeout: float = 10) -> dict:
    """One request to one worker's query service (bypassing routing)."""
    import json

    host, port = addresses.split(address)
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    try:
        writer.write(json.dumps({"id": 1, "op": op, "args": args or {}}).encode() + b"\n")
        await writer.drain()
        reply = json.loads(await asyncio.wait_for(reader.readline(), timeout))
    finally:
        writer.close()
    assert reply["ok"], reply
    return reply["result"]


async def owned_by(workers: list[WorkerProcess], partitions: int, timeout: float = 60) -> dict[str, list[int]]:
    """Wait until the workers own every partition between them, each once; {name: owned}."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        owned = {w.name: (await ask_worker(w.address, "stats"))["owned"] for w in workers}
        flat = sorted(p for ps in owned.values() for p in ps)
        if flat == list(range(partitions)) and all(owned.values()):
            return owned
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"partitions not split between the workers in {timeout}s: {owned}")
        await asyncio.sleep(0.2)  # polling a state no event announces to the test

"""`threadlog worker` processes for benchmarks: start, ask their stats, wait for a split, stop."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

from threadlog.kernel import addresses

PARTITIONS = 4


class Worker:
    def __init__(self, bootstrap: str, ns: str, state: str, name: str, *extra: str,
                 partitions: int = PARTITIONS) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "threadlog", "worker", "--bootstrap", bootstrap, "--namespace", ns,
             "--partitions", str(partitions), "--state-dir", state, *extra],
            stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.address = ""
        while not self.address:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"worker {name} exited")
            if "serving queries at " in line:
                self.address = line.split("serving queries at ", 1)[1].split()[0]

    async def stats(self) -> dict:
        host, port = addresses.split(self.address)
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
        try:
            writer.write(json.dumps({"id": 1, "op": "stats", "args": {}}).encode() + b"\n")
            await writer.drain()
            return json.loads(await asyncio.wait_for(reader.readline(), 10))["result"]
        finally:
            writer.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()


async def split(workers: list[Worker], timeout: float = 120, partitions: int = PARTITIONS) -> dict[str, list[int]]:
    """Wait until the workers own every partition between them (each some); {name: owned}."""
    deadline = time.monotonic() + timeout
    while True:
        owned = {w.name: (await w.stats())["owned"] for w in workers}
        if sorted(p for ps in owned.values() for p in ps) == list(range(partitions)) and all(owned.values()):
            return owned
        if time.monotonic() > deadline:
            raise TimeoutError(f"partitions not split: {owned}")
        await asyncio.sleep(0.1)

"""A run's host for the takeover test: drives a run until it is SIGKILLed.

    python tests/driver_host.py BOOTSTRAP NAMESPACE STATE_DIR RUN THREAD HEARTBEAT_MS

Creates the run, drives it (`tl.runs.drive`: claim + heartbeat), takes the
thread's checkpoint writer, and then, step after step, appends one checkpoint
(chained on its head) and one delivery chunk. Prints a JSON line per fact:
`driving` (epoch, first heartbeat time, writer fence and token), `checkpoint` (id) after each acknowledged append,
`chunk` (index, offset) after each acknowledged chunk. Never ends by itself.
"""

from __future__ import annotations

import asyncio
import json
import sys

from checkpoint_helpers import checkpoint

import threadlog


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def content(run_id: str, i: int) -> dict:
    return {"type": "TEXT_MESSAGE_CONTENT", "messageId": f"msg-{run_id}", "delta": f"w{i} ", "index": i}


async def main() -> None:
    bootstrap, namespace, state_dir, run_id, thread_id, heartbeat_ms = sys.argv[1:]
    async with threadlog.open(bootstrap, namespace=namespace, state_dir=state_dir) as tl:
        await tl.runs.create_or_resume(run_id=run_id, thread_id=thread_id, started_at=1)
        driver = await tl.runs.drive(run_id, heartbeat_ms=float(heartbeat_ms))
        lease = await tl.checkpoints.acquire_writer(thread_id)
        emit(event="driving", epoch=driver.epoch, fence=lease.fence, token=lease.owner_token,
             heartbeat_at=driver.heartbeat_at)
        await driver.log.append([{"type": "RUN_STARTED", "threadId": thread_id, "runId": run_id},
                                 {"type": "TEXT_MESSAGE_START", "messageId": f"msg-{run_id}", "role": "assistant"}])
        head = None
        i = 0
        while True:
            cid = f"{run_id}-cp{i}"
            head = await tl.checkpoints.append(checkpoint=checkpoint(cid, thread_id, head, created_at=i),
                                               expected_head_id=head, writer=lease)
            emit(event="checkpoint", id=cid)
            (offset,) = await driver.log.append([content(run_id, i)])
            emit(event="chunk", index=i, offset=offset)
            i += 1
            await asyncio.sleep(0.05)  # the agent's next step: pacing, not synchronization


if __name__ == "__main__":
    asyncio.run(main())

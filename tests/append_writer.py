"""A writer process for fault tests: streams checkpoint appends until killed.

    python tests/append_writer.py BOOTSTRAP NAMESPACE STATE_DIR THREAD...

Prints `ACK <checkpoint id>` after each acknowledged append, `FAIL <id> <code>`
after a refused or unanswered one, and `READY` once its leases are granted.
The test SIGKILLs it mid-stream: proposals it wrote must be judged all the
same, and nothing it never wrote may appear.
"""

from __future__ import annotations

import asyncio
import sys

from checkpoint_helpers import checkpoint, file_key

import threadlog
from threadlog import ThreadLogError


def body(cid: str, thread: str, head: str | None, n: int) -> dict:
    return checkpoint(cid, thread, head, created_at=n, conversation=[{"n": n, "t": thread}],
                      files=[{"path": f"f{n % 3}", "kind": "file", "blobKey": file_key("abc"[n % 3]), "size": n}])


async def stream(tl, thread: str, lease) -> None:
    head = None
    n = 0
    while True:
        cid = f"{thread}/{n}"
        try:
            head = await tl.checkpoints.append(checkpoint=body(cid, thread, head, n), expected_head_id=head,
                                               writer=lease)
            print(f"ACK {cid}", flush=True)
        except ThreadLogError as exc:
            print(f"FAIL {cid} {exc.code}", flush=True)
            head = await tl.checkpoints.get_head(thread)
        n += 1


async def main() -> None:
    bootstrap, namespace, state_dir, *threads = sys.argv[1:]
    async with threadlog.open(bootstrap, namespace=namespace, state_dir=state_dir) as tl:
        leases = [await tl.checkpoints.acquire_writer(t) for t in threads]
        for t, lease in zip(threads, leases, strict=True):
            print(f"LEASE {t} {lease.owner_token} {lease.fence}", flush=True)
        print("READY", flush=True)
        await asyncio.gather(*[stream(tl, t, lease) for t, lease in zip(threads, leases, strict=True)])


if __name__ == "__main__":
    asyncio.run(main())

"""`threadlog worker` with a test-only way to hold one transaction open before its commit.

Fault injection for the zombie tests, kept out of the decider itself: this
launcher wraps `Decider._commit_txn` (called after the batch's records and
consumer offsets were sent to the transaction, just before the commit) and
then runs the ordinary CLI. With `THREADLOG_TEST_CONTROL_DIR=D`:

- when `D/arm` exists, the next commit removes it, flushes the batch's records
  (so they sit in the log, uncommitted), prints `PAUSED` and waits until
  `D/release` exists; then it commits as usual and prints `COMMITTED`;
- a commit that raises prints `COMMIT-FAILED <error>` before the error takes
  its normal course (a fenced decider stops; the worker exits 2).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from threadlog.processors.decider import Decider

from threadlog import cli

CONTROL = Path(os.environ["THREADLOG_TEST_CONTROL_DIR"])
_commit_txn = Decider._commit_txn


def _held_commit(self: Decider, producer) -> None:
    arm = CONTROL / "arm"
    held = arm.exists()
    if held:
        arm.unlink()
        producer.flush(30)
        print("PAUSED", flush=True)
        while not (CONTROL / "release").exists():
            time.sleep(0.02)
    try:
        _commit_txn(self, producer)
    except Exception as exc:
        print(f"COMMIT-FAILED {exc}", flush=True)
        raise
    if held:
        print("COMMITTED", flush=True)


Decider._commit_txn = _held_commit

if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[1:]))

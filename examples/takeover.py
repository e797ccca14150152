"""Host takeover: a driver dies mid-run, another host claims the run and finishes its output.

    # host A streams a run's output (one delivery-log append per word)...
    .venv/bin/python examples/takeover.py drive --run run-1 --thread thread-1
    # ...and is killed (kill -9) half way. Host B runs the very same command:
    .venv/bin/python examples/takeover.py drive --run run-1 --thread thread-1
    # any reader, any time (before, during or after the takeover):
    .venv/bin/python examples/takeover.py read --run run-1

`drive` claims the run (`tl.runs.claim`: a driver epoch one above every earlier
one), reads what the log already holds (`snapshot()`: everything that stood
before its claim) and appends from the first word that is not there. The claim
fences the dead driver: a write of its still in flight that lands after the
claim is dropped by every reader. So a reader of the log
(`tl.delivery(run).read("-1")`) sees one stream, each word once, in order.
Each command prints JSON lines (`drive`: claimed / appended / finished;
`read`: one line per chunk).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import threadlog
from threadlog import ThreadLogError

TEXT = ("A run's output is a delivery log in Kafka, partitioned by run id and read by offset. "
        "When the host driving the run dies, another host claims the run, which fences the dead driver, "
        "reads what the log holds and continues from the next word, so every reader sees one stream.")


def words(text: str = TEXT) -> list[str]:
    """The run's output, one chunk per word (with its following space: they concatenate back to `text`)."""
    parts = text.split(" ")
    return [w + " " for w in parts[:-1]] + [parts[-1]]


def emit(**fields) -> None:
    # One JSON line per event, flushed: a supervisor (or the test) follows progress as it happens.
    print(json.dumps(fields), flush=True)


async def drive(tl: threadlog.ThreadLog, run_id: str, thread_id: str, delay: float) -> int:
    run = await tl.runs.create_or_resume(run_id=run_id, thread_id=thread_id, started_at=int(time.time() * 1000))
    # An existing run keeps its own thread: the chunks name that one, not --thread.
    thread_id = run["threadId"]
    try:
        epoch = await tl.runs.claim(run_id)
    except ThreadLogError as exc:
        if exc.code != "RUN_TERMINAL":
            raise
        # Its driver completed it. The log is closed before the run is marked so, but
        # a run finished by an older version of this script may have died in between:
        # closing again is harmless, and without it readers would wait forever.
        # Read again: the record read before the claim may predate a later driver's.
        finished = await tl.runs.get(run_id) or run
        await tl.delivery(run_id, finished["driverEpoch"] or 0).close()
        emit(event="already finished")  # nothing to take over
        return 0
    log = tl.delivery(run_id, epoch)
    # After the claim nothing older can be added, so what stands now is exactly where to go on from.
    stored = [chunk for _, chunk in await log.snapshot()]
    done = sum(1 for c in stored if c.get("type") == "TEXT_MESSAGE_CONTENT")
    # The last append (END + FINISHED, one record) stood, but its driver died before
    # finishing the run: only the run's status and the log's close are left to do.
    streamed = any(c.get("type") == "RUN_FINISHED" for c in stored)
    emit(event="claimed", epoch=epoch, resume_at=done)
    message_id = f"msg-{run_id}"
    try:
        if not stored:
            await log.append([{"type": "RUN_STARTED", "threadId": thread_id, "runId": run_id},
                              {"type": "TEXT_MESSAGE_START", "messageId": message_id, "role": "assistant"}])
        for i, word in enumerate(words()[done:], start=done):
            await asyncio.sleep(delay)  # the model producing the next word: pacing, not synchronization
            (offset,) = await log.append([{"type": "TEXT_MESSAGE_CONTENT", "messageId": message_id,
                                           "delta": word, "index": i}])
            emit(event="appended", index=i, offset=offset)
        if not streamed:
            await log.append([{"type": "TEXT_MESSAGE_END", "messageId": message_id},
                              {"type": "RUN_FINISHED", "threadId": thread_id, "runId": run_id,
                               "finishReason": "stop"}])
    except ThreadLogError as exc:
        if exc.code != "RUN_CLAIM_LOST":
            raise
        # Another host claimed the run meanwhile: it owns the output now; stop writing.
        emit(event="superseded", epoch=epoch)
        return 3
    # Closed first: a driver dying between the two leaves a run a next driver claims
    # and completes. The other order left a completed run whose log no one would
    # close, and every reader following it waited forever (found by a review).
    await log.close()
    await tl.runs.update(run_id, {"status": "completed", "finishedAt": int(time.time() * 1000)})
    emit(event="finished", epoch=epoch)
    return 0


async def read(tl: threadlog.ThreadLog, run_id: str) -> int:
    # Follows the log until it is closed: a reader started mid-run waits through a takeover.
    async for offset, chunk in tl.delivery(run_id).read("-1"):
        emit(offset=offset, chunk=chunk)
    return 0


async def amain(args: argparse.Namespace) -> int:
    async with threadlog.open(args.bootstrap, namespace=args.namespace, state_dir=args.state_dir) as tl:
        if args.command == "drive":
            return await drive(tl, args.run, args.thread, args.delay)
        return await read(tl, args.run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--bootstrap", default=os.environ.get("THREADLOG_BOOTSTRAP", "127.0.0.1:9092"))
    parser.add_argument("--namespace", default="takeover-example")
    parser.add_argument("--state-dir", default=None,
                        help="this host's RocksDB state (default: under $THREADLOG_STATE_DIR or ~/.local/state)")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("drive", help="claim the run and stream (the rest of) its output")
    p.add_argument("--run", required=True)
    p.add_argument("--thread", required=True)
    p.add_argument("--delay", type=float, default=0.1, help="seconds between words")
    p = commands.add_parser("read", help="print the run's chunks from the start until the log closes")
    p.add_argument("--run", required=True)
    return asyncio.run(amain(parser.parse_args(argv)))


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ThreadLogError as exc:
        # An operational error (broker down, unknown namespace, a refused call):
        # its code and message are the whole story, not a traceback.
        sys.exit(f"takeover.py: {exc.code}: {exc.message}")
    except KeyboardInterrupt:
        sys.exit(130)

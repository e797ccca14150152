"""Interrupts (SPEC section 7): decided on the interrupt's thread partition.

Both decisions of one interrupt (resolve, cancel) are decided on one partition,
one after the other, so when they race exactly one lands: the first.
"""

from __future__ import annotations

from threadlog.projections import global_ids as gid
from threadlog.projections.folds import interrupts as state

from threadlog.kernel.errors import invalid_argument
from threadlog.kernel.records import decode_interrupt, new_interrupt, require_json_value
from threadlog.kernel.validation import dumps, loads_json_value, require_id

from . import Context, Decision, handles
from .global_ids import locate, own_thread

DECISIONS = ("resolved", "cancelled")


@handles("threadlog.cmd.CreateInterrupt", global_ids=True)
def create(ctx: Context, cmd: dict) -> Decision:
    try:
        payload = loads_json_value(cmd["payload"], "interrupt payload")
    except ValueError as exc:
        raise invalid_argument(str(exc)) from None
    record = new_interrupt({**{k: cmd[k] for k in ("interruptId", "runId", "threadId", "requestedAt")},
                            "payload": payload})
    own_thread(ctx, cmd["threadId"])
    # Insert-if-absent across every thread: an existing id is never overwritten.
    if locate(ctx, gid.INTERRUPT, record["interruptId"]) is not None:
        return Decision()
    return Decision(events=[("threadlog.evt.InterruptCreated", {
        "interruptId": record["interruptId"], "runId": record["runId"], "threadId": record["threadId"],
        "requestedAt": record["requestedAt"], "payload": dumps(record["payload"]),
    })])


@handles("threadlog.cmd.DecideInterrupt")
def decide(ctx: Context, cmd: dict) -> Decision:
    interrupt_id = require_id(cmd["interruptId"], "interruptId")
    thread_id = own_thread(ctx, cmd["threadId"])
    if cmd["status"] not in DECISIONS:
        raise invalid_argument(f"an interrupt is decided as resolved or cancelled, not {cmd['status']!r}")
    response = cmd.get("response")
    if response is not None:
        if cmd["status"] != "resolved":
            raise invalid_argument("only a resolve carries a response")
        try:
            parsed = loads_json_value(response, "interrupt response")
            require_json_value(parsed, "response")
        except ValueError as exc:
            raise invalid_argument(str(exc)) from None
        if parsed is None:
            # JSON null is no response: an absent field is absent from the record,
            # never None (SPEC 1); the client never sends it, a raw proposal may.
            response = None
    record = decode_interrupt(ctx.view.get(state.record_key(thread_id, interrupt_id)))
    if record is None:
        return Decision(result=None)  # unknown id: a no-op
    if record["status"] != "pending":
        return Decision(result=record)  # the first decision is final
    event = {"interruptId": interrupt_id, "threadId": thread_id, "status": cmd["status"],
             # The judged time of the proposal: folds never read a clock.
             "resolvedAt": ctx.now, "response": response}
    decided = {**record, "status": cmd["status"], "resolvedAt": ctx.now}
    if response is not None:
        decided["response"] = parsed
    return Decision(events=[("threadlog.evt.InterruptDecided", event)], result=decided)

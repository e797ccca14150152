"""Metadata (SPEC section 9): decided on the partition of the (namespace, key) entry."""

from __future__ import annotations

from threadlog.projections.folds import metadata as state

from threadlog.kernel.errors import invalid_argument
from threadlog.kernel.validation import loads_json_value, require_id

from . import Context, Decision, handles


def _entry(ctx: Context, cmd: dict) -> tuple[str, str]:
    namespace = require_id(cmd["namespace"], "namespace")
    name = require_id(cmd["key"], "key")
    if ctx.key != state.partition_key(namespace, name):
        raise invalid_argument(f"metadata command for {(namespace, name)!r} sent with key {ctx.key!r}")
    return namespace, name


@handles("threadlog.cmd.SetMetadata", rules=4, thread_keyed=False)
def set_value(ctx: Context, cmd: dict) -> Decision:
    namespace, name = _entry(ctx, cmd)
    try:
        loads_json_value(cmd["value"], "value", finite=ctx.rules >= 4)  # as a transcript (messages.py)
    except ValueError as exc:
        raise invalid_argument(str(exc)) from None
    return Decision(events=[("threadlog.evt.MetadataSet", {"namespace": namespace, "key": name,
                                                           "value": cmd["value"]})])


@handles("threadlog.cmd.DeleteMetadata", thread_keyed=False)
def delete(ctx: Context, cmd: dict) -> Decision:
    namespace, name = _entry(ctx, cmd)
    if ctx.view.get(state.value_key(namespace, name)) is None:
        return Decision()  # deleting an absent entry is silent and writes nothing
    return Decision(events=[("threadlog.evt.MetadataDeleted", {"namespace": namespace, "key": name})])

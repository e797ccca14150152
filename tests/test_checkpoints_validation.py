"""Every validation rule of SPEC section 4 (checkpoint fields, file entries, checkpoint
artifacts): refused with SANDBOX_SNAPSHOT_INVALID_ENTRY / INVALID_ID, state unchanged.

Each bad checkpoint is tried twice: through `tl.checkpoints.append` (refused by the
client before anything is sent) and, whenever it can be encoded at all, as a forged
command straight onto the commands topic (refused by the decider's own re-check).
"""

from __future__ import annotations

import copy
import json
import math

import pytest
from checkpoint_helpers import artifact, artifact_key, checkpoint, file_key, refused, thread_state
from support import state_of, within
from threadlog.schemas import CodecError

from threadlog import ThreadLogError
from threadlog.kernel.checkpoint_rules import check_checkpoint, from_wire, to_wire

INVALID_ENTRY = "SANDBOX_SNAPSHOT_INVALID_ENTRY"
INVALID_ID = "SANDBOX_SNAPSHOT_INVALID_ID"


def f(path, **extra):
    return {"path": path, "kind": "file", "blobKey": file_key("a"), "size": 1, **extra}


def d(path, **extra):
    return {"path": path, "kind": "dir", **extra}


def with_files(*files):
    return {"files": list(files)}


def with_artifact(**over):
    art = artifact(**{k: v for k, v in over.items() if not k.startswith("_")})
    for k in over.get("_drop", ()):
        art.pop(k)
    return {"artifacts": [art]}


def bad_key(k):
    return lambda cp: cp.pop(k)


FILE_RULES = {
    "files not a list (dict)": {"files": {"a": f("a")}},
    "files not a list (tuple)": {"files": (f("a"),)},
    "files missing": bad_key("files"),
    "files None": {"files": None},
    "entry not a dict": with_files("a.txt"),
    "entry None": with_files(None),
    "entry with an extra key": with_files(f("a", mode=0o644)),
    "path empty": with_files(f("")),
    "path missing": with_files({"kind": "dir"}),
    "path not a str": with_files(f(5)),
    "path absolute": with_files(f("/etc/passwd")),
    "path starting with a backslash": with_files(f("\\share")),
    "path with a drive prefix": with_files(f("C:/x")),
    "path with a bare drive": with_files(d("c:")),
    "path with a drive and backslash": with_files(f("c:\\x")),
    "path with a backslash inside": with_files(f("a\\b")),
    "path with NUL": with_files(f("a\x00b")),
    "path with an empty segment": with_files(f("a//b")),
    "path with a trailing slash": with_files(d("a/")),
    "path with a '.' segment": with_files(f("a/./b")),
    "path starting with '.'": with_files(f("./a")),
    "path with a '..' segment": with_files(f("a/../b")),
    "path '..'": with_files(d("..")),
    "path with a lone surrogate": with_files(f("a\ud800")),
    "duplicate file paths": with_files(f("a"), f("a")),
    "duplicate dir and file path": with_files(d("a"), f("a")),
    "entry under a file": with_files(f("a"), d("a/b")),
    "deep entry under a file": with_files(f("a"), f("a/b/c")),
    "file ancestor of an earlier entry": with_files(d("a/b"), f("a")),
    "file ancestor of an earlier deep entry": with_files(f("a/b/c"), f("a")),
    "file without blobKey": with_files({"path": "a", "kind": "file", "size": 1}),
    "file blobKey of another namespace": with_files(f("a", blobKey=artifact_key("a"))),
    "file blobKey with uppercase hex": with_files(f("a", blobKey="sandbox-files/sha256/" + "A" * 64)),
    "file blobKey too short": with_files(f("a", blobKey="sandbox-files/sha256/" + "a" * 63)),
    "file blobKey too long": with_files(f("a", blobKey="sandbox-files/sha256/" + "a" * 65)),
    "file blobKey with a trailing newline": with_files(f("a", blobKey=file_key("a") + "\n")),
    "file blobKey not a str": with_files(f("a", blobKey=7)),
    "file without size": with_files({"path": "a", "kind": "file", "blobKey": file_key("a")}),
    "file size None": with_files(f("a", size=None)),
    "file size negative": with_files(f("a", size=-1)),
    "file size 2**53": with_files(f("a", size=2**53)),
    "file size a float": with_files(f("a", size=1.0)),
    "file size a bool": with_files(f("a", size=True)),
    "file size a str": with_files(f("a", size="1")),
    "dir with a blobKey": with_files(d("a", blobKey=file_key("a"))),
    "dir with a size": with_files(d("a", size=0)),
    "dir with blobKey None": with_files(d("a", blobKey=None)),
    "kind symlink": with_files({"path": "a", "kind": "symlink"}),
    "kind missing": with_files({"path": "a"}),
    "kind None": with_files({"path": "a", "kind": None}),
}

ARTIFACT_RULES = {
    "artifacts not a list": {"artifacts": {"x": artifact()}},
    "artifacts missing": bad_key("artifacts"),
    "artifact not a dict": {"artifacts": ["art"]},
    "artifact with an extra key": with_artifact(threadId="t"),
    "artifactId empty": with_artifact(aid=""),
    "artifactId not a str": with_artifact(aid=5),
    "artifactId a lone surrogate": with_artifact(aid="\ud800"),
    "artifactId missing": with_artifact(_drop=["artifactId"]),
    "name empty": with_artifact(name=""),
    "name missing": with_artifact(_drop=["name"]),
    "name not a str": with_artifact(name=3),
    "mimeType empty": with_artifact(mimeType=""),
    "mimeType None": with_artifact(mimeType=None),
    "blobKey of the files namespace": with_artifact(blobKey=file_key("b")),
    "blobKey with bad hex": with_artifact(blobKey="sandbox-artifacts/sha256/" + "g" * 64),
    "blobKey missing": with_artifact(_drop=["blobKey"]),
    "size negative": with_artifact(size=-5),
    "size 2**53": with_artifact(size=2**53),
    "size a float": with_artifact(size=3.0),
    "size a bool": with_artifact(size=False),
    "size missing": with_artifact(_drop=["size"]),
    "createdAt NaN": with_artifact(createdAt=math.nan),
    "createdAt infinite": with_artifact(createdAt=-math.inf),
    "createdAt a str": with_artifact(createdAt="5"),
    "createdAt a bool": with_artifact(createdAt=True),
    "createdAt missing": with_artifact(_drop=["createdAt"]),
}

CHECKPOINT_RULES = {
    "createdAt NaN": {"createdAt": math.nan},
    "createdAt +inf": {"createdAt": math.inf},
    "createdAt None": {"createdAt": None},
    "createdAt a str": {"createdAt": "10"},
    "createdAt a bool": {"createdAt": False},
    "createdAt an int beyond 64 bits": {"createdAt": 2**64},
    "createdAt missing": bad_key("createdAt"),
    "reason unknown": {"reason": "manual"},
    "reason None": {"reason": None},
    "reason missing": bad_key("reason"),
    "label not a str": {"label": 5},
    "label a lone surrogate": {"label": "\udc00"},
    "sourceRunId not a str": {"sourceRunId": b"run"},
    "conversation not a list": {"conversation": {"role": "user"}},
    "conversation a str": {"conversation": "[]"},
    "conversation missing": bad_key("conversation"),
    "conversation with NaN": {"conversation": [{"x": math.nan}]},
    "conversation with a set": {"conversation": [{1, 2}]},
    "conversation with bytes": {"conversation": [b"raw"]},
    "conversation with a non-str key": {"conversation": [{1: "x"}]},
    "conversation with a lone surrogate": {"conversation": ["\ud800"]},
    "an unexpected key": {"extra": True},
    "a key of another record": {"checkpointId": "c2"},
}

ID_RULES = {
    "id empty": {"id": ""},
    "id None": {"id": None},
    "threadId not a str": {"threadId": 1},
    "threadId a lone surrogate": {"threadId": "t\ud800"},
    "parentCheckpointId empty": {"parentCheckpointId": ""},
    "parentCheckpointId not a str": {"parentCheckpointId": 5},
}


def build(change) -> dict:
    cp = checkpoint("c2", "t", "c1")
    if callable(change):
        change(cp)
    else:
        cp.update(copy.deepcopy(change))
    return cp


def forged_payload(tl, cp: dict, writer) -> dict | None:
    """The command a client that skipped validation would send, or None if the
    fault cannot travel: no Avro encoding exists, or encoding removed it (a
    tuple becomes an array). Then only the client can refuse it."""
    try:
        rec = to_wire({**cp, "conversation": []})
        conversation = cp["conversation"]
        rec["conversation"] = conversation if isinstance(conversation, str) else json.dumps(conversation)
        payload = {"checkpoint": rec, "expectedHeadId": "c1",
                   "writer": {"threadId": "t", "ownerToken": writer.owner_token, "fence": writer.fence}}
        codec = tl.runtime.codec
        _, travelled = codec.decode(codec.encode("threadlog.cmd.AppendCheckpoint", payload))
    except (CodecError, KeyError, TypeError, AttributeError, ValueError):
        return None
    try:
        check_checkpoint(from_wire(travelled["checkpoint"]))
    except ThreadLogError:
        return payload  # still malformed as it travels: the decider must refuse it
    return None


async def check_rules(tl, rules: dict, code: str) -> int:
    w = await within(tl.checkpoints.acquire_writer("t"))
    await within(tl.checkpoints.append(checkpoint=checkpoint("c1", "t"), expected_head_id=None, writer=w))
    before = await thread_state(tl, "t")
    everything = await state_of(tl)
    forged = 0
    for name, change in rules.items():
        cp = build(change)
        err = await refused(tl.checkpoints.append(checkpoint=cp, expected_head_id="c1", writer=w), code)
        assert err.message, name
        payload = forged_payload(tl, cp, w)
        if payload is not None:
            forged += 1
            try:
                await refused(tl.bus.send("threadlog.cmd.AppendCheckpoint", "t", payload), code)
            except AssertionError as exc:
                raise AssertionError(f"{name}: {exc}") from None
    # Nothing changed: refused proposals stay in the log, but no state moved anywhere,
    # and every read is as before.
    assert await state_of(tl) == everything
    assert await thread_state(tl, "t") == before
    assert await within(tl.checkpoints.get("c2")) is None
    # The same writer still appends a valid checkpoint afterwards.
    assert await within(tl.checkpoints.append(checkpoint=checkpoint("c2", "t", "c1"), expected_head_id="c1",
                                              writer=w)) == "c2"
    return forged


async def test_every_file_entry_rule_is_invalid_entry(tl):
    forged = await check_rules(tl, FILE_RULES, INVALID_ENTRY)
    assert forged >= 33  # most file rules can travel, so the decider re-checks them


async def test_every_artifact_rule_is_invalid_entry(tl):
    forged = await check_rules(tl, ARTIFACT_RULES, INVALID_ENTRY)
    assert forged >= 9


async def test_every_checkpoint_field_rule_is_invalid_entry(tl):
    forged = await check_rules(tl, CHECKPOINT_RULES, INVALID_ENTRY)
    assert forged >= 6


async def test_checkpoint_identifiers_are_invalid_id(tl):
    assert await check_rules(tl, ID_RULES, INVALID_ID) >= 2


async def test_a_checkpoint_that_is_not_a_dict_is_invalid_entry(tl):
    w = await within(tl.checkpoints.acquire_writer("t"))
    for bad in (None, [], "checkpoint", 5):
        await refused(tl.checkpoints.append(checkpoint=bad, expected_head_id=None, writer=w), INVALID_ENTRY)
    assert await within(tl.checkpoints.get_head("t")) is None


@pytest.mark.parametrize("name,files", [
    ("unicode and dotted names", [d("dir"), f("dir/ü 文件.txt"), f(".hidden"), f("a..b"), d("...x")]),
    ("nested dirs, files in any order", [f("x/y/z.txt"), d("x"), d("x/y"), d("x/w")]),
    ("sibling sharing a prefix with a file", [f("ab"), f("a/b"), d("abc")]),
    ("size bounds", [f("zero", size=0), f("max", size=2**53 - 1)]),
    ("drive-like but not a drive", [f("C:x"), f("1:/x")]),
    ("no files", []),
])
async def test_valid_edge_cases_are_accepted_and_round_trip(tl, name, files):
    w = await within(tl.checkpoints.acquire_writer("t"))
    cp = checkpoint("c1", "t", files=files, createdAt=-1.5, label="", reason="named",
                    artifacts=[artifact("a1", createdAt=0), artifact("a1", "c", size=2**53 - 1)])
    assert await within(tl.checkpoints.append(checkpoint=cp, expected_head_id=None, writer=w)) == "c1"
    assert await within(tl.checkpoints.get("c1")) == cp


async def test_an_artifact_id_that_is_not_an_id_is_an_entry_error_not_an_id_error(tl):
    # SPEC: artifacts need a valid artifactId "else INVALID_ENTRY" -- the artifact
    # is an entry of the checkpoint; INVALID_ID is for the checkpoint's own ids.
    w = await within(tl.checkpoints.acquire_writer("t"))
    cp = checkpoint("c1", "t", artifacts=[artifact("")])
    await refused(tl.checkpoints.append(checkpoint=cp, expected_head_id=None, writer=w), INVALID_ENTRY)

"""`tl.delivery(run_id, epoch=None)`: a run's durable, replayable output stream (SPEC 11).

Layout. A run lives in one partition of `<ns>.deliveries` (key = run id). Every
`append` is ONE record holding the whole batch, so a batch is all or nothing.
Chunk i of the record at Kafka offset X has the opaque offset
`"<partition>.<X>.<i>.<tag>"`, tag = 8 hex digits of a hash of the run id; a
reader seeks to X and skips to i. The run index (`projections/run_index.py`)
is a fold of the topic that says which records stand (fencing, close) and
where a run's first record is, so `"-1"` is a seek too.

Fencing, the one rule that matters: **an append returns only after the run
index has folded every record before its own and found it standing** (by the
verdict the fold will record for it: it depends only on what came before). The
index folds in read_committed order, so a claim marker written before the
record -- even in a transaction still open when the record landed -- is folded
first (the fold waits for it), and the append then raises RUN_CLAIM_LOST; every
reader drops the record by the same verdict. Never "acknowledged but dropped".

Reading. A reader first passes a read barrier on the index (so it reflects
every write acknowledged before it began), then reads what was folded before
it subscribed from Kafka with a pooled consumer, then takes new records from
the index follower's live feed (no consumer per waiting reader). Positions
only grow along the log, so "a position already yielded" is "not after the
last one yielded": duplicates can never be yielded twice.

Upsert re-persists positions: one record whose chunks replace the given
positions. `snapshot()` and every reader that reaches a position later show
the replacement at the original position; a reader that already yielded a
position does not yield it again (the index keeps the replacement; a reader
looks it up when it yields the position).
"""

from .log import DeliveryLog
from .offsets import Offset, encode_offset, parse_offset
from .service import DeliveryService

__all__ = ["DeliveryLog", "DeliveryService", "Offset", "encode_offset", "parse_offset"]

"""The rules floor marker of a new namespace (judging rules 7).

A partition judges a proposal by the rules it names, raised to the partition's
floor: the highest rules of at least FLOOR_FROM (4) any proposal before it named
(processors/judge.py `read_clock`). A fresh partition had floor 0 until an
honest proposal of rules >= 4 landed there, and some types still name rules 2
or 3. Meanwhile a raw proposal naming rules 3 was judged by rules 3: a
transcript holding 1e400, which every current check refuses, was accepted
(tried, a review). The client that creates a namespace's topics now writes this
marker to each events partition first, naming the newest rules it knows
(processors/judge.py RULES); the judge raises the floor to them, like any
proposal's. A log position, so every judge and every rebuild
agree; logs without one are judged as before.
"""

from __future__ import annotations

from . import Context, Decision, handles

# The rules that introduced the marker: a judge of older rules stops the
# partition (as on any proposal naming rules it does not know) rather than
# judge the namespace by a floor it cannot raise.
FLOOR_MARKER_RULES = 7
MARKER_TYPE = "threadlog.cmd.RaiseRulesFloor"


@handles(MARKER_TYPE, rules=FLOOR_MARKER_RULES, new=True, thread_keyed=False)
def raise_rules_floor(ctx: Context, cmd: dict) -> Decision:
    return Decision()  # the floor itself is the judge's (it raises it for every proposal of rules >= 4)

"""The integrations refuse what is not a connected asyncio client, at construction (no broker).

Tried (a new-user review): a bootstrap address, `threadlog.open(...)` not
awaited and the blocking client were accepted and failed later as
`AttributeError: ... has no attribute 'opts'` -- an OpenAI Agents session only
at its first use, inside `Runner.run`.
"""

from __future__ import annotations

import pytest

import threadlog
from threadlog.integrations.langgraph import AsyncThreadLogSaver, ThreadLogSaver
from threadlog.integrations.openai_agents import ThreadLogSession


class Blocking:
    """Stands for another object passed by mistake (the blocking client needs a broker)."""


@pytest.mark.parametrize("make", [lambda c: AsyncThreadLogSaver(c), lambda c: ThreadLogSession("s", c)],
                         ids=["langgraph", "openai_agents"])
async def test_what_is_not_a_connected_client_is_a_type_error_naming_what_was_meant(make):
    opener = threadlog.open("127.0.0.1:1", namespace="never-opened")  # not awaited: connects nothing
    for wrong, said in ((opener, "not awaited"), ("127.0.0.1:9092", "the string '127.0.0.1:9092'"),
                        (Blocking(), "Blocking")):
        with pytest.raises(TypeError) as err:
            make(wrong)
        assert "takes a connected threadlog.ThreadLog" in str(err.value) and said in str(err.value)
        assert ".open(" in str(err.value)  # what to call instead


def test_the_blocking_saver_refuses_a_client_where_the_address_goes():
    with pytest.raises(TypeError, match="bootstrap servers"):
        ThreadLogSaver(object())  # before anything is opened

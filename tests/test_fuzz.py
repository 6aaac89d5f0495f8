"""Property tests over the public API: whatever comes in is refused or accepted unchanged.

A refusal is a `SophosError` (a code and a message) with nothing written; no other exception
escapes, and the database passes `PRAGMA integrity_check` afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import matplotlib.pyplot as plt
import pytest
from conftest import ASYNC_TEST_TIMEOUT, integrity
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sophos_lab.lab import inspect as views
from sophos_lab.runtime.errors import BAD_REQUEST, CONFIG_ERROR, SophosError
from sophos_lab.runtime.requests import parse_conversation_id
from sophos_lab.runtime.service import AgentService
from sophos_lab.runtime.tools import ServerConfig, load_mcp_config

FAST = settings(max_examples=200, deadline=None)
# One service serves every example of a test (see `service`), hence the function-scoped fixture.
RUNS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

VIEWS = [
    views.peek_runs, views.checkpoints, views.pending_writes, views.messages, views.thread_view,
    views.state, views.timeline,
]

uuids = st.uuids().map(str)
conversation_ids = st.one_of(
    st.text(),
    uuids,
    uuids.map(str.upper),
    st.tuples(st.text(max_size=2), uuids, st.text(max_size=2)).map("".join),  # near misses
    st.none(), st.booleans(), st.integers(), st.floats(), st.binary(),
    st.lists(st.text(max_size=3), max_size=3),
    st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2),
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=12,
)
server_entries = st.dictionaries(
    st.sampled_from(["command", "args", "env", "cwd", "url", "transport", "other"]), json_values, max_size=4,
)


# --- conversation ids ----------------------------------------------------------------------


@FAST
@given(conversation_ids)
@example(str(uuid.uuid4()) + "\n")
def test_parse_conversation_id_accepts_only_a_uuid(value):
    try:
        parsed = parse_conversation_id(value)
    except SophosError as error:
        assert error.code == BAD_REQUEST
        assert error.message == f"Invalid Conversation ID: {value!r}"
    else:
        assert parsed == value.lower() == str(uuid.UUID(value))


@FAST
@given(st.data())
def test_the_inspect_views_raise_only_sophos_errors(fetched, data):
    view = data.draw(st.sampled_from(VIEWS), label="view")
    known = st.sampled_from([fetched.conversation, fetched.conversation.upper()])
    conversation = data.draw(conversation_ids | known, label="conversation")
    try:
        result = view(fetched.db_path, conversation)
    except SophosError as error:
        assert error.code == BAD_REQUEST
        assert error.message == f"Invalid Conversation ID: {conversation!r}"
    else:
        if view is views.timeline:
            plt.close(result)
        if not (view is views.peek_runs and conversation is None):  # None: all runs
            parse_conversation_id(conversation)  # accepted only if the service accepts it
    assert integrity(fetched.db_path) == "ok"


# --- configuration -------------------------------------------------------------------------


@FAST
@given(st.one_of(
    st.binary(),
    json_values.map(json.dumps),
    st.dictionaries(st.text(max_size=8), server_entries, max_size=3).map(json.dumps),
))
def test_load_mcp_config_raises_only_config_errors(tmp_path_factory, contents):
    path = tmp_path_factory.mktemp("mcp") / "mcp.json"
    path.write_bytes(contents if isinstance(contents, bytes) else contents.encode())
    try:
        servers = load_mcp_config(path, {"A": "a"})
    except SophosError as error:
        assert error.code == CONFIG_ERROR
        assert str(path) in error.message
    else:
        assert all(isinstance(server, ServerConfig) for server in servers)
        assert all(bool(server.command) != bool(server.url) for server in servers)


# --- messages ------------------------------------------------------------------------------


@dataclass
class Driven:
    """A service on an event loop of the test's own, shared by all of its examples."""

    agent: AgentService
    run: Callable[[Coroutine[Any, Any, Any]], Any]
    existing: str
    """A conversation already in the database."""

    def stored(self) -> tuple[list[Any], list[Any]]:
        return self.run(self.agent.list_conversations()), self.run(self.agent.list_runs())


@pytest.fixture
def service(open_service, fetched, db_path):
    """One service for all the examples of a test: opening one per example would take seconds.

    The conftest runs `async def` tests with `asyncio.run`; a hypothesis test is a plain
    function, so it drives this loop itself.
    """
    source, target = sqlite3.connect(fetched.db_path), sqlite3.connect(db_path)
    source.backup(target)
    source.close()
    target.close()
    loop = asyncio.new_event_loop()

    def run(coroutine):
        return loop.run_until_complete(asyncio.wait_for(coroutine, ASYNC_TEST_TIMEOUT))

    stack = contextlib.AsyncExitStack()
    try:
        agent = run(stack.enter_async_context(open_service()))
        run(agent.open())
        yield Driven(agent, run, fetched.conversation)
    finally:
        run(stack.aclose())
        loop.close()


lone_surrogates = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)


@RUNS
@given(st.tuples(st.text(max_size=20), lone_surrogates, st.text(max_size=20)).map("".join))
@example("hello \ud800")
def test_a_message_with_a_lone_surrogate_is_refused_and_nothing_is_stored(service, db_path, message):
    before = service.stored()
    for conversation in (None, service.existing):
        with pytest.raises(SophosError) as refused:
            service.run(service.agent.chat(message, conversation))
        assert refused.value.code == BAD_REQUEST
    assert service.stored() == before
    assert integrity(db_path) == "ok"


@RUNS
@given(st.text(st.characters(exclude_categories=["Cs"]), max_size=200))
@example(" \x00 hello\r\n\u200b\U0001f600 ")
def test_a_valid_message_is_refused_only_if_blank_and_else_stored_unchanged(service, db_path, message):
    before = service.stored()
    try:
        run = service.run(service.agent.chat(message))
    except SophosError as error:
        assert error.code == BAD_REQUEST
        assert not message.strip()
        assert service.stored() == before
    else:
        assert message.strip()
        service.run(run.wait())
        first = service.run(service.agent.get_conversation(run.conversation)).messages[0]
        assert (first["role"], first["content"]) == ("user", message)
        assert views.messages(db_path, run.conversation)["content"].iloc[0] == message
    assert integrity(db_path) == "ok"

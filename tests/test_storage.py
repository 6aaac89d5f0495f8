"""Storage: a checkpoint keeps what its step added, not the thread again, and old files still read.

The thread's messages live in a `DeltaChannel`: a checkpoint's blob holds no messages (except
every `SNAPSHOT_FREQUENCY` updates, when it holds the whole list), and the thread is rebuilt from
the writes since the latest such snapshot. These tests read the raw `checkpoints` and `writes`
tables to see what is stored, and read threads back through everything that shows them.

An "old file" is one the kit wrote before, with LangGraph's default channel (`MessagesState`),
where every checkpoint holds the whole list. It is made here, with the kit's own graph over the
old channel and the kit's store, as the service of that time wrote it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import sqlite3
import uuid
from dataclasses import dataclass
from functools import reduce
from pathlib import Path

import aiosqlite
import pytest
from conftest import ASYNC_TEST_TIMEOUT, integrity, roles, statuses
from hypothesis import given, settings
from hypothesis import strategies as st
from langchain_core.messages import AIMessage, HumanMessage, RemoveMessage
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver
from langgraph.graph import MessagesState
from langgraph.graph.message import REMOVE_ALL_MESSAGES, add_messages

from sophos_lab.lab import inspect as views
from sophos_lab.runtime.agent import (
    SNAPSHOT_FREQUENCY, AgentParts, add_message_batches, build_graph, chat_model, read_system_prompt,
)
from sophos_lab.runtime.messages import message_dtos
from sophos_lab.runtime.agent import thread_config
from sophos_lab.runtime.storage import sqlite_storage
from sophos_lab.runtime.tools import McpTools

SERDE = JsonPlusSerializer()


def note(turn: int) -> str:
    """A user message that no script matches (a short plain answer) and that names its turn."""
    return f"Note number {turn:03d} for the storage test: keep it."


def stored_bytes(db_path: Path) -> int:
    """The bytes of every checkpoint and write in the file (blobs and metadata)."""
    with contextlib.closing(sqlite3.connect(db_path)) as conn:
        checkpoints = conn.execute("SELECT total(length(checkpoint) + length(metadata)) FROM checkpoints").fetchone()[0]
        writes = conn.execute("SELECT total(length(value)) FROM writes").fetchone()[0]
    return int(checkpoints + writes)


def rows_holding(db_path: Path, text: str) -> dict[str, int]:
    """How many checkpoint blobs and writes hold `text` (strings are stored as UTF-8 as they are)."""
    needle = text.encode()
    with contextlib.closing(sqlite3.connect(db_path)) as conn:
        blobs = [row[0] for row in conn.execute("SELECT checkpoint FROM checkpoints")]
        values = [row[0] for row in conn.execute("SELECT value FROM writes")]
    return {"checkpoints": sum(needle in blob for blob in blobs), "writes": sum(needle in value for value in values)}


def stored_messages(db_path: Path, conversation: str) -> list[object]:
    """What each checkpoint's blob stores for `messages`, oldest first: a list (the old channel
    stores the whole list every time), a `_DeltaSnapshot`, or None (only the step's writes)."""
    with contextlib.closing(sqlite3.connect(db_path)) as conn:
        rows = conn.execute(
            "SELECT type, checkpoint FROM checkpoints WHERE thread_id = ? ORDER BY checkpoint_id", (conversation,)
        ).fetchall()
    return [SERDE.loads_typed((kind, blob))["channel_values"].get("messages") for kind, blob in rows]


async def chat_turns(agent, turns: range, conversation: str | None = None, each=None) -> str:
    for turn in turns:
        end = await agent.ask(note(turn), conversation)
        assert end.event == "end", end.data
        conversation = end.data["conversation"]
        if each is not None:
            each(turn)
    return conversation


# --- what a checkpoint stores -----------------------------------------------------------------


async def test_each_turn_stores_about_as_much_as_the_one_before(open_service, db_path):
    stored = []
    async with open_service() as agent:
        await chat_turns(agent, range(1, 13), each=lambda _: stored.append(stored_bytes(db_path)))

    per_turn = [after - before for before, after in zip(stored, stored[1:])]
    # With the whole list in every checkpoint, the twelfth turn stored about five times what the
    # second did (30.8 KB, 6.4 KB); now every turn stores its two messages and three small
    # checkpoints (3.1 KB).
    assert max(per_turn) < 1.1 * min(per_turn), per_turn


async def test_the_latest_checkpoints_do_not_hold_the_first_message(open_service, db_path):
    async with open_service() as agent:
        conversation = await chat_turns(agent, range(1, 3))
        after_two = rows_holding(db_path, note(1))
        await chat_turns(agent, range(3, 11), conversation)
        after_ten = rows_holding(db_path, note(1))
        latest_run = (await agent.list_runs(conversation))[-1].id

    assert after_ten == after_two  # stored where it was added, and nowhere again
    checkpoints = views.checkpoints(db_path, conversation)
    latest = checkpoints[checkpoints["run_id"] == latest_run]
    assert list(latest["message_count"]) == [18, 19, 20]  # the view still counts them all
    assert stored_messages(db_path, conversation)[-3:] == [None, None, None]  # the blobs hold none


async def test_a_thread_longer_than_the_snapshot_cadence_reads_back_whole(open_service, db_path):
    """Every SNAPSHOT_FREQUENCY updates (two a turn here) one checkpoint holds the whole list;
    reading the thread replays the writes after it. Every reader sees every message, in order."""
    turns = SNAPSHOT_FREQUENCY // 2 + 5
    async with open_service() as agent:
        conversation = await chat_turns(agent, range(1, turns + 1))
    async with open_service() as fresh:
        detail = await fresh.get_conversation(conversation)
        jsonl = await fresh.export_jsonl(conversation)
        markdown = await fresh.export_markdown(conversation)

    kinds = [type(value).__name__ for value in stored_messages(db_path, conversation)]
    assert kinds.count("_DeltaSnapshot") == 1 and kinds.count("list") == 0
    expected_counts = [count for turn in range(turns) for count in (2 * turn, 2 * turn + 1, 2 * turn + 2)]
    assert [message["content"] for message in detail.messages[::2]] == [note(turn) for turn in range(1, turns + 1)]
    assert roles(detail) == ["user", "assistant"] * turns
    assert [json.loads(line)["message_count"] for line in jsonl.splitlines()] == expected_counts
    assert list(views.checkpoints(db_path, conversation)["message_count"]) == expected_counts
    assert list(views.checkpoints(db_path, conversation)["last_role"]) == [None, "user", "assistant"] + [
        "assistant", "user", "assistant"] * (turns - 1)
    assert views.state(db_path, conversation)["roles"] == roles(detail)
    assert list(views.messages(db_path, conversation)["content"]) == [m["content"] for m in detail.messages]
    assert markdown.count("## User") == turns and note(turns) in markdown


# --- the reducer -------------------------------------------------------------------------------

message_ids = st.sampled_from(["a", "b", "c", "d"])
writes = st.one_of(
    st.builds(lambda i, text: HumanMessage(text, id=i), message_ids, st.text(max_size=3)),
    st.builds(lambda i, text: AIMessage(text, id=i), message_ids, st.text(max_size=3)),
    st.builds(lambda i: RemoveMessage(id=i), message_ids),
    st.just(RemoveMessage(id=REMOVE_ALL_MESSAGES)),
)


def outcome(reducer):
    """What a reducer gives, as plain values (its error's text when it refuses)."""
    try:
        return [(type(m).__name__, m.id, m.content) for m in reducer()]
    except ValueError as error:
        return str(error)


@settings(max_examples=300, deadline=None)
@given(st.lists(writes, max_size=4), st.lists(st.lists(writes, max_size=4), min_size=1, max_size=5))
def test_replaying_writes_in_one_call_is_adding_them_one_batch_at_a_time(start, batches):
    start = [message for message in start if not isinstance(message, RemoveMessage)]
    one_by_one = outcome(lambda: reduce(add_messages, [list(batch) for batch in batches], list(start)))
    assert outcome(lambda: add_message_batches(list(start), [list(batch) for batch in batches])) == one_by_one


# --- files written with the old channel -------------------------------------------------------


@dataclass
class OldFile:
    """A database written with the old channel: one finished fetch conversation, and one whose
    run was cut off after its tool result was checkpointed, as a kill there leaves it."""

    db_path: Path
    finished: str
    finished_page: str
    cut_off: str
    cut_off_page: str


async def old_run(settings, message: str, conversation: str | None = None, stop_at_step: int | None = None) -> str:
    """One run as the kit ran it with `MessagesState`: the run row and its message first, the
    kit's graph streamed with durability "sync" and the run id in every checkpoint, the outcome
    last. With `stop_at_step` the run stops when that step is about to start (its checkpoint
    before it is on disk) and its row stays `running`; closing the store then leaves its owner
    gone, as a killed process does."""
    new = conversation is None
    conversation = conversation or str(uuid.uuid4())
    store = sqlite_storage(settings.database_path)
    tools = McpTools(settings, log_dir=settings.database_path.parent / "logs")
    parts = AgentParts(model=lambda: chat_model(settings), tools=tools.get,
                       system_prompt=lambda: read_system_prompt(settings))
    run_id, message_id = str(uuid.uuid4()), str(uuid.uuid4())
    await store.start_run(run_id, conversation, [{"id": message_id, "content": message}], message if new else None)
    conn = await aiosqlite.connect(settings.database_path)
    try:
        saver = AsyncSqliteSaver(conn)
        graph = build_graph(parts, saver, schema=MessagesState)
        config = {**thread_config(conversation), "metadata": {"run_id": run_id}, "recursion_limit": 25}
        stream = graph.astream({"messages": [HumanMessage(message, id=message_id)]}, config,
                               stream_mode="debug", durability="sync")
        async with contextlib.aclosing(stream):
            async for chunk in stream:
                if chunk["type"] == "task" and chunk["step"] == stop_at_step:
                    return conversation
        state = await graph.aget_state(thread_config(conversation))
        await store.finish_run(run_id, "completed", len(message_dtos(state.values["messages"])))
        return conversation
    finally:
        await tools.aclose()
        await conn.close()
        await store.aclose()


@pytest.fixture(scope="module")
def old_file(lab, tmp_path_factory) -> OldFile:
    root = tmp_path_factory.mktemp("old-file")
    settings = lab.settings(DATABASE_PATH=str(root / "sophos.db"), MEMORY_FILE_PATH=str(root / "memory.jsonl"))
    finished_page, cut_off_page = lab.page("index.html"), lab.page("wal.html")

    async def write() -> tuple[str, str]:
        finished = await old_run(settings, f"Fetch {finished_page}")
        # Steps: -1 input, 0 agent asks for the fetch, 1 tools, 2 the tool result, 3 the answer.
        cut_off = await old_run(settings, f"Fetch {cut_off_page}", stop_at_step=3)
        return finished, cut_off

    finished, cut_off = asyncio.run(asyncio.wait_for(write(), ASYNC_TEST_TIMEOUT))
    old = OldFile(root / "sophos.db", finished, finished_page, cut_off, cut_off_page)
    # It is an old file: every checkpoint after the first holds the whole list.
    stored = stored_messages(old.db_path, old.finished)
    assert [len(value) for value in stored[1:]] == [1, 2, 3, 4] and stored[0] is None
    return old


@pytest.fixture
def old_copy(old_file, tmp_path) -> OldFile:
    """This test's own copy of the old file, free to write to."""
    copy = tmp_path / "old.db"
    shutil.copyfile(old_file.db_path, copy)
    return OldFile(copy, old_file.finished, old_file.finished_page, old_file.cut_off, old_file.cut_off_page)


async def test_an_old_file_reads_as_it_did(old_copy, open_service):
    old = old_copy
    async with open_service(DATABASE_PATH=str(old.db_path)) as agent:
        detail = await agent.get_conversation(old.finished)
        markdown = await agent.export_markdown(old.finished)
        records = [json.loads(line) for line in (await agent.export_jsonl(old.finished)).splitlines()]

    assert roles(detail) == ["user", "assistant", "tool", "assistant"]
    assert detail.messages[0]["content"] == f"Fetch {old.finished_page}"
    assert detail.messages[1]["toolCalls"][0]["args"] == {"url": old.finished_page}
    assert (detail.next, detail.resumable) == ((), False)
    assert [r["message_count"] for r in records] == [0, 1, 2, 3, 4]
    assert [r["last_message"] and r["last_message"]["role"] for r in records] == [
        None, "user", "assistant", "tool", "assistant"]
    assert "### Tool result: `fetch__fetch` (success)" in markdown and "loaded fine" in markdown

    checkpoints = views.checkpoints(old.db_path, old.finished)
    assert list(checkpoints["message_count"]) == [0, 1, 2, 3, 4]
    assert list(checkpoints["last_role"]) == [None, "user", "assistant", "tool", "assistant"]
    assert list(views.messages(old.db_path, old.finished)["role"]) == roles(detail)
    assert views.thread_view(old.db_path, old.finished) == (detail.messages, ())
    assert views.state(old.db_path, old.finished)["last_checkpoint"] == {"step": 3, "next": [], "message_count": 4}


async def test_a_run_cut_off_in_an_old_file_resumes_without_fetching_again(old_copy, open_service, lab):
    old = old_copy
    fetched_before = lab.fetches("wal.html")
    async with open_service(DATABASE_PATH=str(old.db_path)) as agent:
        assert [c.status for c in (await agent.list_conversations()) if c.id == old.cut_off] == ["interrupted"]
        before = await agent.get_conversation(old.cut_off)
        end = await (await agent.resume(old.cut_off)).wait()
        after = await agent.get_conversation(old.cut_off)
        assert (await statuses(agent, old.cut_off)) == ["interrupted", "completed"]

    assert (before.next, before.resumable, roles(before)) == (("agent",), True, ["user", "assistant", "tool"])
    assert end.event == "end"
    assert roles(after) == ["user", "assistant", "tool", "assistant"]
    assert after.messages[:3] == before.messages
    assert lab.fetches("wal.html") == fetched_before  # the old checkpoint's tool result was used
    # The resume wrote in the new channel: its checkpoint holds no messages, yet counts them all.
    assert stored_messages(old.db_path, old.cut_off)[-1] is None
    assert list(views.checkpoints(old.db_path, old.cut_off)["message_count"]) == [0, 1, 2, 3, 4]
    assert integrity(old.db_path) == "ok"


async def test_an_old_thread_goes_on_with_new_messages(old_copy, open_service):
    old = old_copy
    async with open_service(DATABASE_PATH=str(old.db_path)) as agent:
        before = await agent.get_conversation(old.finished)
        await chat_turns(agent, range(1, 3), old.finished)
    async with open_service(DATABASE_PATH=str(old.db_path)) as fresh:
        after = await fresh.get_conversation(old.finished)
        records = [json.loads(line) for line in (await fresh.export_jsonl(old.finished)).splitlines()]
        [summary] = [c for c in (await fresh.list_conversations()) if c.id == old.finished]

    assert after.messages[:4] == before.messages
    assert [m["content"] for m in after.messages[4:]][::2] == [note(1), note(2)]
    assert roles(after) == ["user", "assistant", "tool", "assistant"] + ["user", "assistant"] * 2
    assert summary.message_count == 8
    counts = [0, 1, 2, 3, 4, 4, 5, 6, 6, 7, 8]
    assert [r["message_count"] for r in records] == counts
    assert list(views.checkpoints(old.db_path, old.finished)["message_count"]) == counts
    # Old checkpoints keep their lists; the new ones hold only what their step added.
    stored = stored_messages(old.db_path, old.finished)
    assert [len(value) for value in stored[1:5]] == [1, 2, 3, 4] and stored[5:] == [None] * 6
    assert views.thread_view(old.db_path, old.finished)[0] == after.messages

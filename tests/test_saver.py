"""The SQLite saver's one trip a call: the same rows and reads as LangGraph's own async saver.

`OneTripSqliteSaver` runs each checkpoint, write and read as LangGraph's synchronous
`SqliteSaver` in the aiosqlite connection's thread. A thread it writes must read back the same
through LangGraph's `AsyncSqliteSaver`, and a thread that saver wrote must go on through it.
"""

from __future__ import annotations

import contextlib
import sqlite3
from typing import Annotated, TypedDict

import aiosqlite
import pytest
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage
from langgraph.channels import DeltaChannel
from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import _messages_delta_reducer

from sophos_lab.runtime.checkpointer import OneTripSqliteSaver


class State(TypedDict):
    messages: Annotated[list[AnyMessage], DeltaChannel(_messages_delta_reducer, snapshot_frequency=3)]


def echo_graph(saver):
    """agent answers each message with its length; a snapshot every three updates, so a few
    turns read the channel back from a snapshot and the writes after it."""
    async def agent(state: State) -> dict:
        return {"messages": [AIMessage(f"{len(state['messages'])} so far")]}

    builder = StateGraph(State)
    builder.add_node("agent", agent)
    builder.add_edge(START, "agent")
    builder.add_edge("agent", END)
    return builder.compile(checkpointer=saver)


CONFIG = {"configurable": {"thread_id": "t-1"}}


async def turns(saver, texts: list[str]) -> None:
    graph = echo_graph(saver)
    for text in texts:
        await graph.ainvoke({"messages": [HumanMessage(text)]}, CONFIG, durability="sync")


async def what_it_reads(saver) -> tuple:
    """The thread as `saver` reads it: its state, every checkpoint of its history (with pending
    writes) and the messages channel's history from the latest checkpoint."""
    graph = echo_graph(saver)
    state = await graph.aget_state(CONFIG)
    history = [(t.config, t.checkpoint, t.metadata, t.parent_config, t.pending_writes)
               async for t in saver.alist(CONFIG)]
    latest = await saver.aget_tuple(CONFIG)
    deltas = await saver.aget_delta_channel_history(config=latest.config, channels=["messages"])
    return [m.content for m in state.values["messages"]], history, latest, deltas


@contextlib.asynccontextmanager
async def both(path):
    """The kit's saver and LangGraph's, each on a connection of its own to one file."""
    async with aiosqlite.connect(path) as ours_conn, aiosqlite.connect(path) as theirs_conn:
        ours, theirs = OneTripSqliteSaver(ours_conn), AsyncSqliteSaver(theirs_conn)
        await theirs.setup()
        yield ours, theirs


async def test_a_thread_written_in_one_trip_a_call_reads_back_the_same_through_langgraphs_saver(tmp_path):
    async with both(tmp_path / "thread.db") as (ours, theirs):
        await turns(ours, ["one", "two", "three", "four"])

        messages, *rest = await what_it_reads(theirs)
        assert messages == ["one", "1 so far", "two", "3 so far", "three", "5 so far", "four", "7 so far"]
        assert await what_it_reads(ours) == (messages, *rest)


async def test_a_thread_langgraphs_saver_wrote_goes_on_through_the_kits_and_back(tmp_path):
    async with both(tmp_path / "thread.db") as (ours, theirs):
        await turns(theirs, ["one", "two"])
        await turns(ours, ["three"])
        await turns(theirs, ["four"])

        read = await what_it_reads(ours)
        assert read[0] == ["one", "1 so far", "two", "3 so far", "three", "5 so far", "four", "7 so far"]
        assert read == await what_it_reads(theirs)


async def test_a_write_refused_part_way_leaves_no_half_of_it_for_the_next_commit(tmp_path):
    async with both(tmp_path / "thread.db") as (ours, _):
        await turns(ours, ["one"])
        latest = await ours.aget_tuple(CONFIG)
        # The file refuses a task's second write, as a full disk or a constraint would part-way.
        await ours.conn.execute("CREATE TEMP TRIGGER second_write_refused BEFORE INSERT ON writes"
                                " WHEN NEW.idx = 1 BEGIN SELECT RAISE(ABORT, 'refused'); END")

        with pytest.raises(sqlite3.IntegrityError, match="refused"):
            await ours.aput_writes(latest.config, [("messages", [AIMessage("a")]), ("extra", 1)], "task-1")
        await ours.conn.execute("DROP TRIGGER second_write_refused")
        await turns(ours, ["two"])  # the connection's next writes commit

        with sqlite3.connect(tmp_path / "thread.db") as conn:
            kept = conn.execute("SELECT count(*) FROM writes WHERE task_id = 'task-1'").fetchone()[0]
        assert kept == 0, "the first of the refused task's writes was committed by a later write"


async def test_a_read_that_fails_leaves_the_connection_s_open_transaction_alone(tmp_path):
    async with both(tmp_path / "thread.db") as (ours, _):
        await turns(ours, ["one"])
        await ours.conn.execute("CREATE TABLE notes (text TEXT)")
        await ours.conn.commit()
        await ours.conn.execute("INSERT INTO notes VALUES ('not committed yet')")
        unreadable = {"configurable": {"thread_id": "t-2", "checkpoint_ns": ""}}
        await ours.conn.execute("INSERT INTO checkpoints (thread_id, checkpoint_ns, checkpoint_id, type, checkpoint)"
                                " VALUES ('t-2', '', 'c-1', 'msgpack', x'c1')")  # 0xc1: never valid msgpack

        with pytest.raises(Exception):
            await ours.aget_tuple(unreadable)
        await ours.conn.commit()

        async with ours.conn.execute("SELECT text FROM notes") as rows:
            assert [row[0] for row in await rows.fetchall()] == ["not committed yet"]


async def test_a_call_on_a_closed_connection_fails_as_on_langgraphs_saver(tmp_path):
    """A process that closes its saver mid-run (lesson 06e's naive shutdown) sees LangGraph's error."""
    async with both(tmp_path / "thread.db") as (ours, theirs):
        await turns(ours, ["one"])
        for saver in (ours, theirs):
            await saver.conn.close()
        errors = []
        for saver in (ours, theirs):
            with pytest.raises(ValueError) as raised:
                await saver.aget_tuple(CONFIG)
            errors.append(str(raised.value))
        assert errors == ["no active connection", "no active connection"]

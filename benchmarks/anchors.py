"""The anchors: what a user would write with LangGraph alone, doing the same work as the kit.

Every row of `make bench` compares the kit with the strongest thing a user could pick instead;
for the agent itself that is bare LangGraph written the way its own documentation shows, with the
same storage choices the kit makes:

- the messages channel: `DeltaChannel` with LangGraph's own batch reducer for it,
  `langgraph.graph.message._messages_delta_reducer` (the reducer its docstring shows for this
  channel) and the channel's default cadence, a full snapshot every 100 updates (the kit's
  `SNAPSHOT_FREQUENCY` is the same 100). Each checkpoint stores only what its step added, as
  the kit's does. `DEFAULT` is LangGraph's default channel (`MessagesState`, the whole list in
  every checkpoint), kept for a second, labelled row where storage is the measure;
- a thread named as the kit names one (`thread`): a uuid4 string, the kit's conversation id,
  which every row of LangGraph's tables and their keys carry (a short name such as "bench"
  stores less than the same thread under the kit's id);
- the same two-node graph (agent <-> tools), `ChatOllama` on the same scripted model, the same
  system prompt, durability "sync" (each step's checkpoint written before the next step runs,
  as the kit runs);
- the savers: `AsyncSqliteSaver` on a file, and `AsyncPostgresSaver.from_conn_string(url,
  pipeline=True)` (one async connection in pipeline mode: autocommit, dict rows, statements
  prepared at once, as LangGraph's own constructor makes it), each set up once (`setup()`, on a
  connection of its own: its `CREATE INDEX CONCURRENTLY` cannot run in a pipeline) before
  anything is timed. The fastest of LangGraph's ways for one run at a time: measured on
  4 December 2026 (15 paired rounds of steps.py's conversation, twice), a step took 0.82x and
  0.87x as long as on an `AsyncConnectionPool` with the kit's options, and 0.94x and 0.87x as
  long as on the same single connection without pipeline mode.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any, TypedDict

from langchain_core.messages import AnyMessage, SystemMessage
from langchain_ollama import ChatOllama
from langgraph.channels import DeltaChannel
from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.graph.message import _messages_delta_reducer

PROMPT = "You are a benchmark."
"""The system prompt of every benchmark's agent (the kit's is the same text, in its system.md)."""


class DeltaState(TypedDict):
    """Bare LangGraph's messages on `DeltaChannel`, LangGraph's batch reducer, default cadence."""

    messages: Annotated[list[AnyMessage], DeltaChannel(_messages_delta_reducer)]


DELTA = DeltaState
DEFAULT = MessagesState
"""LangGraph's default messages channel (`add_messages`): the whole list in every checkpoint."""


def thread() -> dict[str, Any]:
    """The config of a new thread of bare LangGraph, its id a uuid4 string as the kit's."""
    return {"configurable": {"thread_id": str(uuid.uuid4())}, "recursion_limit": 25}


def bare_graph(url: str, checkpointer: Any, state: type = DELTA, prompt: str = PROMPT, **node_options: Any):
    """The kit's graph shape with LangGraph alone: START -> agent, agent -> tools or END,
    tools -> agent (never reached without tools). `node_options` go to the agent node
    (`retry_policy=`, `timeout=`), as the kit gives its nodes theirs."""
    model = ChatOllama(model="scripted", base_url=url)

    async def agent(state: dict) -> dict:
        return {"messages": [await model.ainvoke([SystemMessage(prompt), *state["messages"]])]}

    builder = StateGraph(state)
    builder.add_node("agent", agent, **node_options)
    builder.add_node("tools", agent)  # the same shape as the kit's graph; never reached here
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", lambda state: "tools" if state["messages"][-1].tool_calls else END,
                                  ["tools", END])
    builder.add_edge("tools", "agent")
    return builder.compile(checkpointer=checkpointer)


@asynccontextmanager
async def sqlite_saver(path: str, saver_class: type = AsyncSqliteSaver) -> AsyncIterator[AsyncSqliteSaver]:
    """`AsyncSqliteSaver` (or a subclass, `saver_class`) on the file at `path`, its tables made."""
    async with saver_class.from_conn_string(path) as saver:
        await saver.setup()
        yield saver


@asynccontextmanager
async def postgres_saver(database_url: str) -> AsyncIterator[Any]:
    """`AsyncPostgresSaver.from_conn_string(database_url, pipeline=True)`, its tables made."""
    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

    async with AsyncPostgresSaver.from_conn_string(database_url) as saver:
        await saver.setup()
    async with AsyncPostgresSaver.from_conn_string(database_url, pipeline=True) as saver:
        yield saver


@asynccontextmanager
async def saver_for(target: str) -> AsyncIterator[Any]:
    """The saver for `target`: a PostgreSQL URL or a SQLite file's path."""
    if target.startswith(("postgres://", "postgresql://")):
        async with postgres_saver(target) as saver:
            yield saver
    else:
        async with sqlite_saver(target) as saver:
            yield saver

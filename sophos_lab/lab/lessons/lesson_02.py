"""Lesson 02 · Model execution state: what the lesson uses besides the lesson itself.

`start_child` starts the agent process the lesson talks to; `entered` lists the steps a run
entered; `carried_by` and `per_run` are the lesson's two views that join the product's `runs` to
LangGraph's checkpoints; `stored_metadata` reads a thread's checkpoint metadata straight from the
file; `invoke` runs a plain LangGraph graph the original's way; `test_run_of_each_message` is the
exercise's check. Read any of them with `??`, e.g. `lesson.invoke??`.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Sequence
from contextlib import closing
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

if TYPE_CHECKING:
    from ..children import LabKernel, LabWorker
    from ..harness import Lab

MESSAGES = ["Name one prime number.", "Name another one.", "And a third one."]
"""The three messages of the lesson's conversation, in the order they are sent."""


def start_child(lab: Lab, kind: str, **env: str) -> LabKernel | LabWorker:
    """A fresh agent process (a "restart"): a Jupyter kernel of its own when `kind` is "kernel",
    else a plain subprocess; `env` overrides the lab's settings (e.g. `OLLAMA_HOST`)."""
    return lab.kernel(**env) if kind == "kernel" else lab.worker(**env)


def entered(child: LabKernel | LabWorker) -> list[tuple[int, str]]:
    """`(step, node)` of every step the child's latest run entered, from its trace events."""
    return [(event["data"]["step"], event["data"]["node"]) for event in child.events()
            if event["event"] == "trace" and event["data"]["event"] == "enter"]


def carried_by(messages: Sequence[dict[str, Any]], runs: pd.DataFrame) -> pd.DataFrame:
    """The conversation's messages (as `get_conversation` returns them: role, id, content), each
    with the number of the run whose `runs.input` carried it in (1 = the first run to start).
    A run keeps the messages it adds to the thread in its `input` column, with their ids; a
    resume carries none, and an answer is no run's input."""
    number = {run_id: n for n, run_id in enumerate(runs["id"], start=1)}
    carried = {message["id"]: number[run.id] for run in runs.itertuples()
               for message in json.loads(run.input or "[]")}
    frame = pd.DataFrame([{"role": m["role"], "id": m["id"], "content": m["content"][:40]} for m in messages])
    frame["carried by run"] = frame["id"].map(carried).astype("Int64")
    return frame


def per_run(joined: pd.DataFrame) -> pd.DataFrame:
    """`runs ⨝ checkpoints` (one row per checkpoint, with its run's `status` and `error_code`)
    grouped by run, in start order: how many checkpoints each run wrote, at which steps, from
    which sources."""
    return (joined.groupby("run_id", sort=False)
            .agg(run=("run", "first"), status=("status", "first"), error_code=("error_code", "first"),
                 checkpoints=("step", "count"), steps=("step", list), sources=("source", list))
            .reset_index(drop=True))


def stored_metadata(db_path: str | Path, thread_id: str) -> list[dict[str, Any]]:
    """The `metadata` column of a thread's checkpoints as it is in the file, oldest first
    (read-only: plain SQL, as `sqlite3 $DB` would show it)."""
    with closing(sqlite3.connect(f"{Path(db_path).absolute().as_uri()}?mode=ro", uri=True)) as conn:
        rows = conn.execute("SELECT metadata FROM checkpoints WHERE thread_id = ? ORDER BY checkpoint_id",
                            (thread_id,)).fetchall()
    return [json.loads(metadata) for (metadata,) in rows]


def stand_in_agent(state: dict[str, Any]) -> dict[str, Any]:
    """The plain graph's one node: answers the last message without a model (what the lesson
    looks at is the checkpointer's bookkeeping, not the answer)."""
    from langchain_core.messages import AIMessage

    return {"messages": [AIMessage(f"stand-in answer to {state['messages'][-1].content!r}")]}


def invoke(db_path: str | Path, message: str, config: dict[str, Any]) -> None:
    """One invocation (one "run") of a plain LangGraph graph, `START → agent → END`, the way the
    original ran its graph: `graph.invoke({"messages": [message]}, config)` with LangGraph's
    `SqliteSaver` on the file `db_path`. Whatever `config` holds (the thread id, maybe
    `metadata`) is all LangGraph learns about the run."""
    from langchain_core.messages import HumanMessage
    from langgraph.checkpoint.sqlite import SqliteSaver
    from langgraph.graph import END, START, MessagesState, StateGraph

    builder = StateGraph(MessagesState)
    builder.add_node("agent", stand_in_agent)
    builder.add_edge(START, "agent")
    builder.add_edge("agent", END)
    with closing(sqlite3.connect(db_path, check_same_thread=False)) as conn:
        builder.compile(checkpointer=SqliteSaver(conn)).invoke({"messages": [HumanMessage(message)]}, config)


def test_run_of_each_message(run_of_each_message: Callable[[pd.DataFrame, pd.DataFrame], Any], lab: Lab,
                             conversation: str, history: Sequence[Any]) -> None:
    """The exercise's check: `run_of_each_message` gets fresh frames of the conversation, and its
    answer is compared, message by message, with one found another way: for each message of the
    last snapshot of `history` (the runtime's `state_history`, oldest first), the oldest snapshot
    holding its id names the run. Fails with the first message attributed to the wrong run."""
    runs = lab.peek_runs(conversation)
    number = {run_id: n for n, run_id in enumerate(runs["id"], start=1)}
    final_messages = history[-1].values["messages"]
    answer = run_of_each_message(lab.checkpoints(conversation), lab.peek_runs(conversation))
    assert isinstance(answer, list), f"return a list, one runs.id per message, not a {type(answer).__name__}"
    assert len(answer) == len(final_messages), \
        f"the final state holds {len(final_messages)} messages: return one runs.id for each, not {len(answer)}"
    for n, (message, given) in enumerate(zip(final_messages, answer), start=1):
        what = f"message {n} ({'user' if message.type == 'human' else 'assistant'}: {message.content[:30]!r})"
        assert given in number, (f"{what} gets {given!r}, which is not a runs.id of this conversation: "
                                 "the runs.id values are the runs frame's `id`, the same as the checkpoints' `run_id`")
        holder = next(s for s in history if message.id in {m.id for m in s.values["messages"]})
        right = holder.metadata["run_id"]
        if given != right:
            status = runs.loc[runs["id"] == right, "status"].iloc[0]
            why = (f" Run {number[right]} {status}, but not before it had added this message."
                   if status == "failed" else "")
            raise AssertionError(
                f"{what} is attributed to run {number[given]}, but run {number[right]} added it: the first "
                f"checkpoint that holds it (step {holder.metadata['step']}) is run {number[right]}'s.{why} The "
                "checkpoints after it hold the message too; only the first one says who added it.")

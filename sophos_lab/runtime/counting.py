"""How many messages a conversation has: the one count every listing shows.

A conversation shows the messages of its thread's latest state (`AgentService.get_conversation`:
the latest checkpoint, live, with the output of a task that finished after it) and, after them, a
message that was accepted but never reached the thread (`store.unapplied_input`). The page's
header and the widget's status line count those.

A listing never reads a checkpoint: it reads `conversations.message_count` (the page's sidebar,
the widget's conversation list, `GET /api/conversations`). The column is written

- with a run's row (`Store.start_run`): the messages it carries count from then on (pending,
  until they reach the thread);
- with a run's outcome (`Store.finish_run`), from the state the run ended with; and
- by the recovery that relabels a run its dead process left `running` (`interrupted`, or
  `cancelled`), in the relabelling's transaction: that run recorded no outcome, so the column
  still held what its row wrote (the count before it, and its own message). Recovery reads the thread once, here
  (`shown_message_count`), for each conversation it relabels a run of (`recount`).

A read-only view of a file that no process has recovered yet (the chat widget over a killed
child) cannot write: it counts a stranded run's conversation with the same function, so that it
shows what recovery will write.

Why not at every step: with `DeltaChannel` a checkpoint stores only what its step added, so the
saver, in the checkpoint's own transaction, does not know the thread's length; a count written
after the checkpoint's commit is a second commit, and a process killed between the two (the case
this is for) leaves it one step behind. Recovery has to count again anyway; it is the one place
that needs to.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .messages import message_dtos

log = logging.getLogger(__name__)


def shown_count(messages: Iterable[Any], pending: Iterable[Any] = ()) -> int:
    """The messages a conversation shows: its thread's (those `message_dto` shows) and the
    accepted ones not in the thread yet."""
    return len(message_dtos(messages)) + len(list(pending))


def shown_message_count(path: str | Path, conversation_id: str) -> int | None:
    """What `get_conversation(conversation_id)` counts, read once through a read-only
    connection to the file; None when there is no thread to read (no file, or no checkpoint
    tables yet: the saver makes them before any run's first step).

    Costs one `get_state` of the thread (the replay of its writes since the last snapshot) and
    a read-only graph (about 2 ms): for recovery and for stranded runs, never for a listing."""
    from langgraph.checkpoint.sqlite import SqliteSaver

    from .agent import build_graph
    from .store import has_table, read_only

    with read_only(path) as conn:
        if conn is None or not has_table(conn, "checkpoints") or not has_table(conn, "runs"):
            return None
        conn.row_factory = sqlite3.Row
        latest = conn.execute(
            "SELECT * FROM runs WHERE conversation_id = ? ORDER BY rowid DESC LIMIT 1", (conversation_id,),
        ).fetchone()
        conn.row_factory = None  # the saver reads tuples
        saver = SqliteSaver(conn)
        saver.is_setup = True  # the tables exist; setup() would try to write
        snapshot = build_graph(None, saver).get_state({"configurable": {"thread_id": conversation_id}})
        has_input = latest is not None and "input" in latest.keys()
        return snapshot_count(snapshot, (latest["id"], latest["input"]) if has_input else None)


def snapshot_count(snapshot: Any, latest: tuple[str, str | None] | None) -> int:
    """What a conversation shows, from its thread's latest state and its latest run's
    `(id, input)` (None: no run, or a file without `runs.input`)."""
    from .store import unapplied_input

    messages: list[Any] = []
    written_by = None
    if snapshot.created_at is not None:  # something was checkpointed
        messages = snapshot.values.get("messages", [])
        written_by = (snapshot.metadata or {}).get("run_id")
    pending = unapplied_input(latest[0], latest[1], written_by) if latest is not None else []
    return shown_count(messages, pending)


def recount(conn: sqlite3.Connection, path: str | Path, run_ids: Iterable[str]) -> None:
    """Inside the transaction (on `conn`) that relabelled `run_ids`: set each of their
    conversations' `message_count` to what the conversation shows (`shown_message_count`).

    A thread that cannot be read leaves its count as it was (logged): recovery never fails for
    a count."""
    run_ids = list(run_ids)
    if not run_ids:
        return
    marks = ", ".join("?" * len(run_ids))
    conversations = [row[0] for row in conn.execute(
        f"SELECT DISTINCT conversation_id FROM runs WHERE id IN ({marks})", run_ids)]
    for conversation_id in conversations:
        try:
            count = shown_message_count(path, conversation_id)
        except Exception:
            log.exception("could not count the messages of %s; its message_count stays", conversation_id)
            continue
        if count is not None:
            conn.execute("UPDATE conversations SET message_count = ? WHERE id = ?", (count, conversation_id))

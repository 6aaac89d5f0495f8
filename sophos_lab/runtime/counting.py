"""How many messages a conversation has: the one count every listing shows.

A conversation shows the messages of its thread's latest state (`AgentService.get_conversation`:
the latest checkpoint, live, with the output of a task that finished after it) and, after them, a
message that was accepted but never reached the thread (`storage.models.unapplied_input`). The page's
header and the widget's status line count those.

A listing never reads a checkpoint: it reads `conversations.message_count` (the page's sidebar,
the widget's conversation list, `GET /api/conversations`). The column is written

- with a run's row (`Storage.start_run`): the messages it carries count from then on (pending,
  until they reach the thread);
- with a run's outcome (`Storage.finish_run`), from the state the run ended with; and
- by the recovery that relabels a run its dead process left `running` (`interrupted`, or
  `cancelled`), in the relabelling's transaction: that run recorded no outcome, so the column
  still held what its row wrote (the count before it, and its own message). Recovery reads the thread once
  (`thread_count`), for each conversation it relabels a run of (`Storage._recount`).

A read-only view of a file that no process has recovered yet (the chat widget over a killed
child) cannot write: it counts a stranded run's conversation with the same rule
(`storage.sqlite.shown_message_count`), so that it shows what recovery will write.

Why not at every step: with `DeltaChannel` a checkpoint stores only what its step added, so the
saver, in the checkpoint's own transaction, does not know the thread's length; a count written
after the checkpoint's commit is a second commit, and a process killed between the two (the case
this is for) leaves it one step behind. Recovery has to count again anyway; it is the one place
that needs to.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .messages import message_dtos
from .storage.models import unapplied_input


def shown_count(messages: Iterable[Any], pending: Iterable[Any] = ()) -> int:
    """The messages a conversation shows: its thread's (those `message_dto` shows) and the
    accepted ones not in the thread yet."""
    return len(message_dtos(messages)) + len(list(pending))


async def thread_count(saver: Any, conversation_id: str, latest: tuple[str, str | None] | None) -> int:
    """What `get_conversation(conversation_id)` counts, read once from the thread through
    `saver` (LangGraph's own, reading) and a graph built for reading (about 2 ms): for
    recovery, never for a listing. `latest` is the latest run's `(id, input)` (None: no run)."""
    from .agent import build_graph

    snapshot = await build_graph(None, saver).aget_state({"configurable": {"thread_id": conversation_id}})
    return snapshot_count(snapshot, latest)


def snapshot_count(snapshot: Any, latest: tuple[str, str | None] | None) -> int:
    """What a conversation shows, from its thread's latest state and its latest run's
    `(id, input)` (None: no run, or a file without `runs.input`)."""
    messages: list[Any] = []
    written_by = None
    if snapshot.created_at is not None:  # something was checkpointed
        messages = snapshot.values.get("messages", [])
        written_by = (snapshot.metadata or {}).get("run_id")
    pending = unapplied_input(latest[0], latest[1], written_by) if latest is not None else []
    return shown_count(messages, pending)

"""Reading conversations: the listing, a conversation with its messages and its gate, its runs
and its history. Part of `AgentService` (`service`), whose store and graph it reads."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from . import errors, users
from .agent import thread_config
from .errors import SophosError
from .export import checkpoint_jsonl, markdown_transcript
from .messages import message_dtos, pending_dtos
from .progress import is_resumable, work_left
from .requests import parse_conversation_id
from .storage.models import PAGE_SIZE, Conversation, ConversationPage, Gate, Run, decode_cursor, page_size


@dataclass
class ConversationDetail:
    """A conversation as the UI shows it: summary, messages from the latest checkpoint, resumable."""

    conversation: Conversation
    messages: list[dict[str, Any]]
    next: tuple[str, ...]
    """The work the thread has left (`progress.work_left`): empty once it has ended."""
    resumable: bool
    approval: Gate | None = None
    """The gate the conversation waits at (its latest run is `waiting`), else None."""


class Reading:
    """`AgentService`'s reads: each waits for the database on the loop, never blocking it."""

    async def list_conversations(self) -> list[Conversation]:
        """Every conversation, most recently updated first, with its latest run's outcome.

        Unbounded, as it always was (the lab's files are small); a client that may face
        thousands of conversations asks for them a page at a time with `conversation_page`.
        """
        await self.store.recover()
        return await self.store.list_conversations()

    async def conversation_page(self, limit: int = PAGE_SIZE, cursor: str | None = None) -> ConversationPage:
        """Up to `limit` conversations (1 to 1000), most recently updated first; for the next
        page pass back the page's `next_cursor` (None on the last page).

        Reads the app tables only, never a checkpoint. A malformed cursor or limit is refused
        with `BAD_REQUEST`, before anything is read.
        """
        limit = page_size(limit)
        after = None if cursor is None else decode_cursor(cursor)
        await self.store.recover()
        return await self.store.conversation_page(limit, after)

    async def list_runs(self, conversation: str | None = None) -> list[Run]:
        """The conversation's runs in start order (every conversation's, with no user acting),
        each naming the messages it carried with their text: every conversation's thread is
        read once for it, so the whole list is for a lab's file, not a large server's."""
        if conversation is None:
            if users.acting_user.get() is not None:
                raise SophosError(errors.BAD_REQUEST, "A user lists the runs of one conversation of theirs at a time.")
            runs = await self.store.list_runs(None)
        else:
            runs = await self.store.list_runs(await self._owned(conversation))
        # A finished run's row keeps its messages' ids; their text is in the thread, stored once:
        # each thread that holds some is read once.
        texts: dict[str, dict[str, str]] = {}
        for run in runs:
            if run.input and '"content"' not in run.input and run.conversation_id not in texts:
                state = await (await self._graph_ready()).aget_state(thread_config(run.conversation_id))
                texts[run.conversation_id] = {m["id"]: m["content"] for m in message_dtos(state.values.get("messages", []))}
        return [replace(run, input=json.dumps([m if "content" in m else {**m, "content": text.get(m["id"])}
                                               for m in json.loads(run.input)], ensure_ascii=False))
                if run.input and (text := texts.get(run.conversation_id)) is not None else run for run in runs]

    async def conversation_summary(self, conversation: str) -> Conversation:
        """The conversation's row, once a dead owner's run on it is recovered; no thread read."""
        summary = await self._existing(conversation)
        if await self._recover(summary.id):
            summary = await self._existing(summary.id)
        return summary

    async def get_conversation(self, conversation: str) -> ConversationDetail:
        """The conversation, its messages and whether it can be resumed. Reads only the database."""
        summary = await self._existing(conversation)
        graph = await self._graph_ready()
        if await self._recover(summary.id):
            summary = await self._existing(summary.id)
        state = await graph.aget_state(thread_config(summary.id))
        pending = await self._pending_input(summary.id, state.metadata)
        messages = message_dtos(state.values.get("messages", [])) + pending_dtos(pending)
        busy = summary.id in self.active or summary.status in ("queued", "running", "waiting")
        work = work_left(state)
        return ConversationDetail(
            conversation=summary,
            messages=messages,
            next=work,
            resumable=is_resumable(work, bool(pending), busy),
            approval=await self.pending_approval(summary.id) if summary.status == "waiting" else None,
        )

    async def pending_approval(self, conversation: object) -> Gate | None:
        """The gate the conversation waits at: its pending tool calls (`calls`: id, name and
        arguments), or None when its latest run is not `waiting`. Reads the app tables only."""
        conversation_id = parse_conversation_id(conversation)
        latest = await self.store.latest_run(conversation_id)
        if latest is None or latest.status != "waiting":
            return None
        return await self.store.run_gate(latest.id)

    async def state_history(self, conversation: str) -> list[Any]:
        """The thread's checkpoints as LangGraph `StateSnapshot`s, oldest first."""
        summary = await self._existing(conversation)
        graph = await self._graph_ready()
        history = [snapshot async for snapshot in graph.aget_state_history(thread_config(summary.id))]
        return history[::-1]

    async def export_markdown(self, conversation: str) -> str:
        detail = await self.get_conversation(conversation)
        return markdown_transcript(detail.conversation, detail.messages)

    async def export_jsonl(self, conversation: str) -> str:
        return checkpoint_jsonl(await self.state_history(conversation))

"""The chat widget's two backends, where the agent runs (see `chat_model`).

- `ServiceBackend`: an `AgentService` in this process, on an asyncio loop owned by a thread of
  its own (ipykernel 7 stops advancing tasks created on the kernel's loop once a cell ends);
- `ChildBackend`: a `LabKernel` / `LabWorker` child. Its events come from the child's event log
  and every read goes through the read-only views, because the child owns the database.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from ..runtime.errors import SophosError
from ..runtime.progress import is_resumable
from .chat_model import (FINAL_EVENTS, WIDGET_ERROR, ConversationSummary, EventDict, PendingApproval, ThreadDetail,
                         recorded_error)


class ServiceBackend:
    """An `AgentService` in this process, on an asyncio loop that a thread of its own runs.

    Every call into the service runs on that loop (`run_coroutine_threadsafe`); events come back
    through a `queue.Queue`. Nothing is ever scheduled on the notebook kernel's own loop.
    """

    def __init__(self, settings: Any, log_dir: Path | None = None) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sophos-chat-loop", daemon=True)
        self._thread.start()
        self.service = self._call(_make_service(settings, log_dir))

    def conversations(self) -> list[ConversationSummary]:
        async def read() -> list[ConversationSummary]:
            return [
                ConversationSummary(c.id, c.title, c.status, c.message_count)
                for c in await self.service.list_conversations()
            ]
        return self._call(read())

    def detail(self, conversation_id: str) -> ThreadDetail:
        found = self._call(self.service.get_conversation(conversation_id))
        summary, gate = found.conversation, found.approval
        return ThreadDetail(
            conversation_id=summary.id, messages=found.messages, next=found.next,
            resumable=found.resumable, run_status=summary.status,
            error=recorded_error(summary.status, summary.error_code, summary.error_message),
            approval=None if gate is None else PendingApproval.from_calls(gate.id, gate.run_id, gate.calls),
        )

    def chat(self, message: str, conversation: str | None) -> Iterator[EventDict]:
        return self._stream(lambda: self.service.chat(message, conversation))

    def resume(self, conversation: str) -> Iterator[EventDict]:
        return self._stream(lambda: self.service.resume(conversation))

    def approve(self, conversation: str) -> Iterator[EventDict]:
        return self._stream(lambda: self.service.approve(conversation))

    def reject(self, conversation: str, reason: str | None) -> Iterator[EventDict]:
        return self._stream(lambda: self.service.reject(conversation, reason))

    def cancel(self, conversation: str) -> EventDict:
        try:
            return self._call(self.service.cancel(conversation)).to_dict()
        except SophosError as error:
            return {"event": "rejected", "data": error.to_dict()}

    def close(self) -> None:
        """Drain the service (as a shutdown would), then stop the loop and its thread."""
        if self._loop.is_closed():
            return
        try:
            self._call(self.service.shutdown())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def _call(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def _stream(self, start: Callable[[], Any]) -> Iterator[EventDict]:
        events: queue.Queue[EventDict] = queue.Queue()

        async def pump() -> None:
            try:
                run = await start()
            except SophosError as error:
                events.put({"event": "rejected", "data": error.to_dict()})
                return
            async for event in run.events():
                events.put(event.to_dict())

        def on_done(future: Future) -> None:
            problem = "cancelled" if future.cancelled() else future.exception()
            if problem is not None:  # never leave the reader waiting
                events.put({"event": "rejected", "data": {"code": WIDGET_ERROR, "message": repr(problem)}})

        asyncio.run_coroutine_threadsafe(pump(), self._loop).add_done_callback(on_done)
        while True:
            event = events.get()
            yield event
            if event["event"] in FINAL_EVENTS:
                return


async def _make_service(settings: Any, log_dir: Path | None) -> Any:
    """The service, created on the loop that will run it."""
    from ..runtime.service import AgentService

    return AgentService(settings, log_dir=log_dir)


class ChildBackend:
    """A `LabKernel` or `LabWorker` child: commands go to the child, reads to the database file.

    When the child is gone (killed), the next Send or Resume first starts a fresh one with
    `restart` (by default the child's own `start()`, same settings). Its first open of the
    database relabels the dead run `interrupted`, so the resume is accepted.
    """

    def __init__(self, child: Any, restart: Callable[[], Any] | None = None, poll: float = 0.2) -> None:
        self.child = child
        self.restart = restart or child.start
        self.db_path = Path(child.env["DATABASE_PATH"])
        self.poll = poll
        """How often (s) to check that the child is alive while no event arrives."""
        self._stranded_counts: dict[str, int] = {}
        """orphaned run id → its conversation's message count (its thread cannot change)."""

    def conversations(self) -> list[ConversationSummary]:
        """The list, from the read-only views. A conversation whose latest run is orphaned (its
        process is gone; nobody has recovered the file yet) is counted as recovery will count
        it, from its thread (`runtime.counting`), once per run: the column still holds the count
        of the run before it."""
        from ..lab import inspect as views

        latest = {run.conversation_id: (run.id, run.status) for run in views.peek_runs(self.db_path).itertuples()}
        live = None
        listed = []
        for row in views.conversations(self.db_path).itertuples():
            run_id, status = latest.get(row.id, (None, None))
            count = int(row.message_count)
            if status == "running":
                live = self._live_runs() if live is None else live
                if run_id not in live:
                    count = self._stranded_count(row.id, run_id, count)
            listed.append(ConversationSummary(row.id, row.title, status, count))
        return listed

    def _stranded_count(self, conversation_id: str, run_id: str, recorded: int) -> int:
        from ..runtime.storage.sqlite import shown_message_count

        if run_id not in self._stranded_counts:
            try:
                counted = shown_message_count(self.db_path, conversation_id)
            except Exception:  # the list must show, whatever the thread holds
                counted = None
            self._stranded_counts[run_id] = recorded if counted is None else counted
        return self._stranded_counts[run_id]

    def detail(self, conversation_id: str) -> ThreadDetail:
        from ..lab import inspect as views

        messages, next_nodes = views.thread_view(self.db_path, conversation_id)
        runs = views.peek_runs(self.db_path, conversation_id)
        last = runs.iloc[-1] if len(runs) else None
        status = None if last is None else last["status"]
        orphaned = status == "running" and last["id"] not in self._live_runs()
        gate = views.pending_gate(self.db_path, conversation_id) if status == "waiting" else None
        return ThreadDetail(
            conversation_id=conversation_id, messages=messages, next=next_nodes,
            resumable=is_resumable(next_nodes, any(m.get("pending") for m in messages),
                                busy=status in ("running", "waiting") and not orphaned), run_status=status,
            error=None if last is None else recorded_error(status, _text(last["error_code"]), _text(last["error_message"])),
            orphaned=orphaned,
            approval=None if gate is None else PendingApproval.from_calls(gate["gate"], gate["run"], gate["calls"]),
        )

    def chat(self, message: str, conversation: str | None) -> Iterator[EventDict]:
        return self._follow(lambda child: child.chat(message, conversation))

    def resume(self, conversation: str) -> Iterator[EventDict]:
        return self._follow(lambda child: child.resume(conversation))

    def approve(self, conversation: str) -> Iterator[EventDict]:
        return self._follow(lambda child: child.approve(conversation))

    def reject(self, conversation: str, reason: str | None) -> Iterator[EventDict]:
        return self._follow(lambda child: child.reject(conversation, reason))

    def cancel(self, conversation: str) -> EventDict:
        """The child's answer: the run's final event, or a `rejected` one (`RUN_NOT_ACTIVE`, ...)."""
        return self.child.cancel(conversation)

    def close(self) -> None:
        """Nothing to do: the child belongs to whoever started it (the lab closes it)."""

    def _follow(self, command: Callable[[Any], None]) -> Iterator[EventDict]:
        if not self.child.is_alive():
            yield {"event": "note", "data": "The child is gone: starting a fresh one…"}
            self.child = self.restart()
        child = self.child
        command(child)
        index = child.log.mark
        while True:
            batch = child.log.events_since(index, timeout=self.poll)
            index += len(batch)
            for event in batch:
                if _answers_cancel(event):
                    continue  # a refused cancel is the cancel's answer, not the turn's end
                yield event
                if event["event"] in FINAL_EVENTS:
                    return
            # A killed kernel's reader may stop without logging its exit.
            if not batch and not child.is_alive():
                yield {"event": "process-exited", "data": {"returncode": None}}
                return

    def _live_runs(self) -> set[str]:
        """Runs the live child has started and not finished (by its event log)."""
        if not self.child.is_alive():
            return set()
        live: set[str] = set()
        for event in list(self.child.log.events):
            data = event.get("data")
            if event["event"] == "started":
                live.add(data["run"])
            elif event["event"] in ("end", "chat-error"):
                live.discard(data["run"])
        return live


def _answers_cancel(event: EventDict) -> bool:
    """A child's events that answer a `cancel` command rather than belong to the run."""
    data = event.get("data")
    return event["event"] == "cancel-answer" or (
        event["event"] == "rejected" and isinstance(data, dict) and data.get("cmd") == "cancel")


def _text(value: Any) -> str | None:
    """A text cell of a DataFrame row (pandas gives NaN for NULL)."""
    return value if isinstance(value, str) else None

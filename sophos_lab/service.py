"""The run lifecycle: start, stream, record, resume, and shut down honestly.

A run is one attempt to advance a conversation's thread. Its `running` row is written before
the graph starts; its outcome and the conversation's message count are written in one
transaction before the final event is published (persist, then notify). A resume is a new run
that streams `None` on the same thread, so LangGraph runs only the nodes in `next`.
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

from langchain_core.messages import HumanMessage
from langgraph.errors import GraphDrained
from langgraph.runtime import RunControl

from . import errors
from .agent import AgentParts, build_graph, chat_model, classify_error, read_system_prompt
from .errors import SophosError
from .events import Event, StreamTranslator
from .export import checkpoint_jsonl, markdown_transcript
from .messages import message_dtos
from .settings import Settings
from .store import Conversation, Run, Store
from .tools import McpTools

log = logging.getLogger(__name__)

_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[1-5][0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$", re.I)


def parse_conversation_id(value: object) -> str:
    """A conversation id: a UUID (versions 1-5), normalised to lower case."""
    if not isinstance(value, str) or not _UUID.match(value):
        raise SophosError(errors.BAD_REQUEST, f"Invalid Conversation ID: {value!r}")
    return value.lower()


def thread_config(conversation_id: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": conversation_id}}


@dataclass
class ConversationDetail:
    """A conversation as the UI shows it: summary, messages from the latest checkpoint, resumable."""

    conversation: Conversation
    messages: list[dict[str, Any]]
    next: tuple[str, ...]
    resumable: bool


@dataclass
class ActiveRun:
    """A run in progress in this process, with its event buffer (replayable from any id)."""

    id: str
    conversation: str
    resume: bool
    control: RunControl = field(default_factory=RunControl)
    buffer: list[Event] = field(default_factory=list)
    task: asyncio.Task | None = None
    _signal: asyncio.Event = field(default_factory=asyncio.Event)

    def publish(self, name: str, data: Any) -> Event:
        event = Event(len(self.buffer) + 1, name, data)
        self.buffer.append(event)
        self._signal.set()
        self._signal = asyncio.Event()
        return event

    @property
    def finished(self) -> bool:
        return bool(self.buffer) and self.buffer[-1].is_terminal

    async def events(self, after: int = 0) -> AsyncIterator[Event]:
        """Every event with an id above `after`, then live ones, up to the final event."""
        index = after
        while True:
            signal = self._signal
            while index < len(self.buffer):
                event = self.buffer[index]
                index += 1
                yield event
                if event.is_terminal:
                    return
            await signal.wait()

    async def wait(self) -> Event:
        """The final event (`end` or `chat-error`)."""
        async for event in self.events(len(self.buffer) - 1 if self.buffer else 0):
            pass
        return event  # events() stops right after the final event


class AgentService:
    """The durable agent of one process: conversations, runs and their events."""

    def __init__(self, settings: Settings | None = None, log_dir: Path | None = None) -> None:
        self.settings = settings or Settings.from_env()
        self.store = Store(self.settings.database_path)
        self.tools = McpTools(self.settings, log_dir=log_dir)
        self.active: dict[str, ActiveRun] = {}
        self.accepting = True
        self._graph = None
        self._saver = None
        self._saver_conn = None
        self._opening = asyncio.Lock()

    async def open(self) -> None:
        """Open the database (running recovery) and build the graph now, not on first use."""
        await self._graph_ready()

    # reading

    def list_conversations(self) -> list[Conversation]:
        return self.store.list_conversations()

    def list_runs(self, conversation: str | None = None) -> list[Run]:
        return self.store.list_runs(None if conversation is None else parse_conversation_id(conversation))

    async def get_conversation(self, conversation: str) -> ConversationDetail:
        """The conversation, its messages and whether it can be resumed. Reads only SQLite."""
        summary = self._existing(conversation)
        state = await (await self._graph_ready()).aget_state(thread_config(summary.id))
        messages = message_dtos(state.values.get("messages", []))
        return ConversationDetail(
            conversation=summary,
            messages=messages,
            next=tuple(state.next),
            resumable=bool(state.next) and summary.id not in self.active,
        )

    async def state_history(self, conversation: str) -> list[Any]:
        """The thread's checkpoints as LangGraph `StateSnapshot`s, oldest first."""
        summary = self._existing(conversation)
        graph = await self._graph_ready()
        history = [snapshot async for snapshot in graph.aget_state_history(thread_config(summary.id))]
        return history[::-1]

    async def export_markdown(self, conversation: str) -> str:
        detail = await self.get_conversation(conversation)
        return markdown_transcript(detail.conversation, detail.messages)

    async def export_jsonl(self, conversation: str) -> str:
        return checkpoint_jsonl(await self.state_history(conversation))

    # running

    async def chat(self, message: object, conversation: object = None) -> ActiveRun:
        """Start a run with a new user message, in a new conversation unless one is given."""
        self._check_accepting()
        if not isinstance(message, str) or not message.strip():
            raise SophosError(errors.BAD_REQUEST, "A message is required (it may not be empty).")
        if conversation is None:
            conversation_id, new = str(uuid.uuid4()), True
        else:
            conversation_id, new = self._existing(conversation).id, False
        self._check_idle(conversation_id)
        await self._graph_ready()
        if new:
            await self._write(self.store.create_conversation, conversation_id, message)
        return await self._launch(conversation_id, {"messages": [HumanMessage(message)]}, resume=False)

    async def resume(self, conversation: object) -> ActiveRun:
        """Start a run that continues the thread from its latest checkpoint."""
        self._check_accepting()
        conversation_id = self._existing(conversation).id
        self._check_idle(conversation_id)
        state = await (await self._graph_ready()).aget_state(thread_config(conversation_id))
        if not state.next:
            raise SophosError(errors.RUN_NOT_RESUMABLE, "Nothing to resume: the last run finished")
        return await self._launch(conversation_id, None, resume=True)

    async def ask(self, message: str, conversation: str | None = None) -> Event:
        """Start a chat run and wait for its final event (handy in a notebook cell)."""
        return await (await self.chat(message, conversation)).wait()

    # shutting down

    def request_drain(self, reason: str = "shutdown") -> None:
        """Stop accepting runs and ask each active run to stop at its next step boundary.

        Safe to call from a signal handler: it only sets flags.
        """
        self.accepting = False
        for run in list(self.active.values()):
            run.control.request_drain(reason)

    async def shutdown(self, timeout: float | None = None) -> None:
        """Drain active runs (up to `timeout`, default `SHUTDOWN_TIMEOUT`), record them, close."""
        self.request_drain()
        tasks = [run.task for run in self.active.values() if run.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout or self.settings.shutdown_timeout)
            for task in pending:
                task.cancel()  # recorded as interrupted / SHUTDOWN by _execute
            if pending:
                await asyncio.wait(pending)
        await self.aclose()

    async def aclose(self) -> None:
        """Close MCP servers and database connections now, whatever is running."""
        await self.tools.aclose()
        conn, self._saver_conn, self._graph = self._saver_conn, None, None
        if conn is not None:
            await conn.close()
        self.store.close()

    # internals

    def _existing(self, conversation: object) -> Conversation:
        conversation_id = parse_conversation_id(conversation)
        summary = self.store.get_conversation(conversation_id)
        if summary is None:
            raise SophosError(errors.NOT_FOUND, f"Conversation Not Found: {conversation_id}")
        return summary

    def _check_accepting(self) -> None:
        if not self.accepting:
            raise SophosError(errors.SHUTDOWN, "The agent is shutting down and accepts no new runs.")

    def _check_idle(self, conversation_id: str) -> None:
        if conversation_id in self.active:
            raise SophosError(errors.SESSION_IN_PROGRESS, "Previous request still in progress")

    async def _graph_ready(self):
        """The compiled graph; opens the store first, so recovery precedes any thread read."""
        async with self._opening:  # concurrent first callers must not open two savers
            if self._graph is None:
                await self._build_graph()
        return self._graph

    async def _build_graph(self) -> None:
        import aiosqlite
        from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

        self.store.conn  # noqa: B018 - the first open runs migrations and recovery
        conn = await aiosqlite.connect(self.settings.database_path)
        await conn.execute("PRAGMA busy_timeout = 5000")
        saver = AsyncSqliteSaver(conn)
        await saver.setup()
        model = chat_model(self.settings)  # once: building a client costs ~40 ms (TLS context)
        parts = AgentParts(
            model=lambda: model,
            tools=self.tools.get,
            system_prompt=lambda: read_system_prompt(self.settings),
        )
        self._saver_conn, self._saver, self._graph = conn, saver, build_graph(parts, saver)

    async def _write(self, write: Any, *args: Any) -> None:
        """Run an app-table write on the loop, outside any transaction of the saver.

        The saver holds its lock from its INSERT to its commit, and needs the loop in between;
        a synchronous write that waited on SQLite's lock meanwhile would block that very loop.
        """
        async with self._saver.lock:
            write(*args)

    async def _launch(self, conversation_id: str, graph_input: Any, resume: bool) -> ActiveRun:
        run = ActiveRun(id=str(uuid.uuid4()), conversation=conversation_id, resume=resume)
        await self._write(self.store.start_run, run.id, conversation_id)
        self.active[conversation_id] = run
        run.publish("started", {"conversation": conversation_id, "run": run.id, "resume": resume})
        run.task = asyncio.create_task(self._execute(run, self._graph, graph_input))
        return run

    async def _execute(self, run: ActiveRun, graph: Any, graph_input: Any) -> None:
        config = {
            **thread_config(run.conversation),
            "metadata": {"run_id": run.id},
            "recursion_limit": self.settings.recursion_limit,
        }
        translator = StreamTranslator(model_name=self.settings.ollama_model)
        status, error = "completed", None
        try:
            async for mode, chunk in graph.astream(
                graph_input, config, stream_mode=["messages", "debug"], durability="sync",
                control=run.control,
            ):
                for name, data in translator.feed(mode, chunk):
                    run.publish(name, data)
        except GraphDrained:
            status, error = "interrupted", (errors.SHUTDOWN, errors.SHUTDOWN_MESSAGE)
        except asyncio.CancelledError:
            # Only shutdown() cancels a run: its time to drain ran out mid-step.
            status, error = "interrupted", (errors.SHUTDOWN, errors.SHUTDOWN_MESSAGE)
        except Exception as exc:
            status, error = "failed", classify_error(exc)
        for name, data in translator.finish():
            run.publish(name, data)
        # A completed run's last checkpoint is on the stream; after a failure, ask the saver what
        # was actually written.
        count = translator.message_count if status == "completed" else None
        try:
            if count is None:
                count = await self._message_count(graph, run.conversation)
            record = asyncio.ensure_future(
                self._write(self.store.finish_run, run.id, status, count, *(error or (None, None)))
            )
            try:
                await asyncio.shield(record)
            except asyncio.CancelledError:  # a late shutdown cancel: let the write under way finish
                await record
        except Exception:
            # The row stays `running`; the next process relabels it `interrupted`.
            log.exception("could not record the outcome of run %s", run.id)
        if error:
            run.publish("chat-error", {
                "code": error[0], "message": error[1], "conversation": run.conversation, "run": run.id,
            })
        else:
            run.publish("end", {"conversation": run.conversation, "run": run.id, "status": status})
        self.active.pop(run.conversation, None)

    async def _message_count(self, graph: Any, conversation_id: str) -> int | None:
        try:
            state = await graph.aget_state(thread_config(conversation_id))
        except (Exception, asyncio.CancelledError):  # a late shutdown cancel must not skip the record
            return None
        return len(message_dtos(state.values.get("messages", [])))

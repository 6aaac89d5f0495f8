"""The run lifecycle: start, stream, record, resume, and shut down honestly.

A run is one attempt to advance a conversation's thread. Persist, then notify, at every step:

- The `running` row is written before the graph starts, in one transaction with the user's
  message (`runs.input`) and, for a new conversation, the conversation itself. Only then is
  `started` published and `chat()` returns: an accepted message is on disk before anyone is told.
- A finished step is reported (`leave`, `call`, `result`) only once its checkpoint is saved.
- The outcome and the message count are written in one transaction before the final event.

A resume is a new run on the same thread. If the latest run's message never reached the thread
(the process died before LangGraph's first checkpoint), the resume enters that same message,
with the same id; otherwise it streams `None`, so LangGraph runs only the nodes in `next`.

Runs belong to the process that started them (see `ownership`): it renews a lease while it has
runs, another process relabels the run only once its owner is gone, and a process that lost a
run writes nothing more (the saver's fence and the outcome's `owner_id` check).
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, AsyncIterator

from langchain_core.messages import HumanMessage
from langgraph.errors import GraphDrained
from langgraph.runtime import RunControl

from . import errors, retention
from .agent import (
    ATTEMPT_WATCH, AgentParts, AttemptWatch, build_graph, chat_model, check_config, classify_failure, read_system_prompt,
)
from .checkpointer import NotifyingSaver, is_fenced, shared_lock
from .errors import SophosError
from .events import DurableGate, Event, StreamTranslator
from .export import checkpoint_jsonl, markdown_transcript
from .messages import message_dtos, pending_dtos
from .ownership import Owner
from .retention import Removal, Vacuum
from .settings import Settings
from .store import PAGE_SIZE, Conversation, ConversationPage, IdempotencyKey, Run, Store, decode_cursor, page_size, unapplied_input
from .tools import McpTools

log = logging.getLogger(__name__)

_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[1-5][0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", re.I)


def parse_conversation_id(value: object) -> str:
    """A conversation id: a UUID (versions 1-5), normalised to lower case."""
    if not isinstance(value, str) or not _UUID.fullmatch(value):
        raise SophosError(errors.BAD_REQUEST, f"Invalid Conversation ID: {value!r}")
    return value.lower()


def parse_message(value: object) -> str:
    """A user message: text that is not blank and that UTF-8 can store exactly as it is.

    A lone surrogate (`"\\ud800"`) has no UTF-8 form: storing it would alter the message.
    """
    if not isinstance(value, str) or not value.strip():
        raise SophosError(errors.BAD_REQUEST, "A message is required (it may not be empty).")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise SophosError(
            errors.BAD_REQUEST,
            f"The message is not valid Unicode: a lone surrogate {value[error.start]!r} at "
            f"position {error.start}. Nothing was stored.",
        ) from None
    return value


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
    """A run in progress in this process, with its event buffer (replayable from any id it keeps).

    The buffer keeps the latest `keep` events (all of them when `keep` is None); ids go on
    counting, so the buffer holds ids `dropped + 1` to `last_id`.
    """

    id: str
    conversation: str
    resume: bool
    control: RunControl = field(default_factory=RunControl)
    buffer: list[Event] = field(default_factory=list)
    task: asyncio.Task | None = None
    lost: bool = False
    """Another process took the run over (this process's lease ran out)."""
    recorded: bool = False
    """Its outcome has been written (or refused, when it was lost): no lease to keep for it."""
    keep: int | None = None
    """How many of the latest events the buffer keeps for replay (None: every event)."""
    dropped: int = 0
    """How many of the oldest events the buffer has let go (ids 1 to `dropped`)."""
    cancel_requested: bool = False
    """`cancel()` was accepted: written to the run's row before anything was stopped."""
    in_graph: bool = False
    """The graph is streaming (a cancel then stops it mid-step); False once it has stopped."""
    _signal: asyncio.Event = field(default_factory=asyncio.Event)

    def publish(self, name: str, data: Any) -> Event:
        event = Event(self.last_id + 1, name, data)
        self.buffer.append(event)
        if self.keep is not None and len(self.buffer) > self.keep:
            excess = len(self.buffer) - self.keep
            del self.buffer[:excess]
            self.dropped += excess
        self._signal.set()
        self._signal = asyncio.Event()
        return event

    @property
    def last_id(self) -> int:
        """The id of the latest event (0 before the first)."""
        return self.dropped + len(self.buffer)

    @property
    def finished(self) -> bool:
        return bool(self.buffer) and self.buffer[-1].is_terminal

    async def events(self, after: int = 0) -> AsyncIterator[Event]:
        """Every event with an id above `after`, then live ones, up to the final event.

        Raises `REPLAY_GONE` when the next event to give is no longer kept: `after` is older
        than the buffer, or a slow reader fell more than `keep` events behind.
        """
        last = after
        while True:
            signal = self._signal
            while last < self.last_id:
                index = last - self.dropped
                if index < 0:
                    raise SophosError(errors.REPLAY_GONE, (
                        f"Events {last + 1} to {self.dropped} of run {self.id} are no longer kept (the "
                        f"buffer keeps the latest {self.keep}). Reload the conversation, then follow "
                        "the run again without Last-Event-ID: it starts from the oldest event kept."))
                event = self.buffer[index]
                last = event.id
                yield event
                if event.is_terminal:
                    return
            await signal.wait()

    async def wait(self) -> Event:
        """The final event (`end` or `chat-error`)."""
        async for event in self.events(max(self.last_id - 1, 0)):
            pass
        return event  # events() stops right after the final event


class AgentService:
    """The durable agent of one process: conversations, runs and their events."""

    def __init__(self, settings: Settings | None = None, log_dir: Path | None = None) -> None:
        self.settings = settings or Settings.from_env()
        self.store = Store(
            self.settings.database_path,
            lease_seconds=self.settings.lease_seconds,
            single_owner=self.settings.single_owner,
        )
        self.tools = McpTools(self.settings, log_dir=log_dir)
        self.active: dict[str, ActiveRun] = {}
        self.accepting = True
        self._graph = None
        self._saver: NotifyingSaver | None = None
        self._saver_conn = None
        self._opening = asyncio.Lock()
        self._lease_keeper: asyncio.Task | None = None

    async def open(self) -> None:
        """Open the database (running recovery) and build the graph now, not on first use."""
        await self._graph_ready()

    # reading

    def list_conversations(self) -> list[Conversation]:
        """Every conversation, most recently updated first, with its latest run's outcome.

        Unbounded, as it always was (the lab's files are small); a client that may face
        thousands of conversations asks for them a page at a time with `conversation_page`.
        """
        self._recover_before_listing()
        return self.store.list_conversations()

    def conversation_page(self, limit: int = PAGE_SIZE, cursor: str | None = None) -> ConversationPage:
        """Up to `limit` conversations (1 to 1000), most recently updated first; for the next
        page pass back the page's `next_cursor` (None on the last page).

        Reads the app tables only, never a checkpoint. A malformed cursor or limit is refused
        with `BAD_REQUEST`, before anything is read.
        """
        limit = page_size(limit)
        after = None if cursor is None else decode_cursor(cursor)
        self._recover_before_listing()
        return self.store.conversation_page(limit, after)

    def list_runs(self, conversation: str | None = None) -> list[Run]:
        return self.store.list_runs(None if conversation is None else parse_conversation_id(conversation))

    async def conversation_summary(self, conversation: str) -> Conversation:
        """The conversation's row, once a dead owner's run on it is recovered; no thread read."""
        summary = self._existing(conversation)
        await self._graph_ready()  # the saver's lock, which app-table writes take
        if await self._write(self.store.recover, summary.id):
            summary = self._existing(summary.id)
        return summary

    async def get_conversation(self, conversation: str) -> ConversationDetail:
        """The conversation, its messages and whether it can be resumed. Reads only SQLite."""
        summary = self._existing(conversation)
        graph = await self._graph_ready()
        if await self._write(self.store.recover, summary.id):
            summary = self._existing(summary.id)
        state = await graph.aget_state(thread_config(summary.id))
        pending = self._pending_input(summary.id, state.metadata)
        messages = message_dtos(state.values.get("messages", [])) + pending_dtos(pending)
        busy = summary.id in self.active or summary.status == "running"
        return ConversationDetail(
            conversation=summary,
            messages=messages,
            next=tuple(state.next),
            resumable=bool(state.next or pending) and not busy,
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

    async def chat(
        self, message: object, conversation: object = None, idempotency: IdempotencyKey | None = None
    ) -> ActiveRun:
        """Start a run with a new user message, in a new conversation unless one is given.

        With `idempotency`, its key is written with the run; a key that started a run already
        refuses this one with `IDEMPOTENCY_KEY_REUSED` (`store.keyed_run` says which)."""
        self._check_accepting()
        text = parse_message(message)
        if conversation is None:
            conversation_id, new = str(uuid.uuid4()), True
        else:
            conversation_id, new = self._existing(conversation).id, False
        self._check_idle(conversation_id)
        check_config(self.settings)  # a bad mcp.json or system.md is refused with nothing written
        await self._graph_ready()
        # A message accepted earlier that never reached the thread goes first: nothing is dropped.
        carried = [] if new else await self._carried_input(conversation_id)
        messages = [*carried, {"id": str(uuid.uuid4()), "content": text}]
        return await self._launch(conversation_id, messages, resume=False, title=text if new else None,
                                  idempotency=idempotency)

    async def resume(self, conversation: object, idempotency: IdempotencyKey | None = None) -> ActiveRun:
        """Start a run that continues the thread from its latest checkpoint (`idempotency` as in `chat`)."""
        self._check_accepting()
        conversation_id = self._existing(conversation).id
        self._check_idle(conversation_id)
        check_config(self.settings)
        state = await (await self._graph_ready()).aget_state(thread_config(conversation_id))
        pending = self._pending_input(conversation_id, state.metadata)
        if not state.next and not pending:
            raise SophosError(errors.RUN_NOT_RESUMABLE, "Nothing to resume: the last run finished")
        return await self._launch(conversation_id, pending, resume=True, idempotency=idempotency)

    async def cancel(self, conversation: object) -> Event:
        """Stop the conversation's active run now, mid-step, and record it `cancelled` /
        `CANCELLED` ("Cancelled by user"); the run's final event.

        The request is written to the run's row first (`cancel_requested_at`), under the lock
        the outcome is written under, and only then is the run stopped: the step in flight is
        abandoned (the model's stream closed, a tool call left unanswered) and, not finished, is
        not saved; every step finished before it stays saved, so the conversation resumes from
        `next`. Whichever of the cancel and the run's own outcome reaches the database first is
        the outcome: a run already recorded answers with its final event (`end` if it
        completed). Refused with `RUN_NOT_ACTIVE` when this process runs nothing there.
        """
        conversation_id = self._existing(conversation).id
        run = self.active.get(conversation_id)
        if run is None:
            latest = self.store.latest_run(conversation_id)
            where = (" (its latest run is running in another process: cancel it there)"
                     if latest is not None and latest.status == "running" else "")
            raise SophosError(errors.RUN_NOT_ACTIVE, f"No run is active on conversation {conversation_id}{where}.")
        if not run.cancel_requested:
            def request() -> bool:
                # Under the lock: the outcome is either written already or will see the request.
                run.cancel_requested = not run.recorded and self.store.request_cancel(run.id)
                return run.cancel_requested

            if await self._write(request):
                # A run whose task has not reached the graph yet is stopped by the drain at its
                # first step boundary (cancelling a task that never started would skip its
                # record); one past the graph is recording, and records `cancelled`.
                run.control.request_drain("cancel")
                if run.in_graph and run.task is not None:
                    run.task.cancel()
        return await run.wait()

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

    async def drain(self, timeout: float | None = None) -> None:
        """Stop accepting runs; each active run stops at its next step boundary, or is cancelled
        after `timeout` (default `SHUTDOWN_TIMEOUT`). Each is recorded and publishes its final event."""
        self.request_drain()
        tasks = [run.task for run in self.active.values() if run.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self.settings.shutdown_timeout if timeout is None else timeout)
            for task in pending:
                task.cancel()  # recorded as interrupted / SHUTDOWN by _execute
            if pending:
                await asyncio.wait(pending)

    async def shutdown(self, timeout: float | None = None) -> None:
        """Drain active runs (up to `timeout`, default `SHUTDOWN_TIMEOUT`), record them, close."""
        await self.drain(timeout)
        await self.aclose()

    async def aclose(self) -> None:
        """Close MCP servers and database connections now, whatever is running."""
        if self._lease_keeper is not None:
            self._lease_keeper.cancel()
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

    def _recover_before_listing(self) -> None:
        if self._saver is None or not self._saver.lock.locked():
            # No saver on this loop is between its INSERT and its commit, and none can start one
            # during this synchronous write: it cannot wait on a transaction that needs this loop.
            self.store.recover()

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

        self.store.conn  # noqa: B018 - the first open runs migrations and recovery
        conn = await aiosqlite.connect(self.settings.database_path)
        await conn.execute("PRAGMA busy_timeout = 5000")
        saver = NotifyingSaver(conn, lock=shared_lock(self.settings.database_path))
        await saver.setup()
        if not self.settings.single_owner:
            await saver.fence(self.store.owner.id)
        model = chat_model(self.settings)  # once: building a client costs ~20 ms (its TLS context)
        parts = AgentParts(
            model=lambda: model,
            tools=self.tools.get,
            system_prompt=lambda: read_system_prompt(self.settings),
        )
        self._saver_conn, self._saver, self._graph = conn, saver, build_graph(parts, saver, settings=self.settings)

    async def _write(self, write: Any, *args: Any) -> Any:
        """Run an app-table write on the loop, outside any transaction of the saver.

        The saver holds its lock from its INSERT to its commit, and needs the loop in between;
        a synchronous write that waited on SQLite's lock meanwhile would block that very loop.
        """
        async with self._saver.lock:
            return write(*args)

    async def _carried_input(self, conversation_id: str) -> list[dict[str, str]]:
        """`_pending_input` for a new message. The common case (the last run completed, so its
        input is in the thread) reads no checkpoint; otherwise only the latest checkpoint's
        metadata is read, not the thread's messages (which would be rebuilt from its writes)."""
        latest = self.store.latest_run(conversation_id)
        if latest is None or not latest.input or latest.status == "completed":
            return []
        saved = await self._saver.aget_tuple(thread_config(conversation_id))
        return self._pending_input(conversation_id, saved.metadata if saved else None)

    def _pending_input(self, conversation_id: str, metadata: dict[str, Any] | None) -> list[dict[str, str]]:
        """The messages of the latest run if they never reached the thread, else [].

        `metadata` is that of the thread's latest checkpoint (None when there is none)."""
        latest = self.store.latest_run(conversation_id)
        if latest is None:
            return []
        return unapplied_input(latest.id, latest.input, (metadata or {}).get("run_id"))

    async def _launch(
        self, conversation_id: str, messages: list[dict[str, str]], resume: bool, title: str | None = None,
        idempotency: IdempotencyKey | None = None,
    ) -> ActiveRun:
        run = ActiveRun(id=str(uuid.uuid4()), conversation=conversation_id, resume=resume,
                        keep=self.settings.event_buffer)

        def start() -> None:
            self._check_accepting()  # again, under the lock: a shutdown may have begun meanwhile
            self.store.start_run(run.id, conversation_id, messages, title, idempotency)
            self.active[conversation_id] = run

        await self._write(start)
        self._keep_lease()
        run.publish("started", {"conversation": conversation_id, "run": run.id, "resume": resume})
        graph_input = {"messages": [HumanMessage(m["content"], id=m["id"]) for m in messages]} if messages else None
        run.task = asyncio.create_task(self._execute(run, self._graph, graph_input))
        return run

    def _keep_lease(self) -> None:
        if self.settings.single_owner or (self._lease_keeper is not None and not self._lease_keeper.done()):
            return
        self._lease_keeper = asyncio.create_task(self._renew_lease())

    async def _renew_lease(self) -> None:
        """While this process has runs, renew its lease; a run taken over stops at its next step."""
        def renew() -> list[ActiveRun]:
            # Under the lock, so a run is either recorded already or still ours to vouch for.
            runs = [run for run in self.active.values() if not run.recorded]
            lost = self.store.renew_lease([run.id for run in runs])
            return [run for run in runs if run.id in lost]

        while self.active:
            await asyncio.sleep(self.settings.lease_seconds / 3)
            try:
                lost = await self._write(renew)
            except Exception:
                log.exception("could not renew the lease of %s", self.store.owner)
                continue
            for run in lost:
                if not run.lost:
                    run.lost = True
                    run.control.request_drain("ownership lost")

    async def _execute(self, run: ActiveRun, graph: Any, graph_input: Any) -> None:
        config = {
            **thread_config(run.conversation),
            "metadata": {"run_id": run.id},
            "recursion_limit": self.settings.recursion_limit,
        }
        translator = StreamTranslator(model_name=self.settings.ollama_model)
        gate = DurableGate(run.publish)
        self._saver.listeners[run.conversation] = lambda metadata: gate.saved(metadata.get("step", -1))

        def retrying(node: str, notice: dict[str, Any]) -> None:
            # Live, like a token: a retry is news about a step in flight, not a saved fact.
            step = translator.open_step(node)
            gate.offer("trace", {**step, "event": "retry", "data": notice}, None)

        watch = AttemptWatch(on_retry=retrying)
        ATTEMPT_WATCH.set(watch)  # this task's context, which the graph's tasks inherit
        status, error = "completed", None
        run.in_graph = True
        try:
            async for mode, chunk in graph.astream(
                graph_input, config, stream_mode=["messages", "debug"], durability="sync",
                control=run.control,
            ):
                for item in translator.feed(mode, chunk):
                    gate.offer(*item)
        except (GraphDrained, asyncio.CancelledError):
            # A drain stopped it at a step boundary, or a cancel mid-step: cancel() or a
            # shutdown whose time to drain ran out.
            status, error = "interrupted", (errors.SHUTDOWN, errors.SHUTDOWN_MESSAGE)
        except Exception as exc:
            status, error = "failed", classify_failure(exc, watch.gave_up, self.settings)
            run.lost = run.lost or is_fenced(exc)
        finally:
            run.in_graph = False
            self._saver.listeners.pop(run.conversation, None)
        for item in translator.finish():
            gate.offer(*item)
        # A completed run's last checkpoint is on the stream; after a failure, ask the saver what
        # was actually written.
        count = translator.message_count if status == "completed" else None
        try:
            if count is None:
                count = await self._message_count(graph, run.conversation)

            def record() -> bool:
                nonlocal status, error
                if run.cancel_requested:  # written before this, under the same lock: it wins
                    status, error = "cancelled", (errors.CANCELLED, errors.CANCELLED_MESSAGE)
                recorded = self.store.finish_run(run.id, status, count, *(error or (None, None)))
                run.recorded = True
                return recorded

            write = asyncio.ensure_future(self._write(record))
            try:
                recorded = await asyncio.shield(write)
            except asyncio.CancelledError:  # a late shutdown cancel: let the write under way finish
                recorded = await write
            if not recorded:  # the run is another process's now: its record stands, not ours
                run.lost = True
        except Exception as exc:
            # Not on disk, so not `end`: the row stays `running` until this process exits (then
            # the next open relabels it) or its lease runs out.
            log.exception("could not record the outcome of run %s", run.id)
            status, error = "failed", (errors.AGENT_FAILURE, f"The run's outcome could not be recorded: {exc}")
        gate.flush()
        if run.lost:
            error = (errors.OWNERSHIP_LOST, errors.OWNERSHIP_LOST_MESSAGE)
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

    # retention (see `retention`): only this SQLite file; the memory server's file is never touched

    async def delete_conversation(self, conversation: object, dry_run: bool = False) -> Removal:
        """Delete the conversation with its runs, checkpoints, writes and prune records, in one
        transaction; what went (with `dry_run`: what would go, read-only, nothing changed).

        Refused with `SESSION_IN_PROGRESS` while a live process runs it. A run whose process is
        gone (a crash) is recovered first, so a crashed conversation can be deleted.
        """
        conversation_id = parse_conversation_id(conversation)
        self._check_idle(conversation_id)
        path = self.settings.database_path
        # Read-only first: a refusal (unknown, running) writes nothing, not even an owner row.
        with retention.read_only(path) as conn:
            removal = retention.plan_delete(conn, conversation_id)
            retention.recoverable_runs(conn, conversation_id, self._retention_owner(), "delete")
        if dry_run:
            return replace(removal, dry_run=True)
        async with shared_lock(path):
            with self.store.transaction() as conn:
                return retention.delete_conversation(conn, conversation_id, self._retention_owner())

    async def prune_conversation(self, conversation: object, keep: int | None = None,
                                 dry_run: bool = False) -> Removal:
        """Delete the thread's older checkpoints and their writes, keeping its state exactly.

        Kept: the newest `keep` checkpoints of the thread (default: those of the run that wrote
        the latest one) and their writes; the oldest kept one is given the whole message list,
        so the thread reads, resumes and takes new messages as before. Runs are all kept. Each
        prune is recorded (`prunes`) and shown by the checkpoint-history view. Refused while a
        live process runs the conversation; `dry_run` says what would go and changes nothing.
        """
        conversation_id = parse_conversation_id(conversation)
        keep = retention.parse_keep(keep)
        self._check_idle(conversation_id)
        path = self.settings.database_path
        with retention.read_only(path) as conn:
            retention.require_conversation(conn, conversation_id)
            retention.recoverable_runs(conn, conversation_id, self._retention_owner(), "prune")
            if dry_run:
                return replace(retention.plan_prune(conn, conversation_id, keep).removal, dry_run=True)
        async with shared_lock(path):
            with self.store.transaction() as conn:
                return retention.prune_conversation(conn, path, conversation_id, keep, self._retention_owner())

    async def vacuum(self) -> Vacuum:
        """Give the space of deleted rows back to the file system (`VACUUM`, then the WAL folded
        back into the file); the file's size before and after. Refused while a run is running."""
        self._require_file()
        async with shared_lock(self.settings.database_path):
            return retention.vacuum(self.store.conn, self.settings.database_path, self._retention_owner())

    def _require_file(self) -> None:
        """Retention on a file that does not exist is refused, and does not create it."""
        if not self.store.is_open and not self.settings.database_path.exists():
            raise SophosError(errors.NOT_FOUND, f"No database at {self.settings.database_path}")

    def _retention_owner(self) -> Owner | None:
        """Who judges whether a run's owner is gone: this store (a fresh identity before it is
        open); None under the original's single-owner rule, where every `running` run is live."""
        if self.settings.single_owner:
            return None
        return self.store.owner or Owner.here()

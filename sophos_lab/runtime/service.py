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
import contextlib
import json
import logging
import re
import shutil
import time
import uuid
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

from collections.abc import Callable, Mapping

from langchain_core.messages import HumanMessage
from langgraph.errors import GraphDrained
from langgraph.runtime import RunControl
from langgraph.types import Command

from . import errors, retention, users
from .agent import (
    AGENT_NODES, APPROVE, ATTEMPT_WATCH, CARRIED_DECISIONS, REJECT, AgentParts, AttemptWatch, build_graph, chat_model, check_config, classify_failure,
    read_system_prompt,
)
from .counting import shown_count
from .checkpointer import DurableWrite, NotifyingSaver, WriteObserver, is_fenced
from .errors import SophosError
from .events import DurableGate, Event, StreamTranslator
from .export import checkpoint_jsonl, markdown_transcript
from .messages import message_dtos, pending_dtos
from .ownership import Owner
from .progress import is_resumable, unfolded, work_left
from .retention import Removal, Vacuum
from .settings import Settings
from .storage import open_storage
from .storage.models import (
    PAGE_SIZE, Conversation, ConversationPage, Gate, IdempotencyKey, KeyedRun, Run, decode_cursor, page_size, unapplied_input,
    utc_now,
)
from .tools import McpTools, approval_rule, mcp_servers, user_memory_path

log = logging.getLogger(__name__)

_KEY = re.compile(r"[\x21-\x7e]{1,255}")
"""An idempotency key: 1 to 255 visible ASCII characters (as the HTTP header allows)."""
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
    return storable(value, "The message", "Nothing was stored.")


def parse_id(value: object, what: str) -> str:
    """A gate's or a tool call's id (`what` names which): a non-empty string that UTF-8 can
    encode, as every id stored in the database is; anything else can name nothing there."""
    if not isinstance(value, str) or not value or "\x00" in value:
        raise SophosError(errors.BAD_REQUEST, (
            f"{what} {value!r} is not a non-empty string without NUL characters. Nothing was decided."))
    return storable(value, what, "Nothing was decided.")


def storable(text: str, what: str, outcome: str) -> str:
    """`text` if UTF-8 can encode it (SQLite holds UTF-8), else a `BAD_REQUEST`: a lone surrogate
    (`"\\ud800"`) has no UTF-8 form, and storing it would alter it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise SophosError(
            errors.BAD_REQUEST,
            f"{what} is not valid Unicode: a lone surrogate {text[error.start]!r} at position {error.start}. {outcome}",
        ) from None
    return text


def parse_decisions(value: object) -> dict[str, dict[str, Any]]:
    """Decisions on a gate's tool calls: `{tool_call_id: "approve" | "reject" | {"decision",
    "reason"?, "args"?}}`. Returns them as `{id: {"decision", "reason"?, "args"?}}`; anything
    else is a `BAD_REQUEST` that names what is wrong. (`args`, if given, must be the call's
    arguments exactly: see `check_decisions`.)"""
    def bad(why: str) -> SophosError:
        return SophosError(errors.BAD_REQUEST, f"Invalid decisions: {why}. Nothing was decided.")

    if not isinstance(value, Mapping) or not value:
        raise bad('give a mapping of tool call ids to "approve" or "reject" (or {"decision", "reason"})')
    decisions = {}
    for call_id, decision in value.items():
        call_id = parse_id(call_id, "The tool call id")
        if isinstance(decision, str):
            decision = {"decision": decision}
        if not isinstance(decision, Mapping):
            raise bad(f"the decision for {call_id!r} is neither a string nor a mapping")
        unknown = set(decision) - {"decision", "reason", "args"}
        if unknown:
            raise bad(f"the decision for {call_id!r} has unknown keys {sorted(map(str, unknown))}")
        if decision.get("decision") not in (APPROVE, REJECT):
            raise bad(f'the decision for {call_id!r} is {decision.get("decision")!r}, not "approve" or "reject"')
        out = {"decision": decision["decision"]}
        if decision.get("reason") is not None:
            out["reason"] = parse_message(decision["reason"]) if isinstance(decision["reason"], str) else None
            if out["reason"] is None:
                raise bad(f"the reason for {call_id!r} is not text")
        if "args" in decision:
            if not isinstance(decision["args"], Mapping):
                raise bad(f"the args for {call_id!r} are not a mapping")
            out["args"] = dict(decision["args"])
        decisions[call_id] = out
    return decisions


def check_decisions(gate: Gate, decisions: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The decisions as they are recorded (without `args`), if they fit the gate: one for each
    of its calls, none for another, and `args`, where given, the call's arguments exactly (the
    person approved what they saw). Otherwise `APPROVAL_MISMATCH`, and nothing is decided."""
    calls = {call["id"]: call for call in gate.calls}
    unknown = [call_id for call_id in decisions if call_id not in calls]
    missing = [call_id for call_id in calls if call_id not in decisions]
    if unknown or missing:
        held = ", ".join(f"{call['id']} ({call['name']})" for call in gate.calls)
        raise SophosError(errors.APPROVAL_MISMATCH, (
            f"The gate holds the tool calls {held}: decide on each of them, and on no other"
            + (f"; not held here: {', '.join(unknown)}" if unknown else "")
            + (f"; no decision for: {', '.join(missing)}" if missing else "") + ". Nothing was decided."))
    for call_id, decision in decisions.items():
        if "args" in decision and decision["args"] != calls[call_id]["args"]:
            raise SophosError(errors.APPROVAL_MISMATCH, (
                f"The arguments of tool call {call_id} are {calls[call_id]['args']!r}, not "
                f"{decision['args']!r}: look at the call again before deciding. Nothing was decided."))
    return {call_id: {k: v for k, v in decision.items() if k != "args"} for call_id, decision in decisions.items()}


def every_call(gate: Gate, decision: str, reason: str | None = None) -> dict[str, dict[str, Any]]:
    """The same decision for each of the gate's calls (e.g. approve them all)."""
    return {call["id"]: {"decision": decision, **({"reason": reason} if reason else {})} for call in gate.calls}


def canonical_request(resume: bool, message: object, conversation: str | None) -> str:
    """What a request asks for, as a repeat with its idempotency key must ask it again (a
    resume has no message)."""
    asked = {"resume": True, "conversation": conversation} if resume else {"message": message, "conversation": conversation}
    return json.dumps(asked, sort_keys=True, ensure_ascii=True)


def thread_config(conversation_id: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": conversation_id}}


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
    replayed: bool = False
    """Not started by this call: the run a repeated request (idempotency key, approval) started
    first; it may have finished long ago, and then holds its `started` and final events only."""
    sink: Callable[[str, str, Event], None] | None = None
    """A worker's: given each event as it is published, to write it where every server reads it."""
    began: float = field(default_factory=time.monotonic)
    """When this process took the run on."""
    overdue: bool = False
    """Stopped for running longer than its steps can take (`AgentService.overdue_seconds`)."""
    _signal: asyncio.Event = field(default_factory=asyncio.Event)

    def publish(self, name: str, data: Any) -> Event:
        event = Event(self.last_id + 1, name, data)
        if self.sink is not None:
            self.sink(self.id, self.conversation, event)
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
        self.store = open_storage(self.settings)
        """The application tables (`storage.rules.Storage`), awaited: no call waits on the loop."""
        self.tools = McpTools(self.settings, log_dir=log_dir, idle_seconds=self.settings.user_tools_idle_seconds)
        self.active: dict[str, ActiveRun] = {}
        self.accepting = True
        self._graph = None
        self._saver: NotifyingSaver | None = None
        self._saver_conn = None
        self._opening = asyncio.Lock()
        self._writing = asyncio.Lock()
        """Held by each write of a run's life (`_write`) and by the saver's writes, so that this
        process's own decisions about a run (its start, a cancel, its outcome, the lease) and
        its checkpoints are made one after the other: a cancel recorded between a step's writes
        and its checkpoint stops the run before that checkpoint begins."""
        self._keys: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self._lease_keeper: asyncio.Task | None = None
        self._unrecorded: dict[str, str] = {}
        """run id → conversation: this process's runs whose outcome it could not write (a full
        disk). Their rows say `running` under a live owner, which recovery leaves alone: they are
        relabelled `interrupted` here, as a crash's are, once the disk has room again (at the
        conversation's next start or look, or the lease keeper's next round)."""
        self._strays_possible = False
        """A write of a run's life failed (a claim, a start, an outcome): a run may be `running`
        under this owner with no task working on it. The lease keeper looks until none is."""
        self._feed = None
        """PostgreSQL with workers: the `LISTEN` connection that wakes followers of remote runs."""
        self.at_point: Callable[[str], None] | None = None
        """Called by name just before the database calls of a run's life that a fault may hit:
        `claimed` (a worker's claim committed, nothing read yet), `owner`, `budget` and `outcome`.
        Fault tests stop the database there (`SOPHOS_LAB_STOP_AT` stops a worker itself)."""
        self.on_write: WriteObserver | None = None
        """Called right after each commit a run makes, in order, before any event tells of it:
        the run's row, each task's pending writes, each checkpoint, the outcome (see
        `DurableWrite`). Crash tests stop the process there; a lesson can print them."""

    async def open(self) -> None:
        """Open the database (running recovery) and build the graph now, not on first use."""
        await self._graph_ready()

    # reading

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
        if conversation is None:
            if users.acting_user.get() is not None:
                raise SophosError(errors.BAD_REQUEST, "A user lists the runs of one conversation of theirs at a time.")
            return await self.store.list_runs(None)
        return await self.store.list_runs(await self._owned(conversation))

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

    # running

    async def chat(
        self, message: object, conversation: object = None, idempotency_key: str | IdempotencyKey | None = None,
    ) -> ActiveRun:
        """Start a run with a new user message, in a new conversation unless one is given.

        With `idempotency_key`, the key is written with the run, in its transaction. The same
        key again, from any process and after any restart, starts nothing: it returns the run
        the key started (`replayed=True`; still running here, or holding its recorded outcome),
        if the request is the same (message and conversation), and is refused with
        `IDEMPOTENCY_KEY_REUSED` otherwise."""
        text = parse_message(message)
        conversation_id = None if conversation is None else parse_conversation_id(conversation)
        keyed = self._keyed(idempotency_key, canonical_request(False, text, conversation_id))
        if keyed is not None and (first := await self.first_run_of(keyed)) is not None:
            return first
        try:
            return await self._chat(text, conversation_id, keyed)
        except SophosError:
            # A request with the same key may have started its run while this one was checked.
            if keyed is not None and (first := await self.first_run_of(keyed)) is not None:
                return first
            raise

    async def _chat(self, text: str, conversation_id: str | None, keyed: IdempotencyKey | None) -> ActiveRun:
        self._check_accepting()
        if conversation_id is None:
            conversation_id, new = str(uuid.uuid4()), True
        else:
            conversation_id, new = (await self._existing(conversation_id)).id, False
        self._check_idle(conversation_id)
        if not new:
            await self._check_not_waiting(conversation_id)
        check_config(self.settings)  # a bad mcp.json or system.md is refused with nothing written
        await self._graph_ready()
        # A message accepted earlier that never reached the thread goes first: nothing is dropped.
        carried = [] if new else await self._carried_input(conversation_id)
        messages = [*carried, {"id": str(uuid.uuid4()), "content": text}]
        return await self._launch(conversation_id, messages, resume=False, title=text if new else None,
                                  idempotency=keyed)

    async def first_run_of(self, keyed: IdempotencyKey) -> ActiveRun | None:
        """The run an idempotency key started (None if it started none), refused with
        `IDEMPOTENCY_KEY_REUSED` if that was for another request."""
        first = await self.keyed_run(keyed)
        return None if first is None else await self._run_as_started(first.run_id)

    async def keyed_run(self, keyed: IdempotencyKey) -> KeyedRun | None:
        """The row of the run an idempotency key started (None if none), refused with
        `IDEMPOTENCY_KEY_REUSED` if that was for another request."""
        first = await self.store.keyed_run(keyed.key)
        if first is not None and first.request != keyed.request:
            raise SophosError(errors.IDEMPOTENCY_KEY_REUSED, (
                f"The idempotency key {keyed.key!r} started run {first.run_id} with a different request; "
                "use a new key for a new request."))
        return first

    @contextlib.asynccontextmanager
    async def requests_keyed(self, key: str) -> AsyncIterator[None]:
        """Held by a request with the idempotency key `key` while it looks for the key's run and
        starts one: a repeat that comes meanwhile finds the first's run, as a repeat."""
        lock = self._keys.get(key)
        if lock is None:
            lock = self._keys[key] = asyncio.Lock()
        async with lock:
            yield

    def _keyed(self, key: str | IdempotencyKey | None, request: str) -> IdempotencyKey | None:
        if key is None or isinstance(key, IdempotencyKey):
            return key
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise SophosError(errors.BAD_REQUEST, "An idempotency key must be 1 to 255 visible ASCII characters")
        return IdempotencyKey(key, request)

    async def resume(self, conversation: object, idempotency_key: str | IdempotencyKey | None = None) -> ActiveRun:
        """Start a run that continues the thread from its latest checkpoint (`idempotency_key`
        as in `chat`).

        Refused with `RUN_WAITING` while the run waits at an approval gate (approve or reject
        instead). A gate decided by a run that stopped before it carried the decision on (a
        crash, a shutdown) is carried on now, with the recorded decision: nobody is asked again.
        """
        conversation_id = parse_conversation_id(conversation)
        keyed = self._keyed(idempotency_key, canonical_request(True, None, conversation_id))
        if keyed is not None and (first := await self.first_run_of(keyed)) is not None:
            return first
        try:
            return await self._resume(conversation_id, keyed)
        except SophosError:
            if keyed is not None and (first := await self.first_run_of(keyed)) is not None:
                return first
            raise

    async def _resume(self, conversation_id: str, keyed: IdempotencyKey | None) -> ActiveRun:
        self._check_accepting()
        conversation_id = (await self._existing(conversation_id)).id
        self._check_idle(conversation_id)
        check_config(self.settings)
        graph = await self._graph_ready()
        await self._recover(conversation_id)
        await self._check_not_waiting(conversation_id)
        state = await graph.aget_state(thread_config(conversation_id))
        pending = await self._pending_input(conversation_id, state.metadata)
        if not work_left(state) and not pending:
            raise SophosError(errors.RUN_NOT_RESUMABLE, "Nothing to resume: the last run finished")
        decided = await self._decided_gate(conversation_id, state.interrupts)
        command = None if decided is None else Command(resume={decided.id: decided.decisions})
        return await self._launch(conversation_id, pending, resume=True, idempotency=keyed, command=command)

    async def approve(self, conversation: object, decisions: object = None, gate: str | None = None) -> ActiveRun:
        """Decide on the tool calls a waiting run holds at its gate, and carry on: a new run on
        the thread, which runs the approved calls and gives the model, for each rejected one,
        a tool result that says so, with the reason.

        `decisions` maps each pending call's id to `"approve"`, `"reject"` or `{"decision",
        "reason"?, "args"?}` (see `parse_decisions`); None approves every call of the gate
        (`reject()` rejects every one): of `gate` (its id, as the `waiting` event and
        `pending_approval` give it) if given, else of the gate waiting now. Name the gate when
        you may send the same approval again (a retry): without it, a retry after the run has
        stopped at a later gate would approve that one.
        The decisions are written, in the transaction that starts the run, before the graph
        resumes: a crash after that asks nobody again (`resume()` carries them on). The same
        decisions again are a no-op that returns the run they started (`replayed=True`);
        different ones are refused (`GATE_DECIDED`). Decisions that do not fit the gate are
        refused (`APPROVAL_MISMATCH`), and nothing waiting is `NO_APPROVAL_PENDING`.
        """
        conversation_id = (await self._existing(conversation)).id
        asked = None if decisions is None else parse_decisions(decisions)
        gate = None if gate is None else parse_id(gate, "The gate id")
        await self._graph_ready()
        await self._recover(conversation_id)
        pending = await self.pending_approval(conversation_id)
        target = await self._target_gate(conversation_id, pending, gate, asked)
        if asked is None:
            asked = every_call(target, APPROVE)
        if target.decided or pending is None or target.id != pending.id:
            return await self._repeated_approval(target, asked)
        recorded = check_decisions(target, asked)
        self._check_accepting()
        self._check_idle(conversation_id)
        check_config(self.settings)
        try:
            return await self._launch(conversation_id, [], resume=True, command=Command(resume={target.id: recorded}),
                                      decision=(target, recorded))
        except SophosError as error:
            if error.code != errors.GATE_DECIDED:
                raise
            # Another process decided meanwhile.
            return await self._repeated_approval(await self.store.gate(conversation_id, target.id), asked)

    async def reject(self, conversation: object, reason: str | None = None, gate: str | None = None) -> ActiveRun:
        """Reject every call of the gate (`gate`, else the one waiting now), with `reason` for
        the model (its tool results say the user rejected the call, and why); as `approve()`."""
        conversation_id = (await self._existing(conversation)).id
        if reason is not None and (not isinstance(reason, str) or not reason.strip()):
            raise SophosError(errors.BAD_REQUEST, f"A reason must be text that is not blank, not {reason!r}. Nothing was decided.")
        if reason is not None:
            parse_message(reason)  # text UTF-8 can store exactly
        gate = None if gate is None else parse_id(gate, "The gate id")
        target = await self._target_gate(conversation_id, await self.pending_approval(conversation_id), gate, None)
        return await self.approve(conversation_id, every_call(target, REJECT, reason), gate=target.id)

    async def _target_gate(self, conversation_id: str, pending: Gate | None, gate: str | None,
                           asked: dict[str, dict] | None) -> Gate:
        """The gate an approval is about: the one named, else the decided one whose calls the
        decisions name (a retry, while a later gate may wait), else the one waiting now, else
        (nothing waits, no decisions given) the latest one, decided: a repeat."""
        if gate is not None:
            named = await self.store.gate(conversation_id, gate)
            if named is None:
                raise SophosError(errors.NO_APPROVAL_PENDING, f"No gate {gate!r} on conversation {conversation_id}.")
            return named
        gates = list(reversed(await self.store.gates(conversation_id)))
        if asked is not None:
            for earlier in gates:
                if earlier.decided and set(asked) <= {call["id"] for call in earlier.calls}:
                    return earlier
        if pending is not None:
            return pending
        if asked is None and gates and gates[0].decided:
            return gates[0]  # nothing waits: a repeat of the latest decision
        raise SophosError(errors.NO_APPROVAL_PENDING, f"No run waits for approval on conversation {conversation_id}.")

    async def _repeated_approval(self, gate: Gate, asked: dict[str, dict[str, Any]]) -> ActiveRun:
        """An approval of a gate that is not the one waiting: the run its decision started, if
        the decisions are the same; `GATE_DECIDED` if they differ; `NO_APPROVAL_PENDING` if the
        gate was never decided (its run was superseded: nothing waits there any more)."""
        if not gate.decided:
            raise SophosError(errors.NO_APPROVAL_PENDING, (
                f"The gate {gate.id} of run {gate.run_id} no longer waits, and was never decided."))
        if check_decisions(gate, asked) != gate.decisions:
            raise SophosError(errors.GATE_DECIDED, (
                f"The gate of run {gate.run_id} was decided already, differently: "
                f"{json.dumps(gate.decisions, ensure_ascii=False)} at {gate.decided_at}. A decision "
                "cannot be changed; the run it started carried it on."))
        if gate.decided_run_id is None:
            raise SophosError(errors.NO_APPROVAL_PENDING, "The run that carried this decision is gone.")
        return await self._run_as_started(gate.decided_run_id)

    async def _check_not_waiting(self, conversation_id: str) -> None:
        gate = await self.pending_approval(conversation_id)
        if gate is not None:
            names = ", ".join(call["name"] for call in gate.calls)
            raise SophosError(errors.RUN_WAITING, (
                f"The run waits for approval of {len(gate.calls)} tool call(s) ({names}): approve or "
                "reject them (approve()) to carry on."))

    async def _decided_gate(self, conversation_id: str, interrupts: Any) -> Gate | None:
        """The decided gate among the thread's pending interrupts, if any."""
        for pending in interrupts or ():
            gate = await self.store.gate(conversation_id, pending.id)
            if gate is not None and gate.decided:
                return gate
        return None

    async def _run_as_started(self, run_id: str) -> ActiveRun:
        """A run started earlier, to follow like a new one: itself if it is active here, else
        its `started` and final events as recorded."""
        row = await self.store.get_run(run_id)
        active = self.active.get(row.conversation_id) if row else None
        if active is not None and active.id == run_id:
            return active
        if row is None:
            raise SophosError(errors.NOT_FOUND, f"Run Not Found: {run_id}")
        if row.status == "running":
            await self.store.recover(row.conversation_id)  # its owner may be gone
            row = await self.store.get_run(run_id)
        if self.settings.on_workers and (await self.store.event_span(run_id))[1]:
            return await self._remote(row.id, row.conversation_id, row.input is None, replayed=True)
        if row.status == "running":
            raise SophosError(errors.SESSION_IN_PROGRESS, (
                f"Run {run_id} is running in another process: follow it there."))
        run = ActiveRun(id=row.id, conversation=row.conversation_id, resume=row.input is None, replayed=True)
        run.publish("started", {"conversation": row.conversation_id, "run": row.id, "resume": run.resume})
        if row.error_code:
            run.publish("chat-error", {"code": row.error_code, "message": row.error_message,
                                       "conversation": row.conversation_id, "run": row.id})
        else:
            stopped_at = await self.store.run_gate(row.id) if row.status == "waiting" else None
            run.publish("end", self._end_data(row.conversation_id, row.id, row.status,
                                              stopped_at if stopped_at and not stopped_at.decided else None))
        return run

    @staticmethod
    def _end_data(conversation_id: str, run_id: str, status: str, gate: Gate | None) -> dict[str, Any]:
        data = {"conversation": conversation_id, "run": run_id, "status": status}
        if gate is not None:
            data["approval"] = {"gate": gate.id, "calls": gate.calls}
        return data

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
        conversation_id = parse_conversation_id(conversation)
        run = self.active.get(conversation_id) if users.acting_user.get() is None else None
        if run is None:  # (a run of this process is stopped at once: nothing is read first)
            conversation_id = (await self._existing(conversation_id)).id
            run = self.active.get(conversation_id)
        if run is None and self.settings.on_workers:
            latest = await self.store.latest_run(conversation_id)
            if latest is not None and latest.status in ("queued", "running") and (await self.store.event_span(latest.id))[1]:
                # A worker's run: recorded first (a queued one is cancelled at once), then its worker told.
                remote = await self._remote(latest.id, conversation_id, latest.input is None)
                await self.store.cancel_remote(latest.id)
                return await remote.wait()
        if run is None:
            latest = await self.store.latest_run(conversation_id)
            where = (" (its latest run is running in another process: cancel it there)"
                     if latest is not None and latest.status == "running" else "")
            raise SophosError(errors.RUN_NOT_ACTIVE, f"No run is active on conversation {conversation_id}{where}.")
        if not run.cancel_requested:
            async def request() -> bool:
                # Under the lock: the outcome is either written already or will see the request.
                run.cancel_requested = not run.recorded and await self.store.request_cancel(run.id)
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
        if self._feed is not None:
            await self._feed.aclose()
        conn, self._saver_conn, self._graph = self._saver_conn, None, None
        if conn is not None:
            await conn.close()
        await self.store.aclose()

    # internals

    async def _existing(self, conversation: object) -> Conversation:
        conversation_id = parse_conversation_id(conversation)
        summary = await self.store.get_conversation(conversation_id)
        if summary is None:
            raise SophosError(errors.NOT_FOUND, f"Conversation Not Found: {conversation_id}")
        return summary

    async def _owned(self, conversation: object) -> str:
        """The id, once the acting user is known to own it (`NOT_FOUND` otherwise); with no user
        acting, only parsed: the retention calls must not open a file before their own checks."""
        if users.acting_user.get() is None:
            return parse_conversation_id(conversation)
        return (await self._existing(conversation)).id

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
        await self.store.open()  # the first open runs migrations and recovery
        owner = None if self.settings.single_owner else self.store.owner.id
        if self.settings.database_url:
            from .storage import postgres

            conn, saver = await postgres.open_saver(self.settings.database_url, owner, self._writing)
        else:
            import aiosqlite

            conn = await aiosqlite.connect(self.settings.database_path)
            await conn.execute("PRAGMA busy_timeout = 5000")
            saver = NotifyingSaver(conn, lock=self._writing)
            await saver.setup()
            if owner is not None:
                await saver.fence(owner)
        saver.on_write = self._observe
        model = chat_model(self.settings)  # once: building a client costs ~20 ms (its TLS context)
        parts = AgentParts(
            model=lambda: model,
            tools=lambda: self.tools.get(users.run_owner.get()),
            system_prompt=lambda: read_system_prompt(self.settings),
            approvals=lambda: approval_rule(mcp_servers(self.settings)),
        )
        self._saver_conn, self._saver, self._graph = conn, saver, build_graph(parts, saver, settings=self.settings)

    async def _recover(self, conversation_id: str) -> int:
        """`store.recover` for the conversation, and this process's own runs there whose outcome
        could not be written (a full disk; left for a later look if the disk is full still)."""
        return await self._relabel_unrecorded(conversation_id, refuse=False) + await self.store.recover(conversation_id)

    async def _relabel_unrecorded(self, conversation_id: str, refuse: bool) -> int:
        stranded = [run_id for run_id, there in self._unrecorded.items() if there == conversation_id]
        if not stranded:
            return 0
        try:
            count = await self.store.relabel(stranded)
        except SophosError as error:
            if refuse or error.code != errors.STORAGE_FULL:
                raise
            return 0
        for run_id in stranded:
            del self._unrecorded[run_id]
        return count

    def _point(self, name: str) -> None:
        if self.at_point is not None:
            self.at_point(name)

    def _observe(self, write: DurableWrite) -> None:
        if self.on_write is not None:
            try:
                self.on_write(write)
            except Exception:  # an observer's failure is its own: the run goes on
                log.exception("the write observer failed on %s", write)

    async def _write(self, write: Callable[..., Any], *args: Any) -> Any:
        """Await a write of a run's life (`write(*args)`) holding `_writing`: this process's flags
        about its runs (`active`, `recorded`, `cancel_requested`) change with the rows they mirror."""
        async with self._writing:
            return await write(*args)

    async def _carried_input(self, conversation_id: str) -> list[dict[str, str]]:
        """`_pending_input` for a new message. The common case (the last run completed, so its
        input is in the thread) reads no checkpoint; otherwise the thread's latest state (live:
        a gate a carried decision has answered no longer holds it)."""
        latest = await self.store.latest_run(conversation_id)
        if latest is None or latest.status == "completed":
            return []
        state = await self._graph.aget_state(thread_config(conversation_id))
        if state.interrupts:  # live: not those a decision carried on has answered
            # The thread stopped at a gate that the latest run did not get past (it stopped
            # before recording it, or before carrying its decision on): a new message would
            # leave the held calls unanswered.
            raise SophosError(errors.RUN_WAITING, (
                "The thread stopped at an approval gate that its latest run did not get past: "
                "resume() to carry on (a recorded decision is carried on, else the gate is shown again)."))
        if unasked := self._unasked_calls(state):
            # The run stopped after the model asked for these and before its tools step saved
            # the gate: a new message would drop them with nobody asked, where a run stopped a
            # moment later (at its gate) refuses it. The same answer at either point.
            raise SophosError(errors.RUN_WAITING, (
                f"The thread's last turn holds {len(unasked)} tool call(s) that need approval "
                f"({', '.join(unasked)}), and its run stopped before it asked: resume() to reach "
                "the gate, then approve or reject them."))
        if not latest.input:
            return []
        return await self._pending_input(conversation_id, state.metadata)

    def _unasked_calls(self, state: Any) -> list[str]:
        """The tool calls needing approval that the thread's tools step, still to run, holds."""
        if not any(task.name == "tools" and task.result is None and not task.interrupts for task in state.tasks):
            return []
        messages = state.values.get("messages") or []
        needs_approval = approval_rule(mcp_servers(self.settings))
        return [call["name"] for call in getattr(messages[-1], "tool_calls", None) or []
                if needs_approval(call["name"])] if messages else []

    async def _pending_input(self, conversation_id: str, metadata: dict[str, Any] | None) -> list[dict[str, str]]:
        """The messages of the latest run if they never reached the thread, else [].

        `metadata` is that of the thread's latest checkpoint (None when there is none)."""
        latest = await self.store.latest_run(conversation_id)
        if latest is None:
            return []
        return unapplied_input(latest.id, latest.input, (metadata or {}).get("run_id"))

    async def _launch(
        self, conversation_id: str, messages: list[dict[str, str]], resume: bool, title: str | None = None,
        idempotency: IdempotencyKey | None = None, command: Command | None = None,
        decision: tuple[Gate, dict[str, dict]] | None = None,
    ) -> ActiveRun:
        """Write the run (with its messages, key and gate decision), then publish `started` and
        run the graph: with the messages, or `command` (a gate's decisions), or from `next`.
        With workers, queue it instead (the same row `queued`, and its `started` event): a
        worker claims it and works out the same input (`start_claimed`)."""
        if self.settings.on_workers:
            return await self._queue(conversation_id, messages, resume, title, idempotency, decision)
        run = ActiveRun(id=str(uuid.uuid4()), conversation=conversation_id, resume=resume,
                        keep=self.settings.event_buffer)

        async def start() -> None:
            self._check_accepting()  # again, under the lock: a shutdown may have begun meanwhile
            await self._relabel_unrecorded(conversation_id, refuse=True)
            try:
                await self.store.start_run(run.id, conversation_id, messages, title, idempotency, decision)
            except Exception as error:
                if errors.database_unavailable(error):  # its commit may have landed, the answer lost:
                    self._note_stray()  # a run of ours with no task
                raise
            self.active[conversation_id] = run
            self._observe(DurableWrite("run", conversation_id))

        await self._write(start)
        self._keep_lease()
        run.publish("started", {"conversation": conversation_id, "run": run.id, "resume": resume})
        graph_input = command
        if messages:
            graph_input = {"messages": [HumanMessage(m["content"], id=m["id"]) for m in messages]}
        # New input on a thread that has runs: a step they left unfolded is checkpointed first.
        fold = bool(messages) and title is None
        run.task = asyncio.create_task(self._execute(run, self._graph, graph_input, fold))
        return run

    async def _queue(self, conversation_id: str, messages: list[dict[str, str]], resume: bool, title: str | None,
                     idempotency: IdempotencyKey | None, decision: tuple[Gate, dict[str, dict]] | None) -> Any:
        run_id = str(uuid.uuid4())

        async def queue() -> None:
            self._check_accepting()
            await self.store.queue_run(run_id, conversation_id, messages, title, idempotency, decision, resume)
            self._observe(DurableWrite("run", conversation_id))

        await self._write(queue)
        return await self._remote(run_id, conversation_id, resume)

    async def _remote(self, run_id: str, conversation_id: str, resume: bool, replayed: bool = False) -> Any:
        """A worker's run, to follow from the events table (`queue.RemoteRun`)."""
        from .queue import EventFeed, RemoteRun

        if self._feed is None:
            self._feed = EventFeed(self.settings.database_url)
        dropped, last = await self.store.event_span(run_id)
        return RemoteRun(run_id, conversation_id, resume, self._feed, self._look, self.settings.lease_seconds / 3,
                         dropped=dropped, last_id=last, replayed=replayed)

    async def _look(self, run: Any) -> None:
        """No news of a worker's run for a while: if its worker is gone, relabel it (which writes
        its final event), or write the final event of an outcome it recorded and did not announce."""
        await self._recover(run.conversation)
        await self.store.close_orphaned_events(run.id)

    async def run_to_follow(self, conversation_id: str, after: int) -> Any:
        """With workers: the conversation's latest run to follow from the events table, if it is
        queued or running, or if the client has events of it (`after`) still kept; else None."""
        latest = await self.store.latest_run(conversation_id)
        if latest is None:
            return None
        dropped, last = await self.store.event_span(latest.id)
        if not last:
            return None  # no events kept
        finished = latest.status not in ("queued", "running")
        if finished and not 0 < after < last and (dropped == last or await self.store.final_event_kept(latest.id)):
            return None  # a finished run the client has every event of, or whose events a crash took
        # A finished run whose events are kept but not its final one: its worker has written the
        # outcome and not given the final event yet (persist, then notify). It is followed to
        # that event, or to the one a look writes for it if the worker died in between.
        return await self._remote(latest.id, conversation_id, latest.input is None)

    async def claim(self, sink: Callable[[str, str, Event], None]) -> ActiveRun | None:
        """As a worker: claim the next queued run and run it, with the input `resume()` would work
        out for it (the accepted messages if they never reached the thread, a recorded gate
        decision, else the thread's `next`); None when there is none to claim. Its events go to
        `sink`, numbered after those it gave already (`started`, written when it was queued).

        The claim and the run's place in `active` are one step under the lock, so the lease
        keeper never finds the run claimed and unattended; every database call after it is in
        the run's task, which records an outcome or gives the run up, whatever fails."""
        graph = await self._graph_ready()

        async def claim() -> tuple[ActiveRun, Run] | None:
            try:
                row = await self.store.claim_run()
            except Exception as error:
                if errors.database_unavailable(error):
                    self._note_stray()  # the claim may have committed with its answer lost
                raise
            if row is None:
                return None
            run = ActiveRun(id=row.id, conversation=row.conversation_id, resume=row.input is None,
                            keep=self.settings.event_buffer, sink=sink)
            self.active[row.conversation_id] = run
            return run, row

        claimed = await self._write(claim)
        if claimed is None:
            return None
        run, row = claimed
        self._keep_lease()
        run.task = asyncio.create_task(self._execute_claimed(run, row, graph))
        return run

    async def _execute_claimed(self, run: ActiveRun, row: Run, graph: Any) -> None:
        try:
            self._point("claimed")
            run.dropped = (await self.store.event_span(row.id))[1]  # ids go on after those it gave
            state = await graph.aget_state(thread_config(row.conversation_id))
            pending = await self._pending_input(row.conversation_id, state.metadata)
            graph_input = None
            if pending:
                graph_input = {"messages": [HumanMessage(m["content"], id=m["id"]) for m in pending]}
            elif (decided := await self._decided_gate(row.conversation_id, state.interrupts)) is not None:
                graph_input = Command(resume={decided.id: decided.decisions})
        except Exception:
            # Not started: given up now, as a crash's run would be (re-queued or relabelled, its
            # final event written), or, if even that fails, by the lease keeper once it can.
            log.warning("could not start claimed run %s; giving it up", row.id, exc_info=True)
            self.active.pop(row.conversation_id, None)
            self._note_stray()
            with contextlib.suppress(Exception):
                await self._write(self._give_up_strays)
            return
        await self._execute(run, graph, graph_input, fold=bool(pending))

    def cancel_here(self, run_id: str) -> None:
        """As a worker: another process recorded a cancel of this run (`queue.request_cancel`):
        stop it as `cancel()` stops a run of its own."""
        run = next((run for run in self.active.values() if run.id == run_id), None)
        if run is None or run.cancel_requested or run.recorded:
            return
        run.cancel_requested = True
        run.control.request_drain("cancel")
        if run.in_graph and run.task is not None:
            run.task.cancel()

    def _keep_lease(self) -> None:
        if self.settings.single_owner or (self._lease_keeper is not None and not self._lease_keeper.done()):
            return
        self._lease_keeper = asyncio.create_task(self._renew_lease())

    async def _renew_lease(self) -> None:
        """While this process has runs, renew its lease; a run taken over stops at its next step.
        Each round also gives up this owner's runs that no task works on (`_give_up_strays`) and
        stops a run that has run longer than its steps can take (`overdue_seconds`)."""
        async def renew() -> list[ActiveRun]:
            # Under the lock, so a run is either recorded already or still ours to vouch for.
            runs = [run for run in self.active.values() if not run.recorded]
            lost = await self.store.renew_lease([run.id for run in runs])
            return [run for run in runs if run.id in lost]

        while self.active or self._strays_possible:
            await asyncio.sleep(self.settings.lease_seconds / 3)
            try:
                lost = await self._write(renew)
            except Exception:
                log.warning("could not renew the lease of %s", self.store.owner, exc_info=True)
                continue
            for run in lost:
                if not run.lost:
                    run.lost = True
                    run.control.request_drain("ownership lost")
            if self._strays_possible:
                try:
                    await self._write(self._give_up_strays)
                except Exception:
                    log.warning("could not give up the runs no task works on; trying again", exc_info=True)
            self._stop_overdue()

    def _note_stray(self) -> None:
        """A write of a run's life failed: a run may now be ours with no task on it."""
        self._strays_possible = True
        self._keep_lease()

    async def _give_up_strays(self) -> int:
        """Give up the runs `running` under this owner that no task of this process works on: a
        claim or a start whose commit landed but whose answer was lost, a claimed run whose
        start failed, an outcome that could not be written. Re-queued or relabelled as a gone
        owner's are (`store.give_up`), so no conversation stays refused behind a live process.
        Under the lock: a run is in `active` from the write that makes it ours."""
        working = {run.id for run in self.active.values() if run.task is None or not run.task.done()}
        strays = [run_id for run_id in await self.store.owned_runs() if run_id not in working]
        given_up = await self.store.give_up(strays) if strays else 0
        for run_id in strays:
            self._unrecorded.pop(run_id, None)
        self._strays_possible = False
        if given_up:
            log.warning("gave up %d run(s) no task of this process works on: %s", given_up, ", ".join(strays))
        return given_up

    def overdue_seconds(self) -> float:
        """The longest a run can take: its step limit, each step at its time limit for each of
        its attempts (the model's and the tools' alternate), and a lease for the outcome."""
        step = (self.settings.model_timeout_seconds * self.settings.model_attempts
                + self.settings.tool_timeout_seconds * self.settings.tool_attempts) / 2
        return self.settings.recursion_limit * step + self.settings.lease_seconds

    def _stop_overdue(self) -> None:
        now = time.monotonic()
        for run in list(self.active.values()):
            if (run.task is not None and not run.task.done() and not run.overdue
                    and now - run.began > self.overdue_seconds()):
                log.warning("run %s has run longer than it can (%.0f s): stopping it", run.id, self.overdue_seconds())
                run.overdue = True
                run.task.cancel()

    async def _execute(self, run: ActiveRun, graph: Any, graph_input: Any, fold: bool = False) -> None:
        """The run's life after its row: the graph, the outcome, the final event. Whatever fails,
        the run leaves `active`, and a run left without a recorded outcome is given up by the
        lease keeper (`_give_up_strays`), never held by this live process for good."""
        try:
            await self._advance(run, graph, graph_input, fold)
        finally:
            if self.active.get(run.conversation) is run:
                del self.active[run.conversation]
            if not run.finished:
                self._note_stray()
                log.error("run %s stopped without its final event", run.id)
                run.publish("chat-error", {
                    "code": errors.AGENT_FAILURE, "conversation": run.conversation, "run": run.id,
                    "message": ("The run stopped before its outcome was recorded; it is relabelled "
                                "interrupted (resumable) as soon as the database can be written.")})

    async def _while_unavailable(self, attempt: Callable[[], Any], what: str) -> Any:
        """`await attempt()`, again and again while the database is unavailable (PostgreSQL
        restarting: `errors.database_unavailable`), waiting 0.1 s, then twice as long each time
        up to 2 s. Any other error is raised at once; so is a cancel (a shutdown)."""
        wait = 0.1
        while True:
            try:
                return await attempt()
            except Exception as error:
                if not errors.database_unavailable(error):
                    raise
                log.warning("the database is unavailable for %s (%s); trying again in %.1f s", what,
                            str(error).strip() or type(error).__name__, wait)
            await asyncio.sleep(wait)  # a backoff, not a barrier
            wait = min(wait * 2, 2.0)

    async def _recorded_already(self, run_id: str, status: str, error: tuple[str, str] | None) -> bool:
        """After an outcome write whose answer was lost (the connection cut at its commit), is
        this outcome the one the row holds? Then it was written, and the retry found it so."""
        row = await self.store.get_run(run_id)
        mine = self.store.owner is None or (row is not None and row.owner_id == self.store.owner.id)
        return row is not None and mine and (row.status, row.error_code) == (status, error[0] if error else None)

    async def _advance(self, run: ActiveRun, graph: Any, graph_input: Any, fold: bool) -> None:
        config = {
            **thread_config(run.conversation),
            "metadata": {"run_id": run.id},
            "recursion_limit": self.settings.recursion_limit,
        }
        if isinstance(graph_input, Command) and isinstance(graph_input.resume, dict):
            # The tools step holds every call it carries a decision for, whatever mcp.json says now.
            carried = {call_id: decision for decisions in graph_input.resume.values() for call_id, decision in decisions.items()}
            config["configurable"][CARRIED_DECISIONS] = carried
        translator = StreamTranslator(model_name=self.settings.ollama_model)
        gate = DurableGate(run.publish)
        self._saver.listeners[run.conversation] = lambda metadata: gate.saved(metadata.get("step", -1))

        def retrying(node: str, notice: dict[str, Any]) -> None:
            # Live, like a token: a retry is news about a step in flight, not a saved fact.
            step = translator.open_step(node)
            gate.offer("trace", {**step, "event": "retry", "data": notice}, None)

        watch = AttemptWatch(on_retry=retrying)
        ATTEMPT_WATCH.set(watch)  # this task's context, which the graph's tasks inherit
        status, error, budget = "completed", None, None
        run.in_graph = True
        try:
            # The conversation's owner's own MCP servers serve its tools (a memory of theirs only);
            # the owner comes from the row, never from the model.
            self._point("owner")
            owner = await users.owner_of(self.store, run.conversation)
            users.run_owner.set(owner)
            self._point("budget")
            budget = await users.step_budget(self.store, owner, self.settings.user_limits,
                                             self.settings.recursion_limit, utc_now())
            config["recursion_limit"] = budget.steps
            self.tools.hold(owner)
            asyncio.current_task().add_done_callback(lambda _: self.tools.release(owner))
            if fold:
                await self._fold(graph, run)
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
            if run.overdue:
                status, error = "failed", (errors.TIMEOUT, (
                    f"The run ran longer than its steps can take ({self.overdue_seconds():.0f} s) and was "
                    "stopped; every step it saved stands."))
        except Exception as exc:
            status, error = "failed", classify_failure(exc, watch.gave_up, self.settings)
            if error[0] == errors.DATABASE_UNAVAILABLE:
                log.warning("run %s stopped: the database is unavailable (%s)", run.id, exc)
            if error[0] == errors.RECURSION_LIMIT and budget is not None and budget.setting:
                error = errors.STEP_BUDGET_SPENT, budget.message
            run.lost = run.lost or is_fenced(exc)
        finally:
            run.in_graph = False
            self._saver.listeners.pop(run.conversation, None)
        steps = translator.steps_entered
        for item in translator.finish():
            gate.offer(*item)
        stopped_at = None  # the approval gate the run stopped at
        if status == "completed" and translator.interrupts:
            status, stopped_at = "waiting", self._gate_of(run, translator.interrupts[0])
        # A completed run's last checkpoint is on the stream; after a failure, ask the saver what
        # was actually written.
        count = translator.message_count if status in ("completed", "waiting") else None
        attempts = 0

        async def record() -> bool:
            nonlocal status, error, stopped_at
            if run.cancel_requested:  # written before this, under the same lock: it wins
                status, error, stopped_at = "cancelled", (errors.CANCELLED, errors.CANCELLED_MESSAGE), None
            recorded = await self.store.finish_run(run.id, status, count, *(error or (None, None)), gate=stopped_at,
                                                   steps=steps)
            if not recorded and not run.cancel_requested and await self.store.cancel_requested(run.id):
                # Another process recorded a cancel of this run before this outcome.
                run.cancel_requested = True
                status, error, stopped_at = "cancelled", (errors.CANCELLED, errors.CANCELLED_MESSAGE), None
                recorded = await self.store.finish_run(run.id, status, count, *error, gate=None, steps=steps)
            if not recorded and attempts > 1:
                recorded = await self._recorded_already(run.id, status, error)
            run.recorded = True
            if recorded:
                self._observe(DurableWrite("outcome", run.conversation, status=status))
            return recorded

        async def record_outcome() -> bool:
            nonlocal count, attempts
            attempts += 1
            if attempts == 1:
                self._point("outcome")
            if count is None:  # after a failure, ask the saver what was actually written
                count = await self._message_count(graph, run.conversation)
            write = asyncio.ensure_future(self._write(record))
            try:
                return await asyncio.shield(write)
            except asyncio.CancelledError:  # a late shutdown cancel: let the write under way finish
                return await write

        try:
            # Persist, then notify: while the database is unavailable, the outcome waits for it
            # (followers get pings), and is written once it is back.
            if not await self._while_unavailable(record_outcome, f"the outcome of run {run.id}"):
                run.lost = True  # the run is another process's now: its record stands, not ours
        except (Exception, asyncio.CancelledError) as exc:
            # Not on disk, so not `end`: the row stays `running` under this live owner until the
            # lease keeper gives it up (`_give_up_strays`: relabelled once the database can be
            # written), or this process exits and the next open relabels it.
            log.warning("could not record the outcome of run %s", run.id, exc_info=True)
            self._unrecorded[run.id] = run.conversation
            self._note_stray()
            if isinstance(exc, asyncio.CancelledError) or errors.database_unavailable(exc):
                code = errors.DATABASE_UNAVAILABLE
            else:
                code = exc.code if isinstance(exc, SophosError) else errors.AGENT_FAILURE  # STORAGE_FULL, say
            why = str(exc) or "the process stopped while the database was unavailable"
            status, error = "failed", (code, f"The run's outcome could not be recorded: {why}")
        self._point("recorded")  # the outcome is on disk, its final event not given yet
        gate.flush()
        if run.lost:
            error = (errors.OWNERSHIP_LOST, errors.OWNERSHIP_LOST_MESSAGE)
        if error:
            run.publish("chat-error", {
                "code": error[0], "message": error[1], "conversation": run.conversation, "run": run.id,
            })
        else:
            if stopped_at is not None:
                run.publish("trace", {**(translator.waiting_step or {}), "event": "waiting",
                                      "data": {"gate": stopped_at.id, "calls": stopped_at.calls}})
            run.publish("end", self._end_data(run.conversation, run.id, status, stopped_at))

    async def _fold(self, graph: Any, run: ActiveRun) -> None:
        """Before this run's new input: checkpoint a step that a run before it finished (its writes
        saved) but did not checkpoint, without running anything again; LangGraph drops the
        latest checkpoint's pending writes when a run starts with input. Read now, after this
        run's row: no other run can change the thread any more (one run per conversation).

        The common case reads no checkpoint: a run that completed left every step checkpointed.
        The fold's checkpoint is the stopped run's (the one whose step it is): this run's own
        input has not reached the thread yet (see `unapplied_input`). A resume stops before any
        node (an input-less run passes no breakpoint in its first step, so it folds just that)."""
        runs = await self.store.list_runs(run.conversation)
        if len(runs) < 2 or runs[-2].status == "completed":
            return
        config = thread_config(run.conversation)
        state = await graph.aget_state(config)
        if not unfolded(state):
            return
        config["metadata"] = {"run_id": (state.metadata or {}).get("run_id")}
        async for _ in graph.astream(None, config, stream_mode="values", durability="sync",
                                     interrupt_before=list(AGENT_NODES), control=run.control):
            pass

    @staticmethod
    def _gate_of(run: ActiveRun, interrupt: dict[str, Any]) -> Gate:
        value = interrupt["value"] if isinstance(interrupt["value"], dict) else {}
        return Gate(id=interrupt["id"], conversation_id=run.conversation, run_id=run.id,
                    calls=value.get("calls", []), created_at="")

    async def _message_count(self, graph: Any, conversation_id: str) -> int | None:
        try:
            state = await graph.aget_state(thread_config(conversation_id))
        except (Exception, asyncio.CancelledError):  # a late shutdown cancel must not skip the record
            return None
        # What get_conversation will show (see `counting`): an accepted message a cancel kept
        # out of the thread counts too.
        return shown_count(state.values.get("messages", []), await self._pending_input(conversation_id, state.metadata))

    # retention (see `retention`): only the database's tables; the memory server's file is never touched

    async def delete_conversation(self, conversation: object, dry_run: bool = False) -> Removal:
        """Delete the conversation with its runs, checkpoints, writes and prune records, in one
        transaction; what went (with `dry_run`: what would go, nothing changed).

        Refused with `SESSION_IN_PROGRESS` while a live process runs it. A run whose process is
        gone (a crash) goes with it, so a crashed conversation can be deleted.
        """
        conversation_id = await self._owned(conversation)
        self._check_idle(conversation_id)
        return await retention.delete_conversation(self.store, conversation_id, self._retention_owner(), dry_run)

    async def prune_conversation(self, conversation: object, keep: int | None = None,
                                 dry_run: bool = False) -> Removal:
        """Delete the thread's older checkpoints and their writes, keeping its state exactly.

        Kept: the newest `keep` checkpoints of the thread (default: those of the run that wrote
        the latest one) and their writes; the oldest kept one is given the whole message list,
        so the thread reads, resumes and takes new messages as before. Runs are all kept. Each
        prune is recorded (`prunes`) and shown by the checkpoint-history view. Refused while a
        live process runs the conversation; `dry_run` says what would go and changes nothing.
        """
        conversation_id = await self._owned(conversation)
        keep = retention.parse_keep(keep)
        self._check_idle(conversation_id)
        return await retention.prune_conversation(self.store, conversation_id, keep, self._retention_owner(), dry_run)

    async def vacuum(self) -> Vacuum:
        """Give the space of deleted rows back to the file system (`VACUUM`, then the WAL folded
        back into the file; on PostgreSQL `VACUUM FULL` of the kit's and LangGraph's tables); the
        size before and after. Refused while a run is running."""
        if not self.settings.database_url and not self.store.is_open and not self.settings.database_path.exists():
            raise SophosError(errors.NOT_FOUND, f"No database at {self.settings.database_path}")
        return await retention.vacuum(self.store, self._retention_owner())

    async def delete_user(self, name: str, dry_run: bool = False) -> list[Removal]:
        """Delete a user with every conversation of theirs (runs, checkpoints, writes, gates,
        idempotency keys, prunes: each conversation in one transaction, as `delete_conversation`),
        then the user and the files of their own MCP servers (their memory); what went, a removal per conversation (`dry_run`: what would go,
        nothing changed). Refused, before anything goes, while a run of theirs is live."""
        user = await users.find_user(self.store, name)
        conversations = await users.user_conversations(self.store, user)
        removals = [await self.delete_conversation(c, dry_run=True) for c in conversations]  # refusals first
        if dry_run:
            return removals
        removals = [await self.delete_conversation(c) for c in conversations]
        await users.forget_user(self.store, user)
        await self.tools.stop_user(user.id)
        shutil.rmtree(user_memory_path(self.settings, user.id).parent, ignore_errors=True)
        return removals

    async def conversation_ids(self) -> list[str]:
        """Every conversation id, oldest first (read-only on SQLite; what `prune --all` goes through)."""
        return await retention.conversation_ids(self.store)

    def _retention_owner(self) -> Owner | None:
        """Who judges whether a run's owner is gone: this store (a fresh identity before it is
        open); None under the original's single-owner rule, where every `running` run is live."""
        if self.settings.single_owner:
            return None
        return self.store.owner or Owner.here()

"""The chat widget's view-model and its two backends. Pure Python: no ipywidgets here.

`ChatViewModel` holds what the widget shows (conversations, transcript, the answer being
streamed, a status line, an error banner, `busy`, `resumable`, the tool calls a run waits to have
approved) and runs each agent turn (a message, a resume, an approval or a rejection) on a worker
thread, telling its listeners what changed; a run in progress can be cancelled. When a turn ends it reloads everything from
durable state, so what you see afterwards is what the database says, not what was streamed.

A backend is where the agent runs (`backends`: an `AgentService` in this process, or a child of
the lab).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

FINAL_EVENTS = ("end", "chat-error", "rejected", "process-exited", "kernel-error")
"""Events that end a turn: the run's own final events, a refusal, or the child going away."""

WIDGET_ERROR = "WIDGET_ERROR"
CHILD_EXITED = "CHILD_EXITED"

EventDict = dict[str, Any]


@dataclass(frozen=True)
class ConversationSummary:
    """One entry of the conversation list."""

    id: str
    title: str
    status: str | None
    message_count: int

    @property
    def label(self) -> str:
        return f"{self.title} · {self.status or 'no runs'} · {self.message_count} msgs"


@dataclass(frozen=True)
class TranscriptItem:
    """One thing in the transcript: a `user` or `assistant` message, the model's `reasoning`
    (with OLLAMA_THINK=true), a `tool_call` chip or a `tool_result` (whose `status` is `success`
    or `error`). A `user` message with status
    `pending` was accepted but has not reached the thread (a resume answers it)."""

    kind: str
    text: str = ""
    name: str = ""
    arguments: dict[str, Any] | None = None
    status: str = ""


@dataclass(frozen=True)
class ErrorBanner:
    """Why the last run (or the last request) did not finish: an error code and its message."""

    code: str
    message: str


@dataclass(frozen=True)
class ApprovalCall:
    """One tool call held at an approval gate, as the model made it."""

    id: str
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class PendingApproval:
    """The gate a conversation's `waiting` run stopped at: the tool calls it holds back, none of
    which has run. Approve runs them all; Reject gives the model a tool result that says so."""

    gate: str
    run: str
    calls: tuple[ApprovalCall, ...]

    @classmethod
    def from_calls(cls, gate: str, run: str, calls: list[dict[str, Any]]) -> PendingApproval:
        """From the runtime's `[{id, name, args}]`."""
        return cls(gate, run, tuple(ApprovalCall(c["id"], c["name"], c.get("args") or {}) for c in calls))


@dataclass(frozen=True)
class ThreadDetail:
    """A conversation as durable state describes it.

    `orphaned` means the database still says `running` but the process that ran the run is
    gone (killed): only the next runtime to open the file will relabel it `interrupted`.
    """

    conversation_id: str
    messages: list[dict[str, Any]]
    next: tuple[str, ...]
    resumable: bool
    run_status: str | None
    error: ErrorBanner | None = None
    orphaned: bool = False
    approval: PendingApproval | None = None
    """What the latest run waits for (its status is `waiting`), else None."""


class ChatBackend(Protocol):
    """Where the agent runs. `chat`, `resume`, `approve` and `reject` yield event dicts up to a
    final event; `cancel` returns the cancelled run's final event, or a `rejected` event."""

    def conversations(self) -> list[ConversationSummary]: ...

    def detail(self, conversation_id: str) -> ThreadDetail: ...

    def chat(self, message: str, conversation: str | None) -> Iterator[EventDict]: ...

    def resume(self, conversation: str) -> Iterator[EventDict]: ...

    def approve(self, conversation: str) -> Iterator[EventDict]: ...

    def reject(self, conversation: str, reason: str | None) -> Iterator[EventDict]: ...

    def cancel(self, conversation: str) -> EventDict: ...

    def close(self) -> None: ...


CANCELLED = "CANCELLED"
"""A cancel someone chose: told in the status line, not as an error."""


def recorded_error(status: str | None, code: str | None, message: str | None) -> ErrorBanner | None:
    """The banner for a run's recorded outcome: only failed or interrupted runs with a code (a
    `cancelled` run was stopped on purpose: the status line says so, see `describe`)."""
    if status in ("failed", "interrupted") and code:
        return ErrorBanner(code, message or "")
    return None


def transcript_from_messages(messages: list[dict[str, Any]]) -> list[TranscriptItem]:
    """Transcript items from message dicts (`sophos_lab.runtime.messages.message_dto`)."""
    items: list[TranscriptItem] = []
    for message in messages:
        role = message["role"]
        if role == "user":
            items.append(TranscriptItem("user", message["content"], status="pending" if message.get("pending") else ""))
        elif role == "assistant":
            if message.get("reasoning"):
                items.append(TranscriptItem("reasoning", message["reasoning"]))
            if message["content"]:
                items.append(TranscriptItem("assistant", message["content"]))
            items.extend(
                TranscriptItem("tool_call", name=call["name"], arguments=call["args"])
                for call in message.get("toolCalls", [])
            )
        elif role == "tool":
            items.append(TranscriptItem(
                "tool_result", message["content"], name=message.get("name") or "",
                status=message.get("status") or "success",
            ))
    return items


def describe(detail: ThreadDetail | None) -> str:
    """The status line for a conversation at rest."""
    if detail is None:
        return "New conversation: type a message and press Send."
    count = len(detail.messages)
    next_nodes = ", ".join(detail.next)
    if detail.orphaned:
        return (
            "The database still says `running`, but the process that ran it is gone. "
            "Resume starts a fresh child; its first open of the database relabels the run "
            f"`interrupted`, then it continues with `{next_nodes}`."
        )
    if detail.approval is not None:
        count = len(detail.approval.calls)
        calls = "1 tool call" if count == 1 else f"{count} tool calls"
        return f"The run waits for your decision on {calls}: nothing has run yet. Approve or Reject above."
    if detail.run_status == "running":
        return "A run of this conversation is in progress in another process."
    if detail.resumable:
        outcome = {"failed": "failed", "cancelled": "was cancelled"}.get(detail.run_status, "stopped before it finished")
        return f"The last run {outcome}. Its progress is saved: Resume continues with `{next_nodes}`."
    if detail.run_status is None:
        return f"No run yet · {count} messages."
    return f"Last run {detail.run_status} · {count} messages."


@dataclass
class _Turn:
    """What the turn in progress has streamed since its last step boundary."""

    tokens: list[str] = field(default_factory=list)
    step: int | None = None
    answering: bool = False
    run: str | None = None
    """The run, once its `started` event arrived (only then can it be cancelled)."""
    cancelling: bool = False


class ChatViewModel:
    """What the chat widget shows, and the actions behind its buttons.

    Listeners are called as `listener(what)` with `what` either `"live"` (only the streamed
    answer grew) or `"all"`; they may be called from the worker thread.

    While the open conversation's latest run is `waiting`, `approval` holds its gate: Send and
    Resume are not offered there (the runtime refuses both with `RUN_WAITING`), `approve()` and
    `reject()` are.
    """

    def __init__(self, backend: ChatBackend, open_latest: bool = True) -> None:
        self.backend = backend
        self.conversations: list[ConversationSummary] = []
        self.conversation_id: str | None = None
        self.transcript: list[TranscriptItem] = []
        self.streamed_answer = ""
        """The text the last turn's final model step streamed (kept after the turn ends)."""
        self.status = ""
        self.error: ErrorBanner | None = None
        self.busy = False
        self.resumable = False
        self.approval: PendingApproval | None = None
        """The gate the open conversation waits at (shown as the approval card), else None."""
        self.detail: ThreadDetail | None = None
        self._turn = _Turn()
        self._listeners: list[Callable[[str], None]] = []
        self._lock = threading.RLock()
        self._thread: threading.Thread | None = None
        self._cancel_thread: threading.Thread | None = None
        self.reload()
        if open_latest and self.conversations:
            self.select(self.conversations[0].id)

    # what the view reads

    @property
    def live_text(self) -> str:
        """The answer being streamed by the current model step."""
        return "".join(self._turn.tokens)

    @property
    def can_resume(self) -> bool:
        """Whether to show Resume: the thread is resumable and no turn is running here."""
        return self.resumable and not self.busy and self.approval is None

    @property
    def can_send(self) -> bool:
        """Whether Send is offered: no turn runs here and the open conversation waits for no decision."""
        return not self.busy and self.approval is None

    @property
    def can_cancel(self) -> bool:
        """Whether to show Cancel: a turn runs here, its run has started, no cancel was asked yet."""
        return self.busy and self._turn.run is not None and not self._turn.cancelling

    @property
    def can_decide(self) -> bool:
        """Whether to show the approval card: the open conversation waits at a gate, no turn runs."""
        return self.approval is not None and not self.busy

    def subscribe(self, listener: Callable[[str], None]) -> None:
        self._listeners.append(listener)

    # actions

    def send(self, text: str) -> bool:
        """Start a turn with a user message (in a new conversation unless one is open).

        False when a turn is already running, the open conversation waits for a decision on
        tool calls (see `approve`, `reject`), or the text is blank."""
        with self._lock:
            if not self.can_send or not text.strip():
                return False
            self._begin("Sending…")
            self.transcript = [*self.transcript, TranscriptItem("user", text)]
            conversation = self.conversation_id
        self._notify("all")
        self._start(lambda: self.backend.chat(text, conversation))
        return True

    def resume(self) -> bool:
        """Start a turn that continues the open conversation from its latest checkpoint.

        False when a turn is already running or the thread is not resumable."""
        with self._lock:
            if not self.can_resume or self.conversation_id is None:
                return False
            self._begin("Resuming…")
            conversation = self.conversation_id
        self._notify("all")
        self._start(lambda: self.backend.resume(conversation))
        return True

    def approve(self) -> bool:
        """Approve every tool call the open conversation's run waits with, as a turn: a new run
        runs them and carries on. False when nothing waits or a turn is running."""
        return self._decide("Approving…", self.backend.approve)

    def reject(self, reason: str | None = None) -> bool:
        """Reject every held tool call, as a turn: none runs, and the model gets a tool result
        saying the user rejected it (with `reason`, when given). False as for `approve`."""
        reason = (reason or "").strip() or None
        return self._decide("Rejecting…", lambda conversation: self.backend.reject(conversation, reason))

    def cancel(self) -> bool:
        """Ask the backend to cancel the run in progress. The turn then ends with the run's own
        final event (`CANCELLED`: no error banner, the status line says the run was cancelled;
        what the run saved before stays, so Resume is offered).
        False when no run has started here or a cancel was asked already."""
        with self._lock:
            if not self.can_cancel or self.conversation_id is None:
                return False
            turn, conversation = self._turn, self.conversation_id
            turn.cancelling = True
            self.status = "Cancelling…"
        self._notify("all")
        # Not on the caller's thread: the backend answers once the run's outcome is recorded.
        self._cancel_thread = threading.Thread(
            target=self._cancel, args=(turn, conversation), name="sophos-chat-cancel", daemon=True)
        self._cancel_thread.start()
        return True

    def select(self, conversation_id: str | None) -> bool:
        """Open a conversation, or none (False while a turn is running)."""
        with self._lock:
            if self.busy:
                return False
            self.conversation_id = conversation_id
            self.error = None
        self.reload()
        return True

    def new_conversation(self) -> bool:
        """Start afresh: the next Send creates a conversation (False while a turn is running)."""
        return self.select(None)

    def reload(self) -> None:
        """Read the conversation list and the open conversation from durable state.

        While a turn is running only the list is refreshed, so the live transcript stays."""
        try:
            conversations = self.backend.conversations()
            with self._lock:
                current, busy = self.conversation_id, self.busy
            detail = self.backend.detail(current) if current and not busy else None
        except Exception as exc:  # a widget must show, not raise, what went wrong
            with self._lock:
                self.error = ErrorBanner(WIDGET_ERROR, f"reload failed: {type(exc).__name__}: {exc}")
            self._notify("all")
            return
        with self._lock:
            self.conversations = conversations
            if not busy:
                self._show(detail)
        self._notify("all")

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the turn in progress (and a cancel asked of it); True when none is running any more."""
        for thread in (self._thread, self._cancel_thread):
            if thread is not None:
                thread.join(timeout)
        return not self.busy

    def close(self, timeout: float | None = 30.0) -> None:
        """Wait for the turn in progress, then close the backend."""
        self.join(timeout)
        self.backend.close()

    # the turn, on its worker thread

    def _decide(self, status: str, stream: Callable[[str], Iterator[EventDict]]) -> bool:
        with self._lock:
            if not self.can_decide or self.conversation_id is None:
                return False
            self._begin(status)
            conversation = self.conversation_id
        self._notify("all")
        self._start(lambda: stream(conversation))
        return True

    def _cancel(self, turn: _Turn, conversation: str) -> None:
        try:
            answer = self.backend.cancel(conversation)
        except Exception as exc:  # e.g. the child is gone; the turn ends by itself then
            answer = {"event": "rejected", "data": {"code": WIDGET_ERROR, "message": f"cancel failed: {type(exc).__name__}: {exc}"}}
        if answer["event"] != "rejected":
            return  # the run's final event ends the turn, through its own stream
        with self._lock:
            if self._turn is not turn or not self.busy:
                return  # the run ended first: its own outcome is what shows
            data = answer.get("data") or {}
            self.error = ErrorBanner(data.get("code", WIDGET_ERROR), data.get("message", ""))
            turn.cancelling = False
        self._notify("all")

    def _begin(self, status: str) -> None:
        self.busy = True
        self.error = None
        self.resumable = False
        self.approval = None
        self.streamed_answer = ""
        self._turn = _Turn()
        self.status = status

    def _start(self, stream: Callable[[], Iterator[EventDict]]) -> None:
        self._thread = threading.Thread(target=self._follow, args=(stream,), name="sophos-chat-turn", daemon=True)
        self._thread.start()

    def _follow(self, stream: Callable[[], Iterator[EventDict]]) -> None:
        final: EventDict = {"event": "rejected", "data": {
            "code": WIDGET_ERROR, "message": "the event stream ended without a final event",
        }}
        try:
            for event in stream():
                if event["event"] in FINAL_EVENTS:
                    final = event
                    break
                self._apply(event)
        except Exception as exc:  # shown in the banner; the turn must always end
            final = {"event": "rejected", "data": {"code": WIDGET_ERROR, "message": f"{type(exc).__name__}: {exc}"}}
        self._finish(final)

    def _apply(self, event: EventDict) -> None:
        name, data = event["event"], event.get("data")
        with self._lock:
            turn = self._turn
            if name == "token":
                turn.tokens.append(data)
                if turn.answering:
                    what = "live"
                else:
                    turn.answering, what = True, "all"
                    self.status = f"step {turn.step} · agent: answering…"
            elif name == "reasoning":
                what = "all"
                self.status = f"step {turn.step} · agent: thinking…"
            elif name == "started":
                what = "all"
                self.conversation_id = data["conversation"]
                turn.run = data["run"]
                self.status = f"{'Resuming' if data.get('resume') else 'Running'} run {data['run'][:8]}…"
            elif name == "note":
                what, self.status = "all", str(data)
            elif name == "trace":
                what = "all"
                self._trace(data)
            else:
                return
        if name == "started":
            self._refresh_list()
        self._notify(what)

    def _trace(self, note: dict[str, Any]) -> None:
        turn, kind, data = self._turn, note["event"], note.get("data") or {}
        if kind == "enter":
            self._flush_live()
            turn.step, turn.answering = note["step"], False
            if note["node"] == "agent":
                self.status = f"step {note['step']} · agent ({note['name']}): calling the model…"
            else:
                self.status = f"step {note['step']} · tools: {note['name']}"
        elif kind == "call":
            self._flush_live()
            self.transcript = [*self.transcript, TranscriptItem("tool_call", name=data["name"], arguments=data["arguments"])]
        elif kind == "result":
            self.transcript = [*self.transcript, TranscriptItem(
                "tool_result", data["result"], name=data["name"], status=data.get("status") or "success",
            )]
        elif kind == "leave" and "error" in data:
            self.status = f"step {note['step']} · {note['node']} raised: {data['error']}"
        elif kind == "waiting":
            self._flush_live()
            self.status = f"step {note.get('step')} · tools: waiting for your approval…"

    def _flush_live(self) -> None:
        """Move the streamed text into the transcript (a model step that also called tools)."""
        text = self.live_text
        if text:
            self.transcript = [*self.transcript, TranscriptItem("assistant", text)]
        self._turn.tokens = []

    def _finish(self, final: EventDict) -> None:
        with self._lock:
            self.streamed_answer = self.live_text
            conversation = self.conversation_id
        try:
            conversations = self.backend.conversations()
            detail = self.backend.detail(conversation) if conversation else None
            reload_error = None
        except Exception as exc:
            detail, conversations = None, self.conversations
            reload_error = ErrorBanner(WIDGET_ERROR, f"reload failed: {type(exc).__name__}: {exc}")
        with self._lock:
            self.conversations = conversations
            self._turn = _Turn()
            self.busy = False
            if detail is not None or conversation is None:
                self._show(detail)
            self.error = _final_error(final) or reload_error or self.error
        self._notify("all")

    def _show(self, detail: ThreadDetail | None) -> None:
        self.detail = detail
        self.transcript = transcript_from_messages(detail.messages) if detail else []
        self.resumable = bool(detail and detail.resumable)
        self.approval = detail.approval if detail else None
        self.error = detail.error if detail else None
        self.status = describe(detail)

    def _refresh_list(self) -> None:
        try:
            conversations = self.backend.conversations()
        except Exception:  # the list catches up at the end of the turn
            return
        with self._lock:
            self.conversations = conversations

    def _notify(self, what: str) -> None:
        for listener in list(self._listeners):
            listener(what)


def _final_error(final: EventDict) -> ErrorBanner | None:
    """The banner a final event calls for (None for `end`)."""
    name, data = final["event"], final.get("data") or {}
    if name == "chat-error" and data.get("code") == CANCELLED:
        return None  # asked for: the status line tells it (`describe`), with Resume when there is work left
    if name in ("chat-error", "rejected"):
        return ErrorBanner(data.get("code", WIDGET_ERROR), data.get("message", ""))
    if name == "process-exited":
        code = data.get("returncode")
        how = "" if code is None else f" (return code {code})"
        return ErrorBanner(CHILD_EXITED, f"The child process exited{how} during the run; nothing recorded its outcome.")
    if name == "kernel-error":
        return ErrorBanner(CHILD_EXITED, f"The child kernel's cell raised {data.get('error')}")
    return None



"""The chat widget: a thin ipywidgets 8 view over `sophos_lab.ui.chat_model.ChatViewModel`.

    chat = ChatWidget.for_lab(lab)            # the agent in this process
    chat = ChatWidget.for_child(lab.kernel()) # the agent in a child kernel you can kill
    chat                                      # shows it; chat.join() waits for the turn

While a run is active a Cancel button shows (a cancelled run is told in the status line, with
Resume, not in the error banner: it was asked for); when a run stops at an approval gate, an
approval card lists the tool calls it holds (name and JSON arguments) with Approve and Reject
(and an optional reason the model reads).

The agent's turn runs on a worker thread, never on the kernel's event loop, so the widget keeps
streaming after the cell has finished (ipykernel 7). The transcript is re-rendered only at step
boundaries; the streamed answer at most every `throttle` seconds.
"""

from __future__ import annotations

import html
import re
import json
import threading
import time
from pathlib import Path
from typing import Any

import ipywidgets as w

from .backends import ChildBackend, ServiceBackend
from .chat_model import (
    ChatBackend,
    ChatViewModel,
    ErrorBanner,
    PendingApproval,
    TranscriptItem,
)

__all__ = ["ChatViewModel", "ChatWidget"]

NEW_CONVERSATION = ""
"""The conversation list's value for "a new conversation"."""

STYLE = """<style>
.sophos-chat { color: var(--jp-ui-font-color1); font-family: var(--jp-ui-font-family); }
.sophos-chat .sx-msg { margin: 6px 0; padding: 6px 10px; border-radius: 8px; line-height: 1.45;
  white-space: pre-wrap; overflow-wrap: anywhere; border: 1px solid var(--jp-border-color2);
  background: var(--jp-layout-color1); }
.sophos-chat .sx-user { margin-left: 12%; background: var(--jp-layout-color2); }
.sophos-chat .sx-assistant { margin-right: 12%; border-left: 3px solid var(--jp-brand-color1); }
.sophos-chat .sx-live { opacity: 0.85; }
.sophos-chat .sx-live::after { content: "▍"; color: var(--jp-brand-color1); }
.sophos-chat .sx-role { display: block; font-size: var(--jp-ui-font-size0); color: var(--jp-ui-font-color2);
  text-transform: uppercase; letter-spacing: 0.04em; white-space: normal; }
.sophos-chat .sx-chip { display: inline-block; margin: 3px 0; padding: 2px 10px; border-radius: 12px;
  border: 1px solid var(--jp-brand-color1); background: var(--jp-layout-color2);
  font-family: var(--jp-code-font-family); font-size: var(--jp-code-font-size); }
.sophos-chat .sx-tool { margin: 3px 0 3px 14px; padding-left: 8px;
  border-left: 3px solid var(--jp-success-color1, var(--jp-border-color2)); }
.sophos-chat .sx-tool.sx-error { border-left-color: var(--jp-error-color1); }
.sophos-chat .sx-tool summary { cursor: pointer; color: var(--jp-ui-font-color2); }
.sophos-chat .sx-tool pre { max-height: 14em; overflow: auto; white-space: pre-wrap; margin: 4px 0;
  padding: 6px; background: var(--jp-layout-color2); color: var(--jp-ui-font-color1); }
.sophos-chat .sx-banner { padding: 6px 10px; border-radius: 4px; border: 1px solid var(--jp-error-color1);
  border-left-width: 4px; background: var(--jp-layout-color1); color: var(--jp-ui-font-color1); }
.sophos-chat .sx-banner b { color: var(--jp-error-color1); font-family: var(--jp-code-font-family); }
.sophos-chat .sx-status { color: var(--jp-ui-font-color2); font-size: var(--jp-ui-font-size1); line-height: 1.4; }
.sophos-chat .sx-empty { color: var(--jp-ui-font-color3); font-style: italic; }
.sophos-chat .sx-approval { margin: 6px 0; padding: 6px 10px; border-radius: 4px;
  border: 1px solid var(--jp-warn-color1); border-left-width: 4px; background: var(--jp-layout-color1); }
.sophos-chat .sx-approval-title { color: var(--jp-ui-font-color1); line-height: 1.4; }
.sophos-chat .sx-approval-call { align-items: baseline; margin: 2px 0; }
.sophos-chat .sx-call-name, .sophos-chat .sx-call-args { height: auto; line-height: 1.4; color: var(--jp-ui-font-color1);
  font-family: var(--jp-code-font-family); font-size: var(--jp-code-font-size); }
.sophos-chat .sx-call-name { font-weight: bold; flex: 0 0 auto; }
.sophos-chat .sx-call-args { white-space: pre-wrap; overflow-wrap: anywhere; flex: 1 1 auto; }
</style>"""


def item_html(item: TranscriptItem) -> str:
    """One transcript item as HTML; every piece of text is escaped."""
    text = html.escape(item.text)
    if item.kind in ("user", "assistant"):
        role = "you" if item.kind == "user" else "agent"
        note = '<span class="sx-status"> · saved, not answered yet: Resume answers it</span>' if item.status == "pending" else ""
        return f'<div class="sx-msg sx-{item.kind}"><span class="sx-role">{role}</span>{text}{note}</div>'
    if item.kind == "reasoning":  # collapsed: the answer is what the learner reads first
        return f'<details class="sx-tool sx-reasoning"><summary>💭 thinking · {len(item.text)} chars</summary><pre>{text}</pre></details>'
    if item.kind == "tool_call":
        arguments = html.escape(json.dumps(item.arguments or {}, ensure_ascii=False))
        return f'<div class="sx-chip">🔧 {html.escape(item.name)} {arguments}</div>'
    css = "sx-tool sx-error" if item.status == "error" else "sx-tool"
    summary = f"{html.escape(item.name)} → {html.escape(item.status)} · {len(item.text)} chars"
    return f'<details class="{css}"><summary>{summary}</summary><pre>{text}</pre></details>'


def transcript_html(items: list[TranscriptItem]) -> str:
    if not items:
        return '<div class="sx-empty">No messages yet.</div>'
    return "".join(map(item_html, items))


def live_html(text: str) -> str:
    if not text:
        return ""
    return f'<div class="sx-msg sx-assistant sx-live"><span class="sx-role">agent</span>{html.escape(text)}</div>'


def banner_html(error: ErrorBanner | None) -> str:
    if error is None:
        return ""
    return f'<div class="sx-banner"><b>{html.escape(error.code)}</b> {html.escape(error.message)}</div>'


APPROVAL_TITLE = (
    '<div class="sx-approval-title"><b>⏸ Approval needed.</b> The run holds these tool calls; '
    "none has run yet.</div>"
)


def approval_rows(approval: PendingApproval | None) -> list[w.HBox]:
    """One row per held call: its tool name and its arguments as JSON, in Labels (set as text,
    never parsed as HTML: the model made both)."""
    rows = []
    for call in approval.calls if approval else ():
        name = w.Label(call.name)
        name.add_class("sx-call-name")
        arguments = w.Label(json.dumps(call.arguments, ensure_ascii=False))
        arguments.add_class("sx-call-args")
        row = w.HBox([name, arguments])
        row.add_class("sx-approval-call")
        rows.append(row)
    return rows


def status_html(status: str, busy: bool) -> str:
    spinner = "⏳ " if busy else ""
    text = re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(status))  # `next` etc. as code
    return f'<div class="sx-status">{spinner}{text}</div>'


class ChatWidget:
    """A chat panel: conversation list, transcript, streamed answer, status, error banner,
    Resume, Cancel, the approval card, and a message box with Send. State and actions live in
    `view_model`."""

    def __init__(self, view_model: ChatViewModel, throttle: float = 0.05) -> None:
        self.view_model = view_model
        self.throttle = throttle
        self.conversation_list = w.Dropdown(description="Chat", layout=w.Layout(flex="1 1 auto", width="auto"))
        self.new_button = w.Button(description="New", icon="plus", tooltip="Start a new conversation")
        self.reload_button = w.Button(description="Reload", icon="refresh", tooltip="Read durable state again")
        self.banner = w.HTML()
        self.transcript = w.HTML()
        self.live = w.HTML()
        self.status = w.HTML()
        self.resume_button = w.Button(
            description="Resume", icon="play", button_style="warning",
            tooltip="Continue the thread from its latest checkpoint",
        )
        self.cancel_button = w.Button(
            description="Cancel", icon="stop", button_style="danger",
            tooltip="Stop the run now; what it saved before stays, and Resume continues from there",
        )
        self.approval_calls = w.VBox()
        self.reject_reason = w.Text(
            placeholder="Reason for rejecting (optional; the model reads it)",
            layout=w.Layout(flex="1 1 auto", width="auto"),
        )
        self.approve_button = w.Button(
            description="Approve", icon="check", button_style="success", tooltip="Run the tool calls, then carry on",
        )
        self.reject_button = w.Button(
            description="Reject", icon="times", button_style="danger",
            tooltip="Run none of them: the model is told you rejected them (and why)",
        )
        self.approval_card = w.VBox([
            w.HTML(APPROVAL_TITLE),
            self.approval_calls,
            w.HBox([self.reject_reason, self.approve_button, self.reject_button]),
        ])
        self.approval_card.add_class("sx-approval")
        self._shown_approval: PendingApproval | None = None
        self.input = w.Text(placeholder="Message the agent…", layout=w.Layout(flex="1 1 auto", width="auto"))
        self.send_button = w.Button(description="Send", icon="paper-plane", button_style="primary")
        # column-reverse keeps a scrolled transcript pinned to its newest message
        scroller = w.VBox(
            [self.live, self.transcript],
            layout=w.Layout(flex_flow="column-reverse", max_height="520px", overflow="auto"),
        )
        self.root = w.VBox([
            w.HTML(STYLE),
            w.HBox([self.conversation_list, self.new_button, self.reload_button]),
            self.banner,
            scroller,
            self.approval_card,
            w.HBox([self.status, self.resume_button, self.cancel_button], layout=w.Layout(align_items="center")),
            w.HBox([self.input, self.send_button]),
        ], layout=w.Layout(width="100%"))
        self.root.add_class("sophos-chat")

        self._render_lock = threading.RLock()
        self._last_live = 0.0
        self._timer: threading.Timer | None = None
        self._syncing = False
        self.send_button.on_click(lambda _: self._send())
        self.resume_button.on_click(lambda _: view_model.resume())
        self.cancel_button.on_click(lambda _: view_model.cancel())
        self.approve_button.on_click(lambda _: view_model.approve())
        self.reject_button.on_click(lambda _: self._reject())
        self.new_button.on_click(lambda _: view_model.new_conversation())
        self.reload_button.on_click(lambda _: view_model.reload())
        self.conversation_list.observe(self._on_pick, names="value")
        view_model.subscribe(self._on_change)
        self.render()

    # constructors

    @classmethod
    def for_backend(cls, backend: ChatBackend, **options: Any) -> ChatWidget:
        """A widget over any backend (opens the most recent conversation)."""
        return cls(ChatViewModel(backend), **options)

    @classmethod
    def for_service(cls, settings: Any, log_dir: Path | None = None, **options: Any) -> ChatWidget:
        """A widget over a new `AgentService(settings)` in this process, run on a thread of its own."""
        return cls.for_backend(ServiceBackend(settings, log_dir=log_dir), **options)

    @classmethod
    def for_lab(cls, lab: Any, **env: str) -> ChatWidget:
        """A widget over an in-process `AgentService` with the lab's settings (plus `env` overrides)."""
        return cls.for_service(lab.settings(**env), log_dir=lab.root / "logs")

    @classmethod
    def for_child(cls, child: Any, **options: Any) -> ChatWidget:
        """A widget over a `LabKernel` / `LabWorker` child (e.g. `lab.kernel()`).

        Reads come from the database through the read-only views. If the child has been killed,
        Send or Resume first restarts it (same settings): the fresh child's first open of the
        database relabels the dead run `interrupted`, and the resume continues the thread."""
        return cls.for_backend(ChildBackend(child), **options)

    # use

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the turn in progress; True when none is running."""
        return self.view_model.join(timeout)

    @property
    def resume_visible(self) -> bool:
        return self.resume_button.layout.display != "none"

    @property
    def cancel_visible(self) -> bool:
        return self.cancel_button.layout.display != "none"

    @property
    def approval_visible(self) -> bool:
        return self.approval_card.layout.display != "none"

    @property
    def approval_shown(self) -> list[tuple[str, str]]:
        """What the approval card lists: (tool name, JSON arguments) per held call."""
        return [(row.children[0].value, row.children[1].value) for row in self.approval_calls.children]

    def display(self) -> None:
        from IPython.display import display

        display(self.root)

    def _ipython_display_(self) -> None:
        self.display()

    def close(self) -> None:
        """Wait for the turn in progress, close the backend, and remove the widgets."""
        self.view_model.close()
        self.root.close()

    # rendering

    def render(self) -> None:
        """Show the whole view-model (at step boundaries and at rest)."""
        vm = self.view_model
        with self._render_lock:
            self._cancel_timer()
            self._sync_list()
            self.banner.value = banner_html(vm.error)
            self.transcript.value = transcript_html(vm.transcript)
            self._render_live()
            self.status.value = status_html(vm.status, vm.busy)
            self.resume_button.layout.display = None if vm.can_resume else "none"
            self.cancel_button.layout.display = None if vm.can_cancel else "none"
            self._render_approval()
            for control in (self.new_button, self.conversation_list):
                control.disabled = vm.busy
            self.send_button.disabled = not vm.can_send

    def _render_approval(self) -> None:
        vm = self.view_model
        if vm.approval != self._shown_approval:  # new rows only when the gate changes
            for row in self.approval_calls.children:
                for label in row.children:
                    label.close()
                row.close()
            self.approval_calls.children = approval_rows(vm.approval)
            self._shown_approval = vm.approval
        self.approval_card.layout.display = None if vm.can_decide else "none"

    def _render_live(self) -> None:
        self.live.value = live_html(self.view_model.live_text)
        self._last_live = time.monotonic()

    def _on_change(self, what: str) -> None:
        if what != "live":
            self.render()
            return
        with self._render_lock:
            wait = self._last_live + self.throttle - time.monotonic()
            if wait <= 0:
                self._render_live()
            elif self._timer is None:
                # render what has arrived by then, even if no further token comes (a paused stream)
                self._timer = threading.Timer(wait, self._flush_live)
                self._timer.daemon = True
                self._timer.start()

    def _flush_live(self) -> None:
        with self._render_lock:
            self._timer = None
            self._render_live()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _sync_list(self) -> None:
        vm = self.view_model
        options = [("＋ new conversation", NEW_CONVERSATION)]
        options += [(c.label, c.id) for c in vm.conversations]
        current = vm.conversation_id or NEW_CONVERSATION
        if current not in (value for _, value in options):
            options.append(("(current conversation)", current))
        self._syncing = True
        try:
            if list(self.conversation_list.options) != options:
                self.conversation_list.options = options
            self.conversation_list.value = current
        finally:
            self._syncing = False

    def _on_pick(self, change: dict) -> None:
        if self._syncing:
            return
        if change["new"] == NEW_CONVERSATION:
            self.view_model.new_conversation()
        else:
            self.view_model.select(change["new"])

    def _send(self) -> None:
        if self.view_model.send(self.input.value):
            self.input.value = ""

    def _reject(self) -> None:
        if self.view_model.reject(self.reject_reason.value):
            self.reject_reason.value = ""

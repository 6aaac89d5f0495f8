"""Run events, and the translation of LangGraph's stream into them.

The names and payloads follow the original system's wire contract:
`token` (a string), `trace` (`{step, node, name, event, data?}` with event `enter`, `leave`,
`call` or `result`, and the kit's `retry` and `waiting` (the tools step stopped at an approval
gate: `data: {gate, calls}`, published once the run is recorded `waiting`); a `call` carries the step and model name of the agent step that asked for it
but `node: "tools"`, the node that will run it, exactly as the original's clients expect), `end` (`{conversation, run, status}`) and `chat-error`
(`{code, message, conversation, run}`). The kit adds `reasoning` (the model's thinking, kept
apart from `token` so the stream and the record agree) and `started` (`{conversation, run,
resume}`), the first event of every run.

Persist, then notify: an event that reports a finished step (`leave`, and the `call` and
`result` facts read from the step's output) is published only once the checkpoint holding that
step's writes is committed; `DurableGate` holds it until then. So a client that saw `leave` for
step N knows a resume will not run step N again. `token` and `reasoning` events stream live,
before anything is saved: streaming is not persistence, and a kill mid-answer loses those tokens.
A `retry` trace (`data: {attempt, of, wait, code, error}`: attempt `attempt` of `of` follows after
`wait` seconds, because the one before failed with `error`) is live too: it is news about a step
in flight, of which nothing is saved; the tokens that attempt streamed are void.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from langchain_core.messages import AIMessage, AIMessageChunk, ToolMessage

from .messages import content_text, message_dtos

TERMINAL_EVENTS = ("end", "chat-error")

Item = tuple[str, Any, "int | None"]
"""`(event, data, step)`: `step` is the step whose checkpoint must be saved first, or None (live)."""


@dataclass(frozen=True)
class Event:
    """One event of a run; `id` counts from 1 within the run."""

    id: int
    event: str
    data: Any

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "event": self.event, "data": self.data}

    @property
    def is_terminal(self) -> bool:
        return self.event in TERMINAL_EVENTS


@dataclass
class StreamTranslator:
    """Turns `astream(stream_mode=["messages", "debug"])` items into `(event, data, step)`."""

    model_name: str
    interrupts: list[dict[str, Any]] = field(default_factory=list)
    """The interrupts a step stopped at (`{"id", "value"}`): the run is waiting at a gate."""
    waiting_step: dict[str, Any] | None = None
    """`{step, node, name}` of the step that stopped at the gate."""
    steps_entered: int = 0
    """The graph steps (model or tools) the run entered, as LangGraph's recursion limit counts
    them: what a user's step budget is spent in."""
    _open: dict[str, Any] | None = field(default=None)
    _latest_messages: list[Any] | None = field(default=None)

    @property
    def message_count(self) -> int | None:
        """Messages in the latest checkpoint seen on the stream (None before the first).

        Counted when asked (once, at the end of a run), not at every checkpoint: a long thread
        would otherwise be walked three times a turn."""
        return None if self._latest_messages is None else len(message_dtos(self._latest_messages))

    def feed(self, mode: str, chunk: Any) -> list[Item]:
        if mode == "messages":
            return self._message(*chunk)
        if mode == "debug" and chunk["type"] == "task":
            return self._enter(chunk["step"], chunk["payload"])
        if mode == "debug" and chunk["type"] == "task_result":
            return self._leave(chunk["step"], chunk["payload"])
        if mode == "debug" and chunk["type"] == "checkpoint":
            values = chunk["payload"].get("values") or {}
            self._latest_messages = values.get("messages", [])
        return []

    def open_step(self, node: str) -> dict[str, Any]:
        """`{step, node, name}` of the step in flight, if it is `node`'s (else step None)."""
        if self._open is not None and self._open["node"] == node:
            return dict(self._open)
        return {"step": None, "node": node, "name": self.model_name if node == "agent" else ""}

    def finish(self) -> list[Item]:
        """A final `leave` if the stream stopped inside a step (a failure or a drain)."""
        if self._open is None:
            return []
        note, self._open = {**self._open, "event": "leave"}, None
        return [("trace", note, note["step"])]

    def _message(self, message: Any, metadata: dict) -> list[Item]:
        if metadata.get("langgraph_node") != "agent" or not isinstance(message, AIMessageChunk):
            return []
        out: list[Item] = []
        reasoning = message.additional_kwargs.get("reasoning_content")
        if reasoning:
            out.append(("reasoning", reasoning, None))
        text = content_text(message.content)
        if text:
            out.append(("token", text, None))
        return out

    def _enter(self, step: int, payload: dict) -> list[Item]:
        node = payload["name"]
        name = self.model_name if node == "agent" else ""
        if node == "tools":
            messages = (payload.get("input") or {}).get("messages") or []
            calls = (getattr(messages[-1], "tool_calls", None) or []) if messages else []
            name = ", ".join(call["name"] for call in calls)
        out = self.finish()
        self.steps_entered += 1
        self._open = {"step": step, "node": node, "name": name}
        return out + [("trace", {**self._open, "event": "enter"}, None)]

    def _leave(self, step: int, payload: dict) -> list[Item]:
        if payload.get("interrupts"):
            # Stopped at a gate: the step did not finish and is not saved (the interrupt is);
            # the run reports it, with the calls, once it is recorded `waiting`.
            self.interrupts = [{"id": i["id"], "value": i["value"]} for i in payload["interrupts"]]
            self.waiting_step, self._open = {**(self._open or {}), "step": step, "node": payload["name"]}, None
            return []
        out: list[Item] = []
        result = payload.get("result") or {}
        messages = result.get("messages", []) if isinstance(result, dict) else []
        for message in messages:
            if isinstance(message, AIMessage):
                for call in message.tool_calls:
                    out.append(("trace", {
                        "step": step, "node": "tools", "name": self.model_name, "event": "call",
                        "data": {"name": call["name"], "arguments": call["args"], "tool_call_id": call["id"]},
                    }, step))
            elif isinstance(message, ToolMessage) and message.name and message.tool_call_id:
                out.append(("trace", {
                    "step": step, "node": "tools", "name": message.name, "event": "result",
                    "data": {
                        "name": message.name,
                        "tool_call_id": message.tool_call_id,
                        "result": content_text(message.content),
                        "status": message.status or "success",
                    },
                }, step))
        note = {"step": step, "node": payload["name"], "name": (self._open or {}).get("name", ""), "event": "leave"}
        if payload.get("error"):
            note["data"] = {"error": str(payload["error"])}
        self._open = None
        return out + [("trace", note, step)]


class DurableGate:
    """Publishes events in order, holding each step fact until its step's checkpoint is saved.

    `saved(step)` is called by the saver once a checkpoint of that step is committed; anything
    offered after a held fact waits behind it, so the order of events never changes.
    """

    def __init__(self, publish: Callable[[str, Any], Any]) -> None:
        self._publish = publish
        self._held: deque[Item] = deque()
        self.saved_step: int | None = None
        """The step of the latest checkpoint this run saved (None before the first)."""

    def offer(self, name: str, data: Any, step: int | None) -> None:
        self._held.append((name, data, step))
        self._release()

    def saved(self, step: int) -> None:
        self.saved_step = step if self.saved_step is None else max(self.saved_step, step)
        self._release()

    def flush(self) -> None:
        """At the end of a run, once its outcome is recorded: publish what is still held.

        A fact whose checkpoint never got saved (the step failed, or was cut off) did not
        happen durably: its `call`/`result` facts are dropped (a resume makes them again) and
        its `leave` goes out marked `saved: False`.
        """
        while self._held:
            name, data, step = self._held.popleft()
            if self._is_saved(step):
                self._publish(name, data)
            elif data.get("event") == "leave":
                self._publish(name, {**data, "saved": False})

    def _is_saved(self, step: int | None) -> bool:
        return step is None or (self.saved_step is not None and step <= self.saved_step)

    def _release(self) -> None:
        while self._held and self._is_saved(self._held[0][2]):
            name, data, _ = self._held.popleft()
            self._publish(name, data)

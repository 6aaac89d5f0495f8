"""Run events, and the translation of LangGraph's stream into them.

The names and payloads follow the original system's wire contract:
`token` (a string), `trace` (`{step, node, name, event, data?}` with event `enter`, `leave`,
`call` or `result`), `end` (`{conversation, run, status}`) and `chat-error`
(`{code, message, conversation, run}`). The kit adds `reasoning` (the model's thinking, kept
apart from `token` so the stream and the record agree) and `started` (`{conversation, run,
resume}`), the first event of every run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from langchain_core.messages import AIMessage, AIMessageChunk, ToolMessage

from .messages import content_text, message_dtos

TERMINAL_EVENTS = ("end", "chat-error")


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
    """Turns `astream(stream_mode=["messages", "debug"])` items into `(event, data)` pairs."""

    model_name: str
    message_count: int | None = None
    """Messages in the latest checkpoint seen on the stream (None before the first)."""
    _open: dict[str, Any] | None = field(default=None)

    def feed(self, mode: str, chunk: Any) -> list[tuple[str, Any]]:
        if mode == "messages":
            return self._message(*chunk)
        if mode == "debug" and chunk["type"] == "task":
            return self._enter(chunk["step"], chunk["payload"])
        if mode == "debug" and chunk["type"] == "task_result":
            return self._leave(chunk["step"], chunk["payload"])
        if mode == "debug" and chunk["type"] == "checkpoint":
            values = chunk["payload"].get("values") or {}
            self.message_count = len(message_dtos(values.get("messages", [])))
        return []

    def finish(self) -> list[tuple[str, Any]]:
        """A final `leave` if the stream stopped inside a step (a failure or a drain)."""
        if self._open is None:
            return []
        note, self._open = {**self._open, "event": "leave"}, None
        return [("trace", note)]

    def _message(self, message: Any, metadata: dict) -> list[tuple[str, Any]]:
        if metadata.get("langgraph_node") != "agent" or not isinstance(message, AIMessageChunk):
            return []
        out: list[tuple[str, Any]] = []
        reasoning = message.additional_kwargs.get("reasoning_content")
        if reasoning:
            out.append(("reasoning", reasoning))
        text = content_text(message.content)
        if text:
            out.append(("token", text))
        return out

    def _enter(self, step: int, payload: dict) -> list[tuple[str, Any]]:
        node = payload["name"]
        name = self.model_name if node == "agent" else ""
        if node == "tools":
            messages = (payload.get("input") or {}).get("messages") or []
            calls = (getattr(messages[-1], "tool_calls", None) or []) if messages else []
            name = ", ".join(call["name"] for call in calls)
        out = self.finish()
        self._open = {"step": step, "node": node, "name": name}
        return out + [("trace", {**self._open, "event": "enter"})]

    def _leave(self, step: int, payload: dict) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        result = payload.get("result") or {}
        messages = result.get("messages", []) if isinstance(result, dict) else []
        for message in messages:
            if isinstance(message, AIMessage):
                for call in message.tool_calls:
                    out.append(("trace", {
                        "step": step, "node": "tools", "name": self.model_name, "event": "call",
                        "data": {"name": call["name"], "arguments": call["args"], "tool_call_id": call["id"]},
                    }))
            elif isinstance(message, ToolMessage) and message.name and message.tool_call_id:
                out.append(("trace", {
                    "step": step, "node": "tools", "name": message.name, "event": "result",
                    "data": {
                        "name": message.name,
                        "tool_call_id": message.tool_call_id,
                        "result": content_text(message.content),
                        "status": message.status or "success",
                    },
                }))
        note = {"step": step, "node": payload["name"], "name": (self._open or {}).get("name", ""), "event": "leave"}
        if payload.get("error"):
            note["data"] = {"error": str(payload["error"])}
        self._open = None
        return out + [("trace", note)]

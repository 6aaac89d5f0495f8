"""Thread messages as plain dictionaries: the shape the UI, exports and DataFrames show."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage


def content_text(content: Any) -> str:
    """Flatten LangChain message content (a string or a list of blocks) to text."""
    if isinstance(content, str):
        return content
    parts = []
    for block in content or []:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and isinstance(block.get("text"), str):
            parts.append(block["text"])
    return "".join(parts)


def message_dto(message: BaseMessage) -> dict[str, Any] | None:
    """One message as `{id, role, content, ...}`; None for types the UI does not show."""
    if isinstance(message, HumanMessage):
        return {"id": message.id, "role": "user", "content": content_text(message.content)}
    if isinstance(message, AIMessage):
        dto: dict[str, Any] = {
            "id": message.id, "role": "assistant", "content": content_text(message.content)
        }
        if message.additional_kwargs.get("reasoning_content"):  # OLLAMA_THINK=true
            dto["reasoning"] = message.additional_kwargs["reasoning_content"]
        if message.tool_calls:
            dto["toolCalls"] = [
                {"id": call.get("id"), "name": call["name"], "args": call["args"]}
                for call in message.tool_calls
            ]
        return dto
    if isinstance(message, ToolMessage):
        return {
            "id": message.id,
            "role": "tool",
            "content": content_text(message.content),
            "name": message.name,
            "toolCallId": message.tool_call_id,
            "status": message.status or "success",
        }
    return None


def message_dtos(messages: Iterable[BaseMessage]) -> list[dict[str, Any]]:
    return [dto for dto in map(message_dto, messages) if dto is not None]


def pending_dtos(inputs: Iterable[dict[str, str]]) -> list[dict[str, Any]]:
    """Accepted user messages that have not reached the thread yet (see `store.unapplied_input`)."""
    return [{"id": m["id"], "role": "user", "content": m["content"], "pending": True} for m in inputs]

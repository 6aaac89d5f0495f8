"""Exports of a conversation: a Markdown transcript and the JSONL checkpoint history.

Both are generated on request and never read back: deleting an export loses nothing.

The JSONL export says what each checkpoint means, not what its row stores: its message count
and last message are those of the thread as it stood at that checkpoint, which LangGraph
rebuilds from the nearest checkpoint holding the whole list and the writes after it. Most
checkpoints of the kit's messages channel store no messages of their own, while those of a file
written with LangGraph's default channel store the whole list each time; the export reads the
same for both.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from .messages import message_dto, message_dtos
from .storage.models import Conversation


def markdown_transcript(conversation: Conversation, messages: list[dict[str, Any]]) -> str:
    """The thread as Markdown: user and assistant text, tool calls and tool results."""
    lines = [
        f"# {conversation.title}",
        "",
        f"- Conversation (thread_id): `{conversation.id}`",
        f"- Created: {conversation.created_at}",
        f"- Updated: {conversation.updated_at}",
        "",
    ]
    for message in messages:
        if message["role"] == "user" and message.get("pending"):
            lines += ["## User (accepted, not answered yet: a resume answers it)", "", message["content"], ""]
        elif message["role"] == "user":
            lines += ["## User", "", message["content"], ""]
        elif message["role"] == "assistant":
            lines += ["## Assistant", ""]
            if message["content"]:
                lines += [message["content"], ""]
            for call in message.get("toolCalls", []):
                lines += [
                    f"> **Tool call** `{call['name']}` ({call.get('id') or '?'})",
                    "",
                    "```json",
                    json.dumps(call["args"], indent=2, ensure_ascii=False),
                    "```",
                    "",
                ]
        else:
            lines += [
                f"### Tool result: `{message.get('name')}` ({message.get('status') or 'success'})",
                "",
                "```",
                message["content"],
                "```",
                "",
            ]
    return "\n".join(lines)


def checkpoint_record(snapshot: Any) -> dict[str, Any]:
    """One checkpoint as the JSONL export shows it (plus the run id that wrote it).

    `snapshot` is a LangGraph `StateSnapshot`, whose values are the thread rebuilt at that
    checkpoint (never the checkpoint's stored blob, which may hold no messages)."""
    messages = snapshot.values.get("messages", []) if snapshot.values else []
    metadata = snapshot.metadata or {}
    return {
        "checkpoint_id": snapshot.config["configurable"]["checkpoint_id"],
        "created_at": snapshot.created_at,
        "step": metadata.get("step"),
        "source": metadata.get("source"),
        "next": list(snapshot.next),
        "message_count": len(message_dtos(messages)),
        "last_message": message_dto(messages[-1]) if messages else None,
        "run_id": metadata.get("run_id"),
    }


def checkpoint_jsonl(history_oldest_first: Iterable[Any]) -> str:
    """One JSON line per checkpoint, oldest first, ending with a newline."""
    return "".join(json.dumps(checkpoint_record(s), ensure_ascii=False) + "\n" for s in history_oldest_first)

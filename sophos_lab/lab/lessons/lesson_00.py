"""Lesson 00, start here: the helpers its cells call (read any of them with `lesson.name??`)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pandas as pd

if TYPE_CHECKING:
    from ..harness import Lab


def start_child(lab: Lab, child: str, **env: str) -> Any:
    """The agent in a child process that this notebook can stop (or kill): a Jupyter kernel of its
    own when `child` is `"kernel"`, a plain subprocess when it is `"worker"`; both behave the same."""
    return lab.kernel(**env) if child == "kernel" else lab.worker(**env)


def trace_table(events: list[dict[str, Any]]) -> pd.DataFrame:
    """The `trace` events of a run as a table, one row each: the `step`, the `node`, the `event`
    (`enter` a step, a tool `call` the model asked for, a tool's `result`), and for a call or a
    result the `tool` and its `status`. The `leave` events (a step is over) are left out."""
    rows = []
    for event in events:
        data = event["data"]
        if event["event"] != "trace" or data["event"] not in ("enter", "call", "result"):
            continue
        detail = data.get("data") or {}
        rows.append({"step": data["step"], "node": data["node"], "event": data["event"],
                     "tool": detail.get("name"), "status": detail.get("status")})
    return pd.DataFrame(rows, columns=["step", "node", "event", "tool", "status"])


def steps_entered(events: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """(step, node) of every step the run entered, from its `trace` `enter` events."""
    return [(e["data"]["step"], e["data"]["node"]) for e in events
            if e["event"] == "trace" and e["data"]["event"] == "enter"]


def tool_calls(events: list[dict[str, Any]]) -> list[str]:
    """The names of the tools the model asked for, in order, from the `trace` `call` events."""
    return [e["data"]["data"]["name"] for e in events if e["event"] == "trace" and e["data"]["event"] == "call"]


def shorten_blocks(text: str, keep: int = 400) -> str:
    """Markdown with the body of every fenced block cut to `keep` characters (the page a tool
    returned is long)."""
    parts = text.split("```")
    for i in range(1, len(parts), 2):  # odd parts are inside a fence
        if len(parts[i]) > keep:
            parts[i] = parts[i][:keep] + f"\n… ({len(parts[i]) - keep} more characters)\n"
    return "```".join(parts)


def shorten_jsonl(jsonl: str, keep: int = 60) -> str:
    """The JSON Lines export with each line's last message cut to `keep` characters."""
    lines = []
    for line in jsonl.splitlines():
        record = json.loads(line)
        last = record["last_message"]
        if last and len(last["content"]) > keep:
            last["content"] = last["content"][:keep] + "…"
        lines.append(json.dumps(record, ensure_ascii=False))
    return "\n".join(lines)

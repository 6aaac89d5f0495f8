"""Lesson 06c · When a tool answers with an error: the views its cells call.

Read any of them in the notebook with `??`, e.g. `lesson.tool_results??`. Starting a child is
lesson 06a's helper, the same here.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from .lesson_06a import start_child

__all__ = ["print_thread", "start_child", "tool_results"]


def tool_results(events: list[dict[str, Any]]) -> pd.DataFrame:
    """The `trace` events of kind `result` of a run (`child.events()`), one row per tool call:
    the tool's name, the call's id, what came back, and its `status` (`success` or `error`)."""
    return pd.DataFrame(
        [e["data"]["data"] for e in events if e["event"] == "trace" and e["data"]["event"] == "result"],
        columns=["name", "tool_call_id", "result", "status"],
    )


def print_thread(messages: pd.DataFrame, state: dict[str, Any]) -> None:
    """The thread in a few lines: its runs' statuses, `next`, and one line per message (`lab.messages`):
    the role, the tool it came from (or the tools the model called), its status, its text's start."""
    print("runs:", [status for status, _ in state["runs"]])
    print("next:", state["last_checkpoint"]["next"], "| resumable:", state["resumable"])
    for m in messages.fillna("").itertuples():
        who = m.name or ", ".join(m.tool_calls or [])
        text = " ".join(m.content.split())
        print(f"{m.role:<9} | {who:<24} | {m.status:<7} | {text[:60]}")

"""Lesson 06b · Tool server unavailable: the helpers its cells call.

Read any of them in the notebook with `??`, e.g. `lesson.fetch_servers_of??`. Starting a child
and reading its steps are lesson 06a's helpers, the same here.
"""

from __future__ import annotations

import json
from typing import Any

import pandas as pd
import psutil

from ..harness import Lab
from .lesson_06a import entered, start_child, steps_of

__all__ = ["ask_each", "entered", "fetch_server", "fetch_servers_of", "outcomes", "start_child", "steps_of"]


def fetch_server(lab: Lab) -> dict[str, Any]:
    """The `fetch` entry of this lab's `mcp.json` (the lab's copy: the kit's own file is never touched)."""
    return json.loads((lab.config_dir / "mcp.json").read_text())["fetch"]


def fetch_servers_of(child: Any) -> list[psutil.Process]:
    """The child's `fetch` MCP servers: its descendants whose command line runs `mcp_server_fetch`
    (`psutil` reads what `ps` would show)."""
    found = []
    for process in psutil.Process(child.pid).children(recursive=True):
        try:
            if any("mcp_server_fetch" in part for part in process.cmdline()):
                found.append(process)
        except psutil.Error:  # gone meanwhile, or a zombie
            pass
    return found


def ask_each(lab: Lab, child: Any, messages: list[str]) -> dict[str, tuple[str, dict[str, Any], dict[str, Any]]]:
    """Send each message in a new conversation, one after the other, each once the one before has
    ended: message → (its conversation, its final event, `lab.state` of it right after)."""
    asked = {}
    for message in messages:
        child.chat(message)
        conversation = child.conversation()
        event = child.wait_final()
        asked[message] = (conversation, event, lab.state(conversation))
    return asked


def outcomes(lab: Lab, asked: dict[str, tuple[str, dict[str, Any], dict[str, Any]]]) -> pd.DataFrame:
    """What became of each message of `ask_each`: its final event, its run's status and code, the
    error message, and its thread's `next` (the web server's address shortened to `<web>`)."""
    return pd.DataFrame([{"message": message.replace(lab.web.url, "<web>"), "event": event["event"],
                          "status": state["runs"][-1][0], "code": event["data"].get("code"),
                          "error message": event["data"].get("message"), "next": state["last_checkpoint"]["next"]}
                         for message, (_, event, state) in asked.items()])

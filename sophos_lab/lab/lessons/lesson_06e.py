"""Lesson 06e · Graceful shutdown: the stop points its cells set up, and its views.

Read any of them in the notebook with `??`, e.g. `lesson.drain_during_fetch??`. Starting a child
and listing the steps a run entered are lesson 06a's helpers, the same here.
"""

from __future__ import annotations

import threading
from typing import Any

from ..harness import Lab
from .lesson_06a import entered, start_child

__all__ = ["drain_during_fetch", "entered", "final_event", "naive_shutdown_mid_answer", "shutdown_in_background",
           "start_child"]


def shutdown_in_background(child: Any) -> tuple[threading.Thread, dict[str, int]]:
    """Send SIGTERM from a thread: `child.shutdown()` blocks until the child has exited. Returns
    the thread and a dict that gets the child's `exit_code` once it has."""
    outcome: dict[str, int] = {}
    thread = threading.Thread(target=lambda: outcome.update(exit_code=child.shutdown()))
    thread.start()
    return thread, outcome


def final_event(child: Any) -> dict[str, Any]:
    """The child's last run's final event: its `end` or its `chat-error`."""
    return next(e for e in child.events() if e["event"] in ("end", "chat-error"))


def naive_shutdown_mid_answer(lab: Lab, child: Any, message: str) -> tuple[str, dict[str, Any], int]:
    """Part 1: SIGTERM to a child started with `SOPHOS_LAB_NAIVE_SHUTDOWN="1"`, while the model is
    halfway through its answer (after the tool result). Returns (the conversation, the run's final
    event, the child's exit code).

    The scripted model is armed to freeze its summary halfway; the message is sent until the model
    asks for the fetch; once the stream is frozen, SIGTERM goes from a thread (the child cannot exit
    while its run waits on the frozen model). Only after the child says `connections-closed` (it
    has closed its MCP servers and its database) is the model released: released earlier, the
    model could finish, and the step be checkpointed, before the connections were gone."""
    lab.model.arm("summary")
    conversation = child.chat_until_tool_call(message, tool="fetch__fetch")
    lab.model.wait_paused()
    thread, outcome = shutdown_in_background(child)
    print("the child:", child.wait_for("shutdown-requested")["data"])
    child.wait_for("connections-closed")
    lab.model.release()
    thread.join()
    return conversation, final_event(child), outcome["exit_code"]


def drain_during_fetch(lab: Lab, child: Any, message: str) -> tuple[str, dict[str, Any], int]:
    """Part 2: SIGTERM to a default child during its tools step, the fetch allowed to finish.
    Returns (the conversation, the run's final event, the child's exit code).

    The web server holds the request for the page (`lab.web.hold`); the message is sent until the
    model asks for the fetch; once the request is held, SIGTERM goes from a thread, and the page is
    released once the child has acknowledged the signal (`shutdown-requested`)."""
    lab.web.hold("/wal.html")
    conversation = child.chat_until_tool_call(message, tool="fetch__fetch")
    lab.web.wait_held()
    thread, outcome = shutdown_in_background(child)
    print("the child:", child.wait_for("shutdown-requested")["data"])
    lab.web.release()
    thread.join()
    return conversation, final_event(child), outcome["exit_code"]


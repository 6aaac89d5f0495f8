"""Lesson 06d · Crash after a tool result: the kill point its cells set up, and its views.

Read any of them in the notebook with `??`, e.g. `lesson.freeze_mid_answer??`. Starting a child,
listing the steps a run entered and numbering the runs that wrote each checkpoint are lesson
06a's helpers, the same here.
"""

from __future__ import annotations

from typing import Any

from ..harness import Lab
from .lesson_06a import checkpoints_by_run, entered, start_child

__all__ = ["checkpoints_by_run", "entered", "freeze_mid_answer", "start_child"]


def freeze_mid_answer(lab: Lab, child: Any, message: str) -> tuple[str, dict[str, Any]]:
    """Send `message` and return once the run stands exactly after its tool result, with the
    model's answer frozen halfway: (the conversation's id, the tool's `result` trace event).

    The barriers of section 1, in order: the scripted model is armed to freeze its next summary
    halfway (`lab.model.arm("summary")`); the message is sent until the model asks for the fetch
    (a real model may answer in words first: then it is asked again, in a new conversation); the
    tool result has streamed; the model's stream is frozen; and its first words reached the child.
    The caller kills the child there, then calls `lab.model.release()`."""
    lab.model.arm("summary")
    conversation = child.chat_until_tool_call(message, tool="fetch__fetch")
    result = child.wait_for("trace", event="result")
    lab.model.wait_paused()
    child.wait_for("token")
    return conversation, result

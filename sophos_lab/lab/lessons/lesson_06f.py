"""Lesson 06f · Chat and resume: the helpers its cells call.

Read any of them in the notebook with `??`, e.g. `lesson.until_the_model_fetches??`.
"""

from __future__ import annotations

import json
from typing import Any

from ..harness import Lab


def until_the_model_fetches(child: Any, widget: Any, question: str, attempts: int = 3) -> None:
    """Wait until the model of the widget's turn asks for the page (`child.wait_for_tool_call()`).

    The scripted model always fetches. A real model may answer in words instead: then this waits
    for that turn to end, says so, and asks again in a new conversation (the widget's New button,
    the question typed again, Send), at most `attempts` times in all."""
    for attempt in range(1, attempts + 1):
        if child.wait_for_tool_call() is not None:
            return
        widget.join(60)
        print(f"Attempt {attempt}: the model answered without fetching the page. Asking again in a new conversation.")
        widget.new_button.click()
        widget.input.value = question
        widget.send_button.click()


def print_transcript(lab: Lab, transcript: list[Any]) -> None:
    """The widget's transcript, one line per item: its kind, the tool's name, the start of its text
    (the web server's address, which changes from run to run, shortened to `<wal.html>`)."""
    for item in transcript:
        text = " ".join((item.text or json.dumps(item.arguments)).split())
        text = text.replace(lab.page("wal.html"), "<wal.html>")
        print(f"{item.kind:<11} | {item.name:<12} | {text[:60]}")

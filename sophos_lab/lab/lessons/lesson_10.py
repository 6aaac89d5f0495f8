"""Lesson 10 · Cancel a run: what the lesson uses besides the lesson itself.

The barrier that holds the model half-way through its answer (`hold_half_way`), and small views of
what the agent process streamed (`answer_so_far`, `entered`, `tool_results`) and of the runs table
(`runs_summary`). Read any of them with `??`, e.g. `lesson.hold_half_way??`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..children import LabKernel, LabWorker
    from ..harness import Lab

COMMITTED = "/ledger-committed"
"""Where the ledger server reports each committed payment (the lab's web server can hold the report)."""


def hold_half_way(lab: Lab) -> None:
    """Hold the next answer after a tool result half-way: the scripted model's `summary` pause or,
    with another model, the recording proxy's, after 20 chunks. `lab.model.wait_paused()` returns
    once the stream is held; `lab.model.release()` lets it go on."""
    if lab.scripted:
        lab.model.arm("summary")
    else:
        lab.model.arm("summary", after_chunks=20)


def answer_so_far(child: LabKernel | LabWorker) -> str:
    """The text the model has streamed to the child since the latest run's tool result."""
    events = child.events()
    start = max(i for i, e in enumerate(events) if e["event"] == "trace" and e["data"]["event"] == "result")
    return "".join(e["data"] for e in events[start:] if e["event"] == "token")


def entered(child: LabKernel | LabWorker) -> list[tuple[int, str]]:
    """(step, node) of every step the child's latest run entered, in order."""
    return [(e["data"]["step"], e["data"]["node"]) for e in child.events()
            if e["event"] == "trace" and e["data"]["event"] == "enter"]


def tool_results(child: LabKernel | LabWorker) -> list[dict[str, Any]]:
    """The tool results of the child's latest run: each with its name, tool_call_id, result and status."""
    return [e["data"]["data"] for e in child.events()
            if e["event"] == "trace" and e["data"]["event"] == "result"]


def runs_summary(lab: Lab, conversation: str) -> str:
    """Each run of `conversation`: its status, error code and message, one a line, numbered in start order."""
    runs = lab.peek_runs(conversation)
    return "\n".join(f"run {n}: {r.status} {r.error_code or '-'} ({r.error_message or '-'})"
                     for n, r in enumerate(runs.itertuples(), 1))


def bullets(answer: str) -> int:
    """How many `- ` bullet points a Markdown answer has (its first line, and each line after)."""
    return (answer.startswith("- ")) + answer.count("\n- ")

"""What a thread has left to do: the one rule every view of "resumable" reads.

LangGraph saves a step in two commits: each task's pending writes when the task finishes
(`put_writes`), then the checkpoint that folds them into the thread once every task of the step
has (`put`). A run stopped between the two — cancelled, killed, shut down: a few milliseconds
per step — leaves a latest checkpoint whose task has finished. LangGraph's live `next` leaves
that task out (it needs no running), so `next` is empty, yet `astream(None)` still has work:
it folds the saved writes into a checkpoint without running the task again, then goes on.

So "work left" is every task of the latest checkpoint: those with no writes yet (`next`) and
those whose writes are saved but not folded. Either way a resume continues the thread and
repeats no finished task.
"""

from __future__ import annotations

from typing import Any

from langgraph.constants import START


def work_left(snapshot: Any) -> tuple[str, ...]:
    """The nodes `astream(None)` would run or fold on the thread, from its latest `StateSnapshot`
    (live or from the history): empty when the thread has ended (or never started)."""
    return tuple(task.name for task in snapshot.tasks) if snapshot is not None else ()


def unfolded(snapshot: Any) -> tuple[str, ...]:
    """What new input on the thread would drop, from its latest live `StateSnapshot`: LangGraph
    discards the latest checkpoint's tasks when a run starts with input. These are the tasks that
    finished after that checkpoint (writes saved, not folded yet), and an input step
    (`__start__`) that has not run: it only moves the accepted message into the thread. Empty
    unless every task of the checkpoint is one of them: a task still to run (a failed model step,
    a gate) is dropped by new input as it always was."""
    if snapshot is None or not snapshot.tasks:
        return ()
    done = tuple(task.name for task in snapshot.tasks if task.name == START
                 or (task.result is not None and task.error is None and not task.interrupts))
    return done if len(done) == len(snapshot.tasks) else ()


def is_resumable(work: tuple[str, ...], pending_input: bool, busy: bool) -> bool:
    """Whether Resume continues the thread: it has work left (`work_left`) or a message
    accepted that never reached it, and no run holds it (running, or waiting at a gate)."""
    return bool(work or pending_input) and not busy

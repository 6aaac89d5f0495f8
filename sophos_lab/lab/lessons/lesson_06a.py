"""Lesson 06a · Model unavailable: the helpers its cells call, and its exercise's test.

Read any of them in the notebook with `??`, e.g. `lesson.steps_of??`. Lessons 06b to 06e start
their children and read their steps with the same helpers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pandas as pd

from ..children import LabKernel, LabWorker
from ..harness import Lab


def start_child(lab: Lab, kind: str = "kernel", **env: str) -> LabKernel | LabWorker:
    """The agent in a child process that the notebook can stop (or kill).

    `kind` is the lesson's `CHILD`: `"kernel"` (a Jupyter kernel of its own) or `"worker"` (a
    plain subprocess); both behave the same. `env` changes settings for this child only, e.g.
    `OLLAMA_HOST=DEAD` (a model address where nothing listens)."""
    return lab.kernel(**env) if kind == "kernel" else lab.worker(**env)


def steps_of(events: list[dict[str, Any]]) -> pd.DataFrame:
    """The `enter`, `call` and `result` trace events of a run (`child.events()`), one row each:
    the step, the node, the event, and for a tool call or result the tool's name and status."""
    rows = []
    for event in events:
        if event["event"] == "trace" and event["data"]["event"] in ("enter", "call", "result"):
            detail = event["data"].get("data") or {}
            rows.append({"step": event["data"]["step"], "node": event["data"]["node"], "event": event["data"]["event"],
                         "tool": detail.get("name"), "status": detail.get("status")})
    return pd.DataFrame(rows, columns=["step", "node", "event", "tool", "status"])


def entered(child: LabKernel | LabWorker) -> list[tuple[int, str]]:
    """(step, node) of every step the child's latest run entered, in order."""
    return [(e["data"]["step"], e["data"]["node"]) for e in child.events()
            if e["event"] == "trace" and e["data"]["event"] == "enter"]


def checkpoints_by_run(lab: Lab, conversation: str) -> pd.DataFrame:
    """The conversation's checkpoints, oldest first (step, source, next, message count, last role),
    with `run`: the number (1, 2, ... in start order) of the run that wrote each."""
    runs = lab.peek_runs(conversation)
    number = {run_id: n for n, run_id in enumerate(runs["id"], start=1)}
    points = lab.checkpoints(conversation)
    columns = ["step", "source", "next", "message_count", "last_role", "run"]
    return points.assign(run=points["run_id"].map(number))[columns]


def kill_after_accepting(lab: Lab, message: str) -> str:
    """Lesson 03's worst moment: a worker that stops itself (SIGSTOP) right after its first commit,
    the run's row with the accepted `message`, is killed there. Returns the conversation's id.

    A plain subprocess whatever the lesson's `CHILD`: its start is quick, and it tells the lab
    when it has stopped itself."""
    doomed = lab.worker(SOPHOS_LAB_STOP_AFTER_WRITE="1")
    doomed.chat(message)
    doomed.wait_stopped()
    print("exit code:", doomed.kill())
    return lab.peek_runs()["conversation_id"].iloc[-1]


class ReadOnlyViews:
    """The lab as the exercise's function may see it: its read-only views, nothing that judges."""

    ALLOWED = ("conversations", "peek_runs", "runs", "checkpoints", "writes", "messages", "gates")

    def __init__(self, lab: Lab) -> None:
        self._lab = lab

    def __getattr__(self, name: str) -> Any:
        if name in self.ALLOWED:
            return getattr(self._lab, name)
        raise AssertionError(f"resumable_conversations used lab.{name}: work it out from the "
                             f"read-only views alone (lab.{', lab.'.join(self.ALLOWED)})")


def test_resumable_conversations(lab: Lab, resumable_conversations: Callable[[Any], Any],
                                 named: Mapping[str, str]) -> None:
    """The exercise's test: the learner's `resumable_conversations` gets the lab's read-only views
    (and nothing else), and its answer must be the runtime's verdict, `lab.state(c)["resumable"]`,
    for every conversation. `named` (conversation id → how the lesson calls it) words the reasons."""
    answer = resumable_conversations(ReadOnlyViews(lab))
    assert isinstance(answer, (set, frozenset)), (
        f"resumable_conversations should return a set of conversation ids, not a {type(answer).__name__}")
    ids = lab.conversations()["id"].tolist()
    assert answer <= set(ids), (
        f"Your set holds {len(answer - set(ids))} item(s) that are not conversation ids of the lab "
        "(the `id` column of lab.conversations())")
    order = list(named)
    for conversation in sorted(ids, key=lambda x: order.index(x) if x in named else len(named)):
        truth = lab.state(conversation)
        name = named.get(conversation, f"Conversation {conversation[:8]}")
        runs = ", ".join(lab.peek_runs(conversation)["status"])
        last = truth["last_checkpoint"]
        work = "no checkpoint at all" if last is None else f"its latest checkpoint's next is {tuple(last['next'])}"
        if truth["resumable"] and conversation not in answer:
            why = (f"its latest run's accepted message never reached the thread ({work}, but the run's "
                   "`input` holds the message): a resume enters it" if truth.get("pending")
                   else f"{work}: a resume runs that step")
            raise AssertionError(f"{name} is resumable and your set leaves it out. Its runs: {runs}; {why}.")
        if not truth["resumable"] and conversation in answer:
            raise AssertionError(
                f"{name} is not resumable, yet your set has it. Its runs: {runs}; {work}, and no accepted message "
                "is missing from the thread: nothing is left to do. A failed run stays in the history after "
                "a resume has finished its work: look at the thread, not at the runs' statuses.")

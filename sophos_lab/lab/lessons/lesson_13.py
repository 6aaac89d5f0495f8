"""Lesson 13 · Challenge 1 · Cancellation semantics: the kill point, the tools of your experiments,
their checks, the lesson's own experiments and its picture.

    from sophos_lab.lab.lessons import lesson_13 as lesson
    kit = lesson.CancelKit.setup(lab, CHILD)      # writes the kill point into the lab folder
    crashing = kit.start_child(stop_after_cancel_request=True)
    kit.test_cancel_then_crash(cancel_then_crash)  # the check of your first experiment

The kill point (`KILL_POINT`) is this lesson's own: a `sitecustomize.py` that Python runs as a
child starts, which wraps the kit's write of a cancel request (`Storage.request_cancel`) and
stops the child for good right after it, on the thread of its event loop, which every write of
the run goes through. A SIGKILL then lands between the request and the outcome.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from ..children import child_environment
from ..pictures import Picture
from ..pictures.cancel import CancelRun, cancel_picture

PAGE = "/wal.html"
"""The page's path on the lab's web server (`lab.web.hold(PAGE)` holds its next request)."""

KILL_POINT = '''\
"""This lesson's kill point. Python runs this file as the child starts (its folder is first on
the child's PYTHONPATH). Once the child has written a cancel request, it stops there for good."""
import threading

from sophos_lab.lab.worker import emit_line
from sophos_lab.runtime.storage.rules import Storage

_request_cancel = Storage.request_cancel


async def request_cancel(self, run_id):
    accepted = await _request_cancel(self, run_id)  # the kit's write of runs.cancel_requested_at, committed
    if accepted:
        emit_line({"event": "cancel-stop", "data": {"run": run_id}})  # tell the lab
        # Wait forever, on the thread that runs the agent's event loop: every write of the run goes
        # through it, so the run is not stopped and no outcome is written. Only a kill ends this.
        threading.Event().wait()
    return accepted


Storage.request_cancel = request_cancel
'''
"""The kill point's source, as `CancelKit.setup` writes it to `kill_point/sitecustomize.py`."""


def message(lab: Any) -> str:
    """The lesson's question: fetch the page and summarise it."""
    return f"Fetch {lab.page('wal.html')} and summarize it in 12 detailed bullet points."


def press_stop(child: Any, conversation: str) -> None:
    """Press Stop for the conversation's run in `child`, and return at once. (`child.cancel(c)`
    presses it too, then waits for the run's final event, which a child stopped at the kill point
    never sends.)"""
    try:
        child.cancel(conversation, timeout=0)
    except TimeoutError:
        pass  # sent; the answer, if any, comes later


def steps_of(events: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """(step, node) of every step entered in `events`."""
    return [(e["data"]["step"], e["data"]["node"]) for e in events
            if e["event"] == "trace" and e["data"]["event"] == "enter"]


def entered(child: Any) -> list[tuple[int, str]]:
    """(step, node) of every step the child's latest run entered."""
    return steps_of(child.events())


def now() -> float:
    """Seconds since the epoch (the moments the lesson records itself)."""
    return pd.Timestamp.now(tz="UTC").timestamp()


def seconds(value: Any) -> float | None:
    """An ISO time of the runs table as seconds since the epoch (None for none)."""
    return None if value is None or (isinstance(value, float) and pd.isna(value)) else pd.Timestamp(value).timestamp()


@dataclass
class Crashed:
    """What the first experiment left: the run that was stopped, then killed, and what became of it."""

    conversation: str
    run: str
    status: str
    """The status the reopening process gave the run."""
    exit_code: int
    """The child's exit code (-9: SIGKILL)."""
    by: str
    """"you", or "the lesson" when the lesson ran the experiment itself."""


@dataclass
class Resumed:
    """What the second experiment left: the run stopped in its tool call, and the resume."""

    conversation: str
    stopped: str
    """The id of the cancelled run."""
    steps: list[tuple[int, str]]
    """The (step, node) pairs the resume entered."""
    fetched: int
    """How many times the page was fetched, by the cancelled call and the resume."""
    by: str


@dataclass
class WithoutStop:
    """The lesson's contrast: the same kill, with no Stop pressed first."""

    conversation: str
    exit_code: int
    at_kill: pd.Series
    """The run's row right after the kill, before any process opened the file again."""
    after_open: pd.Series
    """The run's row after the next process looked."""
    late: dict[str, Any]
    """The answer to the Stop pressed after the crash."""
    killed_at: float
    """When the child got SIGKILL (seconds since the epoch)."""
    late_at: float
    """When that Stop was refused (seconds since the epoch)."""


@dataclass
class CancelKit:
    """The lesson's lab, the children it started (oldest first) and what its experiments found."""

    lab: Any
    child_kind: str = "kernel"
    children: list[Any] = field(default_factory=list)
    crashed: Crashed | None = None
    """What your first experiment left, once its check passed."""
    resumed: Resumed | None = None
    """What your second experiment left, once its check passed."""

    @classmethod
    def setup(cls, lab: Any, child_kind: str = "kernel") -> CancelKit:
        """The kit of `lab`: writes the kill point into `kill_point/sitecustomize.py` in its folder."""
        kit = cls(lab, child_kind)
        kit.kill_point_dir.mkdir(exist_ok=True)
        (kit.kill_point_dir / "sitecustomize.py").write_text(KILL_POINT)
        return kit

    @property
    def kill_point_dir(self) -> Path:
        """The folder of the kill point's `sitecustomize.py`, in the lab folder."""
        return self.lab.root / "kill_point"

    def start_child(self, stop_after_cancel_request: bool = False) -> Any:
        """A fresh agent process of the kind chosen by CHILD; with `stop_after_cancel_request`, one
        that stops for good right after it has written a cancel request, and says so with a
        `cancel-stop` event (the kill point, section 1)."""
        env = {}
        if stop_after_cancel_request:
            env["PYTHONPATH"] = os.pathsep.join([str(self.kill_point_dir), child_environment({})["PYTHONPATH"]])
            # A fresh interpreter, not one forked from the lab's fork server: only an interpreter that
            # starts runs the kill point's sitecustomize.py.
            env["SOPHOS_LAB_FORKSERVER"] = "0"
        new = self.lab.kernel(**env) if self.child_kind == "kernel" else self.lab.worker(**env)
        self.children.append(new)
        return new

    def hold_half_way(self) -> None:
        """Hold the model's next answer after a tool result half-way (the scripted model's `summary`
        pause; with another model, the recording proxy's, after 20 chunks)."""
        if self.lab.scripted:
            self.lab.model.arm("summary")
        else:
            self.lab.model.arm("summary", after_chunks=20)

    def run_events(self, run_id: str) -> tuple[Any, list[dict[str, Any]]]:
        """(the child that ran run `run_id`, that run's events in order), or (None, [])."""
        for agent in self.children:
            log = agent.log.events
            for start, event in enumerate(log):
                if event["event"] == "started" and event["data"]["run"] == run_id:
                    end = next((i for i in range(start, len(log)) if log[i]["event"] in ("end", "chat-error")
                                and log[i]["data"].get("run") == run_id), len(log) - 1)
                    return agent, log[start:end + 1]
        return None, []

    def tidy(self, started_before: int) -> None:
        """After an experiment, whatever it left: kill the children it started that still live, and
        let go of the model's held answers and the web server's held requests."""
        for agent in self.children[started_before:]:
            if agent.is_alive():
                agent.kill()
        self.lab.model.release()
        self.lab.web.release()

    def runs_summary(self, conversation: str) -> str:
        """Each run's status, error code and message, one per line, numbered in start order."""
        runs = self.lab.peek_runs(conversation)
        return "\n".join(f"run {n}: {r.status} {r.error_code or '-'} ({r.error_message or '-'})"
                         for n, r in enumerate(runs.itertuples(), 1))

    # the checks of your experiments

    def test_cancel_then_crash(self, cancel_then_crash: Any) -> Crashed:
        """Run your `cancel_then_crash(lab)` and check what it did: a run in a child of its own, the
        cancel request on the run's row, the child dead of SIGKILL before it announced the run's
        end, the database opened since, and the status you returned is the row's. Then tidy up."""
        runs_before, started_before = set(self.lab.peek_runs()["id"]), len(self.children)
        self.crashed = None
        try:
            self.crashed = self._verify_crash(cancel_then_crash(self.lab), runs_before, started_before)
            return self.crashed
        finally:
            self.tidy(started_before)  # what a failed experiment left: its children, held answers

    def _verify_crash(self, answer: Any, runs_before: set[str], started_before: int) -> Crashed:
        runs = self.lab.peek_runs()
        new = runs[~runs["id"].isin(runs_before)]
        assert len(new), "your experiment started no run: ask MESSAGE in a child with chat_until_tool_call first"
        run = new.iloc[-1]  # the latest run your experiment started
        agent, events = self.run_events(run["id"])
        assert agent is not None and agent in self.children[started_before:], (
            "the check can't find the child that ran your run among the children your experiment started: "
            "start it with start_child(stop_after_cancel_request=True)")
        assert not pd.isna(run["cancel_requested_at"]), (
            "the run's row holds no cancel request (runs.cancel_requested_at is empty): the child died before "
            "it accepted a Stop, so your experiment was a crash with no Stop in it. Press Stop first "
            "(press_stop(crashing, c)), wait until the child has written the request "
            "(crashing.wait_for(\"cancel-stop\")), then kill it")
        assert not agent.is_alive(), (
            "the child that ran the run is still alive (stopped at the kill point): kill it with crashing.kill() "
            "once it has written the cancel request")
        code = agent.log.wait_for("process-exited", timeout=10, since=0)["data"]["returncode"]
        assert code == -9, (
            f"the child that ran the run ended with exit code {code}, not by SIGKILL (-9): a crash is "
            "crashing.kill(), not a graceful stop")
        told = [e for e in events if e["event"] in ("end", "chat-error")]
        assert not told, (
            f"the child recorded the run's end and announced it ({told[-1]['event']} "
            f"{told[-1]['data'].get('code') or told[-1]['data'].get('status')}) before it died, so your kill "
            "came after the outcome and tested nothing about a crash. crashing.cancel(c) waits for that end: "
            "press Stop with press_stop(crashing, c), wait for \"cancel-stop\", and kill there")
        status = run["status"]
        assert status != "running", (
            "the run still says 'running' on disk: no process has opened the database since the kill "
            "(lab.peek_runs only reads; it never recovers anything). What the run becomes is decided by the "
            "next process that opens the file: open it (start_child().conversations()) and return the "
            "status that process reports")
        if answer != status:
            # Not the row's status itself: that is a prediction's answer, revealed below the check.
            before = (" 'running' is what the file said before a process had opened it again."
                      if answer == "running" else "")
            raise AssertionError(f"you returned {answer!r}, which is not what the run's row says now.{before} "
                                 "Return the status the reopening process reports")
        return Crashed(run["conversation_id"], run["id"], status, code, by="you")

    def test_resume_after_cancelled_call(self, resume_after_cancelled_call: Any, child: Any) -> Resumed:
        """Run your `resume_after_cancelled_call(lab, child)` and check what it did: a run cancelled
        while its tool call was in flight, a resume after it (no new message) that completed, the
        steps you returned are that resume's, and the page's fetches agree with them. Then tidy up."""
        runs_before, fetches_before, started_before = set(self.lab.peek_runs()["id"]), self.lab.fetches(PAGE), len(self.children)
        self.resumed = None
        try:
            self.resumed = self._verify_resume(resume_after_cancelled_call(self.lab, child), runs_before, fetches_before)
            return self.resumed
        finally:
            self.tidy(started_before)  # what a failed experiment left: held answers and pages (the lesson's child lives on)

    def _verify_resume(self, answer: Any, runs_before: set[str], fetches_before: int) -> Resumed:
        lab = self.lab
        runs = lab.peek_runs()
        new = runs[~runs["id"].isin(runs_before)]
        stopped = new[new["status"] == "cancelled"]
        assert len(stopped), (
            "no run of your experiment was cancelled" + (f" (its runs ended {sorted(set(new['status']))})" if len(new)
                                                        else " (it started no run)")
            + ": ask MESSAGE in `child` and press Stop (child.cancel(c)) while the fetch server waits for the page")
        stop = stopped.iloc[-1]
        c = stop["conversation_id"]
        marks = lab.checkpoints(c)
        last = marks[marks["run_id"] == stop["id"]].iloc[-1]  # the cancelled run's last checkpoint
        if list(last["next"]) != ["tools"]:
            where = ("after the tool's result was saved (the page is in the thread), so the resume had only the "
                     "answer left: that is the case of the lesson Cancel a run" if last["step"] >= 2
                     else "before the model had asked for the page")
            raise AssertionError(
                f"the cancelled run's last checkpoint is step {last['step']}, with next {list(last['next'])}: your "
                f"Stop landed {where}. Stop while the call is in flight: lab.web.hold(PAGE) before the message, "
                "lab.web.wait_held() (the fetch server waits for the page), then child.cancel(c)")
        later = runs[(runs["conversation_id"] == c) & (runs.index > stop.name)]
        assert len(later), ("nothing ran on the cancelled conversation after the Stop: resume it (child.resume(c)) "
                            "and wait for the resume's end (child.wait_final())")
        again = later.iloc[0]
        assert pd.isna(again["input"]), (
            "the run after the Stop carries a new message: that is a new turn, not a resume. child.resume(c) "
            "goes on from the thread's last checkpoint, with no new input")
        assert again["status"] == "completed", (
            f"the resume is {again['status']}, not completed: wait for its end (child.wait_final()) before you "
            "return")
        _, events = self.run_events(again["id"])
        steps = steps_of(events)
        got = [tuple(step) for step in answer] if isinstance(answer, (list, tuple)) else answer
        # The messages do not name the resume's steps or the count of fetches: those are predictions'
        # answers, revealed below the check.
        assert got == steps, (
            f"you returned {answer!r}, which are not the steps the resume entered: return the steps of the "
            "resume (entered(child) once child.wait_final() has returned), not those of another run")
        fetched = lab.fetches(PAGE) - fetches_before
        expected = 1 + sum(node == "tools" for _, node in steps)
        assert fetched == expected, (
            "the page's fetches in your experiment do not add up to the cancelled call and the resume's steps: "
            "let the held request go after the Stop (lab.web.release()), so that the web server answers it")
        return Resumed(c, stop["id"], steps, fetched, by="you")

    # the lesson's own experiments

    def lessons_cancel_then_crash(self) -> Crashed:
        """The lesson's own run of the first experiment, for the reveals when yours has not passed
        its check yet. It is one answer to the exercise: read it once you have tried yours."""
        started_before = len(self.children)
        self.lab.model.release()  # nothing an earlier experiment left stays held
        crashing = self.start_child(stop_after_cancel_request=True)
        try:
            self.hold_half_way()
            c = crashing.chat_until_tool_call(message(self.lab), tool="fetch__fetch")
            self.lab.model.wait_paused()
            crashing.wait_for("token")           # the answer is streaming
            press_stop(crashing, c)
            run = crashing.wait_for("cancel-stop")["data"]["run"]  # the request is committed; the child stopped
            code = crashing.kill()
            self.lab.model.release()
            looker = self.start_child()          # a new process: its first look opens the database
            status = next(conv["status"] for conv in looker.conversations() if conv["id"] == c)
        finally:
            self.tidy(started_before)
        return Crashed(c, run, status, code, by="the lesson")

    def lessons_resume_after_cancelled_call(self, child: Any) -> Resumed:
        """The lesson's own run of the second experiment, in `child`, for the reveals when yours has
        not passed its check yet. It is one answer to the exercise: read it once you have tried yours."""
        fetches_before = self.lab.fetches(PAGE)
        self.lab.model.release()
        self.lab.web.hold(PAGE)
        try:
            c = child.chat_until_tool_call(message(self.lab), tool="fetch__fetch")
            self.lab.web.wait_held()             # the call is in flight
            child.cancel(c)
            self.lab.web.release()
            child.resume(c)
            child.wait_final()
            steps = entered(child)
        finally:
            self.lab.web.release()
        runs = self.lab.peek_runs(c)
        stopped = runs[runs["status"] == "cancelled"]["id"].iloc[-1]
        return Resumed(c, stopped, steps, self.lab.fetches(PAGE) - fetches_before, by="the lesson")

    def kill_without_stop(self, looker: Any) -> WithoutStop:
        """The same kill as the first experiment, minus the Stop: a fresh child, the question, the
        answer held half-way, SIGKILL while it streams. Then `looker` lists the conversations (its
        listing relabels the runs of processes that are gone), and presses Stop on that conversation."""
        self.lab.model.release()                 # nothing an earlier experiment left stays held
        plain = self.start_child()
        self.hold_half_way()
        c = plain.chat_until_tool_call(message(self.lab), tool="fetch__fetch")
        self.lab.model.wait_paused()
        plain.wait_for("token")                  # the answer is streaming
        code = plain.kill()                      # SIGKILL; nobody pressed Stop
        killed_at = now()
        self.lab.model.release()
        at_kill = self.lab.peek_runs(c).iloc[-1]
        looker.conversations()                   # the next process looks
        after_open = self.lab.peek_runs(c).iloc[-1]
        late = looker.cancel(c)                  # Stop, pressed after the crash
        return WithoutStop(c, code, at_kill, after_open, late, killed_at, now())

    # the picture

    def cancel_run(self, conversation: str, label: str, killed: bool, silent_from: float | None = None,
                   refused_cancel: float | None = None) -> CancelRun:
        """The latest run of `conversation`, as its row records it, for the picture. `killed`: its
        process died without recording the outcome, so the next process to open the file wrote it;
        `silent_from`: when that process stopped writing (default: its cancel request, at which the
        kill point stopped it)."""
        run = self.lab.peek_runs(conversation).iloc[-1]
        requested = seconds(run["cancel_requested_at"])
        return CancelRun(label, seconds(run["started_at"]), requested, seconds(run["finished_at"]), run["status"],
                         outcome_by_next_process=killed, refused_cancel=refused_cancel,
                         silent_from=(silent_from or requested) if killed else None)

    def picture(self, crashed: Crashed, plain: WithoutStop) -> Picture:
        """The two runs of sections 1 and 2: when the cancel was requested, when the outcome was
        written and by whom, and which came first (`sophos_lab.lab.pictures.cancel`)."""
        return cancel_picture([
            self.cancel_run(crashed.conversation, "Stop, then SIGKILL", killed=crashed.exit_code == -9),
            self.cancel_run(plain.conversation, "SIGKILL, then Stop", killed=plain.exit_code == -9,
                            silent_from=plain.killed_at,
                            refused_cancel=plain.late_at if plain.late.get("event") == "rejected" else None),
        ])

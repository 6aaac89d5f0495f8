"""The lab track's notebook side: your ✏️ stage cells become your agent module, and the grader grades it.

    track = Track(lab)                  # in the lab notebook, after Lab.setup(...)
    graded = track.grade("C")           # your stage cells A to C, as .lab/<lab>/agent_c.py, graded
    check_exercise("stage_c", graded.check)

Each stage of the lab is one ✏️ cell, `# ✏️ EXERCISE stage_<x>: ...` on its first line. Your agent
at stage C is your cells of stages A, B and C, in that order, in one file: a later cell adds
functions and may write one again, and Python keeps the last definition (stage C's `run_turn`
replaces stage B's, and stage B's `read`, which calls `thread_messages`, calls the one the
module ends with). `module(stage)` writes that file from the cells as you last ran them (seen as
they run, and in the kernel's history), so run a cell after changing it, then grade. Open the file to read your whole
agent; the grader runs it in processes of its own, as `sophos-lab grade` would.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from ..lab.harness import Lab
from .driver import Lane
from .grader import Reference, grade_on, open_lanes
from .result import Graded
from .stages import STAGES, TITLES

CELL = re.compile(r"^# ✏️ EXERCISE stage_(?P<stage>[a-e]):")


def assemble(cells: dict[str, str], stage: str) -> str:
    """Your module at `stage`: the cells of stages A to `stage`, in order."""
    stage = stage.upper()
    parts = [f'"""Your agent at stage {stage} ({TITLES[stage]}): your cells of stages A to {stage}, in order.\n\n'
             'Written by the lab notebook from your ✏️ cells, as you last ran them; graded by '
             '`sophos_lab.grading.grade`."""\n']
    for each in STAGES[: STAGES.index(stage) + 1]:
        parts.append(f"# --- stage {each}: {TITLES[each]} " + "-" * 40 + "\n" + cells[each].strip("\n") + "\n")
    return "\n\n".join(parts)


def ran_cells() -> dict[str, str]:
    """The stage cells this kernel's history holds, the latest run of each."""
    from IPython import get_ipython

    shell = get_ipython()
    found: dict[str, str] = {}
    for source in (shell.history_manager.input_hist_raw if shell is not None else []):
        matched = CELL.match(source)
        if matched:
            found[matched["stage"].upper()] = source
    return found


_watching: list = []
"""The `pre_run_cell` callback of the latest `Track` (one at a time: a new one replaces it)."""


def watch_cells(cells: dict[str, str]) -> None:
    """Record each stage cell into `cells` as it runs, from now on: a kernel that keeps no history of
    what it ran (a notebook run by a test runner) still hands every cell to this IPython event."""
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        return

    def ran(info) -> None:
        matched = CELL.match(info.raw_cell or "")
        if matched:
            cells[matched["stage"].upper()] = info.raw_cell

    for old in _watching:
        shell.events.unregister("pre_run_cell", old)
    _watching[:] = [ran]
    shell.events.register("pre_run_cell", ran)


_lanes_of_the_last_track: list[Lane] = []


@dataclass
class Track:
    """The lab notebook's grading: where your modules go, and how fully they are graded."""

    lab: Lab
    every_point: bool = True
    """Every kill point (False: the first of each kind and the last, about a third, for a quick look)."""
    lanes: int = 2
    """Labs grading side by side (each its own model, web server and ledger)."""
    graded: dict[str, Graded] = field(default_factory=dict)
    cells: dict[str, str] = field(default_factory=dict)
    """The stage cells run since this track was made, the latest run of each."""

    _open: list[Lane] = field(default_factory=list)

    def __post_init__(self) -> None:
        watch_cells(self.cells)
        for lane in _lanes_of_the_last_track:  # the setup cell run again: its old labs go
            lane.close()
        _lanes_of_the_last_track.clear()

    def open_lanes(self) -> list[Lane]:
        """This notebook's grading labs (`.lab/<lab>/grading-<n>/`), set up on the first grading and
        kept for the next ones; `lab.close()` closes them with the lab's other children."""
        if not self._open:
            self._open = open_lanes(f"{self.lab.name}/grading", self.lanes)
            self.lab._children.extend(self._open)
            _lanes_of_the_last_track[:] = self._open
        return self._open

    def module(self, stage: str, cells: dict[str, str] | None = None) -> Path:
        """Write your agent at `stage` to `agent_<stage>.py` in the lab folder; its path."""
        stage = stage.upper()
        cells = {**ran_cells(), **self.cells} if cells is None else cells
        missing = [each for each in STAGES[: STAGES.index(stage) + 1] if each not in cells]
        if missing:
            raise LookupError(f"run the ✏️ cell of stage {missing[0]} first: stage {stage} builds on it")
        path = self.lab.root / f"agent_{stage.lower()}.py"
        path.write_text(assemble(cells, stage), encoding="utf-8")
        return path

    def grade(self, stage: str) -> Graded:
        """Grade your stage cells up to `stage`; prints the one-line verdict and returns the result."""
        stage = stage.upper()
        try:
            path = self.module(stage)
        except LookupError as missing:
            result = Graded(module=self.lab.root / f"agent_{stage.lower()}.py", stage=stage,
                            reference=Reference(error=str(missing), not_done=True))
        else:
            result = grade_on(self.open_lanes(), path, stage, every_point=self.every_point)
        self.graded[stage] = result
        print(result.summary)
        return result

    def kit(self) -> Graded:
        """The kit's own runtime (`kit_agent.py`), graded by the same grader as your agent."""
        from . import KIT_AGENT

        result = grade_on(self.open_lanes(), KIT_AGENT, "kit", every_point=self.every_point)
        print(result.summary.replace("your agent", "the kit", 1))
        return result


def share(graded: Graded, verdict: str) -> str | None:
    """At how many of `graded`'s points `verdict` was found: "all", "some" or "none" (None: not
    graded). `"recovers"` counts the points with no verdict at all."""
    if not graded.outcomes:
        return None
    found = [(o.recovers if verdict == "recovers" else verdict in o.verdicts) for o in graded.outcomes]
    return "all" if all(found) else "some" if any(found) else "none"


def where_lost(graded: Graded) -> str | None:
    """The kind of point where a message was lost: "the run's row" (a write before the turn's first
    checkpoint), "a model request", "the payment", several of these joined, or "nowhere"."""
    if not graded.outcomes:
        return None
    kinds = []
    for outcome in graded.outcomes:
        if "lost" in outcome.verdicts:
            point = outcome.point
            kind = ("the run's row" if point.trigger == "write" and point.before_input else
                    "a model request" if point.trigger == "model" else
                    "the payment" if point.trigger == "payment" else point.kind)
            if kind not in kinds:
                kinds.append(kind)
    return " and ".join(kinds) or "nowhere"


def payments_at(graded: Graded, point: str = "payment committed") -> int | None:
    """The payments the ledger held at the end of the run killed at `point` (None: no such point)."""
    found = [o.payments for o in graded.outcomes if o.point.name == point]
    return found[0] if found else None

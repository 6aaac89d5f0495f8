"""A grading's result: the uninterrupted run (`Reference`), each point's killed run judged
(`Outcome`), and the whole (`Graded`): the table, the one line, the picture and the stage's check."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from ..lab.pictures import Picture, picture
from . import stages
from .points import Point

TURNS = ("fetch and summarise", "follow-up", "payment")

COLOURS = {"recovers": "#2ca02c", "lost": "#d62728", "stuck": "#000000", "extra payment": "#9467bd",
           "re-run": "#ff7f0e", "wrong status": "#8c8c8c"}
"""A point's colour: its worst verdict, in this order after `recovers`."""
ROWS = {"model": "the model", "fetch": "the tools", "payment": "the tools", "write": "your database"}


@dataclass
class Reference:
    """The uninterrupted run: its points and what it left."""

    points: list[Point] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    runs: list[str] = field(default_factory=list)
    fetches: int = 0
    payments: int = 0
    model_requests: int = 0
    seconds: float = 0.0
    error: str | None = None
    """Why the uninterrupted run cannot be a reference (None: it can)."""
    not_done: bool = False
    """The module raised `NotImplementedError`: a stub, not yet written."""


@dataclass
class Outcome:
    """One point's killed run, judged."""

    point: Point
    lost: int = 0
    rerun: int = 0
    extra_payment: int = 0
    wrong_status: bool = False
    stuck: bool = False
    payments: int = 0
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def verdicts(self) -> list[str]:
        found = [("lost", self.lost), ("re-run", self.rerun), ("extra payment", self.extra_payment),
                 ("wrong status", self.wrong_status), ("stuck", self.stuck)]
        return [name for name, value in found if value]

    @property
    def recovers(self) -> bool:
        return not self.verdicts


@dataclass
class Graded:
    """What the grader found: `table`, `summary`, `picture()`, and `check()` for the stage."""

    module: Path
    stage: str | None
    reference: Reference
    outcomes: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0
    every_point: bool = True
    scripted: bool = True

    @property
    def table(self) -> pd.DataFrame:
        """One row per point, in time order: its turn and each verdict."""
        rows = [{"point": o.point.name, "turn": o.point.turn, "lost": o.lost, "re-run": o.rerun,
                 "extra payment": o.extra_payment, "wrong status": o.wrong_status, "stuck": o.stuck,
                 "verdict": ", ".join(o.verdicts) or "recovers"} for o in self.outcomes]
        frame = pd.DataFrame(rows, columns=["point", "turn", "lost", "re-run", "extra payment", "wrong status",
                                            "stuck", "verdict"])
        frame.index = range(1, len(frame) + 1)
        return frame

    def notes(self) -> pd.DataFrame:
        """What the grader saw at each point that did not recover (errors, statuses, repeats)."""
        rows = [{"point": o.point.name, "verdict": ", ".join(o.verdicts), "what was seen": "; ".join(o.notes)}
                for o in self.outcomes if not o.recovers]
        return pd.DataFrame(rows, columns=["point", "verdict", "what was seen"])

    @property
    def summary(self) -> str:
        """One line: `your agent: 35 of 35 points recover, 0 lost, 0 re-run, 1 payment`."""
        if self.reference.error:
            return f"your agent: not graded, {self.reference.error}"
        n = len(self.outcomes)
        count = {v: sum(1 for o in self.outcomes if v in o.verdicts) for v in stages.VERDICTS}
        recovering = sum(1 for o in self.outcomes if o.recovers)
        paid = self.reference.payments
        payments = f"{paid} payment{'s' if paid != 1 else ''}"
        if count["extra payment"]:
            most = max(o.payments for o in self.outcomes)
            payments += f" ({most} at {count['extra payment']} point{'s' if count['extra payment'] != 1 else ''})"
        line = (f"your agent: {recovering} of {n} points recover, {count['lost']} lost, "
                f"{count['re-run']} re-run, {payments}")
        more = [f"{count[v]} {v}" for v in ("wrong status", "stuck") if count[v]]
        return line + (", " + ", ".join(more) if more else "")

    def problems(self) -> list[str]:
        """Where the result differs from what its stage should achieve ([] when it does not)."""
        return stages.problems(self) if self.stage else []

    def check(self) -> None:
        """Raise `AssertionError` naming each point where the stage's expectations do not hold
        (`NotImplementedError` for a module that is still a stub)."""
        if self.reference.not_done:
            raise NotImplementedError(self.reference.error)
        found = self.problems()
        if found:
            shown = found[:6] + ([f"... and {len(found) - 6} more points"] if len(found) > 6 else [])
            raise AssertionError(f"stage {self.stage} ({stages.TITLES[self.stage]}): "
                                 + "\n  ".join(["not what this stage should do", *shown]))

    def picture(self):
        """The points along the run's timeline, coloured by verdict (a `Picture`)."""
        return matrix_picture(self)

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        printer.text(self.summary)

    def colour(self, outcome: Outcome) -> str:
        """The colour of a point: its worst verdict's."""
        worst = next((v for v in COLOURS if v in outcome.verdicts), "recovers")
        return COLOURS[worst]

    def turn_spans(self) -> list[tuple[str, int, int]]:
        """Per turn of the scenario: its name and its first and last point (1-based)."""
        spans = []
        for turn, name in enumerate(TURNS, 1):
            numbers = [i for i, o in enumerate(self.outcomes, 1) if o.point.turn == turn]
            if numbers:
                spans.append((name, numbers[0], numbers[-1]))
        return spans


# The kill-point matrix as a picture: each point on the scenario's timeline, coloured by verdict.
#
# Points go left to right in the order the uninterrupted run met them, on three rows: the model
# (a request received, its first chunk), the tools (the page fetched, the payment committed) and
# your database (each write). Shaded bands are the scenario's three turns. A point is green when
# it recovers, else the colour of its worst verdict (lost, stuck, extra payment, re-run, wrong
# status), and named when only a few do not recover. The picture's elements name the turns, the
# colours drawn and each point's verdict.

ROW_Y = {"the model": 2.0, "the tools": 1.0, "your database": 0.0}
LABELLED = 6
"""The points that do not recover are named on the picture when there are at most this many."""


def matrix_picture(result: Graded) -> Picture:
    """The points of `result` along the run's timeline, coloured by verdict."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    outcomes = result.outcomes
    figure, axes = plt.subplots(figsize=(max(6.0, 0.28 * len(outcomes) + 2.5), 2.6))
    title = f"kill points along the run: {result.summary}"
    elements = []
    for (name, first, last), shade in zip(result.turn_spans(), ("#f2f2f2", "#ffffff", "#f2f2f2")):
        axes.axvspan(first - 0.5, last + 0.5, color=shade, zorder=0)
        axes.text((first + last) / 2, 2.55, f"turn: {name}", ha="center", va="bottom", fontsize=8)
        elements.append(f"turn {name}: points {first} to {last}")
    failing = [o for o in outcomes if not o.recovers]
    for number, outcome in enumerate(outcomes, 1):
        y = ROW_Y[ROWS[outcome.point.trigger]]
        axes.scatter([number], [y], s=70, color=result.colour(outcome), edgecolors="black", linewidths=0.4, zorder=3)
        if not outcome.recovers and len(failing) <= LABELLED:
            axes.annotate(outcome.point.name, (number, y), xytext=(4, 7), textcoords="offset points", fontsize=7,
                          rotation=20, color=result.colour(outcome), zorder=4)
        elements.append(f"{number}. {outcome.point.name}: {', '.join(outcome.verdicts) or 'recovers'}")
    axes.set_yticks(list(ROW_Y.values()), list(ROW_Y))
    axes.set_ylim(-0.6, 2.9)
    axes.set_xlim(0.3, len(outcomes) + 0.7)
    axes.set_xlabel("kill point, in the order the uninterrupted run met them")
    for side in ("top", "right"):
        axes.spines[side].set_visible(False)
    shown = [v for v in COLOURS if any(result.colour(o) == COLOURS[v] for o in outcomes)]
    handles = [Line2D([0], [0], marker="o", linestyle="", color=COLOURS[v], markeredgecolor="black", label=v)
               for v in shown]
    if handles:
        axes.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False, fontsize=8)
    axes.set_title(title, fontsize=9, loc="left")
    elements.insert(0, "colours: " + ", ".join(shown))
    return picture(figure, title, elements)

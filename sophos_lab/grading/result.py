"""A grading's result: the table, the one line, the picture and the stage's check."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from . import stages
from .grader import TURNS, Outcome, Reference

COLOURS = {"recovers": "#2ca02c", "lost": "#d62728", "stuck": "#000000", "extra payment": "#9467bd",
           "re-run": "#ff7f0e", "wrong status": "#8c8c8c"}
"""A point's colour: its worst verdict, in this order after `recovers`."""
ROWS = {"model": "the model", "fetch": "the tools", "payment": "the tools", "write": "your database"}


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
        from .picture import matrix_picture

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

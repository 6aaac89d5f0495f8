"""The run-status state machine, with the transitions a lesson's runs took drawn in bold.

Every run of the kit has one row in the `runs` table, and its `status` moves along a few fixed
transitions (`RUN_STATUSES` in `sophos_lab/runtime/storage/models.py`, plus `queued` on PostgreSQL with
workers):

- a message accepted: the run is `running` where it was accepted, or `queued` until a worker
  claims it (and `queued` again if its worker died, with `SOPHOS_LAB_REQUEUE`);
- `running` → `completed` (the graph reached its end), `failed` (an error escaped a node:
  `AGENT_FAILURE`, `MODEL_UNAVAILABLE`, ...), `interrupted` (a drain at shutdown, `SHUTDOWN`; or
  its process died, and a later process relabelled it: no code), `cancelled` (`CANCELLED`), or
  `waiting` (an approval gate);
- none of those ever changes again: a resume (or, at a gate, a decision) is a **new run** on the
  same thread, with a row of its own that starts `running` again.

`run_statuses(runs, title)` draws that machine (hand-placed boxes and arrows, its labels text in
the SVG) and draws in bold what the runs of `runs` (the lab's runs table, `lab.peek_runs(...)`)
did: each run from its start to its status, and each resume from the status of the run it
carried on. Its elements are the statuses drawn and one `observed: ...` line per run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...runtime.storage.models import RUN_STATUSES
from . import Picture, picture

STATUSES: tuple[str, ...] = ("queued", *RUN_STATUSES)
"""Every status drawn: the runs table's (`RUN_STATUSES`) and PostgreSQL's `queued`."""

START = "a message accepted"
NEW_RUN = "a new run"

NODES: dict[str, tuple[float, float]] = {
    START: (0.45, 3.6),
    "queued": (2.0, 5.95),
    "running": (3.7, 3.6),
    "waiting": (7.7, 6.4),
    "completed": (7.7, 5.05),
    "failed": (7.7, 3.6),
    "interrupted": (7.7, 2.15),
    "cancelled": (7.7, 0.7),
    NEW_RUN: (11.2, 3.6),
}
"""Where each box sits (hand-placed: the figure's data coordinates)."""

BOX_W, BOX_H = 1.75, 0.62

CAPTIONS = {
    "waiting": "stopped at an approval gate",
    "completed": "the graph reached its end",
    "failed": "an error escaped a node",
    "interrupted": "drained (SHUTDOWN), or its\nprocess gone (no code)",
    "cancelled": "cancelled (CANCELLED)",
}
"""How a run comes to each status, written under its box."""

COLOURS = {
    "queued": "#6baed6", "running": "#1f77b4", "waiting": "#9467bd", "completed": "#2ca02c",
    "failed": "#d62728", "interrupted": "#ff7f0e", "cancelled": "#7f7f7f", NEW_RUN: "#1f77b4",
}


@dataclass(frozen=True)
class Transition:
    source: str
    target: str
    how: str
    """What makes the runtime take it."""


TRANSITIONS: tuple[Transition, ...] = (
    Transition(START, "running", "runs where accepted"),
    Transition(START, "queued", "with workers: queued first"),
    Transition("queued", "running", "claimed by a worker"),
    Transition("running", "queued", "its worker died: re-queued"),
    Transition("running", "waiting", "an approval gate"),
    Transition("running", "completed", "the graph reached its end"),
    Transition("running", "failed", "an error escaped a node"),
    Transition("running", "interrupted", "drained at shutdown, or its process gone"),
    Transition("running", "cancelled", "cancel"),
    Transition("waiting", NEW_RUN, "approve / reject"),
    Transition("failed", NEW_RUN, "resume"),
    Transition("interrupted", NEW_RUN, "resume"),
    Transition("cancelled", NEW_RUN, "resume"),
    Transition(NEW_RUN, "running", "a new row, the same thread"),
)
"""The transitions the runtime makes (not drawn: a `queued` run cancelled before a worker claims it)."""


@dataclass(frozen=True)
class ObservedRun:
    """One run of the runs table, as the picture tells it."""

    label: str
    """`run 2`, or `hello, run 1` when the picture names the conversations."""
    short: str
    """The label on the drawing: `run 2`, `hello run 1`."""
    status: str
    code: str | None
    after: str | None = None
    """For a run that carries an earlier one on (a resume, a decision): that run's status."""
    after_label: str | None = None

    @property
    def path(self) -> list[tuple[str, str]]:
        """The transitions this run took, in order."""
        steps = [(self.after, NEW_RUN), (NEW_RUN, "running")] if self.after else [(START, "running")]
        return steps + ([("running", self.status)] if self.status != "running" else [])

    def __str__(self) -> str:
        if self.status == "running":
            outcome = "running (on disk: no outcome recorded yet)"
        elif self.status == "interrupted" and not self.code:
            outcome = "running → interrupted (no code: its process was gone)"
        else:
            outcome = f"running → {self.status}" + (f" ({self.code})" if self.code else "")
        if self.after == "waiting":
            return f"observed: {self.label} carries on {self.after_label} (waiting) with a decision: {outcome}"
        if self.after:
            return f"observed: {self.label} resumes {self.after_label} ({self.after}): {outcome}"
        return f"observed: {self.label} {outcome}"


def _given(value: Any) -> bool:
    """Whether a runs-table cell holds something (not None, NaN or empty)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return False
    return bool(value) and value != "null"


def observed_runs(runs: Any, names: Mapping[str, str] | None = None) -> list[ObservedRun]:
    """Each run of `runs` (a runs table, in start order: `lab.peek_runs(...)`), numbered within
    its conversation; a run without `input` after another of its conversation carries that one on.

    `names` (conversation id → a short name) labels the runs of several conversations; without
    it, they are named `conversation 1`, `conversation 2`, ... in order of their first run (and
    not at all when there is one conversation)."""
    conversations = list(dict.fromkeys(runs["conversation_id"]))
    if names is None:
        names = {} if len(conversations) == 1 else {c: f"conversation {n}" for n, c in enumerate(conversations, 1)}
    seen: dict[str, list[ObservedRun]] = {}
    observed = []
    for row in runs.itertuples(index=False):
        earlier = seen.setdefault(row.conversation_id, [])
        name = names.get(row.conversation_id)
        number = len(earlier) + 1
        label = f"{name}, run {number}" if name else f"run {number}"
        short = f"{name} run {number}" if name else f"run {number}"
        code = row.error_code if _given(row.error_code) else None
        carries_on = earlier[-1] if earlier and not _given(getattr(row, "input", None)) else None
        run = ObservedRun(label, short, row.status, code, carries_on.status if carries_on else None,
                          carries_on.label if carries_on else None)
        earlier.append(run)
        observed.append(run)
    return observed


def run_statuses(runs: Any, title: str = "run statuses", names: Mapping[str, str] | None = None) -> Picture:
    """The run-status state machine, with the transitions the runs of `runs` took in bold.

    `runs`: a runs table in start order (`lab.peek_runs()` or `lab.peek_runs(conversation)`);
    `title` should start with `run statuses`; `names` (conversation id → a short name) labels the
    runs of several conversations. The elements: every status drawn, then `observed: ...` per run."""
    import matplotlib.pyplot as plt

    observed = observed_runs(runs, names)
    taken: dict[tuple[str, str], list[str]] = {}
    for run in observed:
        for edge in run.path:
            taken.setdefault(edge, []).append(run.short)
    reached = {node for edge in taken for node in edge}

    figure, axes = plt.subplots(figsize=(11.5, 6.4))
    axes.set_xlim(-0.3, 12.3)
    axes.set_ylim(-1.3, 7.1)
    axes.axis("off")
    axes.set_title(title, loc="left", fontsize=12)
    for transition in TRANSITIONS:
        _arrow(axes, transition, taken.get((transition.source, transition.target), []))
    for node in NODES:
        _box(axes, node, node in reached)
    axes.text(-0.2, -1.15, "bold: what these runs did · grey: what else the runtime can do · "
              "not drawn: a queued run cancelled before a worker claims it", fontsize=8, color="#555555")
    elements = list(STATUSES) + [str(run) for run in observed]
    return picture(figure, title, elements)


def _box(axes: Any, node: str, reached: bool) -> None:
    from matplotlib.patches import Circle, FancyBboxPatch

    x, y = NODES[node]
    ink = "#222222" if reached else "#999999"
    if node == START:
        axes.add_patch(Circle((x, y), 0.13, color=ink, zorder=3))
        axes.text(x, y - 0.28, "a message\naccepted", ha="center", va="top", fontsize=8.5, color=ink)
        return
    colour = COLOURS[node]
    axes.add_patch(FancyBboxPatch(
        (x - BOX_W / 2, y - BOX_H / 2), BOX_W, BOX_H, boxstyle="round,pad=0.02,rounding_size=0.15",
        facecolor=colour if reached else "white", edgecolor=colour if reached else "#bbbbbb",
        linewidth=2.0 if reached else 1.0, zorder=3))
    text = "a new run\n(resume, decision)" if node == NEW_RUN else node
    axes.text(x, y, text, ha="center", va="center", zorder=4, fontsize=10 if node != NEW_RUN else 8.5,
              fontweight="bold" if reached else "normal", color="white" if reached else "#999999")
    if node in CAPTIONS:
        axes.text(x, y - BOX_H / 2 - 0.06, CAPTIONS[node], ha="center", va="top", fontsize=7.5,
                  color="#555555" if reached else "#aaaaaa")


def _anchor(node: str, towards: str) -> tuple[float, float]:
    """Where an arrow leaves (or reaches) `node`'s box on its way to `towards`."""
    x, y = NODES[node]
    tx, ty = NODES[towards]
    if node == START:
        return (x + 0.15, y) if abs(ty - y) < 0.5 else (x + 0.08, y + 0.13)
    if {node, towards} == {"queued", "running"}:  # queued sits above running, to its left: two parallel arrows
        return (x + 0.15, y - BOX_H / 2) if node == "queued" else (x - 0.35, y + BOX_H / 2)
    return (x + BOX_W / 2, y) if tx > x else (x - BOX_W / 2, y)


def _label(axes: Any, x: float, y: float, runs: list[str], above: bool, ha: str = "right", wrap: bool = True) -> None:
    """The runs that took a transition, in bold beside its arrow: one a line (two a line past
    three, when `wrap`)."""
    per_line = 2 if wrap and len(runs) > 3 else 1
    lines = [", ".join(runs[i:i + per_line]) for i in range(0, len(runs), per_line)]
    axes.text(x, y + (0.1 if above else -0.1), "\n".join(lines), ha=ha, va="bottom" if above else "top",
              fontsize=8.5, fontweight="bold", color="#222222", zorder=5)


def _arrow(axes: Any, transition: Transition, runs: list[str]) -> None:
    source, target = transition.source, transition.target
    bold = bool(runs)
    colour = "#222222" if bold else "#c8c8c8"
    width = 2.4 if bold else 1.0
    how = "#444444" if bold else "#aaaaaa"
    style = dict(arrowstyle="-|>", color=colour, lw=width, shrinkA=0, shrinkB=0, mutation_scale=14)
    if (source, target) == (NEW_RUN, "running"):
        # Back along the bottom, under every status: a new run starts `running` again.
        (x0, y0), (x1, y1) = NODES[NEW_RUN], NODES["running"]
        bottom, x1 = -0.55, x1 + 0.4
        axes.plot([x0, x0, x1, x1], [y0 - BOX_H / 2, bottom, bottom, y1 - 1.0], color=colour, lw=width, zorder=1)
        axes.annotate("", xy=(x1, y1 - BOX_H / 2), xytext=(x1, y1 - 1.0), arrowprops=style, zorder=2)
        axes.text(x0 - 0.15, bottom + 0.1, transition.how, ha="right", va="bottom", fontsize=7.5, color=how)
        if bold:
            _label(axes, x0 - 0.15, bottom, runs, above=False)
        return
    if target == NEW_RUN:
        # Right along the status's own line first (its labels sit there), then to the new run.
        (x0, y0), (x1, y1) = _anchor(source, target), _anchor(target, source)
        bend = x0 + 0.85
        axes.plot([x0, bend], [y0, y0], color=colour, lw=width, zorder=1)
        axes.annotate("", xy=(x1, y1), xytext=(bend, y0), arrowprops=style, zorder=2)
        axes.text(x0 + 0.08, y0 + 0.06, transition.how, ha="left", va="bottom", fontsize=7.5, color=how)
        if bold:
            _label(axes, x0 + 0.3, y0 - 0.02, runs, above=False, ha="left")
        return
    start, end = _anchor(source, target), _anchor(target, source)
    if (source, target) == ("running", "queued"):  # beside the arrow down, a little to its left
        start, end = (start[0] - 0.3, start[1]), (end[0] - 0.3, end[1])
    axes.annotate("", xy=end, xytext=start, arrowprops=style, zorder=2)
    if source == START and target == "running":
        axes.text(start[0] + 0.2, start[1] + 0.1, transition.how, ha="left", va="bottom", fontsize=7.5, color=how)
        if bold:
            _label(axes, end[0] - 0.15, end[1], runs, above=False, wrap=False)
    elif source == START:
        axes.text(end[0] - 0.08, end[1] + 0.1, transition.how.replace(": ", ":\n"), ha="right", va="bottom",
                  fontsize=7.5, color=how)
    elif {source, target} == {"queued", "running"}:
        x, y = (start[0] + end[0]) / 2, (start[1] + end[1]) / 2
        text = transition.how + (":\n" + "\n".join(runs) if bold else "")
        axes.text(x + (0.15 if source == "queued" else -0.15), y, text, ha="left" if source == "queued" else "right",
                  va="center", fontsize=7.5, color=how, fontweight="bold" if bold else "normal")
    elif bold:  # from `running` to a status: beside the arrow, before the status it reaches
        level = abs(end[1] - start[1]) < 0.01
        share = 0.45 if level else 0.72
        x, y = start[0] + share * (end[0] - start[0]), start[1] + share * (end[1] - start[1])
        _label(axes, x, y, runs, above=end[1] > start[1] - 0.01, ha="left" if level else "right")

"""The cancel request against the outcome: two writes to a run's row, on a time axis.

Drawn from what lesson 13 recorded: the runs table (each run's start, its `cancel_requested_at`
and its `finished_at`, the moment its outcome was written, with the status written then), the
process that wrote the outcome (the one that ran the run, or the next one, after a crash), and
a Stop the lesson pressed after the outcome, which was refused and wrote nothing. One row per
run, each on its own axis of seconds since it started:

- the run as a bar from its start to its outcome, coloured by the outcome;
- ● the cancel request, ■ the outcome, labelled with the status;
- a hatched stretch where nothing was written: the process that ran the run was stopped or dead,
  and the next one had not opened the file yet;
- ○ a cancel refused after the outcome.

`cancel_picture(runs)` returns a `Picture` whose elements say, per run, which write came first
and what the other one then did, in words that do not depend on timing.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import Picture, picture

TITLE = "cancel request against the outcome"

STATUS_COLOURS = {"completed": "tab:green", "failed": "tab:red", "interrupted": "tab:orange",
                  "cancelled": "tab:purple", "running": "tab:blue"}


@dataclass
class CancelRun:
    """One run, as its row and the lesson recorded it (seconds since the epoch)."""

    label: str
    """What was done to it, e.g. "Stop, then SIGKILL"."""
    started: float
    cancel_requested: float | None
    """`runs.cancel_requested_at` (None: no request was written)."""
    outcome_written: float | None
    """`runs.finished_at`: when the outcome was written (None: not yet)."""
    status: str
    """The outcome: the run's status."""
    outcome_by_next_process: bool = False
    """The outcome was written by the next process to open the file (the one that ran it had died)."""
    refused_cancel: float | None = None
    """When a Stop pressed after the outcome was refused (it wrote nothing)."""
    silent_from: float | None = None
    """From when the process that ran the run wrote nothing more (stopped at a kill point, or killed)."""


def elements(runs: list[CancelRun]) -> list[str]:
    """Per run, which write came first and what followed, in words that do not depend on timing."""
    found = []
    for run in runs:
        by = "by the next process" if run.outcome_by_next_process else "by the process that ran it"
        if run.outcome_written is None:
            found.append(f"{run.label}: no outcome written yet"
                         + (", a cancel request on the row" if run.cancel_requested is not None else ""))
        elif run.cancel_requested is not None and run.cancel_requested <= run.outcome_written:
            found.append(f"{run.label}: the cancel request came first, then the outcome `{run.status}`, {by}")
        elif run.cancel_requested is not None:
            found.append(f"{run.label}: the outcome `{run.status}` came first ({by}), then a cancel request")
        else:
            found.append(f"{run.label}: no cancel request; the outcome `{run.status}`, {by}")
        if run.refused_cancel is not None:
            found.append(f"{run.label}: a cancel after the outcome was refused and wrote nothing")
    return found


def cancel_picture(runs: list[CancelRun]) -> Picture:
    """One row per run of `runs`, each on its own time axis from its start, as a `Picture`."""
    import matplotlib.pyplot as plt

    def moments(run: CancelRun) -> list[float]:
        return [t - run.started for t in (run.cancel_requested, run.outcome_written, run.refused_cancel, run.silent_from)
                if t is not None]

    right = max([1e-3, *(m for run in runs for m in moments(run))])
    figure, axes = plt.subplots(figsize=(9.0, 1.4 + 1.0 * len(runs)))
    for row, run in enumerate(runs):
        end = (run.outcome_written if run.outcome_written is not None else run.started + right) - run.started
        axes.barh(row, max(end, 0.004 * right), left=0.0, height=0.22,
                  color=STATUS_COLOURS.get(run.status, "grey"), alpha=0.35)
        if run.silent_from is not None and run.outcome_written is not None:
            # Between the run's process's last write and the outcome, nobody wrote.
            gone = run.silent_from - run.started
            axes.barh(row, end - gone, left=gone, height=0.22, color="none", hatch="///",
                      edgecolor="grey", linewidth=0)
            axes.annotate("nothing written: its process stopped or dead",
                          ((gone + end) / 2, row + 0.13), xytext=(0, -2), textcoords="offset points",
                          fontsize=7, ha="center", va="top", color="dimgrey")
        if run.cancel_requested is not None:
            at = run.cancel_requested - run.started
            axes.scatter([at], [row], marker="o", s=50, color="black", zorder=3)
            axes.annotate("cancel request", (at, row - 0.14), xytext=(0, 2), textcoords="offset points",
                          fontsize=8, ha="center", va="bottom")
        if run.outcome_written is not None:
            axes.scatter([end], [row], marker="s", s=50, color=STATUS_COLOURS.get(run.status, "grey"), zorder=3)
            axes.annotate(f"outcome: {run.status}", (end, row - 0.14), xytext=(0, 2), textcoords="offset points",
                          fontsize=8, ha="center", va="bottom")
        if run.refused_cancel is not None:
            at = run.refused_cancel - run.started
            axes.scatter([at], [row], marker="o", s=50, facecolors="white", edgecolors="black", zorder=3)
            axes.annotate("cancel refused", (at, row), xytext=(7, 0), textcoords="offset points",
                          fontsize=8, ha="left", va="center")
    axes.set_yticks(range(len(runs)), [run.label for run in runs], fontsize=9)
    axes.tick_params(axis="y", length=0)
    axes.set_ylim(len(runs) - 0.45, -0.65)
    axes.set_xlim(-0.04 * right, 1.25 * right)
    axes.set_xlabel("seconds since the run started;  ● cancel request,  ■ outcome written,  ○ cancel refused",
                    fontsize=8)
    axes.set_title(TITLE, fontsize=10)
    figure.tight_layout()
    return picture(figure, TITLE, elements(runs))

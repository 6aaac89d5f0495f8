"""The lease on a time axis: who held a run, until when, and when another process took it over.

Drawn from what a lesson recorded (lessons 08b and 16): the runs table (each run's start, finish
and status), the owners table (each owner's recorded lease deadline; the lease is renewed every
third of `SOPHOS_LAB_LEASE_SECONDS`, so its last renewal was one lease length before that
deadline), and the moments the lesson itself knows: when it sent SIGKILL or SIGSTOP, when it
continued a frozen process, and what that process heard when it woke. One lane per process:

- its lease as a light bar, from the first moment the records show it held (the start of its
  run) to the deadline recorded in `owners`, with a tick at its last renewal;
- its runs as bars on top, coloured by the status the runs table gives them;
- a kill as ✕, a freeze as a hatched stretch, a wake as ▲;
- the expiry of the taken-over owner's lease as a dashed line, and the takeover as an arrow from
  that lane to the lane of the process that took the run over.

`lease_picture(story)` returns a `Picture` whose elements name what it shows in words that do
not depend on timing ("takeover: B takes A's run over before A's lease ran out").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import Picture, picture

TITLE = "the lease on a time axis"

STATUS_COLOURS = {"completed": "tab:green", "failed": "tab:red", "interrupted": "tab:orange",
                  "running": "tab:blue"}


@dataclass
class Run:
    """One run of a lane, as the runs table has it (seconds since the epoch)."""

    started: float
    finished: float | None
    status: str


@dataclass
class Lane:
    """One process: its lease (as the owners table recorded it) and its runs."""

    name: str
    lease_from: float | None = None
    """The first moment the records show the lease held (e.g. the start of the process's run)."""
    lease_until: float | None = None
    """The deadline recorded in `owners.lease_expires_at`."""
    lease_seconds: float | None = None
    """The lease's length: its last renewal was this long before `lease_until`."""
    runs: list[Run] = field(default_factory=list)


@dataclass
class LeaseStory:
    """What happened to a run and its lease, with the moments the lesson knows."""

    lanes: list[Lane]
    owner: str
    """The lane whose run was taken over (its lease's expiry is drawn)."""
    taken_by: str
    """The lane that took the run over."""
    takeover: float
    """When it did: the start of its run (it relabels the old run as that run starts)."""
    killed: float | None = None
    """When the owner got SIGKILL."""
    frozen: tuple[float, float | None] | None = None
    """When the owner got SIGSTOP, and when SIGCONT (None: still frozen)."""
    woke: tuple[float, str] | None = None
    """When the woken owner's run ended, and how it ended (e.g. `OWNERSHIP_LOST`)."""
    scenario: str = ""
    """Added to the title, e.g. "A killed"."""


def seconds(value: Any) -> float | None:
    """A time of the runs table (an ISO string) in seconds since the epoch, as `time.time()` gives
    them; None for a missing one (a run not finished)."""
    import pandas as pd

    if value is None or (isinstance(value, float) and pd.isna(value)):
        return None
    return pd.Timestamp(value).timestamp()


def takeover(runs: Any, deadline: float, lease_seconds: float, *, scenario: str = "",
             killed: float | None = None, frozen: tuple[float, float | None] | None = None,
             woke: tuple[float, str] | None = None) -> LeaseStory:
    """The story of a run of process A taken over by process B, from the records: `runs` is the
    conversation's runs table (A's run first, B's last, as `lab.peek_runs` gives it), `deadline`
    A's lease deadline as `owners.lease_expires_at` recorded it (seconds since the epoch) and
    `lease_seconds` its length; `killed`, `frozen` (SIGSTOP, SIGCONT) and `woke` (when, and the
    outcome A reported) are the moments the lesson took with `time.time()`."""
    first, last = runs.iloc[0], runs.iloc[-1]

    def run(row: Any) -> Run:
        return Run(seconds(row["started_at"]), seconds(row["finished_at"]), row["status"])

    return LeaseStory(
        lanes=[Lane("A", lease_from=seconds(first["started_at"]), lease_until=deadline,
                    lease_seconds=lease_seconds, runs=[run(first)]),
               Lane("B", runs=[run(last)])],
        owner="A", taken_by="B", takeover=seconds(last["started_at"]),
        killed=killed, frozen=frozen, woke=woke, scenario=scenario)


def _lane(story: LeaseStory, name: str) -> Lane:
    (lane,) = [lane for lane in story.lanes if lane.name == name]
    return lane


def elements(story: LeaseStory) -> list[str]:
    """What the picture shows, named in words that depend on the order of events, not on timing."""
    owner = _lane(story, story.owner)
    expiry = owner.lease_until
    found = []
    for lane in story.lanes:
        if lane.lease_until is not None:
            found.append(f"{lane.name}: lease")
        found += [f"{lane.name}: run {run.status}" for run in lane.runs]
    if story.killed is not None:
        left = expiry is not None and story.killed < expiry
        found.append(f"kill: {owner.name} (SIGKILL), {'with time left on its lease' if left else 'after its lease ran out'}")
    if story.frozen is not None:
        stopped, continued = story.frozen
        past = expiry is not None and (continued is None or continued > expiry)
        found.append(f"freeze: {owner.name} (SIGSTOP), {'past' if past else 'within'} its lease")
    if expiry is not None:
        found.append(f"expiry of {owner.name}'s lease")
        when = "before" if story.takeover < expiry else "after"
        found.append(f"takeover: {story.taken_by} takes {owner.name}'s run over {when} {owner.name}'s lease ran out")
    else:
        found.append(f"takeover: {story.taken_by} takes {owner.name}'s run over")
    if story.woke is not None:
        found.append(f"{owner.name} wakes: {story.woke[1]}")
    return found


def lease_picture(story: LeaseStory) -> Picture:
    """The lanes of `story` on one time axis (seconds since its first moment), as a `Picture`."""
    import matplotlib.pyplot as plt

    moments = [story.takeover]
    for lane in story.lanes:
        moments += [t for t in (lane.lease_from, lane.lease_until) if t is not None]
        if lane.lease_until is not None and lane.lease_seconds is not None:
            moments.append(lane.lease_until - lane.lease_seconds)
        moments += [t for run in lane.runs for t in (run.started, run.finished) if t is not None]
    if story.killed is not None:
        moments.append(story.killed)
    if story.frozen is not None:
        moments += [t for t in story.frozen if t is not None]
    if story.woke is not None:
        moments.append(story.woke[0])
    origin = min(moments)
    right = max(max(moments) - origin, 1e-3)

    def x(moment: float) -> float:
        return moment - origin

    rows = {lane.name: row for row, lane in enumerate(story.lanes)}
    figure, axes = plt.subplots(figsize=(9.0, 1.4 + 0.9 * len(story.lanes)))
    for lane in story.lanes:
        row = rows[lane.name]
        if lane.lease_until is not None:
            start = lane.lease_from if lane.lease_from is not None else origin
            if lane.lease_seconds is not None:  # the last renewal may be a moment before the run's recorded start
                start = min(start, lane.lease_until - lane.lease_seconds)
            axes.barh(row, x(lane.lease_until) - x(start), left=x(start), height=0.55, color="tab:blue",
                      alpha=0.18, edgecolor="tab:blue", linewidth=0.8)
            axes.annotate("lease", (x(lane.lease_until), row + 0.12), xytext=(-3, -1), textcoords="offset points",
                          fontsize=7, ha="right", va="top", color="tab:blue")
            if lane.lease_seconds is not None and lane.lease_until - lane.lease_seconds >= start:
                renewed = x(lane.lease_until - lane.lease_seconds)
                axes.plot([renewed, renewed], [row - 0.27, row + 0.27], color="tab:blue", linewidth=1.2)
                axes.annotate("last renewal", (renewed, row + 0.27), xytext=(0, -2), textcoords="offset points",
                              fontsize=7, ha="center", va="top", color="tab:blue")
        for run in lane.runs:
            end = run.finished if run.finished is not None else origin + right
            axes.barh(row, max(x(end) - x(run.started), 0.004 * right), left=x(run.started), height=0.2,
                      color=STATUS_COLOURS.get(run.status, "grey"))
            axes.annotate(f"run {run.status}", (x(run.started), row - 0.1), xytext=(0, 2),
                          textcoords="offset points", fontsize=7, ha="left", va="bottom")
    owner_row, taker_row = rows[story.owner], rows[story.taken_by]
    if story.killed is not None:
        axes.scatter([x(story.killed)], [owner_row], marker="X", s=90, color="tab:red", zorder=4)
        axes.annotate("kill -9", (x(story.killed), owner_row - 0.3), xytext=(0, 2), textcoords="offset points",
                      fontsize=8, ha="center", va="bottom", color="tab:red")
    if story.frozen is not None:
        stopped, continued = story.frozen
        until = continued if continued is not None else origin + right
        axes.barh(owner_row, x(until) - x(stopped), left=x(stopped), height=0.7, color="none",
                  hatch="///", edgecolor="grey", linewidth=0.8, zorder=3)
        axes.annotate("frozen (SIGSTOP)", (x(stopped), owner_row - 0.36), xytext=(0, 2), textcoords="offset points",
                      fontsize=8, ha="left", va="bottom", color="dimgrey")
    expiry = _lane(story, story.owner).lease_until
    if expiry is not None:
        axes.axvline(x(expiry), color="tab:blue", linestyle="--", linewidth=1)
        axes.annotate(f"{story.owner}'s lease runs out", (x(expiry), -0.68), xytext=(3, 0), textcoords="offset points",
                      fontsize=8, ha="left", va="center", color="tab:blue")
    axes.annotate("", (x(story.takeover), taker_row), xytext=(x(story.takeover), owner_row),
                  arrowprops={"arrowstyle": "->", "color": "black", "linewidth": 1.2})
    axes.annotate("takeover", (x(story.takeover), (owner_row + taker_row) / 2), xytext=(4, 0),
                  textcoords="offset points", fontsize=8, ha="left", va="center")
    if story.woke is not None:
        axes.scatter([x(story.woke[0])], [owner_row], marker="^", s=50, color="black", zorder=4)
        axes.annotate(f"wakes: {story.woke[1]}", (x(story.woke[0]), owner_row + 0.3), xytext=(0, -2),
                      textcoords="offset points", fontsize=8, ha="center", va="top")
    axes.set_yticks(range(len(story.lanes)), [f"process {lane.name}" for lane in story.lanes], fontsize=9)
    axes.tick_params(axis="y", length=0)
    axes.set_ylim(len(story.lanes) - 0.35, -0.85)
    axes.set_xlim(-0.03 * right, 1.08 * right)
    axes.set_xlabel("seconds since the first moment shown", fontsize=8)
    title = f"{TITLE}: {story.scenario}" if story.scenario else TITLE
    axes.set_title(title, fontsize=10)
    figure.tight_layout()
    return picture(figure, title, elements(story))

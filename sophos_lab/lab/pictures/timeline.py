"""The timeline: a conversation's runs on a time axis, with the checkpoints each run wrote (their
step and the node whose write made each one) and the model requests made during each run.

Drawn from the lab's records: the runs table (`inspect.peek_runs`), the checkpoint history
(`inspect.checkpoints`) and the model's request log; `inspect.timeline_picture` reads them, and
`Lab.timeline(conversation)` shows the picture. Each run is a band of its own, from top to bottom:
the notes of its model calls (the stretch before a call, a retry's wait), its ▼ model requests, its
bar, its checkpoint ticks, and below them the ticks' labels on lines of their own (a label goes one
line lower when it would touch the one before it), so no label of one run reaches into the next
run's model requests.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from . import Picture, picture

LABEL_LINES = 3
"""Lines of checkpoint labels under a run; a label that fits on none is left out (its tick stays)."""
LABEL_PAD = 0.06
"""Inches kept free between two labels on one line."""
PREPARE_MIN = 0.1
"""Seconds of an agent step before its model call worth marking (tool discovery takes longer)."""
FONT = 7.0
"""Points: the size of the labels and notes."""

WIDTH = 9.0
"""Inches: the figure's width."""
LEFT, RIGHT = 1.1, 0.3
"""Inches left of the axes (the runs' names) and right of them."""
TOP, BOTTOM = 0.45, 0.85
"""Inches above the axes (the title) and below them (the time axis and its legend)."""

# A run's band, in inches from its top (the axes' y unit is the inch, downwards).
NOTE_Y = 0.2          # the baseline of the notes above the model requests
CALL_Y = 0.3          # the ▼ of each model request
BAR_Y, BAR_HEIGHT = 0.48, 0.18
TICK_Y = 0.64         # the checkpoint ticks
LABEL_Y = 0.72        # the top of the first line of labels
LINE_HEIGHT = 0.3     # a line of labels: the step, and the node's name under it
NODE_OFFSET = 0.12    # the node's name, below its step
BAND_END = 0.08       # space after a run's last line of labels

COLOURS = {"completed": "tab:green", "failed": "tab:red", "interrupted": "tab:orange", "running": "tab:blue",
           "cancelled": "tab:gray", "waiting": "tab:purple"}


def node_names(points: pd.DataFrame) -> list[str]:
    """Per checkpoint (a row of `inspect.checkpoints`), the node whose write made it.

    A checkpoint of source `input` holds the input (`input`); one of source `loop` was written by
    the nodes that ran in its step, which the checkpoint before it named in `next` (`__start__` for
    step 0, then `agent`, `tools`, ...). Anything else (a checkpoint after a prune, an `update`) is
    named by its source, or not at all."""
    names: list[str] = []
    before: tuple[str, ...] = ()
    for source, next_ in zip(points["source"], points["next"]):
        if source == "input":
            names.append("input")
        elif source == "loop":
            names.append("+".join(before))
        else:
            names.append("" if source is None or str(source).startswith("pruned") else str(source))
        before = tuple(next_ or ())
    return names


@dataclass
class _Run:
    number: int
    status: str
    code: str
    start: float
    end: float
    finished: bool
    steps: list[int]
    nodes: list[str]
    times: list[float]
    calls: list[float]


def _seconds(value: Any, origin: float) -> float:
    return pd.Timestamp(value).timestamp() - origin


def _runs(runs: pd.DataFrame, points: pd.DataFrame, requests: list[float], origin: float) -> list[_Run]:
    names = node_names(points)
    kept = points.assign(node=names)
    kept = kept[kept["checkpoint_id"].notna()]  # not the rows that say what was pruned
    spans = []
    for index, run in enumerate(runs.itertuples()):
        start = _seconds(run.started_at, origin)
        finished = isinstance(run.finished_at, str)
        if finished:
            end = _seconds(run.finished_at, origin)
        elif index + 1 < len(runs):
            end = _seconds(runs["started_at"].iloc[index + 1], origin)
        else:
            end = max([start, *requests])
        mine = kept[kept["run_id"] == run.id]
        code = run.error_code if isinstance(run.error_code, str) else ""
        spans.append(_Run(index + 1, str(run.status), code, start, end, finished,
                          [int(step) for step in mine["step"]], list(mine["node"]),
                          [_seconds(t, origin) for t in mine["created_at"]],
                          [t for t in requests if start <= t <= end]))
    return spans


def _text_width(text: str) -> float:
    """Inches: how wide `text` is drawn at the labels' size."""
    from matplotlib.font_manager import FontProperties
    from matplotlib.textpath import TextPath

    if not text:
        return 0.0
    return TextPath((0, 0), text, prop=FontProperties(size=FONT)).get_extents().width / 72


def _label_lines(run: _Run, per_inch: float) -> list[int | None]:
    """Per checkpoint of `run`, the line its label goes on (None: left out); on each line a label
    keeps `LABEL_PAD` from the one before it."""
    right_edge: list[float] = []
    lines: list[int | None] = [None] * len(run.times)
    for index in sorted(range(len(run.times)), key=lambda i: (run.times[i], run.steps[i])):
        centre = run.times[index] / per_inch
        half = max(_text_width(str(run.steps[index])), _text_width(run.nodes[index])) / 2
        line = next((n for n, edge in enumerate(right_edge) if centre - half >= edge + LABEL_PAD), len(right_edge))
        if line == LABEL_LINES:
            continue
        if line == len(right_edge):
            right_edge.append(0.0)
        right_edge[line] = centre + half
        lines[index] = line
    return lines


def draw(runs: pd.DataFrame, points: pd.DataFrame, conversation: str, model_requests: Iterable[Any] = (),
         failed_requests: Iterable[Any] = ()) -> Picture:
    """The timeline of one conversation as a `Picture` titled `runs and checkpoints of <conversation>`,
    from its runs (`inspect.peek_runs`), its checkpoints (`inspect.checkpoints`) and the times of
    the model requests (ISO strings; those in `failed_requests` got no answer: drawn ✕, with the
    wait to the next attempt).

    Its elements name each run and its outcome, the checkpoints each run wrote (step and node), and
    how many model requests fell within the runs."""
    figure, elements = figure_and_elements(runs, points, conversation, model_requests, failed_requests)
    # The drawing's title shortens the id; the Picture's names it in full, which the lessons' checked
    # outputs read as `UUID` (tests/notebooks/sanitize.cfg knows no 8-digit prefix of one).
    return picture(figure, f"runs and checkpoints of {conversation}", elements)


def figure_and_elements(runs: pd.DataFrame, points: pd.DataFrame, conversation: str,
                        model_requests: Iterable[Any] = (), failed_requests: Iterable[Any] = ()
                        ) -> tuple[Any, list[str]]:
    """`draw`'s figure (still open in pyplot) and its elements."""
    import matplotlib.pyplot as plt

    origin = pd.Timestamp(runs["started_at"].iloc[0]).timestamp() if len(runs) else 0.0
    failed = {_seconds(t, origin) for t in failed_requests or ()}
    requests = sorted({_seconds(t, origin) for t in model_requests or ()} | failed)
    written = points[points["checkpoint_id"].notna()]  # not the rows that say what was pruned
    every = [(_seconds(t, origin), tuple(n or ())) for t, n in zip(written["created_at"], written["next"])]
    spans = _runs(runs, points, requests, origin)
    right = max([0.0, *(max([s.end if s.finished else s.start, *s.times, *s.calls]) for s in spans)]) or 1.0
    left_limit, right_limit = -0.02 * right, 1.02 * right
    axes_width = WIDTH - LEFT - RIGHT
    per_inch = (right_limit - left_limit) / axes_width
    layout = [_label_lines(s, per_inch) for s in spans]
    heights = [LABEL_Y + max(1, 1 + max([n for n in lines if n is not None], default=0)) * LINE_HEIGHT + BAND_END
               for lines in layout]
    total = sum(heights) or 1.0
    height = TOP + total + BOTTOM
    figure = plt.figure(figsize=(WIDTH, height))
    axes = figure.add_axes((LEFT / WIDTH, BOTTOM / height, axes_width / WIDTH, total / height))
    axes.set_xlim(left_limit, right_limit)
    axes.set_ylim(total, 0)
    for side in ("top", "right", "left"):
        axes.spines[side].set_visible(False)

    prepared_any = skipped = False
    top = 0.0
    for span, lines, band in zip(spans, layout, heights):
        bar = top + BAR_Y
        axes.barh(bar, max((span.end if span.finished else span.start) - span.start, 0.002 * right),
                  left=span.start, height=BAR_HEIGHT, color=COLOURS.get(span.status, "grey"))
        # The agent step before each model call: from the checkpoint that sent the run to `agent`
        # (a resumed run starts from an earlier run's checkpoint: then from the run's start). A
        # retried call's stretch is the failed call's, then the wait: labelled below, not here.
        for call in span.calls:
            before = [(t, next_) for t, next_ in every if t <= call]
            if not before or before[-1][1] != ("agent",):
                continue
            began = max(before[-1][0], span.start)
            if any(began <= other < call for other in span.calls):
                continue
            if call - began >= PREPARE_MIN:
                axes.barh(bar, call - began, left=began, height=BAR_HEIGHT, color="white", alpha=0.55,
                          hatch="///", edgecolor="black", linewidth=0)
                # Discovery is once per process: a run's first agent step in a new process waits for it.
                label = "tools discovered: MCP servers start" if call == span.calls[0] else "before the model call"
                axes.annotate(f"{label} ({call - began:.1f} s)", (began, top + NOTE_Y), fontsize=FONT,
                              ha="left", va="bottom", annotation_clip=False)
                prepared_any = True
        answered = [t for t in span.calls if t not in failed]
        axes.scatter(answered, [top + CALL_Y] * len(answered), marker="v", s=18, color="tab:purple", zorder=3)
        refused = [t for t in span.calls if t in failed]
        axes.scatter(refused, [top + CALL_Y] * len(refused), marker="x", s=22, color="tab:red", zorder=3)
        for call, after in zip(span.calls, span.calls[1:]):
            if call in failed:
                axes.annotate("", (after, top + CALL_Y), xytext=(call, top + CALL_Y),
                              arrowprops={"arrowstyle": "->", "color": "tab:red", "linewidth": 0.8})
                axes.annotate(f"retry after {after - call:.2f} s", ((call + after) / 2, top + NOTE_Y),
                              fontsize=FONT, ha="center", va="bottom", color="tab:red", annotation_clip=False)
        axes.scatter(span.times, [top + TICK_Y] * len(span.times), marker="|", color="black")
        for time, step, node, line in zip(span.times, span.steps, span.nodes, lines):
            if line is None:
                skipped = True
                continue
            y = top + LABEL_Y + line * LINE_HEIGHT
            axes.annotate(str(step), (time, y), fontsize=FONT, ha="center", va="top", annotation_clip=False)
            if node:
                axes.annotate(node, (time, y + NODE_OFFSET), fontsize=FONT, ha="center", va="top",
                              color="dimgray", annotation_clip=False)
        top += band
    bars = [sum(heights[:n]) + BAR_Y for n in range(len(spans))]
    axes.set_yticks(bars, [f"run {s.number}\n{s.status} {s.code}".rstrip() for s in spans], fontsize=8)
    axes.tick_params(axis="y", length=0)
    legend = "ticks: checkpoints, labelled with their step and the node whose write made it"
    legend += " (some too close to label)" if skipped else ""
    if set(requests) - failed:
        legend += "\n▼ a model request"
    if failed:
        legend += ";  ✕ one that failed, → to the next attempt"
    if prepared_any:
        legend += ";  hatched: an agent step before its model call"
    axes.set_xlabel(f"seconds since the first run started\n{legend}", fontsize=8)
    axes.set_title(f"runs and checkpoints of {conversation[:8]}…")
    return figure, elements(spans, failed)


def elements(spans: Sequence[_Run], failed: set[float]) -> list[str]:
    """What the picture shows, in words that do not change from one run of a lesson to the next."""
    named: list[str] = []
    for span in spans:
        named.append(f"run {span.number}: {span.status}" + (f" {span.code}" if span.code else ""))
        wrote = ", ".join(f"{step} {node}".rstrip() for step, node in zip(span.steps, span.nodes))
        named.append(f"run {span.number} wrote: {wrote or 'no checkpoint'}")
    calls = [t for span in spans for t in span.calls]
    refused = [t for t in calls if t in failed]
    named.append(f"model requests: {len(calls)}" + (f", {len(refused)} of them failed" if refused else ""))
    return named

"""The kill-point matrix as a picture: each point on the scenario's timeline, coloured by verdict.

Points go left to right in the order the uninterrupted run met them, on three rows: the model
(a request received, its first chunk), the tools (the page fetched, the payment committed) and
your database (each write). Shaded bands are the scenario's three turns. A point is green when
it recovers, else the colour of its worst verdict (lost, stuck, extra payment, re-run, wrong
status), and named when only a few do not recover. The picture's elements name the turns, the
colours drawn and each point's verdict.
"""

from __future__ import annotations

from ..lab.pictures import Picture, picture
from .result import COLOURS, ROWS, Graded

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

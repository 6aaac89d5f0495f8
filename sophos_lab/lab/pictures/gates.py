"""The life of each approval gate: when it was made, when it was decided, and the payments around it.

Drawn from the lab's own records: the `gates` table (`lab.gates()`: when each gate was made and
decided, and how), the ledger's payments (`lab.ledger()`, one row per book), and, optionally,
moments the lesson saw itself (a `kill -9`). The x axis is the order of those events, not their
time to scale: a gate that waits an hour and one that waits a second look the same, and what the
picture shows is what happened *while* a gate waited (a payment it doesn't know about, a kill).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pandas as pd

from . import Picture, picture

TITLE = "the life of each gate"
DECISION_COLOURS = {"approve": "tab:green", "reject": "tab:red"}
ORDER = {"made": 0, "mark": 1, "decided": 2, "paid": 3}
"""Which of two events with the same time came first: a gate is made before it is decided, and a
decision is recorded before the payment it allows (the ledger's clock counts milliseconds only)."""


@dataclass(frozen=True)
class Event:
    """One thing the picture shows at one point of the order: `kind` is made, decided, paid or mark."""

    time: pd.Timestamp
    kind: str
    lane: str
    """The gate's id, or the book's name (a payment), or "" (a mark)."""
    text: str


def gate_rows(gates: pd.DataFrame, names: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """One dict per gate of `gates` (a `lab.gates()` frame: a row per held call), oldest first:
    `label` (the payees of its calls, or their tools, and `names[conversation_id]` in brackets),
    `made`, `decided` (None while undecided) and `decision` (None, or approve / reject / mixed)."""
    names = names or {}
    rows = []
    for gate, calls in gates.groupby("gate", sort=False):
        first = calls.iloc[0]
        payees = [args.get("to") if isinstance(args, dict) else None for args in calls["args"]]
        label = ", ".join(p if p else tool for p, tool in zip(payees, calls["tool"]))
        name = names.get(first["conversation_id"])
        decisions = sorted({d for d in calls["decision"] if isinstance(d, str)})
        rows.append({
            "gate": gate, "label": f"{label} ({name})" if name else label, "made": first["created_at"],
            "decided": first["decided_at"] if isinstance(first["decided_at"], str) else None,  # NaN: undecided
            "decision": None if not decisions else decisions[0] if len(decisions) == 1 else "mixed",
        })
    return sorted(rows, key=lambda row: pd.Timestamp(row["made"]))


def events(gates: pd.DataFrame, books: Mapping[str, pd.DataFrame] | None = None,
           names: Mapping[str, str] | None = None, marks: Mapping[str, str] | None = None) -> list[Event]:
    """Every event the picture shows, in the order they happened (ties broken by `ORDER`)."""
    found = []
    for row in gate_rows(gates, names):
        found.append(Event(_utc(row["made"]), "made", row["gate"], f"made: {row['label']}"))
        if row["decided"] is not None:
            found.append(Event(_utc(row["decided"]), "decided", row["gate"], f"{row['decision']}: {row['label']}"))
    books = books or {}
    for book, payments in books.items():
        where = f" ({book})" if len(books) > 1 else ""
        for payment in payments.itertuples():
            found.append(Event(_utc(payment.created_at), "paid", book, f"paid: {payment.to_account}{where}"))
    for label, time in (marks or {}).items():
        found.append(Event(_utc(time), "mark", "", label))
    return sorted(found, key=lambda e: (e.time.floor("ms"), ORDER[e.kind], e.time))


def gate_lives(gates: pd.DataFrame, books: Mapping[str, pd.DataFrame] | None = None, *,
               names: Mapping[str, str] | None = None, marks: Mapping[str, str] | None = None,
               title: str = TITLE) -> Picture:
    """A picture of each gate of `gates` (a `lab.gates()` frame) from the moment it was made to its
    decision (a dashed line to the right edge while it still waits), above one row per ledger book
    of `books` (name -> `lab.ledger()` frame) with a dot per payment, in the order things happened.

    `names` gives a conversation (by id) a name shown after its gates' payees, e.g. `{c: "second
    tab"}`; `marks` (label -> ISO time) draws a moment the lesson saw itself as a vertical line,
    e.g. `{"kill -9": killed_at}`. The elements are the events in order ("made: alice", "approve:
    alice", "paid: alice", "kill -9"), then "waiting: <gate>" for each gate still undecided."""
    import matplotlib.pyplot as plt

    rows = gate_rows(gates, names)
    happened = events(gates, books, names, marks)
    position = {id(event): index for index, event in enumerate(happened)}

    def x(event: Event) -> int:
        return position[id(event)]

    right = max(len(happened) - 1, 1) + 0.6
    lanes = [row["gate"] for row in rows] + list(books or {})
    y = {lane: len(lanes) - 1 - index for index, lane in enumerate(lanes)}

    figure, axes = plt.subplots(figsize=(2.6 + 0.62 * len(happened), 0.9 + 0.5 * max(len(lanes), 1)))
    axes.set_xlim(-0.6, right)
    axes.set_ylim(-0.8, len(lanes) - 0.2)
    for row in rows:
        made = next(e for e in happened if e.kind == "made" and e.lane == row["gate"])
        decided = next((e for e in happened if e.kind == "decided" and e.lane == row["gate"]), None)
        level = y[row["gate"]]
        if decided is None:
            axes.plot([x(made), right], [level, level], color="tab:blue", linestyle="--", linewidth=2)
            axes.annotate("waiting", (right, level), xytext=(-2, 4), textcoords="offset points",
                          ha="right", va="bottom", fontsize=8, color="tab:blue")
        else:
            colour = DECISION_COLOURS.get(row["decision"], "grey")
            axes.plot([x(made), x(decided)], [level, level], color=colour, linewidth=3, solid_capstyle="butt")
            axes.scatter([x(decided)], [level], marker="s", s=40, color=colour, zorder=3)
            axes.annotate(row["decision"], (x(decided), level), xytext=(4, 4), textcoords="offset points",
                          fontsize=8, color=colour)
        axes.scatter([x(made)], [level], marker="o", s=36, facecolor="white", edgecolor="black", zorder=3)
        axes.annotate("made", (x(made), level), xytext=(-4, 4), textcoords="offset points", ha="right", fontsize=8)
    for event in happened:
        if event.kind == "paid":
            axes.axvline(x(event), color="black", alpha=0.15, linewidth=1)
            axes.scatter([x(event)], [y[event.lane]], marker="o", s=40, color="black", zorder=3)
            axes.annotate(event.text.removeprefix("paid: ").split(" (")[0], (x(event), y[event.lane]),
                          xytext=(0, 6), textcoords="offset points", ha="center", fontsize=8)
        elif event.kind == "mark":
            axes.axvline(x(event), color="tab:red", linestyle=":", linewidth=1.5)
            axes.annotate(event.text, (x(event), len(lanes) - 0.35), xytext=(3, 0), textcoords="offset points",
                          fontsize=8, color="tab:red")
    axes.set_yticks([y[lane] for lane in lanes],
                    [f"gate: {row['label']}" for row in rows] + list(books or {}))
    axes.set_xticks([])
    axes.set_xlabel("what happened, in order (not to scale); a grey line marks each payment")
    axes.set_title(title)
    for side in ("top", "right"):
        axes.spines[side].set_visible(False)
    figure.tight_layout()
    elements = [event.text for event in happened] + [f"waiting: {row['label']}" for row in rows if row["decided"] is None]
    return picture(figure, title, elements)


def _utc(value: Any) -> pd.Timestamp:
    stamp = pd.Timestamp(value)
    return stamp.tz_localize("UTC") if stamp.tzinfo is None else stamp.tz_convert("UTC")

"""The kill points: named by what the world observes, listed by an uninterrupted run.

The grader runs your module once without a kill (the reference run) and lists, in time order,
every moment the world saw:

- `model k received`: the k-th request to the model, before any answer (the model holds it);
- `model k first chunk`: the same request right after the first chunk of its answer;
- `fetch received`: the fetch tool's request for the page, at the web server;
- `payment committed`: the ledger's payment, committed on its side, before the tool answers;
- `write n: ...`: your n-th durable write, through `world.connect()` or `world.saver()` (what
  it wrote: `commit: INSERT INTO runs`, `checkpoint step 0`, `writes tools`).

Each point is then one graded run of its own, killed there. `sample` picks the first point of
each kind and the last (about a third of them): a later point of a kind already tried runs the
same code to the same kind of state, a turn further on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

MODEL_AT = {"received": "received", "first-chunk": "first chunk"}


@dataclass(frozen=True)
class Point:
    """One kill point of the matrix."""

    name: str
    kind: str
    """The point without its numbers: `model received`, `write: checkpoint step N`, ..."""
    turn: int
    """The scenario's turn it falls in (1, 2, 3)."""
    at: float
    """Seconds from the start of the reference run."""
    n: int = 1
    """The k-th model request, the n-th write (1 for the others)."""
    hold: str = ""
    """For a model point: `received` or `first-chunk`."""
    before_input: bool = False
    """Whether it comes before its turn's first checkpoint: the turn's message is not yet in the thread."""

    @property
    def trigger(self) -> str:
        """How it is reached: `model`, `fetch`, `payment` or `write`."""
        return self.kind.split()[0].rstrip(":")


def turn_of(at: float, starts: list[float]) -> int:
    """The turn (1-based) whose start is the latest at or before `at`."""
    return max(1, sum(1 for start in starts if start <= at))


def points_of(start: float, turn_starts: list[float], model: list[dict[str, Any]], web: list[dict[str, Any]],
              writes: list[dict[str, Any]], page: str, notify: str) -> list[Point]:
    """The points of a reference run, in time order, from its observations (epoch seconds in
    `time`): the model's chat requests, the web server's log, the child's `write` reports."""
    found: list[tuple[float, int, str, str, int, str]] = []
    for k, request in enumerate(model, 1):
        for order, (hold, words) in enumerate(MODEL_AT.items()):
            found.append((request["time"], order, f"model {k} {words}", f"model {words}", k, hold))
    fetches = [entry for entry in web if entry["path"].split("?")[0] == "/" + page]
    if fetches:
        found.append((fetches[0]["time"], 0, "fetch received", "fetch received", 1, ""))
    payments = [entry for entry in web if entry["path"].split("?")[0] == notify]
    if payments:
        found.append((payments[0]["time"], 0, "payment committed", "payment committed", 1, ""))
    for write in writes:
        kind = "write: " + re.sub(r"-?\d+", "N", write["what"])
        found.append((write["time"], 0, f"write {write['n']}: {write['what']}", kind, write["n"], ""))
    found.sort(key=lambda item: (item[0], item[1]))
    first_checkpoint: dict[int, float] = {}
    for write in writes:
        turn = turn_of(write["time"], turn_starts)
        if "checkpoint" in write["what"] and turn not in first_checkpoint:
            first_checkpoint[turn] = write["time"]
    points = []
    for at, _, name, kind, n, hold in found:
        turn = turn_of(at, turn_starts)
        before = at < first_checkpoint.get(turn, float("inf"))
        points.append(Point(name, kind, turn, round(at - start, 4), n, hold, before))
    return points


def sample(points: list[Point]) -> list[Point]:
    """The first point of each kind, and the last point."""
    firsts: dict[str, Point] = {}
    for point in points:
        firsts.setdefault(point.kind, point)
    chosen = {id(p) for p in firsts.values()} | ({id(points[-1])} if points else set())
    return [point for point in points if id(point) in chosen]

"""Every committed lesson stays light: a short setup, short cells, few of them, claims instead of
assertions, no test machinery in view, and a picture where the lesson's point is time, order or
topology.

The pictures are looked at in the executed lesson: each named one is the output of a cell whose
output nbval compares (its golden output, recorded from a run of the lesson, holds the drawing and
the names of what it shows; nbval checks on every run that the lesson still draws them).
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
LESSONS = sorted((ROOT / "notebooks").glob("[0-9][0-9]*_*.ipynb"))
GOLDEN = ROOT / "tests" / "notebooks" / "golden"

SETUP_LINES = 15
CELL_LINES = 40
CELLS = 45

STATUS_MACHINE = ("run statuses", ["running", "completed", "failed", "interrupted", "observed"])
PICTURES: dict[str, list[tuple[str, list[str]]]] = {
    "00": [("runs and checkpoints", ["agent", "tools"])],
    "04": [("event ids across a disconnect", ["Last-Event-ID", "disconnect", "catch-up"])],
    "06a": [STATUS_MACHINE],
    "06b": [STATUS_MACHINE],
    "06c": [STATUS_MACHINE],
    "06d": [STATUS_MACHINE],
    "06e": [STATUS_MACHINE],
    "07": [("commit, kill, replay", ["commit", "kill", "replay", "key"])],
    "08b": [("the lease on a time axis", ["lease", "kill", "freeze", "takeover"])],
    "11": [("the life of each gate", ["made", "kill -9", "approve", "paid"])],
    "13": [("cancel request against the outcome", ["cancel", "outcome"])],
    "14": [("the life of each gate", ["made", "approve", "paid", "waiting"])],
    "15": [("commit, kill, replay", ["commit", "kill", "replay", "key"])],
    "16": [("the lease on a time axis", ["lease", "kill", "freeze", "takeover"])],
    "17": [("who owns what", ["PostgreSQL", "worker", "server"])],
}
"""Per lesson (its number), the pictures it shows: the title and the words among its elements."""


def lesson_number(path: Path) -> str:
    return path.stem.split("_", 1)[0]


def code_cells(path: Path) -> list:
    return [cell for cell in nbformat.read(path, as_version=4).cells if cell.cell_type == "code"]


def lines(cell) -> int:
    return len(cell.source.strip("\n").splitlines())


def python_of(source: str) -> str:
    """The cell without IPython's magics and shell escapes (which are not Python); a cell magic
    (`%%bash`) makes the whole cell another language."""
    if source.lstrip().startswith("%%"):
        return ""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_a_lesson_is_short_enough_to_read_in_one_sitting(path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    assert len(notebook.cells) <= CELLS, f"{path.name}: {len(notebook.cells)} cells (at most {CELLS})"
    long = {cell.id: lines(cell) for cell in code_cells(path) if lines(cell) > CELL_LINES}
    assert not long, f"{path.name}: code cells over {CELL_LINES} lines: {long}"
    (setup, *_) = [cell for cell in code_cells(path) if "Lab.setup(" in cell.source] or [None]
    assert setup is not None, f"{path.name}: no setup cell (`Lab.setup(...)`)"
    assert lines(setup) <= SETUP_LINES, f"{path.name}: the setup cell has {lines(setup)} lines (at most {SETUP_LINES})"


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_a_lesson_shows_claims_not_test_machinery(path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    for cell in notebook.cells:
        assert "NBVAL" not in cell.source, f"{path.name} {cell.id}: an nbval marker in view (use the cell's tags)"
        if cell.cell_type == "markdown":
            said = re.findall(r"(?i)\b(nbval|golden output|papermill)\b", cell.source)
            assert not said, f"{path.name} {cell.id}: the tests' wording in a lesson's prose: {said}"
            continue
        tree = ast.parse(python_of(cell.source))
        asserts = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Assert)]
        assert not asserts, f"{path.name} {cell.id}: `assert` on lines {asserts} (a ✅ check states claims: `check(...)`)"


def pictures_shown(path: Path) -> list[str]:
    """The text of each picture in the lesson's recorded run (its checked cells' golden outputs)."""
    golden = json.loads((GOLDEN / f"{path.stem}.json").read_text(encoding="utf-8"))
    return ["".join(output["data"]["text/plain"]) for outputs in golden.values() for output in outputs
            if "image/svg+xml" in output.get("data", {}) and "text/plain" in output["data"]]


@pytest.mark.parametrize("path", [p for p in LESSONS if lesson_number(p) in PICTURES], ids=lambda p: p.stem)
def test_a_lesson_about_time_order_or_topology_shows_a_picture_of_it(path: Path) -> None:
    shown = pictures_shown(path)
    for title, words in PICTURES[lesson_number(path)]:
        matching = [text for text in shown if title in text.splitlines()[0]]
        assert matching, f"{path.name}: no picture titled {title!r} among its checked outputs: {shown}"
        missing = [word for word in words if not any(word in text for text in matching)]
        assert not missing, f"{path.name}: the picture {title!r} does not show {missing}: {matching}"

"""The lessons are committed without outputs; the golden outputs for nbval live in tests/notebooks/golden/.

A learner who opens a lesson must not find the answers saved next to the 🔮 prompts. nbval's
comparisons are kept by `tests/notebooks/golden.py inject`, which puts the golden outputs back into
copies (`make test` and `make test-notebooks` run nbval on those). These tests keep the two sides in
step, and check that each lesson has the knobs (`parameters` cell) the other runs set.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "notebooks"))
import golden  # noqa: E402

NOTEBOOKS = golden.lessons()
IDS = [p.stem for p in NOTEBOOKS]


def test_there_are_lessons() -> None:
    assert len(NOTEBOOKS) >= 9, NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_lesson_has_no_outputs_and_no_execution_counts(path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    dirty = [
        (cell.id, len(cell.outputs), cell.execution_count)
        for cell in notebook.cells
        if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)
    ]
    assert not dirty, f"{path.name}: cells with saved outputs or execution counts (id, outputs, count): {dirty}"
    ids = [cell.id for cell in notebook.cells]
    assert len(ids) == len(set(ids)), f"{path.name}: duplicate cell ids"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_every_checked_cell_has_golden_outputs_and_none_is_orphaned(path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    checked = golden.checked_ids(notebook)
    assert checked, f"{path.name} has no cell tagged `nbval-check-output`"
    stored = golden.read_golden(path.stem)
    assert sorted(stored) == sorted(checked), (
        f"{path.name}: checked cells without golden outputs: {sorted(set(checked) - set(stored))}; "
        f"golden outputs of no checked cell: {sorted(set(stored) - set(checked))}"
    )
    for cell_id, outputs in stored.items():
        assert outputs, f"{path.name}: the golden outputs of {cell_id} are empty (nbval would compare nothing)"


def test_no_golden_file_without_a_lesson() -> None:
    files = {p.stem for p in golden.GOLDEN.glob("*")}
    assert files - set(IDS) == set(), f"golden files of no lesson: {sorted(files - set(IDS))}"


PREDICTION_LINE = re.compile(r"(?m)^(prediction\w*) = None\b")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_every_prediction_is_revealed_once_scored_and_answered_in_the_nbval_copy(path: Path, tmp_path: Path) -> None:
    """The lesson asks, reveals each prediction once and ends with its score; nbval's copy answers
    every prediction with the recorded answer (so its checked score cell says all were right)."""
    notebook = nbformat.read(path, as_version=4)
    code = [cell.source for cell in notebook.cells if cell.cell_type == "code"]
    declared = PREDICTION_LINE.findall("\n".join(code))
    revealed = golden.prediction_names(notebook)
    assert declared, f"{path.name} asks for no prediction"
    assert sorted(revealed) == sorted(set(revealed)) == sorted(declared), (path.name, declared, revealed)
    assert "score()" in code[-2] and golden.is_checked(notebook.cells[-2]), f"{path.name}: no score before lab.close()"
    answers = golden.read_answers(path.stem)
    assert sorted(answers) == sorted(declared), f"{path.name}: run `golden.py record {path.stem}`"
    (copy,) = golden.inject(tmp_path, [path.stem])
    answered = "\n".join(c.source for c in nbformat.read(copy, as_version=4).cells if c.cell_type == "code")
    assert not PREDICTION_LINE.search(answered), f"{copy.name}: a prediction left unanswered"
    for name, value in answers.items():
        assert re.search(rf"(?m)^{name} = {re.escape(repr(value))}", answered), (name, value)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_every_exercise_has_a_reference_solution_and_a_known_wrong_answer(path: Path) -> None:
    """Each `# ✏️ EXERCISE name:` cell: a stub that says "not done" as committed, a solution and
    a wrong answer in solutions/<lesson>/ starting with the same marker line, and a check after it."""
    from sophos_lab.lab.exercises import exercise_names

    notebook = nbformat.read(path, as_version=4)
    cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
    for index, cell in enumerate(cells):
        for name in exercise_names(cell.source):
            assert "raise NotImplementedError" in cell.source, f"{path.name} {name}: the stub must say not done"
            checks = [c for c in cells[index + 1:] if f'check_exercise("{name}"' in c.source]
            assert checks and golden.is_checked(checks[0]), f"{path.name} {name}: no checked `check_exercise(\"{name}\", ...)` cell after it"
            marker = cell.source.splitlines()[0]
            for wrong in (False, True):
                solution = golden.solution_path(path.stem, name, wrong)
                assert solution.exists(), f"{path.name} {name}: no {solution.relative_to(ROOT)}"
                assert solution.read_text(encoding="utf-8").splitlines()[0] == marker, solution


def test_no_solutions_without_an_exercise() -> None:
    known = {(path.stem, name) for path in NOTEBOOKS for name in golden.exercises(nbformat.read(path, as_version=4))}
    files = {(p.parent.name, p.name.split(".")[0]) for p in golden.SOLUTIONS.glob("*/*.py")}
    assert files <= known, f"solutions of no exercise: {sorted(files - known)}"


def test_no_answers_without_a_lesson() -> None:
    files = {p.stem for p in golden.ANSWERS.glob("*")}
    assert files - set(IDS) == set(), f"answers of no lesson: {sorted(files - set(IDS))}"


def test_inject_writes_each_lesson_with_its_golden_outputs(tmp_path: Path) -> None:
    from sophos_lab.lab.exercises import exercise_names

    written = golden.inject(tmp_path)
    assert [p.name for p in written] == [p.name for p in NOTEBOOKS]
    for copy in written:
        notebook = nbformat.read(copy, as_version=4)
        nbformat.validate(notebook)  # the golden outputs are valid nbformat outputs
        stored = golden.read_golden(copy.stem)
        lesson = nbformat.read(golden.NOTEBOOKS / copy.name, as_version=4)
        assert [c.id for c in notebook.cells] == [c.id for c in lesson.cells], "inject must not add or drop cells"
        for cell, original in zip(notebook.cells, lesson.cells):
            if cell.cell_type != "code":
                continue
            expected = stored.get(cell.id, [])
            assert json.loads(json.dumps(cell.outputs)) == expected, f"{copy.name} {cell.id}"
            # nbval refuses a reference cell with outputs and no execution count
            assert (cell.execution_count is not None) == (cell.id in stored), f"{copy.name} {cell.id}"
            answered = PREDICTION_LINE.search(original.source) or exercise_names(original.source)
            if "parameters" not in cell.metadata.get("tags", []) and not answered:
                assert cell.source == original.source, (
                    f"{copy.name} {cell.id}: only the parameters, prediction and exercise cells may change")


def test_the_chat_lesson_stops_before_resume_and_its_nbval_copy_clicks(tmp_path: Path) -> None:
    """06 as committed leaves Resume to the learner; nbval's copy presses it, so that the summary
    after the resume (a checked cell) is still compared."""
    def parameters(path: Path) -> str:
        notebook = nbformat.read(path, as_version=4)
        (cell,) = [c for c in notebook.cells if "parameters" in c.metadata.get("tags", [])]
        return cell.source

    lesson = golden.NOTEBOOKS / "06f_chat_and_resume.ipynb"
    assert re.search(r"(?m)^CLICK_RESUME = False\b", parameters(lesson))
    (copy,) = golden.inject(tmp_path, ["06f_chat_and_resume"])
    assert re.search(r"(?m)^CLICK_RESUME = True\b", parameters(copy))
    assert re.search(r"(?m)^CHILD = \"kernel\"", parameters(copy)), "the rest of the cell is kept"


# --- the knobs: one `parameters` cell, which papermill overrides --------------------------

WITHOUT_CHILD = {"01_own_the_process", "04_streaming_is_not_persistence", "16_outgrowing_one_file",
                 "17_the_separate_worker", "18_many_users", "19_lab_build_a_durable_agent"}
"""The lessons whose agent is `sophos-lab serve` (`lab.server()`), or the learner's own module in the
grader's processes (the labs after the course): no `CHILD` knob."""
EXTRA_PARAMETERS = {
    "06f_chat_and_resume": {"CLICK_RESUME": True},
    "04_streaming_is_not_persistence": {"DISCONNECT_AFTER": 1},
    "19_lab_build_a_durable_agent": {"EVERY_POINT": False},
}
"""Per lesson, the parameters the other-model run (test_notebooks_other_model.py) injects besides `CHILD`."""


def parameter_names(path: Path) -> set[str]:
    notebook = nbformat.read(path, as_version=4)
    cells = [c for c in notebook.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(cells) == 1, f"{path.name} needs exactly one cell tagged 'parameters'"
    return {line.split("=")[0].strip() for line in cells[0].source.splitlines() if "=" in line}


def parameters(path: Path) -> dict[str, object]:
    """What papermill injects into `path` (the other-model run): `CHILD = "worker"` where the lesson
    has the knob, and its EXTRA_PARAMETERS."""
    names = parameter_names(path)
    injected: dict[str, object] = {"CHILD": "worker"} if "CHILD" in names else {}
    injected.update(EXTRA_PARAMETERS.get(path.stem, {}))
    assert set(injected) <= names, f"{path.name} has no parameters {set(injected) - names}"
    return injected


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_every_lesson_has_the_knobs_its_runs_set(path: Path) -> None:
    """One `parameters` cell with `CHILD` (except where a server is the agent), and every extra
    parameter a run injects: a knob renamed away would otherwise be injected into nothing."""
    names = parameter_names(path)
    assert ("CHILD" in names) is (path.stem not in WITHOUT_CHILD), (path.name, names)
    parameters(path)


def test_the_course_map_lists_every_lesson_in_file_order_in_the_readme_and_in_00() -> None:
    """File order is reading order: the map in the README and in 00_start_here names every lesson
    once, in the order of the files, and the two maps are the same."""
    def mapped(text: str) -> list[str]:
        table = text[text.index("| stage | notebook |"):]
        table = table[:table.index("\n\n")] if "\n\n" in table else table
        return [re.search(r"\| `([^`]+)` \|", row).group(1) for row in table.splitlines()[2:]]

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    start = nbformat.read(golden.NOTEBOOKS / "00_start_here.ipynb", as_version=4)
    (course,) = [cell.source for cell in start.cells if cell.source.startswith("## The course")]
    assert mapped(readme) == IDS, (mapped(readme), IDS)
    assert mapped(course) == mapped(readme)

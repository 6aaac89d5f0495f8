"""Every notebook runs to the end under papermill with parameters injected.

nbval (the second half of `make test`) runs the notebooks as written, with their agent in a child
kernel; here papermill injects `CHILD = "worker"`, so the same lessons also pass with the agent in
a plain subprocess. Lesson 06 also gets `CLICK_RESUME = True`: as committed, its Run All stops with
the Resume button showing and leaves the click to the learner (`tests/test_browser.py` clicks it in a
real browser); here the notebook clicks it, and its ✅ checks of the resumed answer run. Executed copies
are kept in `.lab/executed/` for inspection.
"""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import papermill
import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
EXTRA_PARAMETERS = {
    "06_chat_and_resume": {"CLICK_RESUME": True},
    "10_streaming_is_not_persistence": {"DISCONNECT_AFTER": 1},
}
"""Per lesson, parameters injected besides `CHILD`."""


def parameter_names(path: Path) -> set[str]:
    notebook = nbformat.read(path, as_version=4)
    cells = [c for c in notebook.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(cells) == 1, f"{path.name} needs exactly one cell tagged 'parameters'"
    return {line.split("=")[0].strip() for line in cells[0].source.splitlines() if "=" in line}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_with_injected_parameters(path: Path, tmp_path: Path) -> None:
    names = parameter_names(path)
    parameters = {"CHILD": "worker"} if "CHILD" in names else {}
    parameters.update(EXTRA_PARAMETERS.get(path.stem, {}))
    assert set(parameters) <= names, f"{path.name} has no parameters {set(parameters) - names}"
    out = ROOT / ".lab" / "executed" / path.name
    out.parent.mkdir(parents=True, exist_ok=True)
    papermill.execute_notebook(
        str(path), str(out), parameters=parameters, kernel_name="python3",
        cwd=str(path.parent), execution_timeout=120, start_timeout=120, progress_bar=False,
    )
    executed = nbformat.read(out, as_version=4)
    injected = [c for c in executed.cells if "injected-parameters" in c.metadata.get("tags", [])]
    assert injected or not parameters, "papermill did not inject the parameters"
    errors = [o for c in executed.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, errors


def test_chat_lesson_run_all_stops_with_resume_showing() -> None:
    """Lesson 06 as committed: Run All ends in the crashed state, Resume visible, the checks skipped.

    The same path as a learner's Run All (and the browser test's), without a browser: the notebook's
    cells in order, then one extra cell that reads the widget and closes the lab the lesson left open.
    """
    from nbclient import NotebookClient

    path = ROOT / "notebooks" / "06_chat_and_resume.ipynb"
    notebook = nbformat.read(path, as_version=4)
    probe = nbformat.v4.new_code_cell(
        "import json as _json\n"
        "print(_json.dumps({'resume_visible': widget.resume_visible, 'RESUMED': RESUMED,\n"
        "    'runs': lab.peek_runs(c)['status'].tolist(), 'fetches': lab.fetches('wal.html')}))"
    )
    client = NotebookClient(
        notebook, timeout=120, startup_timeout=120, kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    with client.setup_kernel():
        try:
            for index, cell in enumerate(notebook.cells):
                client.execute_cell(cell, index)
            notebook.cells.append(probe)
            client.execute_cell(probe, len(notebook.cells) - 1)
        finally:
            closer = nbformat.v4.new_code_cell("if 'lab' in globals():\n    lab.close()")
            notebook.cells.append(closer)
            client.execute_cell(closer, len(notebook.cells) - 1)
    text = lambda cell: "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")  # noqa: E731
    found = json.loads(text(probe))
    assert found == {"resume_visible": True, "RESUMED": False, "runs": ["running"], "fetches": 1}, found
    printed = "".join(text(cell) for cell in notebook.cells if cell.cell_type == "code")
    assert "Your turn: press Resume in the widget above." in printed, printed
    assert "Resume has not run yet" in printed, printed

"""Lesson 06f as committed; and what each run of a lesson checks.

Each lesson runs to the end twice, the two runs differing in where the agent runs and which
model answers (and lesson 06f twice more):

- nbval (in `make test`, on copies with the golden outputs put back): as written, the agent in a
  child *kernel*, the kit's scripted model; every ✅ check runs, the checks of what the model chose
  included, and the cells tagged `nbval-check-output` are compared with their golden outputs. Lesson 06f's
  copy sets `CLICK_RESUME = True`, so its checks of the resumed answer run too.
- `test_notebooks_other_model.py`: papermill injects `CHILD = "worker"` (the agent in a plain
  subprocess) and another Ollama-protocol server answers; every runtime check runs (the checks of
  what the model chose are the scripted model's). It also sets lesson 06f's `CLICK_RESUME = True`
  (Resume pressed through the widget's worker backend) and lesson 04's `DISCONNECT_AFTER = 1`
  (the client hangs up after the first token; nbval's run keeps 5).
- lesson 06f as committed (`CLICK_RESUME = False`): here Run All stops with Resume showing, and
  `tests/test_browser.py` clicks it in a real browser.

A third run of every lesson, papermill's `CHILD = "worker"` with the scripted model, was dropped:
its checks were nbval's (the same scripted answers; what the model chose does not depend on where
the agent runs) or the other-model run's (the worker child, every runtime check). That every
lesson has the knobs these runs set is checked in test_notebooks_committed.py, without running it.
"""

from __future__ import annotations

import json
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent


def test_chat_lesson_run_all_stops_with_resume_showing() -> None:
    """Lesson 06f as committed: Run All ends in the crashed state, Resume visible, the checks skipped.

    The same path as a learner's Run All (and the browser test's), without a browser: the notebook's
    cells in order, then one extra cell that reads the widget and closes the lab the lesson left open.
    """
    from nbclient import NotebookClient

    path = ROOT / "notebooks" / "06f_chat_and_resume.ipynb"
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

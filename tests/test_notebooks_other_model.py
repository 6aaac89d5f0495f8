"""The lessons with a model that is not the kit's scripted one (`pytest -m other_model`).

`OLLAMA_HOST` points at `servers/ollama_like.py`, a second Ollama-protocol server that chooses
its tool calls from the user's message as a real model would; each lab then puts its recording
proxy in front of it, so the kill points stay exact. papermill runs each lesson to the end with
the agent in a plain subprocess (`CHILD = "worker"`; nbval runs them with a child kernel), lesson 06f
pressing Resume itself and lesson 04 hanging up after one token (test_notebooks_papermill.py
says what each run of a lesson checks). Checks of what the model chose (which tool, how many calls, the
text) are made for the scripted model only, and the lessons say so when they skip them.

The lessons whose kill point needs a tool call (01, 04, 06d-06f, 07, 08b, 10; 11's gated payment;
12's held page) run against the server's hesitant tag, which first answers every such question in
words, as a real model sometimes does: the lesson says so, asks again, and still reaches its kill
point. The model failures of lesson 12 (HTTP 500s, a 400) come from the lab's recording proxy
(`fail_next`), as they come from the scripted model.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import papermill
import pytest
from conftest import OLLAMA_LIKE_MODEL
from test_notebooks_committed import golden, parameters

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]*_*.ipynb"))
KILL_POINT_NEEDS_A_TOOL_CALL = {
    "01_own_the_process", "04_streaming_is_not_persistence", "06d_crash_after_tool_result", "06e_graceful_shutdown",
    "06f_chat_and_resume", "07_side_effects_and_idempotency", "08a_local_first", "08b_runtime_ownership",
    "09_life_of_one_run", "10_cancel", "11_approval_gate", "12_retries_and_timeouts",
}

IN_MAKE_TEST = {"06d_crash_after_tool_result"}
"""The lessons `make test` runs against this server: a hesitant kill point (a tool call the model
may not make at once), a crash and a resume.
Every lesson runs with `make test-matrix` (or `-m other_model`):
nbval runs them all with the scripted model in `make test`, and the other server doubles a
lesson's time."""


def sampled(path: Path):
    marks = () if path.stem in IN_MAKE_TEST else (pytest.mark.full_matrix,)
    return pytest.param(path, id=path.stem, marks=marks)


@pytest.mark.other_model
@pytest.mark.parametrize("path", [sampled(p) for p in NOTEBOOKS])
def test_the_lesson_runs_to_the_end_with_another_ollama_server(path, ollama_like, monkeypatch):
    monkeypatch.setenv("OLLAMA_HOST", ollama_like)  # what a learner sets; the kernel inherits it
    hesitant = path.stem in KILL_POINT_NEEDS_A_TOOL_CALL
    monkeypatch.setenv("OLLAMA_MODEL", f"{OLLAMA_LIKE_MODEL}-hesitant" if hesitant else OLLAMA_LIKE_MODEL)
    out = ROOT / ".lab" / "executed-other-model" / path.name
    out.parent.mkdir(parents=True, exist_ok=True)
    injected = parameters(path)
    # The exercises get their known wrong answers here (nbval's copies get the right ones).
    lesson = nbformat.read(path, as_version=4)
    golden.set_solutions(lesson, path.stem, wrong=True)
    wrong = out.with_suffix(".wrong-answers.ipynb")
    nbformat.write(lesson, wrong)
    papermill.execute_notebook(
        str(wrong), str(out), parameters=injected, kernel_name="python3",
        cwd=str(path.parent), execution_timeout=120, start_timeout=120, progress_bar=False,
    )
    executed = nbformat.read(out, as_version=4)
    injected_cells = [c for c in executed.cells if "injected-parameters" in c.metadata.get("tags", [])]
    assert injected_cells or not injected, "papermill did not inject the parameters"
    errors = [o for c in executed.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, errors
    described = "".join(
        o.get("text", "") for c in executed.cells if c.cell_type == "code" for o in c.get("outputs", [])
    )
    assert "recording proxy" in described  # the lab said which model it used
    for exercise in golden.exercises(lesson):  # each check failed the wrong answer, with its reason
        assert re.search(rf"❌ {exercise}: \S", described), (exercise, described[-2000:])
    assert "🔮 You made none of this lesson's" in described  # no predictions injected: told, not stopped
    if hesitant:  # it answered in words first, and the lesson said so before asking again
        assert "answered without" in described and "again" in described

"""Every notebook runs to the end under papermill with parameters injected.

nbval (the second half of `make test`) runs the notebooks as written, with their agent in a child
kernel; here papermill injects `CHILD = "worker"`, so the same lessons also pass with the agent in
a plain subprocess. Executed copies are kept in `.lab/executed/` for inspection.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import papermill
import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def parameter_names(path: Path) -> set[str]:
    notebook = nbformat.read(path, as_version=4)
    cells = [c for c in notebook.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(cells) == 1, f"{path.name} needs exactly one cell tagged 'parameters'"
    return {line.split("=")[0].strip() for line in cells[0].source.splitlines() if "=" in line}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_with_injected_parameters(path: Path, tmp_path: Path) -> None:
    parameters = {"CHILD": "worker"} if "CHILD" in parameter_names(path) else {}
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

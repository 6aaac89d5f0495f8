"""Golden outputs of the lessons' output-checked cells, kept out of the committed notebooks.

The lessons in `notebooks/` are committed without outputs, so that a learner does not see the
answers next to the 🔮 prompts. nbval still compares the cells tagged `nbval-check-output` with
stored outputs: those live in `tests/notebooks/golden/<notebook>.json` (cell id → the outputs list
as nbformat stores it, unsanitised; nbval sanitises both sides with `sanitize.cfg`).

    python tests/notebooks/golden.py inject OUT_DIR [NAME ...]  # OUT_DIR/<name>.ipynb = lesson + golden outputs
    python tests/notebooks/golden.py record [NAME ...]  # execute the injected copies, store their outputs

`make test` and `make test-notebooks` run `inject .lab/nbval` and then nbval on the copies. `record`
(`make record-golden [LESSONS="..."]`) is for when a checked output changes on purpose: it injects,
executes the copies (like nbval: a `python3` kernel whose cwd is the copy's directory) and, for the
lessons named (all by default), rewrites the entries whose output differs after sanitising. Review
the diff of `tests/notebooks/golden/` before committing it.

The copies answer the lesson's 🔮 predictions: `tests/notebooks/answers/<notebook>.json` holds, per
`prediction_*` variable, what the lesson observed (recorded by `record`, from the values `reveal`
saw), and the copy's prediction cell sets them, so the lesson's `score()` cell, a checked one, says
every prediction was right: a lesson whose behaviour drifts from its answers fails there. The
committed lessons leave the predictions `None` (the other-model run executes them so: a learner
who predicts nothing is told so and goes on).

The copies also hold the reference solution of each exercise (`solutions/<notebook>/<exercise>.py`
put into its `# ✏️ EXERCISE <exercise>:` cell), so the checked check cell after it must say ✅;
the other-model run puts in the known wrong answers (`<exercise>.wrong.py`) and expects ❌.

The copies differ from the lessons in one more way, `NBVAL_PARAMETERS`: lesson 06f stops before
Resume by default (`CLICK_RESUME = False`, so that Run All leaves the crashed state to the learner);
its copy sets `CLICK_RESUME = True`, so that nbval also checks the summary after the resume.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
GOLDEN = Path(__file__).resolve().parent / "golden"
ANSWERS = Path(__file__).resolve().parent / "answers"
SOLUTIONS = ROOT / "solutions"
RECORD_DIR = ROOT / ".lab" / "golden-record"

NBVAL_PARAMETERS: dict[str, dict[str, object]] = {
    "06f_chat_and_resume": {"CLICK_RESUME": True},
    # The grading lab grades a sample of its kill points (the first of each kind and the last) in
    # the tests: every point of every stage is `tests/test_grading_matrix.py`'s, in make test-matrix.
    "19_lab_build_a_durable_agent": {"EVERY_POINT": False},
}
"""Per lesson, the parameters the nbval copy sets in its `parameters` cell (names must exist there)."""

def lessons() -> list[Path]:
    return sorted(NOTEBOOKS.glob("[0-9][0-9]*_*.ipynb"))


def is_checked(cell) -> bool:
    """A cell whose output nbval compares under `--nbval-lax` (its tag: a learner sees no marker)."""
    return cell.cell_type == "code" and "nbval-check-output" in cell.metadata.get("tags", [])


def checked_ids(notebook) -> list[str]:
    return [cell.id for cell in notebook.cells if is_checked(cell)]


def golden_path(name: str) -> Path:
    return GOLDEN / f"{name}.json"


def read_golden(name: str) -> dict[str, list[dict]]:
    path = golden_path(name)
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def write_golden(name: str, outputs: dict[str, list[dict]]) -> None:
    GOLDEN.mkdir(parents=True, exist_ok=True)
    text = json.dumps(outputs, indent=1, ensure_ascii=False, sort_keys=True) + "\n"
    golden_path(name).write_text(text, encoding="utf-8")


def set_parameters(notebook, name: str) -> None:
    """Rewrite `NAME = ...` lines of the `parameters` cell with NBVAL_PARAMETERS[name]."""
    values = NBVAL_PARAMETERS.get(name)
    if not values:
        return
    (cell,) = [c for c in notebook.cells if "parameters" in c.metadata.get("tags", [])]
    source = cell.source
    for key, value in values.items():
        source, count = re.subn(rf"(?m)^{re.escape(key)} = \S+", f"{key} = {value!r}", source)
        if count != 1:
            raise SystemExit(f"{name}: no single `{key} = ...` line in the parameters cell:\n{cell.source}")
    cell.source = source


def prediction_names(notebook) -> list[str]:
    """The `prediction_*` variables in the order the lesson reveals them (its `reveal(...)` calls)."""
    import ast

    names = []
    for cell in notebook.cells:
        if cell.cell_type != "code":
            continue
        try:
            tree = ast.parse(cell.source)
        except SyntaxError:  # a cell with IPython magics reveals nothing
            continue
        calls = sorted((node for node in ast.walk(tree) if isinstance(node, ast.Call)
                        and getattr(node.func, "id", None) == "reveal"), key=lambda n: (n.lineno, n.col_offset))
        names += [call.args[0].id for call in calls if call.args and isinstance(call.args[0], ast.Name)]
    return names


def read_answers(name: str) -> dict[str, object]:
    path = ANSWERS / f"{name}.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def set_predictions(notebook, name: str) -> None:
    """Answer the lesson's prediction cell (`prediction_x = None` lines) with its recorded answers."""
    answers = read_answers(name)
    for cell in notebook.cells:
        if cell.cell_type != "code":
            continue
        for key, value in answers.items():
            cell.source = re.sub(rf"(?m)^{re.escape(key)} = None\b", f"{key} = {value!r}", cell.source)


def exercises(notebook) -> list[str]:
    """The names of the lesson's exercise cells (`# ✏️ EXERCISE <name>:`), in order."""
    from sophos_lab.lab.exercises import exercise_names

    return [name for cell in notebook.cells if cell.cell_type == "code" for name in exercise_names(cell.source)]


def solution_path(lesson: str, exercise: str, wrong: bool = False) -> Path:
    return SOLUTIONS / lesson / f"{exercise}{'.wrong' if wrong else ''}.py"


def set_solutions(notebook, name: str, wrong: bool = False) -> None:
    """Put the reference solution (or the known wrong answer) into each exercise cell."""
    from sophos_lab.lab.exercises import exercise_names

    for cell in notebook.cells:
        if cell.cell_type == "code":
            for exercise in exercise_names(cell.source):
                cell.source = solution_path(name, exercise, wrong).read_text(encoding="utf-8").rstrip("\n")


def injected(path: Path, require_golden: bool = True):
    """The lesson with its golden outputs (and its nbval parameters), ready for nbval.

    `record` passes `require_golden=False`: a new checked cell has no golden output until then."""
    name = path.stem
    notebook = nbformat.read(path, as_version=4)
    golden = read_golden(name)
    missing = [cid for cid in checked_ids(notebook) if cid not in golden]
    if missing and require_golden:
        raise SystemExit(f"{name}: no golden outputs for checked cells {missing}; run `golden.py record {name}`")
    code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
    for number, cell in enumerate(code_cells, start=1):
        if cell.id in golden:
            cell.outputs = [nbformat.from_dict(output) for output in golden[cell.id]]
            # nbval fails a reference cell with outputs but no execution count ("Unrun reference
            # cell has outputs"); the count a Run All would give it.
            cell.execution_count = number
    set_parameters(notebook, name)
    set_predictions(notebook, name)
    set_solutions(notebook, name)
    return notebook


def inject(out_dir: Path, names: list[str] | None = None, require_golden: bool = True) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("*.ipynb"):
        stale.unlink()
    written = []
    for path in lessons():
        if names and path.stem not in names:
            continue
        out = out_dir / path.name
        nbformat.write(injected(path, require_golden), out)
        written.append(out)
    return written


def record(names: list[str] | None = None, timeout: int = 120) -> None:
    for name in names or [path.stem for path in lessons()]:
        # A folder per lesson: two recordings of different lessons can run at once.
        shutil.rmtree(RECORD_DIR / name, ignore_errors=True)
        (copy,) = inject(RECORD_DIR / name, [name], require_golden=False)
        print(f"executing {name} ...", flush=True)
        notebook, observed = execute(copy, timeout)
        answers = dict(zip(prediction_names(notebook), observed, strict=True))
        if answers != read_answers(name):
            # The copy answered with the old answers, so its score cell is off: once more with the new.
            ANSWERS.mkdir(parents=True, exist_ok=True)
            (ANSWERS / f"{name}.json").write_text(json.dumps(answers, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
            print(f"  {ANSWERS.relative_to(ROOT)}/{name}.json: new answers; executing {name} again ...", flush=True)
            nbformat.write(injected(NOTEBOOKS / f"{name}.ipynb", require_golden=False), copy)
            notebook, observed = execute(copy, timeout)
        nbformat.write(notebook, copy)  # kept for inspection
        fresh = json.loads(json.dumps({c.id: c.outputs for c in notebook.cells if is_checked(c)}))
        before = read_golden(name)
        # Keep a stored entry that nbval would find equal (same after sanitising): no churn of ports or ids.
        changed = sorted(cid for cid in fresh if cid not in before or sanitised(before[cid]) != sanitised(fresh[cid]))
        write_golden(name, {cid: fresh[cid] if cid in changed else before[cid] for cid in fresh})
        print(f"  {golden_path(name).relative_to(ROOT)}: {len(fresh)} checked cells, changed: {changed or 'none'}")


def execute(copy: Path, timeout: int):
    """Run the copy as nbval does (a `python3` kernel in the copy's directory); the notebook with
    its outputs, and what each `reveal` observed."""
    from nbclient import NotebookClient

    notebook = nbformat.read(copy, as_version=4)
    client = NotebookClient(notebook, timeout=timeout, startup_timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(copy.parent)}})
    probe = nbformat.v4.new_code_cell(
        "import json as _json\nfrom sophos_lab.lab.predictions import current_score as _current\n"
        "print(_json.dumps(_current().observed()))")
    with client.setup_kernel():
        for index, cell in enumerate(notebook.cells):
            client.execute_cell(cell, index)
        notebook.cells.append(probe)
        client.execute_cell(probe, len(notebook.cells) - 1)
        notebook.cells.pop()
    observed = json.loads("".join(o.get("text", "") for o in probe.outputs if o.output_type == "stream"))
    return notebook, observed


def coalesced(outputs: list[dict]) -> list[dict]:
    """Consecutive stream outputs of one stream as one (nbval compares them so): how a cell's
    printing is cut into messages depends on timing, not on what it printed."""
    merged: list[dict] = []
    for output in outputs:
        last = merged[-1] if merged else None
        if (last is not None and output.get("output_type") == "stream" == last.get("output_type")
                and output.get("name") == last.get("name")):
            merged[-1] = {**last, "text": last["text"] + output["text"]}
        else:
            merged.append(dict(output))
    return merged


def sanitised(outputs: list[dict]) -> str:
    """The outputs as text with `sanitize.cfg`'s replacements applied (as nbval applies them)."""
    import configparser

    config = configparser.ConfigParser(interpolation=None)
    config.read(Path(__file__).resolve().parent / "sanitize.cfg")
    text = json.dumps(coalesced(outputs), sort_keys=True, ensure_ascii=False)
    for section in config.sections():
        text = re.sub(config[section]["regex"], config[section]["replace"], text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_inject = sub.add_parser("inject", help="write OUT_DIR/<name>.ipynb: each lesson with its golden outputs")
    p_inject.add_argument("out_dir", type=Path)
    p_inject.add_argument("names", nargs="*", help="only these lessons (default: all)")
    p_record = sub.add_parser("record", help="execute the injected lessons and store their checked outputs")
    p_record.add_argument("names", nargs="*", help="lessons to record, e.g. 07_side_effects_and_idempotency (default: all)")
    args = parser.parse_args(argv)
    known = {path.stem for path in lessons()}
    unknown = sorted(set(args.names) - known)
    if unknown:
        parser.error(f"unknown lessons {unknown}; known: {sorted(known)}")
    if args.command == "inject":
        written = inject(args.out_dir, args.names or None)
        print(f"{len(written)} notebooks with golden outputs in {args.out_dir}")
    else:
        record(args.names or None)
    return 0


if __name__ == "__main__":
    sys.exit(main())

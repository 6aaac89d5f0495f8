"""The grader, end to end, on the lab's reference solutions, their known-wrong variants and the kit.

Each stage of the lab (`notebooks/19_lab_build_a_durable_agent.ipynb`) is graded as the notebook
grades it: the module is the stage cells of `solutions/19_lab_build_a_durable_agent/` from A up to
the stage, in order (`track.assemble`), the stage's own cell right or wrong. For each:

- the reference solution does at every point what its stage should (`stages.expected`);
- the known-wrong variant differs from its stage at exactly the points its stage's hint is about:
  A's graph never reads a tool's result (the uninterrupted run itself fails), B's checkpoints are
  written only when a run ends (`durability="exit"`: every point that is not a write loses its turn),
  C's recovery relabels nothing (a wrong status at every point before the turn's outcome is
  committed), D's resume looks for an empty thread instead of the message (the message is lost where
  a run's row of turn 2 or 3 is the last write), E's key is a fresh uuid (a second payment at
  `payment committed`, and only there);
- the kit's own runtime (`kit_agent.py`) recovers at every point.

`make test` grades one solution, stage E's, on the sample (the first point of each kind and the
last); every point of every variant is `make test-matrix`'s (`full_matrix`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sophos_lab.grading import KIT_AGENT, grade
from sophos_lab.grading.result import Graded
from sophos_lab.grading.stages import STAGES
from sophos_lab.grading.track import assemble

pytestmark = pytest.mark.slow
SOLUTIONS = Path(__file__).resolve().parent.parent / "solutions" / "19_lab_build_a_durable_agent"


def module(tmp_path: Path, stage: str, wrong: bool = False) -> Path:
    """The agent at `stage`: the reference cells before it, and its own cell, right or wrong."""
    cells = {s: (SOLUTIONS / f"stage_{s.lower()}.py").read_text() for s in STAGES}
    if wrong:
        cells[stage] = (SOLUTIONS / f"stage_{stage.lower()}.wrong.py").read_text()
    path = tmp_path / f"agent_{stage.lower()}{'_wrong' if wrong else ''}.py"
    path.write_text(assemble(cells, stage))
    return path


def differing(result: Graded) -> dict[str, str]:
    """Point name → how the result differs from its stage there (`result.problems()`, keyed)."""
    return {problem.split("`")[1]: problem for problem in result.problems()}


def test_stage_e_s_solution_recovers_at_every_point_of_the_sample(tmp_path):
    result = grade(module(tmp_path, "E"), "E", every_point=False, name="grading-e")
    assert result.problems() == [], result.notes()
    kinds = {o.point.kind for o in result.outcomes}
    assert {"model received", "model first chunk", "fetch received", "payment committed",
            "write: commit: INSERT INTO runs", "write: checkpoint step N", "write: writes tools"} <= kinds
    assert result.summary == f"your agent: {len(result.outcomes)} of {len(result.outcomes)} points recover, 0 lost, 0 re-run, 1 payment"
    picture = result.picture()
    assert picture.title.startswith("kill points along the run") and "colours: recovers" in picture.elements


@pytest.mark.full_matrix
@pytest.mark.parametrize("stage", STAGES)
def test_each_stage_s_solution_does_what_its_stage_should_at_every_point(tmp_path, stage):
    result = grade(module(tmp_path, stage), stage, name=f"grading-{stage}")
    assert result.reference.error is None and len(result.outcomes) >= 12
    assert result.problems() == [], result.notes()


@pytest.mark.full_matrix
@pytest.mark.parametrize("stage", STAGES)
def test_each_wrong_variant_fails_at_exactly_the_points_its_stage_says(tmp_path, stage):
    result = grade(module(tmp_path, stage, wrong=True), stage, name=f"grading-{stage}-wrong")
    if stage == "A":
        assert result.reference.error.startswith("in the uninterrupted run, turn 1 (fetch and summarise) did not end")
        return
    points = [o.point for o in result.outcomes]
    found = differing(result)
    if stage == "B":
        want = {p.name for p in points if p.trigger != "write"}
        assert all("found lost" in found[name] for name in want), found
    elif stage == "C":
        want = {p.name for p in points if p.kind != "write: commit: UPDATE runs"}
        assert all("found wrong status" in found[name] and "`running`" in found[name] for name in want), found
    elif stage == "D":
        want = {p.name for p in points if p.before_input and p.turn > 1 and p.trigger == "write"}
        assert len(want) == 2 and all("found lost" in found[name] for name in want), found
    else:
        want = {"payment committed"}
        assert "found extra payment" in found["payment committed"], found
    assert set(found) == want, sorted(set(found) ^ want)


@pytest.mark.full_matrix
def test_the_kit_s_runtime_recovers_at_every_point(tmp_path):
    result = grade(KIT_AGENT, "kit", name="grading-kit")
    assert result.problems() == [], result.notes()
    assert all(o.recovers for o in result.outcomes) and len(result.outcomes) >= 40
    assert result.summary.endswith(f"{len(result.outcomes)} of {len(result.outcomes)} points recover, 0 lost, "
                                   "0 re-run, 1 payment")


@pytest.mark.full_matrix
def test_with_another_ollama_server_the_grader_judges_what_survived_not_the_words(tmp_path, ollama_like):
    """Any model: the same points through the lab's recording proxy, in front of a second
    Ollama-protocol server that writes its own words at a real model's pace."""
    from conftest import OLLAMA_LIKE_MODEL

    result = grade(module(tmp_path, "E"), "E", every_point=False, name="grading-other",
                   ollama_host=ollama_like, ollama_model=OLLAMA_LIKE_MODEL)
    assert not result.scripted and result.reference.error is None
    assert {"fetch received", "payment committed"} <= {o.point.name for o in result.outcomes}
    assert result.problems() == [], result.notes()

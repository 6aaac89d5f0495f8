"""The run-status picture (`sophos_lab.lab.pictures.statuses`), drawn from a constructed runs table."""

from __future__ import annotations

import pandas as pd

from sophos_lab.lab.pictures.statuses import NODES, STATUSES, TRANSITIONS, observed_runs, run_statuses
from sophos_lab.runtime.storage.models import RUN_STATUSES


def runs_table(*rows: tuple[str, str, str | None, str | None]) -> pd.DataFrame:
    """Rows of (conversation, status, error code, input) as the runs table holds them, in start order."""
    return pd.DataFrame([{"conversation_id": c, "status": s, "error_code": e, "input": i} for c, s, e, i in rows])


MESSAGE = '[{"role": "user", "content": "Hello"}]'


def test_every_status_of_the_runtime_is_drawn_and_every_transition_joins_two_boxes():
    assert set(STATUSES) == {"queued", *RUN_STATUSES}
    assert set(STATUSES) <= set(NODES)
    for transition in TRANSITIONS:
        assert transition.source in NODES and transition.target in NODES, transition


def test_a_failure_then_a_resume_is_drawn_and_named():
    runs = runs_table(("a", "failed", "AGENT_FAILURE", MESSAGE), ("a", "completed", None, None))
    shown = run_statuses(runs, "run statuses: the model down, then back")
    assert shown.elements[: len(STATUSES)] == list(STATUSES)
    assert shown.elements[len(STATUSES):] == [
        "observed: run 1 running → failed (AGENT_FAILURE)",
        "observed: run 2 resumes run 1 (failed): running → completed",
    ]
    text = str(shown)
    assert text.splitlines()[0] == "🖼  run statuses: the model down, then back"
    svg = shown.svg()
    assert svg.lstrip().startswith("<?xml") and "</svg>" in svg
    for label in ("interrupted", "a new run", "run 1", "run 2", "an error escaped a node"):
        assert label in svg, label  # the labels stay text in the SVG


def test_several_conversations_a_relabelled_crash_a_drain_and_a_run_still_running():
    runs = runs_table(
        ("a", "interrupted", None, MESSAGE), ("b", "interrupted", "SHUTDOWN", MESSAGE),
        ("a", "completed", None, None), ("c", "running", None, MESSAGE), ("b", "completed", None, MESSAGE),
    )
    observed = [str(run) for run in observed_runs(runs, {"a": "killed", "b": "drained", "c": "stopped"})]
    assert observed == [
        "observed: killed, run 1 running → interrupted (no code: its process was gone)",
        "observed: drained, run 1 running → interrupted (SHUTDOWN)",
        "observed: killed, run 2 resumes killed, run 1 (interrupted): running → completed",
        "observed: stopped, run 1 running (on disk: no outcome recorded yet)",
        "observed: drained, run 2 running → completed",  # a new message, not a resume
    ]
    unnamed = [run.label for run in observed_runs(runs)]
    assert unnamed == ["conversation 1, run 1", "conversation 2, run 1", "conversation 1, run 2",
                       "conversation 3, run 1", "conversation 2, run 2"]
    assert run_statuses(runs, "run statuses").elements[-1] == "observed: conversation 2, run 2 running → completed"


def test_a_decision_at_a_gate_and_a_cancel():
    runs = runs_table(("g", "waiting", None, MESSAGE), ("g", "cancelled", "CANCELLED", None),
                      ("g", "completed", None, None))
    assert [str(run) for run in observed_runs(runs)] == [
        "observed: run 1 running → waiting",
        "observed: run 2 carries on run 1 (waiting) with a decision: running → cancelled (CANCELLED)",
        "observed: run 3 resumes run 2 (cancelled): running → completed",
    ]
    assert observed_runs(runs)[1].path == [("waiting", "a new run"), ("a new run", "running"), ("running", "cancelled")]

"""The cancel picture (`sophos_lab.lab.pictures.cancel`), drawn from constructed runs-table rows:
what it names follows which write came first (the cancel request or the outcome), not their timing."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

from sophos_lab.lab.pictures import Picture  # noqa: E402
from sophos_lab.lab.pictures.cancel import TITLE, CancelRun, cancel_picture  # noqa: E402

T = 1_700_000_000.0


def runs(shift: float = 0.0) -> list[CancelRun]:
    return [
        CancelRun("Stop, then SIGKILL", T + shift, T + shift + 3.1, T + shift + 4.0, "cancelled",
                  outcome_by_next_process=True, silent_from=T + shift + 3.1),
        CancelRun("SIGKILL, then Stop", T + shift + 10, None, T + shift + 13.5, "interrupted",
                  outcome_by_next_process=True, refused_cancel=T + shift + 13.6, silent_from=T + shift + 12.9),
        CancelRun("Stop in a live run", T + shift + 20, T + shift + 21.0, T + shift + 21.02, "cancelled"),
    ]


def test_which_write_came_first() -> None:
    shown = cancel_picture(runs())

    assert isinstance(shown, Picture)
    assert shown.title == TITLE
    assert shown.elements == [
        "Stop, then SIGKILL: the cancel request came first, then the outcome `cancelled`, by the next process",
        "SIGKILL, then Stop: no cancel request; the outcome `interrupted`, by the next process",
        "SIGKILL, then Stop: a cancel after the outcome was refused and wrote nothing",
        "Stop in a live run: the cancel request came first, then the outcome `cancelled`, by the process that ran it",
    ]
    svg = shown.svg()
    for label in ("cancel request", "outcome: cancelled", "outcome: interrupted", "cancel refused",
                  "nothing written: its process stopped or dead", "Stop, then SIGKILL"):
        assert label in svg, label  # labels stay text in the SVG
    assert str(shown).splitlines()[0] == f"🖼  {TITLE}"
    assert set(shown._repr_mimebundle_()) == {"image/svg+xml", "text/plain"}


def test_an_outcome_before_the_request_and_a_run_still_open() -> None:
    late = CancelRun("finished first", T, T + 2.0, T + 1.0, "completed")
    open_run = CancelRun("still running", T, T + 1.0, None, "running")

    assert cancel_picture([late, open_run]).elements == [
        "finished first: the outcome `completed` came first (by the process that ran it), then a cancel request",
        "still running: no outcome written yet, a cancel request on the row",
    ]


def test_the_elements_do_not_depend_on_timing() -> None:
    assert cancel_picture(runs(123.4)).elements == cancel_picture(runs()).elements

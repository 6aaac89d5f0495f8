"""The timeline picture (`sophos_lab.lab.pictures.timeline`), drawn from constructed runs and
checkpoints: every checkpoint named by its step and node, and labels that touch neither each other
nor another run's model requests, however close the checkpoints are."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import pandas as pd  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
import pytest  # noqa: E402

from sophos_lab.lab.pictures import Picture  # noqa: E402
from sophos_lab.lab.pictures import timeline  # noqa: E402

T0 = pd.Timestamp("2026-01-01T12:00:00+00:00")
CONVERSATION = "0b4cf1f2-1111-4222-8333-944445555666"


def at(seconds: float) -> str:
    return (T0 + pd.Timedelta(seconds=seconds)).isoformat()


def thread(steps: list[tuple[int, str, tuple[str, ...], str, float]]) -> pd.DataFrame:
    """Checkpoint rows as `inspect.checkpoints` gives them: (step, source, next, run, seconds)."""
    return pd.DataFrame([{"step": step, "source": source, "next": next_, "message_count": None, "last_role": None,
                          "run_id": run, "checkpoint_id": f"cp{n}", "created_at": at(seconds)}
                         for n, (step, source, next_, run, seconds) in enumerate(steps)])


def runs(*rows: tuple[str, str, str | None, float, float | None]) -> pd.DataFrame:
    return pd.DataFrame([{"id": run, "status": status, "error_code": code, "started_at": at(start),
                          "finished_at": None if end is None else at(end)} for run, status, code, start, end in rows])


def crowded() -> tuple[pd.DataFrame, pd.DataFrame, list[str]]:
    """A killed run and its resume, each with checkpoints a few milliseconds apart, and model
    requests right above the first run's labels' place in the second run."""
    points = [(-1, "input", ("__start__",), "r1", 0.0), (0, "loop", ("agent",), "r1", 0.002)]
    node = "agent"
    for step in range(1, 13):  # agent, tools, agent, ... 4 ms apart
        following = "tools" if node == "agent" else "agent"
        points.append((step, "loop", (following,), "r1", 0.004 * step))
        node = following
    points += [(13, "loop", ("tools",), "r2", 2.001), (14, "loop", ("agent",), "r2", 2.003),
               (15, "loop", (), "r2", 2.005)]
    requests = [at(0.003), at(0.011), at(0.019), at(2.0), at(2.004)]
    return runs(("r1", "interrupted", None, 0.0, 1.9), ("r2", "completed", None, 1.95, 2.01)), thread(points), requests


NOTES = ("tools discovered", "before the model call", "retry after")


def label_boxes(result: Picture):
    figure = result.figure
    [axes] = figure.axes
    renderer = FigureCanvasAgg(figure).get_renderer()  # the Picture's figure is closed in pyplot
    labels = [t for t in axes.texts if t.get_text() and not t.get_text().startswith(NOTES)]
    return axes, renderer, [(t.get_text(), t.get_window_extent(renderer)) for t in labels]


def test_each_checkpoint_is_named_by_its_step_and_the_node_whose_write_made_it() -> None:
    points = thread([(-1, "input", ("__start__",), "r1", 0.0), (0, "loop", ("agent",), "r1", 0.01),
                     (1, "loop", ("tools",), "r1", 1.0), (2, "loop", ("agent",), "r1", 1.5),
                     (3, "loop", (), "r1", 2.5)])
    result = timeline.draw(runs(("r1", "completed", None, 0.0, 2.6)), points, CONVERSATION, [at(0.9), at(1.6)])

    assert result.title == f"runs and checkpoints of {CONVERSATION}"
    assert result.figure.axes[0].get_title() == "runs and checkpoints of 0b4cf1f2…"
    assert result.elements == ["run 1: completed", "run 1 wrote: -1 input, 0 __start__, 1 agent, 2 tools, 3 agent",
                               "model requests: 2"]
    _, _, boxes = label_boxes(result)
    assert [text for text, _ in boxes] == ["-1", "input", "0", "__start__", "1", "agent", "2", "tools", "3", "agent"]
    svg = result.svg()
    assert "__start__" in svg and ">tools<" in svg  # the labels stay text in the SVG


def markers(axes) -> list[tuple[float, float]]:
    """Where each scatter marker is drawn (display coordinates): ▼ and ✕ requests, checkpoint ticks."""
    return [tuple(axes.transData.transform(point)) for collection in axes.collections
            for point in collection.get_offsets()]


def test_close_checkpoints_get_labels_that_touch_nothing_else() -> None:
    run_rows, points, requests = crowded()
    result = timeline.draw(run_rows, points, CONVERSATION, requests, failed_requests=[at(0.011)])
    axes, renderer, boxes = label_boxes(result)

    overlapping = [(a, b) for i, (a, box) in enumerate(boxes) for b, other in boxes[i + 1:] if box.overlaps(other)]
    assert overlapping == []
    assert {"-1", "0", "1", "13", "14", "15"} <= {text for text, _ in boxes}  # a crowd's first, a resume's
    # No label covers a marker: a model request (▼, ✕) of its run or the next, or a tick.
    radius = 4 / 72 * result.figure.dpi
    covered = [(text, (round(x), round(y))) for text, box in boxes for x, y in markers(axes)
               if box.x0 - radius <= x <= box.x1 + radius and box.y0 - radius <= y <= box.y1 + radius]
    assert covered == []
    # The notes above the model requests (the failed request's retry) touch no label either.
    notes = [t.get_window_extent(renderer) for t in axes.texts if t.get_text().startswith(NOTES)]
    assert notes, "the failed request's retry is noted"
    assert [(text, note) for text, box in boxes for note in notes if box.overlaps(note)] == []
    assert result.elements == [
        "run 1: interrupted",
        "run 1 wrote: -1 input, 0 __start__, 1 agent, 2 tools, 3 agent, 4 tools, 5 agent, 6 tools, 7 agent, "
        "8 tools, 9 agent, 10 tools, 11 agent, 12 tools",
        "run 2: completed", "run 2 wrote: 13 agent, 14 tools, 15 agent",
        "model requests: 5, 1 of them failed",
    ]


def test_the_labels_of_one_run_stay_above_the_next_runs_model_requests() -> None:
    run_rows, points, requests = crowded()
    result = timeline.draw(run_rows, points, CONVERSATION, requests)
    axes, renderer, _ = label_boxes(result)
    # The axes' y unit is the inch, downwards: run 2's band starts where its bar's row begins.
    second_band = axes.get_yticks()[1] - timeline.BAR_Y
    run_one = [t.get_window_extent(renderer) for t in axes.texts
               if not t.get_text().startswith(NOTES) and t.xy[1] < second_band]
    # Display y grows upwards: run 2's ▼ markers are below every label of run 1, with room to spare.
    call_y = axes.transData.transform((0, second_band + timeline.CALL_Y))[1]
    assert len(run_one) >= 6 and min(box.y0 for box in run_one) > call_y + 4 / 72 * result.figure.dpi


@pytest.mark.parametrize("status", ["running", "failed"])
def test_a_run_without_an_end_or_with_an_error_is_named_with_its_outcome(status: str) -> None:
    points = thread([(-1, "input", ("__start__",), "r1", 0.0), (0, "loop", ("agent",), "r1", 0.01)])
    end = None if status == "running" else 0.5
    code = "AGENT_FAILURE" if status == "failed" else None
    result = timeline.draw(runs(("r1", status, code, 0.0, end)), points, CONVERSATION, [at(0.2)])
    assert result.elements[0] == f"run 1: {status}" + (" AGENT_FAILURE" if code else "")
    assert result.elements[1] == "run 1 wrote: -1 input, 0 __start__"

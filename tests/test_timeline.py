"""`inspect.timeline`: step labels that do not overlap, and the wait before a run's first model call."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from sophos_lab.lab import inspect as views  # noqa: E402

# The kit's MCP servers as shipped, memory's included: their start is what the charts show.
pytestmark = pytest.mark.memory_server


def step_labels(figure):
    [axes] = figure.axes
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    return [(t.get_text(), t.get_window_extent(renderer)) for t in axes.texts if t.get_text().lstrip("-").isdigit()]


def overlapping(labels):
    return [(a, b) for i, (a, box) in enumerate(labels) for b, other in labels[i + 1:] if box.overlaps(other)]


async def run_to_the_end(open_service, db_path, message, **env):
    async with open_service(**env) as agent:
        end = await agent.ask(message)
    return end.data["conversation"]


async def test_the_first_model_call_waits_for_the_mcp_servers_and_the_chart_says_so(lab, open_service, db_path):
    since = len(lab.model.chat_requests())
    conversation = await run_to_the_end(open_service, db_path, f"Fetch {lab.page('index.html')}")
    requests = [r["time"] for r in lab.model.chat_requests()[since:]]
    figure = views.timeline(db_path, conversation, model_requests=requests)
    try:
        texts = [t.get_text() for t in figure.axes[0].texts]
        [discovery] = [t for t in texts if t.startswith("tools discovered: MCP servers start")]
        labels = step_labels(figure)
        assert sorted(int(text) for text, _ in labels) == [-1, 0, 1, 2, 3]
        assert overlapping(labels) == []  # steps -1 and 0 are a millisecond apart
    finally:
        plt.close(figure)
    plain = views.timeline(db_path, conversation)  # without the request log: no markers, no claim
    try:
        assert not [t for t in plain.axes[0].texts if t.get_text().startswith("tools discovered")]
    finally:
        plt.close(plain)


@pytest.mark.parametrize("limit", ["12", "25"])
async def test_close_checkpoints_get_labels_that_do_not_overlap(open_service, db_path, limit):
    conversation = await run_to_the_end(open_service, db_path, "loop forever", AGENT_RECURSION_LIMIT=limit)
    figure = views.timeline(db_path, conversation)
    try:
        labels = step_labels(figure)
        assert overlapping(labels) == []
        assert {"-1", "1"} <= {text for text, _ in labels}
    finally:
        plt.close(figure)


async def test_a_retried_model_call_shows_each_failed_request_and_the_stretch_to_the_next(lab, open_service, db_path):
    since = len(lab.model.chat_requests())
    lab.model.fail_next(2, status=500)
    conversation = await run_to_the_end(open_service, db_path, "Hello there", SOPHOS_LAB_MODEL_ATTEMPTS="3",
                                        SOPHOS_LAB_RETRY_BASE_SECONDS="0.01")
    requests = lab.model.chat_requests()[since:]
    figure = views.timeline(db_path, conversation, model_requests=[r["time"] for r in requests],
                            failed_requests=[r["time"] for r in requests if r["status"] != 200])
    try:
        [axes] = figure.axes
        texts = [t.get_text() for t in axes.texts]
        assert [r["status"] for r in requests] == [500, 500, 200]
        assert len([t for t in texts if t.startswith("retry after ")]) == 2
        # The stretch before the model call is the first call's (the MCP servers' start) alone:
        # the retries' stretches are the failed calls and their waits, labelled as such.
        assert len([t for t in texts if t.startswith("tools discovered")]) == 1
        assert not [t for t in texts if t.startswith("before the model call")]
        assert "✕ one that failed" in axes.get_xlabel()
    finally:
        plt.close(figure)

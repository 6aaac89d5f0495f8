"""Real processes: a worker that is SIGKILLed mid-run, and a fresh runtime that resumes it.

Each test has a lab of its own, so `lab.peek_runs()`, `lab.fetches()` and the model's request
log count only what that test did. The fresh runtime is an `AgentService` in this process on
the lab's database: like a restarted server, it opens the file on its first request.
"""

import pytest
from conftest import roles, statuses

from sophos_lab.lab import Lab

SUMMARISE = "Fetch {url} and summarize it in 12 detailed bullet points."


@pytest.fixture
def lab(request, lab_home):
    with Lab.setup(f"tests-crash-{request.node.name}", quiet=True) as lab:
        yield lab


@pytest.fixture
def restart(lab, open_service):
    """`async with restart() as fresh:` a new runtime on the lab's database."""
    return lambda: open_service(DATABASE_PATH=str(lab.db_path))


def on_disk(lab, conversation) -> list[str]:
    """Run statuses as the file says right now (a read-only look: it never recovers)."""
    return list(lab.peek_runs(conversation)["status"])


def entered(events) -> list[tuple[int, str]]:
    """The (step, node) of every step a run entered."""
    return [
        (event.data["step"], event.data["node"])
        for event in events
        if event.event == "trace" and event.data["event"] == "enter"
    ]


async def test_a_new_process_continues_a_conversation_written_by_another(lab, restart):
    async with restart() as writer:
        conversation = (await writer.ask("hello")).data["conversation"]

    with lab.worker() as reader:
        reader.chat("hi there", conversation)
        assert reader.wait_final()["data"]["status"] == "completed"

    first, second = lab.model.chat_requests()
    assert (first["n_messages"], second["n_messages"]) == (1 + 1, 1 + 2 + 1)
    assert lab.state(conversation)["roles"] == ["user", "assistant", "user", "assistant"]
    assert on_disk(lab, conversation) == ["completed", "completed"]


async def test_a_kill_while_the_answer_streams_resumes_at_the_agent_step(lab, restart):
    """Killed after the tool result was checkpointed: the resume runs only `agent` again."""
    lab.model.arm("summary")
    with lab.worker() as child:
        child.chat(SUMMARISE.format(url=lab.page("wal.html")))
        conversation = child.conversation()
        child.wait_for("trace", event="result")
        lab.model.wait_paused()
        assert child.kill() == -9

    # A dead process cannot record its own death.
    assert on_disk(lab, conversation) == ["running"]
    async with restart() as fresh:
        assert on_disk(lab, conversation) == ["running"]  # recovery is lazy: nothing opened yet
        [summary] = fresh.list_conversations()  # the first request opens the file
        assert fresh.store.recovered_runs == 1
        assert summary.status == on_disk(lab, conversation)[0] == "interrupted"

        detail = await fresh.get_conversation(conversation)
        assert (detail.next, detail.resumable) == (("agent",), True)
        assert roles(detail) == ["user", "assistant", "tool"]  # the partial summary is gone

        resumed = await fresh.resume(conversation)
        end = await resumed.wait()
        assert statuses(fresh, conversation) == ["interrupted", "completed"]

    assert end.data["status"] == "completed"
    assert entered(resumed.buffer) == [(3, "agent")]
    assert lab.fetches("wal.html") == 1
    # The summary was asked for twice: the lost step ran again from its start.
    assert [request["turn"] for request in lab.model.chat_requests()] == [0, 1, 1]


async def test_a_kill_during_the_tools_step_fetches_the_page_again_on_resume(lab, restart):
    """Killed while the fetch was in flight: the at-least-once window.

    The tools step had started (the page request reached the server) but its result was never
    checkpointed, so the resume runs the whole tools step again and the page is fetched twice.
    """
    lab.web.hold("/wal.html")
    with lab.worker() as child:
        child.chat(f"Fetch {lab.page('wal.html')}")
        conversation = child.conversation()
        lab.web.wait_held()
        assert child.kill() == -9
    lab.web.release()

    async with restart() as fresh:
        detail = await fresh.get_conversation(conversation)
        assert statuses(fresh, conversation) == ["interrupted"]
        assert (detail.next, detail.resumable) == (("tools",), True)
        assert roles(detail) == ["user", "assistant"]

        resumed = await fresh.resume(conversation)
        end = await resumed.wait()
        assert statuses(fresh, conversation) == ["interrupted", "completed"]

    assert end.data["status"] == "completed"
    assert entered(resumed.buffer) == [(2, "tools"), (3, "agent")]
    assert lab.fetches("wal.html") == 2

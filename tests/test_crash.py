"""Real processes: a worker that is SIGKILLed mid-run, and a fresh runtime that resumes it.

Each test has a lab of its own, so `lab.peek_runs()`, `lab.fetches()` and the model's request
log count only what that test did. The fresh runtime is an `AgentService` in this process on
the lab's database: like a restarted server, it opens the file on its first request.
"""

import pytest
from conftest import roles, statuses

from sophos_lab.lab.harness import Lab

# The PostgreSQL side runs in `make test-matrix`: make test tries PostgreSQL through test_postgres,
# test_workers, test_ownership, test_users and the PostgreSQL crash matrices (see docs/testing.md).
pytestmark = pytest.mark.both_backends(postgres_full_matrix=True)

SUMMARISE = "Fetch {url} and summarize it in 12 detailed bullet points."


@pytest.fixture
def lab(request, lab_home, database):
    with Lab.setup(f"tests-crash-{request.node.name}", quiet=True, fork_servers=True,
                   database_url=database.get("DATABASE_URL")) as lab:
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
        [summary] = await fresh.list_conversations()  # the first request opens the file
        assert fresh.store.recovered_runs == 1
        assert summary.status == on_disk(lab, conversation)[0] == "interrupted"

        detail = await fresh.get_conversation(conversation)
        assert (detail.next, detail.resumable) == (("agent",), True)
        assert roles(detail) == ["user", "assistant", "tool"]  # the partial summary is gone
        # The run recorded no outcome; the recovery that relabelled it counted its thread.
        assert summary.message_count == detail.conversation.message_count == len(detail.messages) == 3

        resumed = await fresh.resume(conversation)
        end = await resumed.wait()
        assert (await statuses(fresh, conversation)) == ["interrupted", "completed"]

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
        assert (await statuses(fresh, conversation)) == ["interrupted"]
        assert (detail.next, detail.resumable) == (("tools",), True)
        assert roles(detail) == ["user", "assistant"]

        resumed = await fresh.resume(conversation)
        end = await resumed.wait()
        assert (await statuses(fresh, conversation)) == ["interrupted", "completed"]

    assert end.data["status"] == "completed"
    assert entered(resumed.buffer) == [(2, "tools"), (3, "agent")]
    assert lab.fetches("wal.html") == 2


# --- the accepted message is durable from `started` on ----------------------------------------


@pytest.mark.parametrize("follow_up", [False, True], ids=["new", "follow-up"])
async def test_a_kill_right_after_started_keeps_the_message_and_the_resume_answers_it(
    lab, restart, follow_up
):
    """The worker stops itself right after writing `started` (event 1), then is killed: the
    message it accepted is on disk, the conversation is resumable, the resume answers it."""
    conversation = None
    if follow_up:
        async with restart() as first:
            conversation = (await first.ask("hello")).data["conversation"]
    message = "hi, and keep this exact text: naïve café ☕"
    with lab.worker(SOPHOS_LAB_STOP_AFTER_EVENT="1") as child:
        child.chat(message, conversation)
        started = child.wait_for("started")
        conversation = started["data"]["conversation"]
        assert child.kill() == -9

    async with restart() as fresh:
        detail = await fresh.get_conversation(conversation)
        assert detail.resumable, (detail.next, detail.messages)
        assert [m["content"] for m in detail.messages if m["role"] == "user"][-1] == message
        # The accepted message counts, as the conversation shows it (pending), in the listing too.
        assert detail.conversation.message_count == len(detail.messages) == (3 if follow_up else 1)
        assert [c.message_count for c in (await fresh.list_conversations())] == [len(detail.messages)]
        end = await (await fresh.resume(conversation)).wait()
        assert end.event == "end", end.data
        after = await fresh.get_conversation(conversation)

    users = [m["content"] for m in after.messages if m["role"] == "user"]
    assert users == (["hello", message] if follow_up else [message])
    assert roles(after)[-2:] == ["user", "assistant"]
    assert not any(m.get("pending") for m in after.messages)
    assert after.conversation.title == ("hello" if follow_up else message)


async def test_a_message_accepted_while_an_earlier_one_is_pending_is_added_after_it(lab, restart):
    """A kill before the first message reached the thread, then a new message instead of a
    resume: both are in the thread, in the order they were sent."""
    async with restart() as first:
        conversation = (await first.ask("hello")).data["conversation"]
    with lab.worker(SOPHOS_LAB_STOP_AFTER_EVENT="1") as child:
        child.chat("hi, first", conversation)
        child.wait_for("started")
        child.kill()

    async with restart() as fresh:
        assert (await fresh.ask("hi, second", conversation)).event == "end"
        detail = await fresh.get_conversation(conversation)
    assert [m["content"] for m in detail.messages if m["role"] == "user"] == ["hello", "hi, first", "hi, second"]


# --- persist, then notify: a reported step is never run again ---------------------------------


def stop_at(child, name: str, **fields) -> int:
    """The id of the first event of the latest command named `name` with `fields`."""
    return child.wait_for(name, **fields)["id"]


async def test_a_kill_right_after_a_tool_call_was_shown_runs_that_very_call(lab, restart):
    """The client saw tool call X (reported with the agent step's `leave`): the resume runs X."""
    with lab.worker() as probe:  # where is the `call` event of an uninterrupted run?
        probe.chat(f"Fetch {lab.page('index.html')}")
        point = stop_at(probe, "trace", event="call")
        probe.wait_final()
    with lab.worker(SOPHOS_LAB_STOP_AFTER_EVENT=str(point)) as child:
        child.chat(f"Fetch {lab.page('index.html')}")
        shown = child.wait_for("trace", event="call")["data"]["data"]["tool_call_id"]
        conversation = child.conversation()
        child.kill()

    async with restart() as fresh:
        detail = await fresh.get_conversation(conversation)
        assert detail.next == ("tools",)
        end = await (await fresh.resume(conversation)).wait()
        assert end.event == "end"
        after = await fresh.get_conversation(conversation)
    [tool] = [m for m in after.messages if m["role"] == "tool"]
    assert tool["toolCallId"] == shown


@pytest.mark.parametrize("node", ["tools", "agent"])
async def test_a_kill_right_after_leave_never_runs_that_step_again(lab, restart, node):
    """`leave` is published once the step's checkpoint is saved: a kill right after it, and the
    resume starts with the next step (the page is fetched once, the answer is not redone)."""
    message = f"Fetch {lab.page('index.html')}"
    with lab.worker() as probe:  # the last `leave` of `node` in an uninterrupted run
        probe.chat(message)
        probe.wait_final()
        *_, last = (e for e in probe.events() if e["event"] == "trace"
                    and e["data"]["event"] == "leave" and e["data"]["node"] == node)
    point, left = last["id"], last["data"]["step"]
    fetched_before = lab.fetches("index.html")
    with lab.worker(SOPHOS_LAB_STOP_AFTER_EVENT=str(point)) as child:
        child.chat(message)
        child.wait_for("trace", event="leave", node=node, step=left)
        conversation = child.conversation()
        child.kill()
    requests_before = len(lab.model.chat_requests())

    async with restart() as fresh:
        detail = await fresh.get_conversation(conversation)
        if node == "agent":  # the last step: the answer is saved and the run is over
            assert (detail.next, detail.resumable) == ((), False)
        else:
            resumed = await fresh.resume(conversation)
            await resumed.wait()
            assert min(step for step, _ in entered(resumed.buffer)) == left + 1
    assert lab.fetches("index.html") - fetched_before == 1
    if node == "agent":
        assert len(lab.model.chat_requests()) == requests_before  # nothing was asked again

"""The runtime in this process: persistence, tools, failures, refusals and the event stream.

Each `open_service()` block is a fresh start on the test's database, like a newly started
process: its store, its checkpointer and its MCP servers open on first use.
"""

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import roles, statuses

from sophos_lab.runtime.errors import (
    AGENT_FAILURE,
    MODEL_UNAVAILABLE,
    RECURSION_LIMIT,
    RUN_NOT_RESUMABLE,
    SESSION_IN_PROGRESS,
    SophosError,
)
from sophos_lab.lab.inspect import peek_runs
from sophos_lab.lab.harness import dead_port_url

# The PostgreSQL side runs in `make test-matrix`: make test tries PostgreSQL through test_postgres
# (a gate decided by two processes among them), test_workers, test_ownership, test_users and the
# PostgreSQL crash matrices (see docs/testing.md).
pytestmark = pytest.mark.both_backends(postgres_full_matrix=True)

MISSING_ENTITY = (
    'Add the observation "has a lab" to the existing knowledge graph entity named '
    '"no-such-entity-42". Use add_observations.'
)


def words(text: str) -> int:
    """What the scripted model counts as tokens: whitespace-separated words."""
    return len(text.split())


# --- a conversation persists ---------------------------------------------------------------


async def test_a_new_service_reads_a_finished_conversation_back(fetched, open_service):
    async with open_service(DATABASE_PATH=str(fetched.db_path)) as fresh:
        [summary] = await fresh.list_conversations()
        detail = await fresh.get_conversation(fetched.conversation)
        assert not fresh.tools.discovered  # reading never starts the MCP servers

    assert (summary.id, summary.status, summary.message_count) == (fetched.conversation, "completed", 4)
    assert summary.title == f"Fetch {fetched.page}"
    assert roles(detail) == ["user", "assistant", "tool", "assistant"]
    assert detail.messages[0]["content"] == f"Fetch {fetched.page}"
    assert (detail.next, detail.resumable) == ((), False)


async def test_tool_calls_and_results_persist(fetched, open_service):
    async with open_service(DATABASE_PATH=str(fetched.db_path)) as fresh:
        _, call, result, _ = (await fresh.get_conversation(fetched.conversation)).messages

    [tool_call] = call["toolCalls"]
    assert (tool_call["name"], tool_call["args"]) == ("fetch__fetch", {"url": fetched.page})
    assert result["name"] == "fetch__fetch"
    assert result["toolCallId"] == tool_call["id"]
    assert result["status"] == "success"


async def test_a_real_fetch_returns_the_page_text_and_fetches_once(fetched, open_service):
    async with open_service(DATABASE_PATH=str(fetched.db_path)) as fresh:
        result = (await fresh.get_conversation(fetched.conversation)).messages[2]

    assert "This domain is for use in illustrative examples" in result["content"]
    assert fetched.fetches == 1


async def test_a_second_turn_sends_only_the_new_message(lab, open_service):
    async with open_service() as agent:
        first = await agent.ask("hello")
        conversation = first.data["conversation"]
        seen = len(lab.model.chat_requests())

        second = await agent.ask("hi there", conversation)

        detail = await agent.get_conversation(conversation)
    [request] = lab.model.chat_requests()[seen:]

    assert second.event == "end"
    # The caller passed one message; the model got the system prompt, the history and it.
    assert request["n_messages"] == 1 + 2 + 1
    assert request["last_role"] == "user"
    assert roles(detail) == ["user", "assistant", "user", "assistant"]


async def test_the_system_prompt_is_read_on_every_call_and_never_stored(open_service, config_dir):
    system_md = config_dir / "system.md"
    old_prompt = system_md.read_text().strip()
    new_prompt = "Answer in one short sentence."
    async with open_service() as agent:
        conversation = (await agent.ask("hello")).data["conversation"]
        system_md.write_text(new_prompt + "\n")
        await agent.ask("hi there", conversation)
        history = await agent.state_history(conversation)

    assert all(m.type != "system" for snapshot in history for m in snapshot.values.get("messages", []))
    first_reply, second_reply = [m for m in history[-1].values["messages"] if m.type == "ai"]
    # The scripted model reports the words it was sent as the prompt's token count.
    assert first_reply.usage_metadata["input_tokens"] == words(old_prompt) + words("hello")
    assert second_reply.usage_metadata["input_tokens"] == (
        words(new_prompt) + words("hello") + words(first_reply.content) + words("hi there")
    )


# --- tools ---------------------------------------------------------------------------------


@pytest.mark.memory_server
async def test_a_tool_error_is_data_for_the_model_and_the_run_completes(open_service):
    async with open_service() as agent:
        end = await agent.ask(MISSING_ENTITY)
    async with open_service() as fresh:
        detail = await fresh.get_conversation(end.data["conversation"])
        [run] = await fresh.list_runs(end.data["conversation"])

    failed_call, retry = [m for m in detail.messages if m["role"] == "tool"]
    assert (failed_call["name"], failed_call["status"]) == ("memory__add_observations", "error")
    assert failed_call["content"] == "Entity with name no-such-entity-42 not found"
    assert (retry["name"], retry["status"]) == ("memory__create_entities", "success")
    assert end.data["status"] == "completed"
    assert (run.status, run.error_code) == ("completed", None)


# --- failures and resume -------------------------------------------------------------------


async def test_a_dead_model_port_fails_the_run_and_a_resume_completes_it(lab, open_service):
    async with open_service(OLLAMA_HOST=dead_port_url()) as down:
        error = await down.ask(f"Fetch {lab.page('index.html')}")
        conversation = error.data["conversation"]
        failed = await down.get_conversation(conversation)

    assert (error.event, error.data["code"]) == ("chat-error", AGENT_FAILURE)
    assert (failed.next, failed.resumable) == (("agent",), True)
    assert roles(failed) == ["user"]

    async with open_service() as back:
        end = await (await back.resume(conversation)).wait()
        resumed = await back.get_conversation(conversation)
        assert (await statuses(back, conversation)) == ["failed", "completed"]

    assert end.data["status"] == "completed"
    assert roles(resumed) == ["user", "assistant", "tool", "assistant"]


async def test_an_unknown_model_is_model_unavailable(open_service):
    async with open_service(OLLAMA_MODEL="does-not-exist") as agent:
        error = await agent.ask("hello")
        detail = await agent.get_conversation(error.data["conversation"])
        [run] = await agent.list_runs(error.data["conversation"])

    assert error.data["code"] == MODEL_UNAVAILABLE
    assert (run.status, run.error_code) == ("failed", MODEL_UNAVAILABLE)
    assert detail.next == ("agent",)


async def test_an_endless_tool_loop_hits_the_recursion_limit_and_stays_resumable(open_service):
    async with open_service(AGENT_RECURSION_LIMIT="5") as agent:
        error = await agent.ask("loop forever")
        detail = await agent.get_conversation(error.data["conversation"])
        [run] = await agent.list_runs(error.data["conversation"])

    assert error.data["code"] == RECURSION_LIMIT
    assert (run.status, run.error_code) == ("failed", RECURSION_LIMIT)
    assert detail.next and detail.resumable
    assert roles(detail)[:3] == ["user", "assistant", "tool"]


# --- refusals ------------------------------------------------------------------------------


async def test_a_busy_conversation_refuses_a_second_start(lab, open_service):
    lab.web.hold("/index.html")
    try:
        async with open_service() as agent:
            run = await agent.chat(f"Fetch {lab.page('index.html')}")
            await asyncio.to_thread(lab.web.wait_held)

            with pytest.raises(SophosError) as second_chat:
                await agent.chat("hello", run.conversation)
            with pytest.raises(SophosError) as resume:
                await agent.resume(run.conversation)

            lab.web.release()
            end = await run.wait()
    finally:
        lab.web.release()

    assert second_chat.value.code == resume.value.code == SESSION_IN_PROGRESS
    assert end.data["status"] == "completed"


async def test_the_database_refuses_a_second_running_run_from_another_service(lab, open_service, db_path):
    lab.web.hold("/index.html")
    try:
        async with open_service() as first, open_service() as second:
            await second.list_conversations()  # open the file now, before the first service's run
            run = await first.chat(f"Fetch {lab.page('index.html')}")
            await asyncio.to_thread(lab.web.wait_held)

            with pytest.raises(SophosError) as refused:
                await second.chat("hello", run.conversation)

            lab.web.release()
            await run.wait()
    finally:
        lab.web.release()

    assert refused.value.code == SESSION_IN_PROGRESS
    assert list(peek_runs(db_path, run.conversation)["status"]) == ["completed"]


async def test_a_finished_thread_is_not_resumable(fetched, open_service):
    async with open_service(DATABASE_PATH=str(fetched.db_path)) as fresh:
        with pytest.raises(SophosError) as refused:
            await fresh.resume(fetched.conversation)
        assert (await statuses(fresh, fetched.conversation)) == ["completed"]

    assert refused.value.code == RUN_NOT_RESUMABLE


# --- events --------------------------------------------------------------------------------


def test_a_run_starts_with_started_and_ends_with_end(fetched):
    first, last = fetched.events[0], fetched.events[-1]
    assert (first.event, first.data["conversation"], first.data["resume"]) == ("started", fetched.conversation, False)
    assert (last.event, last.data["status"], last.data["run"]) == ("end", "completed", fetched.run)
    assert [event.id for event in fetched.events] == list(range(1, len(fetched.events) + 1))


async def test_tokens_add_up_to_the_final_answer(fetched, open_service):
    async with open_service(DATABASE_PATH=str(fetched.db_path)) as fresh:
        answer = (await fresh.get_conversation(fetched.conversation)).messages[-1]

    tokens = [event.data for event in fetched.events if event.event == "token"]
    assert len(tokens) > 1
    assert "".join(tokens) == answer["content"]


def test_every_step_is_traced_as_an_enter_leave_pair(fetched):
    steps = [
        (event.data["event"], event.data["step"], event.data["node"])
        for event in fetched.events
        if event.event == "trace" and event.data["event"] in ("enter", "leave")
    ]
    assert steps == [
        ("enter", 1, "agent"), ("leave", 1, "agent"),
        ("enter", 2, "tools"), ("leave", 2, "tools"),
        ("enter", 3, "agent"), ("leave", 3, "agent"),
    ]
    [result] = [e.data["data"] for e in fetched.events if e.event == "trace" and e.data["event"] == "result"]
    assert (result["name"], result["status"]) == ("fetch__fetch", "success")


async def test_the_outcome_is_on_disk_before_the_end_event(open_service, db_path):
    async with open_service() as agent:
        run = await agent.chat("hello")
        async for event in run.events():
            if event.event == "end":
                on_disk = list(peek_runs(db_path, run.conversation)["status"])

    assert on_disk == ["completed"]


async def test_the_accepted_message_is_stored_once_its_run_has_written_it_to_the_thread(open_service, db_path):
    text = "Remember the word heliotrope"
    async with open_service() as agent:
        conversation = (await agent.ask(text)).data["conversation"]
        [user, _] = (await agent.get_conversation(conversation)).messages
        [run] = await agent.list_runs(conversation)
    [row] = peek_runs(db_path, conversation).itertuples()

    assert user["content"] == text
    # The row keeps the message's id; its text is in the thread, and only there.
    assert json.loads(row.input) == [{"id": user["id"]}]
    # Asked for, the run still names what it carried, its text read back from the thread.
    assert json.loads(run.input) == [{"id": user["id"], "content": text}]


async def test_every_run_of_every_conversation_names_its_message_with_its_text(open_service):
    async with open_service() as agent:
        first = (await agent.ask("Remember the word heliotrope")).data["conversation"]
        await agent.ask("And the word lantern", first)
        second = (await agent.ask("Hello from another conversation")).data["conversation"]
        runs = await agent.list_runs()

    said = {(run.conversation_id, message["content"]) for run in runs for message in json.loads(run.input)}
    assert said == {(first, "Remember the word heliotrope"), (first, "And the word lantern"),
                    (second, "Hello from another conversation")}


async def test_a_message_that_never_reached_the_thread_keeps_its_text_in_its_run(open_service, db_path):
    async with open_service() as agent:
        conversation = (await agent.ask("hello")).data["conversation"]
        cancels = []

        def cancel_once_the_run_is_written(write) -> None:  # before any checkpoint of the run
            if write.kind == "run" and not cancels:
                cancels.append(asyncio.get_running_loop().create_task(agent.cancel(conversation)))

        agent.on_write = cancel_once_the_run_is_written
        stopped = await agent.chat("Remember the word heliotrope", conversation)
        assert (await stopped.wait()).event == "chat-error"
        await cancels[0]
        first, second = await agent.list_runs(conversation)
    rows = peek_runs(db_path, conversation)

    assert [run.status for run in (first, second)] == ["completed", "cancelled"]
    assert json.loads(rows["input"].iloc[1])[0]["content"] == "Remember the word heliotrope"  # kept whole
    assert [m["content"] for m in json.loads(first.input)] == ["hello"]  # read back from the thread
    assert [m["content"] for m in json.loads(second.input)] == ["Remember the word heliotrope"]


async def test_concurrent_first_use_opens_one_saver_and_closing_releases_the_file(open_service, db_path):
    import psutil

    me = psutil.Process()

    def handles() -> int:
        return sum(1 for f in me.open_files() if f.path == str(db_path))

    async with open_service() as agent:
        await asyncio.gather(agent.open(), agent.open(), agent.open())
        assert handles() == 3, "two connections for the app tables (one writes, one reads), one for the saver"
    assert handles() == 0, "a connection was left open after aclose()"


async def test_two_runs_in_one_process_both_record_their_outcome(open_service):
    async with open_service() as agent:
        runs = [await agent.chat("Hello from the first"), await agent.chat("Hello from the second")]
        finals = await asyncio.gather(*(run.wait() for run in runs))
        assert [f.event for f in finals] == ["end", "end"]
        assert {r.status for r in (await agent.list_runs())} == {"completed"}


async def test_with_a_short_lease_every_final_event_matches_the_record(open_service):
    """Lease renewals run while runs finish: none may mistake a run it just recorded for one
    another process took over (each final event says what the runs table says)."""
    async with open_service(SOPHOS_LAB_LEASE_SECONDS="0.3") as agent:
        finals = []
        for _ in range(2):  # 4 of 200 ended OWNERSHIP_LOST before renewals skipped recorded runs
            runs = await asyncio.gather(*[agent.chat(f"hello {i}") for i in range(100)])
            finals += [(run.id, await run.wait()) for run in runs]
        recorded = {run.id: run.status for run in (await agent.list_runs())}

    assert {(final.event, final.data.get("status", final.data.get("code"))) for _, final in finals} == {("end", "completed")}
    assert set(recorded.values()) == {"completed"} and len(recorded) == 200


def meanwhile_elsewhere(coroutine) -> None:
    """Run `coroutine` (a second service on the test's database) to its end on a loop of its own
    in another thread, while the caller's loop waits; its errors are raised here."""
    with ThreadPoolExecutor(1) as other:
        other.submit(asyncio.run, coroutine).result()


async def a_message_cancelled_elsewhere(open_service, conversation: str, text: str) -> None:
    """A second process takes `text` in the conversation, and is cancelled before its run's first
    checkpoint: the message is accepted, and never reaches the thread."""
    async with open_service() as other:
        def cancel_once_the_run_is_written(write) -> None:
            if write.kind == "run":
                cancels.append(asyncio.get_running_loop().create_task(other.cancel(conversation)))

        cancels: list[asyncio.Task] = []
        other.on_write = cancel_once_the_run_is_written
        assert (await (await other.chat(text, conversation)).wait()).event == "chat-error"
        await cancels[0]


async def test_a_message_read_against_a_run_another_process_then_stopped_still_carries_that_run_s_message(open_service):
    # A takes a new message on a conversation whose latest run completed (so A reads nothing
    # first). Before A writes its run, a second process on the database takes a message of its
    # own, which is cancelled before it reaches the thread. A's run must carry that message on,
    # as if A had read after.
    async with open_service() as agent:
        conversation = (await agent.ask("hello")).data["conversation"]
        points = []

        def meanwhile(point: str) -> None:  # A's loop waits here: the other process runs to its end
            points.append(point)
            if point == "settled":
                meanwhile_elsewhere(a_message_cancelled_elsewhere(open_service, conversation,
                                                                  "Remember the word heliotrope"))

        agent.at_point = meanwhile
        assert (await agent.ask("What word did I ask you to remember?", conversation)).event == "end"
        detail = await agent.get_conversation(conversation)

    assert points[:2] == ["settled", "read"]  # its assumption failed, so it read the conversation
    said = [message["content"] for message in detail.messages if message["role"] == "user"]
    assert said == ["hello", "Remember the word heliotrope", "What word did I ask you to remember?"]


async def test_a_message_on_a_conversation_whose_latest_run_completed_reads_nothing_before_its_start(open_service):
    # The common case costs the start's transaction alone; the assumption is checked inside it.
    async with open_service() as agent:
        conversation = (await agent.ask("hello")).data["conversation"]
        points = []
        agent.at_point = points.append
        assert (await agent.ask("and again", conversation)).event == "end"

    assert points == ["settled", "budget", "outcome", "recorded"]  # no `read`, and the owner from the start


async def test_a_message_whose_conversation_moves_on_under_it_each_time_is_refused_with_nothing_written(open_service):
    # A's conversation has a stopped run, so A reads it before its start. Each time A has read
    # it, a second process on the database has a run of its own there before A writes: A reads
    # again once, then refuses, writing nothing.

    async def another_turn(conversation: str) -> None:
        async with open_service() as other:
            assert (await other.ask("A message from the other process", conversation)).event == "end"

    async with open_service() as agent:
        conversation = (await agent.ask("hello")).data["conversation"]
        await a_message_cancelled_elsewhere(open_service, conversation, "Stopped before the thread")
        points = []

        def meanwhile(point: str) -> None:
            points.append(point)
            if point == "read":
                meanwhile_elsewhere(another_turn(conversation))

        agent.at_point = meanwhile
        with pytest.raises(SophosError) as refused:
            await agent.chat("Mine, read before theirs", conversation)
        agent.at_point = None
        runs = await agent.list_runs(conversation)

    assert refused.value.code == SESSION_IN_PROGRESS
    assert points == ["settled", "read", "read"]
    said = [message["content"] for run in runs for message in json.loads(run.input)]
    assert "Mine, read before theirs" not in said and len(runs) == 4

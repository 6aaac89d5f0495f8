"""Run control: cancel a run mid-step, retry a failed step with backoff, cut a step that hangs.

In-process services against the lab's scripted model and web pages; no test waits for a timer:
the backoff base is 0.01 s (`SOPHOS_LAB_RETRY_BASE_SECONDS`) and the waits are read from the
`retry` trace events, never measured.
"""

import asyncio

import pytest
from conftest import statuses

from sophos_lab.lab.harness import dead_port_url
from sophos_lab.runtime.errors import (
    AGENT_FAILURE, BAD_REQUEST, CANCELLED, MODEL_UNAVAILABLE, MODEL_UNREACHABLE, NOT_FOUND, RUN_NOT_ACTIVE,
    TIMEOUT, SophosError,
)
from sophos_lab.runtime.settings import Settings
from sophos_lab.runtime.storage import sqlite_storage
from sophos_lab.runtime.storage.blocking import Blocking

# The PostgreSQL side runs in `make test-matrix`: make test tries PostgreSQL through test_postgres,
# test_workers, test_ownership, test_users and the PostgreSQL crash matrices (see docs/testing.md).
pytestmark = pytest.mark.both_backends(postgres_full_matrix=True)

FAST_RETRIES = {"SOPHOS_LAB_RETRY_BASE_SECONDS": "0.01", "SOPHOS_LAB_RETRY_MAX_SECONDS": "0.03"}


def retries(events) -> list[dict]:
    """The `retry` notices, each with the step and node it is about."""
    return [{"step": e.data["step"], "node": e.data["node"], **e.data["data"]}
            for e in events if e.event == "trace" and e.data["event"] == "retry"]


async def all_events(run) -> list:
    return [event async for event in run.events()]


# --- cancel -------------------------------------------------------------------------------


async def test_a_cancel_asked_for_between_two_steps_stops_the_next_one_before_its_call_without_an_error(lab, open_service):
    # Asked for once the model's step is checkpointed: the tools step, next, does not fetch, and
    # its `leave` tells of no error (a cancel is not a failure of the step).
    before = lab.fetches("index.html")
    async with open_service() as agent:
        cancels = []

        def observe(write) -> None:
            if write.kind == "checkpoint" and write.step == 1:
                cancels.append(asyncio.get_running_loop().create_task(agent.cancel(write.conversation)))

        agent.on_write = observe
        run = await agent.chat(f"Fetch {lab.page('index.html')}")
        events = await all_events(run)
        await cancels[0]

    assert events[-1].event == "chat-error" and events[-1].data["code"] == CANCELLED
    assert lab.fetches("index.html") == before
    leaves = [e.data for e in events if e.event == "trace" and e.data["event"] == "leave"]
    assert leaves[0]["node"] == "agent" and len(leaves) <= 2  # the tools step stopped as it began, or before
    assert [leave.get("data", {}).get("error") for leave in leaves] == [None] * len(leaves), leaves


async def test_cancel_mid_answer_stops_the_stream_records_cancelled_and_the_run_resumes(lab, open_service):
    lab.model.arm("essay")
    async with open_service() as agent:
        run = await agent.chat("Write an essay on durable execution.")
        await asyncio.to_thread(lab.model.wait_paused)
        final = await agent.cancel(run.conversation)
        [row] = await agent.list_runs(run.conversation)
        detail = await agent.get_conversation(run.conversation)
        lab.model.release()  # nothing waits on it any more: the client hung up

        resumed = await (await agent.resume(run.conversation)).wait()

    assert (final.event, final.data["code"], final.data["message"]) == ("chat-error", CANCELLED, "Cancelled by user")
    assert (row.status, row.error_code, row.error_message) == ("cancelled", CANCELLED, "Cancelled by user")
    assert row.cancel_requested_at is not None
    assert (detail.next, detail.resumable) == (("agent",), True)  # the answer was not saved half-way
    assert [m["role"] for m in detail.messages] == ["user"]
    assert resumed.event == "end"
    assert (await statuses(agent, run.conversation)) == ["cancelled", "completed"]


async def test_cancel_while_a_tool_call_hangs_abandons_the_call_and_keeps_the_saved_steps(lab, open_service):
    page = lab.page("wal.html")
    lab.web.hold("/wal.html")
    async with open_service() as agent:
        run = await agent.chat(f"Fetch {page}")
        await asyncio.to_thread(lab.web.wait_held)
        final = await agent.cancel(run.conversation)
        events = run.buffer
        detail = await agent.get_conversation(run.conversation)
        lab.web.release()

    assert final.data["code"] == CANCELLED
    # The model step that asked for the fetch was saved (its call was told); the tools step was not.
    assert [e.data["event"] for e in events if e.event == "trace"] == ["enter", "call", "leave", "enter", "leave"]
    assert events[-2].data == {**events[-2].data, "node": "tools", "saved": False}
    assert detail.next == ("tools",)
    assert [m["role"] for m in detail.messages] == ["user", "assistant"]


async def test_cancel_with_nothing_running_is_refused_and_writes_nothing(open_service):
    async with open_service() as agent:
        done = await agent.ask("Hello there")
        with pytest.raises(SophosError) as idle:
            await agent.cancel(done.data["conversation"])
        with pytest.raises(SophosError) as unknown:
            await agent.cancel("00000000-0000-4000-8000-000000000000")
        with pytest.raises(SophosError) as malformed:
            await agent.cancel("not-a-uuid")
        [row] = await agent.list_runs(done.data["conversation"])

    assert idle.value.code == RUN_NOT_ACTIVE
    assert (unknown.value.code, malformed.value.code) == (NOT_FOUND, BAD_REQUEST)
    assert (row.status, row.cancel_requested_at) == ("completed", None)


async def test_a_cancel_at_any_point_of_a_run_records_exactly_one_outcome_and_says_which(lab, open_service):
    """Cancel after each event of a reference run (a fetch): whichever reaches the database first,
    the cancel or the run's outcome, is the one outcome, and the final event says it."""
    page = lab.page("index.html")
    outcomes = []
    async with open_service() as agent:
        reference = await all_events(await agent.chat(f"Fetch {page}"))
        for point in range(1, len(reference)):
            run = await agent.chat(f"Fetch {page}")
            async for event in run.events():
                if event.id == point:
                    break
            try:
                final = await agent.cancel(run.conversation)
            except SophosError as refused:  # the run had ended and left: nothing to cancel
                assert refused.code == RUN_NOT_ACTIVE
                final = await run.wait()
            [row] = await agent.list_runs(run.conversation)
            said = final.data.get("code") or final.data["status"]
            assert (row.status, row.error_code or row.status) in (("cancelled", CANCELLED), ("completed", "completed"))
            assert said == (row.error_code or row.status), (point, final, row)
            assert [e.event for e in run.buffer].count("chat-error") + [e.event for e in run.buffer].count("end") == 1
            outcomes.append(row.status)

    assert outcomes[0] == "cancelled" and "cancelled" in outcomes


def test_a_cancel_accepted_before_a_crash_is_recovered_as_cancelled(db_path):
    crashed = Blocking(lambda: sqlite_storage(db_path))
    crashed.start_run("run-1", "c-1", [{"id": "m-1", "content": "hi"}], title="hi")
    assert crashed.request_cancel("run-1")
    assert not crashed.request_cancel("run-1")  # once is enough
    crashed.close()  # as if the process died: its runs are recoverable, nothing recorded them

    after = Blocking(lambda: sqlite_storage(db_path))
    run = after.get_run("run-1")

    recovered = after.recovered_runs
    after.close()
    assert recovered == 1
    assert (run.status, run.error_code, run.error_message) == ("cancelled", CANCELLED, "Cancelled by user")


def test_a_cancel_is_not_written_once_the_outcome_is(db_path):
    with Blocking(lambda: sqlite_storage(db_path)) as store:
        store.start_run("run-1", "c-1", title="hi")
        store.finish_run("run-1", "completed", 2)

        assert not store.request_cancel("run-1")
        assert store.get_run("run-1").cancel_requested_at is None


def test_cancel_during_a_payment_does_not_undo_it_and_only_a_keyed_tool_is_safe_to_resume(lab_home):
    """The payment commits on the ledger's side while the tools step is cut off: the effect
    stays (a cancel undoes nothing), the step is not saved, and the resume repeats the call. The
    keyed tool gets the same idempotency key again and pays once; the plain one pays twice."""
    from sophos_lab.lab.harness import Lab

    with Lab.setup("run-control-ledger", quiet=True, fork_servers=True, extra_servers=("ledger",)) as lab:
        lab.without_approvals()
        with lab.worker() as child:
            outcomes = {}
            for message in ("Pay 30 to Alice, exactly once.", "Pay 30 to Bob."):
                lab.web.hold("/ledger-committed")
                child.chat(message)
                conversation = child.conversation()
                lab.web.wait_held()
                final = child.cancel(conversation)
                paid_when_cancelled = len(lab.ledger())
                next_after_cancel = lab.state(conversation)["last_checkpoint"]["next"]
                lab.web.release()
                child.resume(conversation)
                resumed = child.wait_final()
                outcomes[message.split()[3].rstrip(",.")] = (
                    final["data"]["code"], next_after_cancel, paid_when_cancelled, resumed["event"])
            payments = lab.ledger()

    assert outcomes["Alice"] == (CANCELLED, ["tools"], 1, "end")
    assert outcomes["Bob"] == (CANCELLED, ["tools"], 2, "end")
    assert payments["to_account"].tolist() == ["Alice", "Bob", "Bob"]


def test_a_worker_child_cancels_on_command_and_refuses_when_idle(lab):
    lab.model.arm("essay")
    with lab.worker() as child:
        child.chat("Write an essay on durable execution.")
        conversation = child.conversation()
        lab.model.wait_paused()
        final = child.cancel(conversation)
        lab.model.release()
        again = child.cancel(conversation)

    assert (final["event"], final["data"]["code"]) == ("chat-error", CANCELLED)
    assert child.wait_final()["data"]["code"] == CANCELLED  # the run's own stream says it too
    assert (again["event"], again["data"]["code"]) == ("rejected", RUN_NOT_ACTIVE)


def test_the_http_api_cancels_a_run_with_200_and_refuses_with_409_404_400(lab):
    lab.model.arm("essay")
    with lab.server() as server:
        server.chat("Write an essay on durable execution.")
        conversation = server.conversation()
        lab.model.wait_paused()
        cancelled = server.request("POST", f"/api/conversations/{conversation}/cancel")
        lab.model.release()
        idle = server.request("POST", f"/api/conversations/{conversation}/cancel")
        unknown = server.request("POST", "/api/conversations/00000000-0000-4000-8000-000000000000/cancel")
        malformed = server.request("POST", "/api/conversations/nope/cancel")
        runs = server.request("GET", f"/api/conversations/{conversation}/runs").json()["runs"]

    assert cancelled.status_code == 200
    assert cancelled.json()["event"] == "chat-error"
    assert cancelled.json()["data"]["code"] == CANCELLED
    assert (idle.status_code, idle.json()["error"]["code"]) == (409, RUN_NOT_ACTIVE)
    assert (unknown.status_code, malformed.status_code) == (404, 400)
    assert [run["status"] for run in runs] == ["cancelled"]


# --- retries and timeouts -------------------------------------------------------------------


def test_the_backoff_doubles_from_the_base_up_to_the_cap():
    assert [Settings().backoff(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]
    fast = Settings.from_env({"SOPHOS_LAB_RETRY_BASE_SECONDS": "0.01", "SOPHOS_LAB_RETRY_MAX_SECONDS": "0.03"})
    assert [fast.backoff(n) for n in range(1, 5)] == [0.01, 0.02, 0.03, 0.03]


def test_retry_settings_default_and_parse_as_the_other_settings():
    defaults = Settings.from_env({})
    assert (defaults.model_attempts, defaults.tool_attempts, defaults.retry_jitter) == (3, 1, False)
    assert (defaults.model_timeout_seconds, defaults.tool_timeout_seconds) == (600, 120)
    custom = Settings.from_env({"SOPHOS_LAB_MODEL_ATTEMPTS": "5", "SOPHOS_LAB_TOOL_ATTEMPTS": "0",
                                "SOPHOS_LAB_RETRY_JITTER": "1"})
    assert (custom.model_attempts, custom.tool_attempts, custom.retry_jitter) == (5, 1, True)


# The retry and time-limit tests below test LangGraph's RetryPolicy and TimeoutPolicy as the kit
# configures them, which no backend changes: they run on SQLite only (`sqlite_only`).
@pytest.mark.sqlite_only
async def test_two_server_errors_then_an_answer_retries_twice_with_the_backoff_in_the_trace(lab, open_service):
    lab.model.fail_next(2, status=500)
    async with open_service(SOPHOS_LAB_MODEL_ATTEMPTS="3", **FAST_RETRIES) as agent:
        run = await agent.chat("Hello there")
        events = await all_events(run)

    assert events[-1].event == "end"
    assert [(r["attempt"], r["of"], r["wait"], r["code"]) for r in retries(events)] == [
        (2, 3, 0.01, MODEL_UNREACHABLE), (3, 3, 0.02, MODEL_UNREACHABLE)]
    assert all(r["node"] == "agent" and r["step"] == 1 for r in retries(events))
    assert [r["status"] for r in lab.model.requests()[-3:]] == [500, 500, 200]


@pytest.mark.sqlite_only
async def test_a_model_that_keeps_failing_ends_with_model_unreachable_naming_the_attempts(lab, open_service):
    lab.model.fail_next(3, status=503)
    async with open_service(SOPHOS_LAB_MODEL_ATTEMPTS="3", **FAST_RETRIES) as agent:
        run = await agent.chat("Hello there")
        events = await all_events(run)
        [row] = await agent.list_runs(run.conversation)
        detail = await agent.get_conversation(run.conversation)

    assert (events[-1].event, events[-1].data["code"]) == ("chat-error", MODEL_UNREACHABLE)
    assert "The model answered HTTP 503 to all 3 attempts (SOPHOS_LAB_MODEL_ATTEMPTS=3)" in row.error_message
    assert (row.status, row.error_code) == ("failed", MODEL_UNREACHABLE)
    assert len(retries(events)) == 2
    assert (detail.next, detail.resumable) == (("agent",), True)


@pytest.mark.sqlite_only
async def test_a_dead_model_port_is_retried_then_model_unreachable(open_service):
    async with open_service(OLLAMA_HOST=dead_port_url(), SOPHOS_LAB_MODEL_ATTEMPTS="2", **FAST_RETRIES) as agent:
        events = await all_events(await agent.chat("Hello there"))

    assert events[-1].data["code"] == MODEL_UNREACHABLE
    assert events[-1].data["message"].startswith("The model did not answer after 2 attempts")  # no HTTP answer at all
    assert "All connection attempts failed" in events[-1].data["message"]
    assert [r["attempt"] for r in retries(events)] == [2]


@pytest.mark.sqlite_only
async def test_one_attempt_keeps_the_original_agent_failure(open_service):
    async with open_service(OLLAMA_HOST=dead_port_url(), SOPHOS_LAB_MODEL_ATTEMPTS="1") as agent:
        events = await all_events(await agent.chat("Hello there"))

    assert (events[-1].data["code"], events[-1].data["message"]) == (AGENT_FAILURE, "All connection attempts failed")
    assert retries(events) == []


@pytest.mark.sqlite_only
async def test_a_missing_model_is_never_retried(lab, open_service):
    before = lab.model_calls()
    async with open_service(OLLAMA_MODEL="does-not-exist", SOPHOS_LAB_MODEL_ATTEMPTS="3", **FAST_RETRIES) as agent:
        events = await all_events(await agent.chat("Hello there"))

    assert events[-1].data["code"] == MODEL_UNAVAILABLE
    assert retries(events) == []
    assert lab.model_calls() - before == 1


@pytest.mark.sqlite_only
async def test_a_client_error_is_not_retried(lab, open_service):
    lab.model.fail_next(1, status=400, message="bad request")
    async with open_service(SOPHOS_LAB_MODEL_ATTEMPTS="3", **FAST_RETRIES) as agent:
        events = await all_events(await agent.chat("Hello there"))

    assert (events[-1].data["code"], retries(events)) == (AGENT_FAILURE, [])


@pytest.mark.sqlite_only
async def test_a_model_that_never_answers_is_cut_by_its_time_limit_and_retried(lab, open_service):
    # The limit bounds the second attempt too (a whole answer), on a machine that may be loaded.
    async with open_service(SOPHOS_LAB_MODEL_ATTEMPTS="2", SOPHOS_LAB_MODEL_TIMEOUT_SECONDS="3",
                            **FAST_RETRIES) as agent:
        await agent.tools.get()  # the MCP servers start within the first model step: not in its 0.5 s
        lab.model.hang_next(1)
        events = await all_events(await agent.chat("Hello there"))

    assert events[-1].event == "end"
    [retry] = retries(events)
    assert (retry["attempt"], retry["code"], retry["wait"]) == (2, TIMEOUT, 0.01)
    assert retry["error"] == "the agent step exceeded its time limit of 3 s (SOPHOS_LAB_MODEL_TIMEOUT_SECONDS)"
    assert [r.get("fault") for r in lab.model.requests()[-2:]] == ["hang", None]


@pytest.mark.sqlite_only
async def test_a_hanging_tool_is_cut_by_its_time_limit_and_the_run_fails_with_timeout(lab, open_service):
    page = lab.page("wal.html")
    lab.web.hold("/wal.html")
    async with open_service(SOPHOS_LAB_TOOL_TIMEOUT_SECONDS="0.5") as agent:
        await agent.tools.get()
        run = await agent.chat(f"Fetch {page}")
        events = await all_events(run)
        [row] = await agent.list_runs(run.conversation)
        detail = await agent.get_conversation(run.conversation)
    lab.web.release()

    assert (events[-1].data["code"], row.error_code) == (TIMEOUT, TIMEOUT)
    assert row.error_message == (
        "The tools step failed in its one attempt (SOPHOS_LAB_TOOL_ATTEMPTS=1): the tools step exceeded "
        "its time limit of 0.5 s (SOPHOS_LAB_TOOL_TIMEOUT_SECONDS).")
    assert detail.next == ("tools",)


@pytest.mark.sqlite_only
async def test_a_hanging_tool_with_two_attempts_is_fetched_again_and_the_run_completes(lab, open_service):
    page = lab.page("wal.html")
    lab.web.hold("/wal.html")  # one request only: the second attempt's fetch is answered
    before = lab.fetches("wal.html")
    # The limit bounds the second attempt's real fetch too, on a machine that may be loaded.
    async with open_service(SOPHOS_LAB_TOOL_TIMEOUT_SECONDS="3", SOPHOS_LAB_TOOL_ATTEMPTS="2",
                            **FAST_RETRIES) as agent:
        await agent.tools.get()
        events = await all_events(await agent.chat(f"Fetch {page}"))
    lab.web.release()

    assert events[-1].event == "end"
    assert [(r["node"], r["attempt"], r["code"]) for r in retries(events)] == [("tools", 2, TIMEOUT)]
    assert lab.fetches("wal.html") - before == 2


@pytest.mark.sqlite_only
async def test_a_tools_own_error_result_is_data_not_a_retry(lab, open_service):
    async with open_service(SOPHOS_LAB_TOOL_ATTEMPTS="3", **FAST_RETRIES) as agent:
        events = await all_events(await agent.chat(f"Fetch {lab.page('missing.html')}"))

    results = [e.data["data"] for e in events if e.event == "trace" and e.data["event"] == "result"]
    assert events[-1].event == "end"
    assert [r["status"] for r in results] == ["error"]
    assert "status code 404" in results[0]["result"]
    assert retries(events) == []

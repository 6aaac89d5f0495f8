"""Fair limits between users: how many runs one user may have, and the order workers claim them.

On the stores themselves (a real SQLite file, a real PostgreSQL database), with users added as
`sophos-lab user add` adds them and requests acting for them as the HTTP server's do.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import httpx
import psutil
import pytest

from sophos_lab.runtime import users
from sophos_lab.runtime.errors import STEP_BUDGET_SPENT, TOO_MANY_RUNS, SophosError
from conftest import open_store
from sophos_lab.runtime.storage.models import utc_now
from sophos_lab.runtime.tools import user_memory_path

LIMITS = {"SOPHOS_LAB_USER_MAX_RUNNING": "2", "SOPHOS_LAB_USER_MAX_QUEUED": "3"}


@contextlib.contextmanager
def acting_as(user: users.User | None):
    token = users.acting_user.set(None if user is None else user.id)
    try:
        yield
    finally:
        users.acting_user.reset(token)


@pytest.fixture
def store(lab, database):
    store = open_store(lab.settings(**database, **LIMITS))
    yield store
    store.close()


@pytest.fixture
def queue_store(lab, request, postgres, migrated_template):
    """A store on a fresh PostgreSQL database, where runs can be queued for workers."""
    from sophos_lab.lab import postgres_server

    url = postgres_server.new_database(postgres.url, request.node.name[:30], template=migrated_template)
    store = open_store(lab.settings(DATABASE_URL=url, **LIMITS))
    yield store
    store.close()
    postgres_server.drop_database(postgres.url, url)


def add(store, name: str) -> users.User:
    return store.call(users.add_user, name, utc_now())[0]


async def added(storage, name: str) -> users.User:
    """`add`, on a service's own storage (awaited on its loop)."""
    return (await users.add_user(storage, name, utc_now()))[0]


def start(store, user: users.User | None, queued: bool = False) -> str:
    """A run of `user` on a new conversation of theirs; its conversation id."""
    conversation, run = str(uuid.uuid4()), str(uuid.uuid4())
    message = [{"id": str(uuid.uuid4()), "role": "user", "content": "hello"}]
    with acting_as(user):
        if queued:
            store.queue_run(run, conversation, message, "hello", None, None, False)
        else:
            store.start_run(run, conversation, message, "hello")
    return conversation


@pytest.mark.both_backends
def test_a_user_at_their_running_limit_is_refused_with_too_many_runs_and_nothing_is_stored(store):
    ada, bea = add(store, "ada"), add(store, "bea")
    start(store, ada), start(store, ada)
    before = len(store.list_runs())

    with pytest.raises(SophosError) as refused:
        start(store, ada)

    assert refused.value.code == TOO_MANY_RUNS
    assert "SOPHOS_LAB_USER_MAX_RUNNING=2" in refused.value.message and "Nothing was stored" in refused.value.message
    assert len(store.list_runs()) == before
    start(store, bea)  # another user is not held up by ada's limit
    start(store, None), start(store, None), start(store, None)  # nor the single-user mode, which has none


@pytest.mark.both_backends
def test_a_run_whose_process_was_killed_holds_no_place_in_its_user_s_running_limit(lab, database):
    """Ada may have one run at a time. Her run is held half-way on a server, which is killed: a
    new chat of hers through another process is not refused for a run nobody runs any more."""
    settings = {**database, "SOPHOS_LAB_USER_MAX_RUNNING": "1"}
    token = lab.add_user("ada", **database)
    store = open_store(lab.settings(**settings))
    try:
        ada = store.call(users.find_user, "ada")  # open (and swept) before her run: no sweep helps later
        lab.model.arm("summary")
        with lab.server(**settings) as server:
            started = httpx.post(f"{server.url}/api/chat", headers={"Authorization": f"Bearer {token}"},
                                 json={"message": f"Fetch {lab.page('wal.html')} and summarize it."}, timeout=30)
            assert started.status_code == 200, started.text
            lab.model.wait_paused()  # her run is `running`, and its process alive
            server.kill()
        lab.model.release()

        start(store, ada)  # her next run, on a new conversation: once refused with TOO_MANY_RUNS
        crashed = store.list_runs(started.json()["conversation"])
    finally:
        store.close()

    # it saved two steps (the model's tool call, the fetch) and died in the third: its user's day counts two
    assert [(run.status, run.steps) for run in crashed] == [("interrupted", 2)]


# A fetch's commits: 1 the run, 2 the input's checkpoint, 3 and 4 the `__start__` task's writes and
# checkpoint (no step), then each step's writes and checkpoint: 5-6 the model's tool call, 7-8 the
# fetch, 9-10 the summary, 11 the outcome.
@pytest.mark.parametrize("commits, saved", [(2, 0), (5, 0), (6, 1), (8, 2)])
def test_a_run_killed_after_any_commit_costs_the_steps_it_saved(lab, commits, saved):
    with lab.worker(SOPHOS_LAB_STOP_AFTER_WRITE=str(commits), SOPHOS_LAB_TRACE_WRITES="1") as child:
        child.chat(f"Fetch {lab.page('wal.html')} and summarize it.")
        child.wait_stopped()  # right after its commit number `commits`
        writes = [e["data"]["write"] for e in child.log.events if e["event"] == "write"]
        conversation = child.conversation()
        assert child.kill() == -9

    store = open_store(lab.settings())  # an open relabels the killed worker's run
    try:
        [run] = store.list_runs(conversation)
    finally:
        store.close()

    assert (run.status, run.steps) == ("interrupted", saved), writes


def test_a_user_at_their_queued_limit_is_refused_and_workers_claim_in_turns_across_users(queue_store):
    store = queue_store
    ada, bea = add(store, "ada"), add(store, "bea")
    adas = [start(store, ada, queued=True) for _ in range(3)]
    with pytest.raises(SophosError) as refused:
        start(store, ada, queued=True)
    beas = start(store, bea, queued=True)  # queued after all of ada's

    claimed = []
    while (run := store.claim_run()) is not None:
        claimed.append(run.conversation_id)

    assert refused.value.code == TOO_MANY_RUNS and "SOPHOS_LAB_USER_MAX_QUEUED=3" in refused.value.message
    # bea's first run is claimed second, not fourth; ada's third waits: two of hers run already
    assert claimed == [adas[0], beas, adas[1]]
    position = {conversation: i + 1 for i, conversation in enumerate(claimed)}
    print(f"\nclaim order: bea's run (queued 4th) claimed {position[beas]}nd; in queue order it would be 4th")


# --- step budgets: per run, and per user and day ---------------------------------------------


async def chat_as(agent, user: users.User | None, message: str, conversation: str | None = None):
    """A run started for `user` (as a request of theirs does), waited for; its final event."""
    with acting_as(user):
        run = await agent.chat(message, conversation)
    return run, await run.wait()


async def resume_as(agent, user: users.User, conversation: str):
    with acting_as(user):
        run = await agent.resume(conversation)
    return await run.wait()


@pytest.mark.both_backends
async def test_a_run_that_takes_its_user_s_steps_for_one_run_stops_with_step_budget_spent_and_resumes(
        lab, open_service):
    """The fetch takes three graph steps (model, tool, model); a user's runs may take two each."""
    message = f"Fetch {lab.page('index.html')}"
    async with open_service(SOPHOS_LAB_USER_MAX_STEPS_PER_RUN="2") as agent:
        ada = await added(agent.store, "ada")
        run, final = await chat_as(agent, ada, message)
        stopped = await agent.get_conversation(run.conversation)
        [row] = await agent.list_runs(run.conversation)
        resumed = await resume_as(agent, ada, run.conversation)
        done = await agent.get_conversation(run.conversation)
        _, unbudgeted = await chat_as(agent, None, message)  # no user: AGENT_RECURSION_LIMIT only

    assert (final.event, final.data["code"]) == ("chat-error", STEP_BUDGET_SPENT), final
    assert "SOPHOS_LAB_USER_MAX_STEPS_PER_RUN=2" in final.data["message"]
    assert (row.status, row.error_code, row.steps) == ("failed", STEP_BUDGET_SPENT, 2)
    assert stopped.resumable and stopped.next == ("agent",), stopped.next  # the tool's result is kept
    assert (resumed.event, resumed.data["status"]) == ("end", "completed")
    assert [m["role"] for m in done.messages] == ["user", "assistant", "tool", "assistant"]
    assert (unbudgeted.event, unbudgeted.data["status"]) == ("end", "completed")


@pytest.mark.both_backends
async def test_a_user_whose_runs_took_the_day_s_steps_is_refused_and_nothing_is_stored(lab, open_service):
    message = f"Fetch {lab.page('index.html')}"
    async with open_service(SOPHOS_LAB_USER_MAX_STEPS_PER_DAY="4") as agent:
        ada, bea = await added(agent.store, "ada"), await added(agent.store, "bea")
        first, first_final = await chat_as(agent, ada, message)       # 3 steps: 1 left today
        second, second_final = await chat_as(agent, ada, message)     # given the 1 step left
        before = ((await agent.store.list_conversations()), len((await agent.store.list_runs())))
        with pytest.raises(SophosError) as refused:
            await chat_as(agent, ada, message)
        with pytest.raises(SophosError) as refused_resume:
            await resume_as(agent, ada, second.conversation)
        after = ((await agent.store.list_conversations()), len((await agent.store.list_runs())))
        _, beas = await chat_as(agent, bea, message)                   # bea's day is her own
        steps = [r.steps for r in (await agent.list_runs(first.conversation)) + (await agent.list_runs(second.conversation))]

    assert (first_final.event, first_final.data["status"]) == ("end", "completed")
    assert (second_final.event, second_final.data["code"]) == ("chat-error", STEP_BUDGET_SPENT)
    assert "SOPHOS_LAB_USER_MAX_STEPS_PER_DAY=4" in second_final.data["message"]
    assert steps == [3, 1]
    assert refused.value.code == refused_resume.value.code == STEP_BUDGET_SPENT
    assert "taken 4 steps today" in refused.value.message and "Nothing was stored" in refused.value.message
    assert after == before
    assert (beas.event, beas.data["status"]) == ("end", "completed")


# --- a user's own MCP servers stop when the user is idle --------------------------------------


def memory_servers_of(path) -> list[psutil.Process]:
    """This process's MCP server processes that were started on the memory file `path`."""
    found = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if child.environ().get("MEMORY_FILE_PATH") == str(path):
                found.append(child)
    return found


@pytest.mark.memory_server
async def test_a_user_s_memory_server_stops_once_idle_and_a_next_run_starts_it_again(lab, open_service):
    remember = "Remember this: the Sophos lab codename is BLUE-HERON."
    async with open_service(SOPHOS_LAB_USER_TOOLS_IDLE_SECONDS="0.5") as agent:
        ada = await added(agent.store, "ada")
        path = user_memory_path(agent.settings, ada.id)
        _, first = await chat_as(agent, ada, remember)
        servers = memory_servers_of(path)
        _, alive = await asyncio.to_thread(psutil.wait_procs, servers, 30)  # the barrier: their exit
        run, again = await chat_as(agent, ada, remember)
        restarted = memory_servers_of(path)
        recalled = await agent.get_conversation(run.conversation)

    assert first.event == again.event == "end"
    assert servers and not alive, alive
    assert restarted and not {p.pid for p in restarted} & {p.pid for p in servers}
    assert "BLUE-HERON" in path.read_text()
    assert any(m["role"] == "tool" for m in recalled.messages)

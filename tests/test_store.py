"""The application tables: migrations, titles, one running run per conversation, lazy recovery."""

import sqlite3
from pathlib import Path

import pytest

from sophos_lab.runtime.errors import IDEMPOTENCY_KEY_REUSED, SCHEMA_TOO_NEW, SESSION_IN_PROGRESS, SophosError
from sophos_lab.lab.inspect import peek_runs
from sophos_lab.runtime.storage import postgres_storage, sqlite_storage
from sophos_lab.runtime.storage.blocking import Blocking
from sophos_lab.runtime.storage.models import IdempotencyKey, title_from_message
from sophos_lab.runtime.storage.sqlite_schema import MIGRATIONS, SCHEMA_VERSION

CONVERSATION = "6f1c7f1e-9a62-4c4e-9a55-0c2b1f0e6a11"


pytestmark = pytest.mark.both_backends  # the tests that take `store` alone run on PostgreSQL too


def store_of(database: dict[str, str], **options) -> Blocking:
    """A store on this test's database, as a newly started process makes one (its calls
    awaited on a loop of its own: see `storage.blocking`)."""
    if "DATABASE_URL" in database:
        return Blocking(lambda: postgres_storage(database["DATABASE_URL"], **options))
    return Blocking(lambda: sqlite_storage(Path(database["DATABASE_PATH"]), **options))


def sql(database: dict[str, str], statement: str, params: dict | None = None) -> list[tuple]:
    """A statement (`:name` parameters) on this test's database, on a connection of its own, committed."""
    if "DATABASE_URL" in database:
        import re

        import psycopg

        with psycopg.connect(database["DATABASE_URL"], autocommit=True) as conn:
            cursor = conn.execute(re.sub(r"(?<![:\w]):(\w+)", r"%(\1)s", statement), params or {})
            return cursor.fetchall() if cursor.description else []
    conn = sqlite3.connect(database["DATABASE_PATH"], isolation_level=None)
    try:
        conn.execute("PRAGMA foreign_keys = ON")
        return conn.execute(statement, params or {}).fetchall()
    finally:
        conn.close()


@pytest.fixture
def store(database):
    """The application tables on this test's database: the SQLite file, or PostgreSQL."""
    store = store_of(database)
    yield store
    store.close()


def user_version(path) -> int:
    conn = sqlite3.connect(path)
    try:
        return conn.execute("PRAGMA user_version").fetchone()[0]
    finally:
        conn.close()


def tables(path) -> set[str]:
    conn = sqlite3.connect(path)
    try:
        return {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    finally:
        conn.close()


def reopen(path) -> Blocking:
    """A new store on the same file, as a newly started process would make, opened."""
    store = Blocking(lambda: sqlite_storage(path))
    store.open()  # the first open migrates and recovers
    return store


# --- opening -------------------------------------------------------------------------------


def test_nothing_is_opened_or_created_before_first_use(db_path):
    with Blocking(lambda: sqlite_storage(db_path)) as store:
        assert not store.is_open
        assert not db_path.exists()


def test_first_open_applies_the_migrations_and_records_the_version(store, db_path):
    store.list_conversations()
    assert store.is_open
    assert SCHEMA_VERSION == 9
    assert user_version(db_path) == SCHEMA_VERSION
    assert {"conversations", "runs", "owners", "prunes", "idempotency_keys", "gates"} <= tables(db_path)


def test_reopening_keeps_the_data_and_does_not_rerun_migrations(store, db_path):
    store.create_conversation(CONVERSATION, "hello")
    store.close()
    # v1 creates its tables without IF NOT EXISTS: running it again would raise.
    again = reopen(db_path)
    try:
        assert [c.id for c in again.list_conversations()] == [CONVERSATION]
        assert user_version(db_path) == SCHEMA_VERSION
    finally:
        again.close()


def test_a_newer_schema_is_refused_and_the_file_is_left_unchanged(db_path):
    conn = sqlite3.connect(db_path)
    conn.execute("PRAGMA user_version = 99")
    conn.close()
    before = db_path.read_bytes()

    with pytest.raises(SophosError) as refused, Blocking(lambda: sqlite_storage(db_path)) as store:
        store.list_conversations()

    assert refused.value.code == SCHEMA_TOO_NEW
    assert str(db_path) in refused.value.message
    assert db_path.read_bytes() == before
    assert user_version(db_path) == 99
    assert tables(db_path) == set()


# --- titles --------------------------------------------------------------------------------


def test_title_is_the_first_line_of_the_first_message():
    assert title_from_message("  Fetch the page\nand summarise it") == "Fetch the page"


def test_title_is_cut_to_50_characters_plus_an_ellipsis():
    long_line = "x" * 49 + "yz" + " and more"
    assert title_from_message(long_line) == "x" * 49 + "y" + "..."
    assert title_from_message("x" * 50) == "x" * 50


def test_title_of_a_blank_message_is_a_placeholder():
    assert title_from_message(" \n ") == "New Conversation"


def test_a_conversation_is_stored_with_its_title(store):
    store.create_conversation(CONVERSATION, "Write an essay about WAL\nPlease.")
    conversation = store.get_conversation(CONVERSATION)
    assert conversation.title == "Write an essay about WAL"
    assert conversation.message_count == 0
    assert conversation.status is None


# --- runs ----------------------------------------------------------------------------------


def test_a_run_is_running_until_its_outcome_is_recorded(store):
    store.create_conversation(CONVERSATION, "hello")
    store.start_run("run-1", CONVERSATION)
    assert store.get_run("run-1").status == "running"
    assert store.get_run("run-1").finished_at is None

    store.finish_run("run-1", "completed", message_count=2)

    assert store.get_run("run-1").status == "completed"
    assert store.get_run("run-1").finished_at is not None
    conversation = store.get_conversation(CONVERSATION)
    assert (conversation.status, conversation.message_count) == ("completed", 2)


def test_the_database_refuses_a_second_running_run_of_one_conversation(store, db_path):
    store.create_conversation(CONVERSATION, "hello")
    store.start_run("run-1", CONVERSATION)

    with pytest.raises(SophosError) as refused:
        store.start_run("run-2", CONVERSATION)
    assert refused.value.code == SESSION_IN_PROGRESS

    store.finish_run("run-1", "failed", None, "AGENT_FAILURE", "boom")
    store.start_run("run-3", CONVERSATION)
    assert [run.status for run in store.list_runs(CONVERSATION)] == ["failed", "running"]


def test_an_idempotency_key_is_written_with_its_run(store):
    key = IdempotencyKey("retry-me", '{"message": "hello"}')
    store.start_run("run-1", CONVERSATION, title="hello", idempotency=key)

    first = store.keyed_run("retry-me")
    assert (first.request, first.conversation_id, first.run_id) == (key.request, CONVERSATION, "run-1")
    assert store.keyed_run("never-used") is None


def test_a_key_that_started_a_run_refuses_another_start_and_nothing_of_it_is_written(store):
    other = "0d4a3f0e-1b2c-4d5e-8f60-718293a4b5c6"
    store.start_run("run-1", CONVERSATION, title="hello", idempotency=IdempotencyKey("retry-me", "first"))
    store.finish_run("run-1", "completed", 2)

    with pytest.raises(SophosError) as refused:
        store.start_run("run-2", other, title="hello again", idempotency=IdempotencyKey("retry-me", "second"))

    assert refused.value.code == IDEMPOTENCY_KEY_REUSED
    assert store.get_conversation(other) is None  # the new conversation went with the refused run
    assert store.get_run("run-2") is None
    assert store.keyed_run("retry-me").run_id == "run-1"


def test_conversations_are_listed_most_recent_first_with_their_latest_outcome(store):
    older, newer = CONVERSATION, "0a4f3c7e-1b2d-4e5f-8a9b-0c1d2e3f4a5b"
    store.create_conversation(older, "first")
    store.create_conversation(newer, "second")
    store.start_run("run-1", older)  # bumps updated_at
    store.finish_run("run-1", "failed", 1, "MODEL_UNAVAILABLE", "no model")

    listed = store.list_conversations()

    assert [c.id for c in listed] == [older, newer]
    assert (listed[0].status, listed[0].error_code) == ("failed", "MODEL_UNAVAILABLE")
    assert listed[1].status is None


# --- lazy recovery -------------------------------------------------------------------------


@pytest.fixture
def left_running(db_path):
    """A file with one run left `running`, as a killed process leaves it."""
    store = Blocking(lambda: sqlite_storage(db_path))
    store.create_conversation(CONVERSATION, "hello")
    store.start_run("run-1", CONVERSATION)
    store.close()
    return db_path


def test_the_first_open_relabels_running_runs_interrupted(left_running):
    store = reopen(left_running)
    try:
        assert store.recovered_runs == 1
        run = store.get_run("run-1")
        assert run.status == "interrupted"
        assert run.finished_at is not None
    finally:
        store.close()


def test_recovery_happens_once_per_open_not_on_every_read(left_running):
    store = reopen(left_running)
    try:
        store.start_run("run-2", CONVERSATION)  # this process's own run
        store.list_conversations()
        assert store.get_run("run-2").status == "running"
        assert store.recovered_runs == 1
    finally:
        store.close()


def test_a_read_only_peek_does_not_recover(left_running):
    assert list(peek_runs(left_running)["status"]) == ["running"]
    assert list(peek_runs(left_running)["status"]) == ["running"]

    store = reopen(left_running)
    store.close()

    assert store.recovered_runs == 1
    assert list(peek_runs(left_running)["status"]) == ["interrupted"]


def test_a_clean_file_recovers_nothing(store):
    store.list_runs()
    assert store.recovered_runs == 0


# --- schema version 2: an old file upgrades in place ----------------------------------------


def test_a_version_1_file_upgrades_in_place_keeping_its_rows(db_path):
    """A file as version 1 wrote it: the tables of the first migration, one finished run and one
    left `running` (its process died). Opening it adds the ownership columns and table."""
    conn = sqlite3.connect(db_path)
    conn.executescript(f"BEGIN; {MIGRATIONS[0]}; PRAGMA user_version = 1; COMMIT;")
    conn.execute("INSERT INTO conversations VALUES (?, 'hello', 't0', 't1', 2)", (CONVERSATION,))
    conn.execute("INSERT INTO runs VALUES ('run-1', ?, 'completed', NULL, NULL, 't0', 't1')", (CONVERSATION,))
    conn.execute("INSERT INTO runs VALUES ('run-2', ?, 'running', NULL, NULL, 't2', NULL)", (CONVERSATION,))
    conn.commit()
    conn.close()

    store = reopen(db_path)
    try:
        assert user_version(db_path) == SCHEMA_VERSION
        assert {"owners", "prunes"} <= tables(db_path)
        [conversation] = store.list_conversations()
        assert (conversation.title, conversation.message_count) == ("hello", 2)
        first, second = store.list_runs(CONVERSATION)
        assert (first.status, first.owner_id, first.input) == ("completed", None, None)
        assert second.status == "interrupted"  # no owner recorded: nobody can still be running it
        assert store.recovered_runs == 1
        store.start_run("run-3", CONVERSATION, [{"id": "m1", "content": "hi"}])
        assert store.get_run("run-3").owner_id == store.owner.id
    finally:
        store.close()


def test_a_version_2_file_gains_the_prune_record_in_place(db_path):
    """Schema version 3 adds `prunes` (what `sophos-lab prune` deleted); a version-2 file keeps its rows."""
    conn = sqlite3.connect(db_path)
    conn.executescript(f"BEGIN; {MIGRATIONS[0]}; {MIGRATIONS[1]}; PRAGMA user_version = 2; COMMIT;")
    conn.execute("INSERT INTO conversations VALUES (?, 'hello', 't0', 't1', 2)", (CONVERSATION,))
    conn.execute("INSERT INTO runs (id, conversation_id, status, started_at, finished_at)"
                 " VALUES ('run-1', ?, 'completed', 't0', 't1')", (CONVERSATION,))
    conn.commit()
    conn.close()

    store = reopen(db_path)
    try:
        assert user_version(db_path) == SCHEMA_VERSION
        assert "prunes" in tables(db_path)
        [run] = store.list_runs(CONVERSATION)
        assert (run.id, run.status) == ("run-1", "completed")
    finally:
        store.close()


def test_a_version_6_file_gains_the_waiting_status_and_gates_keeping_its_rows_and_references(db_path):
    """Version 7 rebuilds `runs` (a CHECK changes only so) for `waiting`, and adds `gates`: a
    version-6 file keeps its runs in order, its idempotency keys and their cascades."""
    conn = sqlite3.connect(db_path)
    conn.executescript("BEGIN; " + "; ".join(MIGRATIONS[:6]) + "; PRAGMA user_version = 6; COMMIT;")
    conn.execute("PRAGMA foreign_keys = ON")
    conn.execute("INSERT INTO conversations VALUES (?, 'hello', 't0', 't1', 2)", (CONVERSATION,))
    for run_id, status in (("run-b", "completed"), ("run-a", "cancelled")):  # rowid order, not id order
        conn.execute("INSERT INTO runs (id, conversation_id, status, started_at, input, cancel_requested_at)"
                     " VALUES (?, ?, ?, 't0', '[]', ?)", (run_id, CONVERSATION, status,
                                                         "t1" if status == "cancelled" else None))
    conn.execute("INSERT INTO idempotency_keys VALUES ('key-1', 'request', ?, 'run-b', 't0')", (CONVERSATION,))
    conn.commit()
    with pytest.raises(sqlite3.IntegrityError):  # version 6 knows no `waiting`
        conn.execute("UPDATE runs SET status = 'waiting' WHERE id = 'run-a'")
    conn.close()

    store = reopen(db_path)
    try:
        assert user_version(db_path) == SCHEMA_VERSION
        assert [(run.id, run.status, run.cancel_requested_at) for run in store.list_runs(CONVERSATION)] == [
            ("run-b", "completed", None), ("run-a", "cancelled", "t1")]
        assert store.keyed_run("key-1").run_id == "run-b"
        database = {"DATABASE_PATH": str(db_path)}
        sql(database, "UPDATE runs SET status = 'waiting' WHERE id = 'run-a'")
        assert sql(database, "PRAGMA foreign_key_check") == []
        sql(database, "DELETE FROM conversations WHERE id = :id", {"id": CONVERSATION})
        assert sql(database, "SELECT count(*) FROM runs") == [(0,)]  # cascades still hold
        assert store.keyed_run("key-1") is None
    finally:
        store.close()


# --- ownership: only runs of gone owners are recovered --------------------------------------


def a_dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def left_by(database, run_id: str, **owner) -> None:
    """A `running` run owned by an owner row with these fields (the others like this process).
    On PostgreSQL the wall-clock lease is a `timestamptz` (`lease_expires_at` in seconds since
    the epoch, as SQLite stores it)."""
    import time

    from sophos_lab.runtime.ownership import Owner

    with store_of(database) as store:  # migrated; its own owner row goes when it closes
        if CONVERSATION not in [c.id for c in store.list_conversations()]:
            store.create_conversation(CONVERSATION, "hello")
    here = Owner.here()
    row = {
        "id": f"owner-{run_id}", "host": here.host, "boot_id": here.boot_id, "pid": here.pid,
        "pid_started": here.pid_started, "opened_at": "t0", "lease_expires_at": time.time() + 60,
        "lease_expires_monotonic": time.monotonic() + 60, **owner,
    }
    wall = "to_timestamp(:lease_expires_at)" if "DATABASE_URL" in database else ":lease_expires_at"
    sql(database, "INSERT INTO owners VALUES (:id, :host, :boot_id, :pid, :pid_started, :opened_at,"
                  f" {wall}, :lease_expires_monotonic)", row)
    sql(database, "INSERT INTO runs (id, conversation_id, status, started_at, owner_id)"
                  " VALUES (:run_id, :conversation, 'running', 't0', :owner)",
        {"run_id": run_id, "conversation": CONVERSATION, "owner": row["id"]})


@pytest.mark.parametrize(
    ("owner", "recovered"),
    [
        ({}, False),  # this very process, lease valid: alive
        ({"pid": "DEAD"}, True),  # same host, its process is gone: at once
        ({"pid_started": "1"}, True),  # same pid number, another process: the pid was reused
        ({"lease_expires_monotonic": 0.0}, True),  # alive but stopped renewing: frozen or hung
        ({"lease_expires_at": 0.0}, False),  # the wall clock jumped: this host reads the monotonic one
        ({"host": "elsewhere", "pid": 1}, False),  # another host within its lease
        ({"host": "elsewhere", "pid": 1, "lease_expires_at": 0.0}, True),  # another host, lease out
        ({"boot_id": "an-earlier-boot"}, True),  # this host rebooted since
    ],
    ids=["alive", "dead-pid", "reused-pid", "lease-expired", "wall-clock-jump", "other-host",
         "other-host-expired", "rebooted"],
)
def test_recovery_relabels_a_run_only_when_its_owner_is_gone(database, owner, recovered):
    if owner.get("pid") == "DEAD":
        owner["pid"] = a_dead_pid()
    left_by(database, "run-1", **owner)
    store = store_of(database)
    store.open()  # the first open recovers
    try:
        assert store.get_run("run-1").status == ("interrupted" if recovered else "running")
        assert store.recovered_runs == int(recovered)
    finally:
        store.close()


def test_a_live_owner_s_run_refuses_a_second_run_on_its_conversation(database):
    left_by(database, "run-1")
    store = store_of(database)
    try:
        with pytest.raises(SophosError) as refused:
            store.start_run("run-2", CONVERSATION)
        assert refused.value.code == SESSION_IN_PROGRESS
        assert [run.id for run in store.list_runs(CONVERSATION)] == ["run-1"]
    finally:
        store.close()


def test_an_outcome_is_not_recorded_for_a_run_another_owner_took_over(database):
    store = store_of(database)
    store.create_conversation(CONVERSATION, "hello")
    store.start_run("run-1", CONVERSATION)
    sql(database, "UPDATE runs SET status = 'interrupted' WHERE id = 'run-1'")  # taken over
    try:
        assert store.finish_run("run-1", "completed", 4) is False
        assert store.get_run("run-1").status == "interrupted"
        assert store.get_conversation(CONVERSATION).message_count == 0
    finally:
        store.close()


def test_single_owner_mode_relabels_every_running_run_as_the_original_did(database):
    left_by(database, "run-1")  # a live owner: this process
    store = store_of(database, single_owner=True)
    try:
        store.list_runs()
        assert store.get_run("run-1").status == "interrupted"
    finally:
        store.close()


def open_and_list(db_path: str, barrier, results) -> None:
    """A process that opens the file as soon as every other one is ready (see below)."""
    store = Blocking(lambda: sqlite_storage(Path(db_path)))
    barrier.wait()
    try:
        store.list_conversations()
        results.put("ok")
    except Exception as error:  # reported to the test, which shows it
        results.put(f"{type(error).__name__}: {error}")
    finally:
        store.close()


@pytest.mark.parametrize("start", ["new", "version-1"])
def test_processes_opening_one_file_at_once_migrate_it_once(tmp_path, start):
    """Four processes open a new (or a version-1) file at the same moment, five times over."""
    import multiprocessing

    spawn = multiprocessing.get_context("fork")  # the children only open SQLite
    outcomes = []
    for trial in range(5):
        db_path = tmp_path / f"{trial}.db"
        if start == "version-1":
            conn = sqlite3.connect(db_path)
            conn.executescript(f"BEGIN; {MIGRATIONS[0]}; PRAGMA user_version = 1; COMMIT;")
            conn.close()
        barrier, results = spawn.Barrier(4), spawn.Queue()
        processes = [spawn.Process(target=open_and_list, args=(str(db_path), barrier, results)) for _ in range(4)]
        for process in processes:
            process.start()
        outcomes += [results.get(timeout=60) for _ in processes]
        for process in processes:
            process.join()
        assert user_version(db_path) == SCHEMA_VERSION
    assert outcomes == ["ok"] * 20

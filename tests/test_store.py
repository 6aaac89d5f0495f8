"""The application tables: migrations, titles, one running run per conversation, lazy recovery."""

import sqlite3

import pytest

from sophos_lab.errors import SCHEMA_TOO_NEW, SESSION_IN_PROGRESS, SophosError
from sophos_lab.inspect import peek_runs
from sophos_lab.store import SCHEMA_VERSION, Store, title_from_message

CONVERSATION = "6f1c7f1e-9a62-4c4e-9a55-0c2b1f0e6a11"


@pytest.fixture
def store(db_path):
    store = Store(db_path)
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


def reopen(path) -> Store:
    """A new Store on the same file, as a newly started process would make."""
    store = Store(path)
    store.conn  # noqa: B018 - the first open migrates and recovers
    return store


# --- opening -------------------------------------------------------------------------------


def test_nothing_is_opened_or_created_before_first_use(db_path):
    store = Store(db_path)
    assert not store.is_open
    assert not db_path.exists()


def test_first_open_applies_the_migrations_and_records_the_version(store, db_path):
    store.list_conversations()
    assert store.is_open
    assert SCHEMA_VERSION == 2
    assert user_version(db_path) == 2
    assert {"conversations", "runs", "owners"} <= tables(db_path)


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

    with pytest.raises(SophosError) as refused:
        Store(db_path).list_conversations()

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
    store = Store(db_path)
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

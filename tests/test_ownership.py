"""Run ownership with two real processes on one database file.

Process A holds a live run: its model stream is paused half-way through the summary by the
scripted model, so the run is `running` for as long as the test wants. Process B is a second
worker on the same database. Nothing here is simulated: two Python processes, one SQLite file
or one PostgreSQL database (each test runs on both), real SIGKILL and SIGSTOP.
"""

import time

import pytest

from sophos_lab.runtime.errors import OWNERSHIP_LOST, SESSION_IN_PROGRESS
from sophos_lab.lab.harness import Lab

SUMMARISE = "Fetch {url} and summarize it in 12 detailed bullet points."


pytestmark = pytest.mark.both_backends


@pytest.fixture
def lab(request, lab_home, database):
    with Lab.setup(f"tests-owner-{request.node.name}", quiet=True, fork_servers=True,
                   database_url=database.get("DATABASE_URL")) as lab:
        yield lab
        assert lab.db_path.exists() != bool(lab.database_url)  # on PostgreSQL, no file at all


def hold_a_run(lab, child) -> str:
    """Start the summary in `child` and hold its answer half-way: a live `running` run."""
    lab.model.arm("summary")
    child.chat(SUMMARISE.format(url=lab.page("wal.html")))
    conversation = child.conversation()
    lab.model.wait_paused()
    return conversation


def on_disk(lab, conversation) -> list[str]:
    return list(lab.peek_runs(conversation)["status"])


def user_messages(lab, conversation) -> list[str]:
    return [m for m, role in zip(lab.messages(conversation)["content"], lab.state(conversation)["roles"]) if role == "user"]


def rows(lab, sql: str, *params) -> list[tuple]:
    return list(lab.sql(sql, *params).itertuples(index=False, name=None))


def saved(lab) -> dict[str, list[tuple]]:
    """Every row of the runs and of LangGraph's tables (PostgreSQL's saver has a third one)."""
    tables = ("checkpoint_writes", "checkpoint_blobs") if lab.database_url else ("writes",)
    return {
        "runs": rows(lab, "SELECT * FROM runs ORDER BY id"),
        "checkpoints": rows(lab, "SELECT checkpoint_id, parent_checkpoint_id FROM checkpoints ORDER BY checkpoint_id"),
        **{table: sorted(map(repr, rows(lab, f"SELECT * FROM {table}"))) for table in tables},
    }


def forks(lab, conversation) -> list[tuple]:
    """Checkpoints of the thread that share a parent: each is a second branch of history."""
    return rows(
        lab,
        "SELECT parent_checkpoint_id, COUNT(*) FROM checkpoints WHERE thread_id = ?"
        " GROUP BY parent_checkpoint_id HAVING COUNT(*) > 1",
        conversation,
    )


def test_a_second_process_leaves_a_live_run_alone_and_is_refused_on_its_conversation(lab):
    with lab.worker() as a, lab.worker() as b:
        conversation = hold_a_run(lab, a)
        b.conversations()  # B's first open: its recovery sweep runs now
        assert b.wait_for("conversations")["data"]["recovered_runs"] == 0
        assert on_disk(lab, conversation) == ["running"]

        b.chat("hi, B here", conversation)
        refused_chat = b.wait_final()
        b.resume(conversation)
        refused_resume = b.wait_final()
        b.chat("hello")  # another conversation: B works as usual
        elsewhere = b.wait_final()

        lab.model.release()
        assert a.wait_final()["data"]["status"] == "completed"
        b.chat("hi, B here", conversation)  # now that A is done
        assert b.wait_final()["data"]["status"] == "completed"

    assert [(e["event"], e["data"]["code"]) for e in (refused_chat, refused_resume)] == [
        ("rejected", SESSION_IN_PROGRESS)] * 2
    assert elsewhere["event"] == "end"
    assert on_disk(lab, conversation) == ["completed", "completed"]
    assert lab.state(conversation)["roles"] == ["user", "assistant", "tool", "assistant", "user", "assistant"]
    assert lab.fetches("wal.html") == 1
    assert forks(lab, conversation) == []


def test_the_original_single_owner_way_loses_the_second_process_s_message(lab):
    """`SOPHOS_LAB_SINGLE_OWNER=1` reproduces the original: B's first open relabels A's live run,
    B's turn is accepted, and A's finish then hides it."""
    original = {"SOPHOS_LAB_SINGLE_OWNER": "1"}
    with lab.worker(**original) as a, lab.worker(**original) as b:
        conversation = hold_a_run(lab, a)
        b.conversations()
        assert b.wait_for("conversations")["data"]["recovered_runs"] == 1
        assert on_disk(lab, conversation) == ["interrupted"]  # while A is alive and working

        b.chat("hi, B here", conversation)
        assert b.wait_final()["data"]["status"] == "completed"
        assert user_messages(lab, conversation)[-1] == "hi, B here"

        lab.model.release()
        assert a.wait_final()["data"]["status"] == "completed"

    assert on_disk(lab, conversation) == ["completed", "completed"]  # A overwrote `interrupted`
    assert lab.state(conversation)["roles"] == ["user", "assistant", "tool", "assistant"]  # 4, not 6
    assert "hi, B here" not in user_messages(lab, conversation)
    assert len(forks(lab, conversation)) == 1  # A's branch and B's share a parent


def test_a_killed_owner_is_recovered_at_once_by_a_process_already_open(lab):
    with lab.worker() as b:
        b.conversations()  # B opened the file while A was not there yet
        with lab.worker() as a:
            conversation = hold_a_run(lab, a)
            assert a.kill() == -9
        lab.model.release()
        b.resume(conversation)  # no lease to wait for: A's pid is gone
        assert b.wait_final()["data"]["status"] == "completed"

    assert on_disk(lab, conversation) == ["interrupted", "completed"]
    assert lab.state(conversation)["roles"] == ["user", "assistant", "tool", "assistant"]
    assert lab.fetches("wal.html") == 1


def test_a_frozen_owner_past_its_lease_is_taken_over_and_writes_nothing_when_it_wakes(lab):
    with lab.worker(SOPHOS_LAB_LEASE_SECONDS="1.5") as a, lab.worker() as b:
        conversation = hold_a_run(lab, a)
        a.freeze()
        [owner] = lab.peek_runs(conversation)["owner_id"]
        [(expires,)] = rows(lab, "SELECT lease_expires_monotonic FROM owners WHERE id = ?", owner)
        # The one wait here is for a deadline the file itself records: A cannot renew while frozen.
        time.sleep(max(0.0, expires - time.monotonic()) + 0.05)

        b.resume(conversation)
        assert b.wait_final()["data"]["status"] == "completed"
        taken_over = saved(lab)

        lab.model.release()  # A's held answer comes through when it wakes
        a.thaw()
        woke = a.wait_final()

    assert (woke["event"], woke["data"]["code"]) == ("chat-error", OWNERSHIP_LOST)
    assert on_disk(lab, conversation) == ["interrupted", "completed"]
    assert saved(lab) == taken_over  # A wrote nothing after it woke
    assert forks(lab, conversation) == []  # exactly one branch of history
    assert lab.state(conversation)["roles"] == ["user", "assistant", "tool", "assistant"]
    assert lab.fetches("wal.html") == 1


def test_a_live_owner_renews_its_lease_and_keeps_its_run_past_the_first_lease(lab):
    with lab.worker(SOPHOS_LAB_LEASE_SECONDS="1.5") as a, lab.worker() as b:
        conversation = hold_a_run(lab, a)
        [owner] = lab.peek_runs(conversation)["owner_id"]
        [(first,)] = rows(lab, "SELECT lease_expires_monotonic FROM owners WHERE id = ?", owner)
        time.sleep(max(0.0, first - time.monotonic()) + 0.05)  # past the lease A started with

        b.resume(conversation)
        refused = b.wait_final()
        [(renewed,)] = rows(lab, "SELECT lease_expires_monotonic FROM owners WHERE id = ?", owner)
        lab.model.release()
        assert a.wait_final()["data"]["status"] == "completed"

    assert (refused["event"], refused["data"]["code"]) == ("rejected", SESSION_IN_PROGRESS)
    assert renewed > first
    assert on_disk(lab, conversation) == ["completed"]

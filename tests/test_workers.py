"""A pool of workers on PostgreSQL: servers that queue, workers that claim, any server streams any run.

Real processes on a real PostgreSQL server: `sophos-lab serve` with `SOPHOS_LAB_RUNS=workers`
(it runs no graph), `sophos-lab worker` (it claims), real SIGKILL, SIGSTOP and SIGTERM. The
barriers are events a server sent, rows, and the scripted model's held stream.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading

import httpx
import pytest

from sophos_lab.lab import postgres_server
from sophos_lab.lab.children import child_environment, sse_events
from sophos_lab.lab.harness import Lab
from sophos_lab.runtime.errors import CANCELLED, CONFIG_ERROR, SESSION_IN_PROGRESS, SophosError
from sophos_lab.runtime.storage import postgres_storage
from sophos_lab.runtime.queue import EventFeed, RemoteRun

SUMMARISE = "Fetch {url} and summarize it in 12 detailed bullet points."
ON_WORKERS = {"SOPHOS_LAB_RUNS": "workers"}


@pytest.fixture
def url(request, postgres, migrated_template):
    url = postgres_server.new_database(postgres.url, request.node.name[:30], template=migrated_template)
    yield url
    postgres_server.drop_database(postgres.url, url)


@pytest.fixture
def lab(request, lab_home, url):
    with Lab.setup(f"tests-workers-{request.node.name}"[:60], quiet=True, fork_servers=True, database_url=url) as lab:
        yield lab


def hold_a_run(lab, server) -> str:
    """Start the summary through `server` and hold the model half-way through it (the fetch
    step done and checkpointed): a live `running` run on a worker. Returns the conversation."""
    lab.model.arm("summary")
    server.chat(SUMMARISE.format(url=lab.page("wal.html")))
    conversation = server.conversation()
    lab.model.wait_paused()
    return conversation


def rows(lab, sql: str, *params) -> list[tuple]:
    return list(lab.sql(sql, *params).itertuples(index=False, name=None))


def runs(lab, conversation: str) -> list[tuple]:
    return rows(lab, "SELECT status, error_code FROM runs WHERE conversation_id = ? ORDER BY seq", conversation)


def follow(server, conversation: str, last_event_id: int | None = None) -> list[dict]:
    """Every frame of the conversation's SSE stream from `server` (pings left out), to its end."""
    headers = {} if last_event_id is None else {"Last-Event-ID": str(last_event_id)}
    with httpx.stream("GET", f"{server.url}/api/chat", params={"conversation": conversation}, headers=headers,
                      timeout=httpx.Timeout(60, read=60)) as response:
        return [event for event in sse_events(response.iter_lines()) if event["event"] != "ping"]


def run_events(events: list[dict]) -> list[tuple]:
    return [(e["id"], e["event"], json.dumps(e["data"], sort_keys=True)) for e in events]


async def test_a_run_accepted_with_no_worker_stays_queued_visible_and_cancellable(lab):
    agent = lab.service(**ON_WORKERS)
    try:
        run = await agent.chat("Hello!")
        assert (run.id, run.last_id) == (run.id, 1)  # `started`, committed with the row
        assert runs(lab, run.conversation) == [("queued", None)]
        assert rows(lab, "SELECT input IS NOT NULL, owner_id FROM runs") == [(True, None)]
        assert [c.status for c in (await agent.list_conversations())] == ["queued"]

        # A second process's recovery leaves it alone: nobody owns it, nothing died.
        other = postgres_storage(lab.database_url)
        assert await other.recover() == 0
        await other.aclose()
        with pytest.raises(SophosError) as busy:
            await agent.chat("Hello again!", run.conversation)
        assert busy.value.code == SESSION_IN_PROGRESS

        final = await agent.cancel(run.conversation)
        assert (final.event, final.data["code"], final.id) == ("chat-error", CANCELLED, 2)
        assert runs(lab, run.conversation) == [("cancelled", CANCELLED)]
        assert lab.model_calls() == 0
    finally:
        await agent.aclose()


class FinalEventDuringTheRead(EventFeed):
    """The feed, with the run's final event committed right after one read that found nothing
    (what a worker's append does when it lands between a follower's read and its next look)."""

    def __init__(self, url: str, finish) -> None:
        super().__init__(url)
        self.finish = finish

    async def read(self, run_id: str, after: int):
        events = await super().read(run_id, after)
        if not events and self.finish is not None:
            self.finish, finish = None, self.finish
            await finish()
        return events


async def test_a_follower_gets_a_final_event_appended_just_after_a_read_that_found_nothing(lab):
    agent = lab.service(**ON_WORKERS)
    try:
        run = await agent.chat("Hello!")  # queued: `started` only
        feed = FinalEventDuringTheRead(lab.database_url, lambda: agent.store.cancel_remote(run.id))

        async def never_looked(_run):
            raise AssertionError("the final event came without a look")

        follower = RemoteRun(run.id, run.conversation, False, feed, never_looked, look_seconds=60, last_id=1)
        got = [event async for event in follower.events(1)]
        assert [(e.id, e.event, e.data["code"]) for e in got] == [(2, "chat-error", CANCELLED)]
        await feed.aclose()
    finally:
        await agent.aclose()


def test_workers_mode_needs_postgresql_and_says_so(lab):
    with pytest.raises(SophosError) as refused:
        lab.service(SOPHOS_LAB_RUNS="workers", DATABASE_URL="")
    assert refused.value.code == CONFIG_ERROR and "DATABASE_URL" in refused.value.message
    with pytest.raises(SophosError) as unknown:
        lab.service(SOPHOS_LAB_RUNS="elsewhere")
    assert unknown.value.code == CONFIG_ERROR and "elsewhere" in unknown.value.message


def test_a_worker_runs_what_a_server_queued_and_another_server_replays_it_exactly(lab):
    a, b = lab.server(**ON_WORKERS), lab.server(**ON_WORKERS)
    worker = lab.pool_worker()
    a.chat(SUMMARISE.format(url=lab.page("wal.html")))
    conversation = a.conversation()
    final = a.wait_final()
    assert final["event"] == "end" and final["data"]["status"] == "completed", final
    seen_by_a = [e for e in a.events() if e.get("id") is not None]

    # Server B never ran anything: it reads the same events, from any id on.
    middle = seen_by_a[len(seen_by_a) // 2]["id"]
    assert run_events(follow(b, conversation, middle)) == run_events([e for e in seen_by_a if e["id"] > middle])
    # A client that has every event, the final one too, gets one end without an id, as from a
    # process whose run has ended: nothing to wait for.
    again = follow(b, conversation, seen_by_a[-1]["id"])
    assert [(e["id"], e["event"], e["data"]["status"]) for e in again] == [(None, "end", "completed")], again
    assert rows(lab, "SELECT owner_id FROM runs") == [(worker.owner,)]
    assert runs(lab, conversation) == [("completed", None)]
    assert lab.state(conversation)["roles"] == ["user", "assistant", "tool", "assistant"]


def test_a_server_killed_mid_answer_leaves_the_run_to_its_worker_and_another_gives_the_missed_events(lab):
    a, b = lab.server(**ON_WORKERS), lab.server(**ON_WORKERS)
    lab.pool_worker()
    conversation = hold_a_run(lab, a)
    a.wait_for("token")
    a.kill()
    seen = [e for e in a.events() if e.get("id") is not None]
    lab.model.release()

    rest = follow(b, conversation, seen[-1]["id"])
    ids = [e["id"] for e in seen + rest]
    assert ids == list(range(1, len(ids) + 1)), ids  # nothing missed, nothing twice
    assert rest[-1]["event"] == "end" and rest[-1]["data"]["status"] == "completed"
    assert runs(lab, conversation) == [("completed", None)]


def test_a_worker_killed_mid_run_is_relabelled_and_resumed_on_another_without_repeating_a_step(lab):
    server = lab.server(**ON_WORKERS, SOPHOS_LAB_LEASE_SECONDS="3")
    first = lab.pool_worker()
    conversation = hold_a_run(lab, server)  # the fetch is done and checkpointed; the summary is half-way
    assert first.kill() == -9
    final = server.wait_final()  # the server's next look finds the worker's pid gone
    assert final["event"] == "end" and final["data"]["status"] == "interrupted", final
    lab.model.release()

    second = lab.pool_worker()
    server.resume(conversation)
    assert server.wait_final()["data"]["status"] == "completed"
    assert runs(lab, conversation) == [("interrupted", None), ("completed", None)]
    assert rows(lab, "SELECT owner_id FROM runs ORDER BY seq") == [(first.owner,), (second.owner,)]
    assert lab.fetches("wal.html") == 1  # the completed fetch step was not run again
    assert lab.state(conversation)["roles"] == ["user", "assistant", "tool", "assistant"]


def test_a_cancel_through_any_server_stops_the_run_on_its_worker(lab):
    a, b = lab.server(**ON_WORKERS), lab.server(**ON_WORKERS)
    lab.pool_worker()
    conversation = hold_a_run(lab, a)
    answer = b.request("POST", f"/api/conversations/{conversation}/cancel")
    lab.model.release()
    assert answer.status_code == 200, answer.text
    assert answer.json()["data"]["code"] == CANCELLED
    assert a.wait_final()["data"]["code"] == CANCELLED
    assert runs(lab, conversation) == [("cancelled", CANCELLED)]
    assert lab.state(conversation)["last_checkpoint"]["next"] == ["agent"]  # the fetch step stays saved


def test_sigterm_drains_a_worker_records_its_run_and_exits_0(lab):
    server = lab.server(**ON_WORKERS)
    worker = lab.pool_worker(SHUTDOWN_TIMEOUT="1")
    conversation = hold_a_run(lab, server)
    assert worker.shutdown() == 0
    lab.model.release()
    final = server.wait_final()
    assert final["event"] == "chat-error" and final["data"]["code"] == "SHUTDOWN", final
    assert runs(lab, conversation) == [("interrupted", "SHUTDOWN")]

    # Queued work waits for the next worker.
    server.chat("Hello!")
    queued = server.conversation()
    assert runs(lab, queued) == [("queued", None)]
    lab.pool_worker()
    assert server.wait_final()["data"]["status"] == "completed"


def test_a_hundred_submissions_across_two_servers_and_two_workers_complete_exactly_once(lab):
    servers = [lab.server(**ON_WORKERS), lab.server(**ON_WORKERS)]
    workers = lab.worker_pool(2, concurrency=4)
    calls_before = lab.model_calls()

    async def submit(client: httpx.AsyncClient, n: int) -> tuple[str, dict]:
        base = servers[n % 2].url
        accepted = (await client.post(f"{base}/api/chat", json={"message": f"Hello! ({n})"})).json()
        follower = servers[(n + 1) % 2].url  # followed through the other server
        async with client.stream("GET", f"{follower}/api/chat", params={"conversation": accepted["conversation"]}) as r:
            frames = [e async for e in _aevents(r) if e["event"] != "ping"]
        return accepted["conversation"], frames[-1]

    async def all_of_them():
        async with httpx.AsyncClient(timeout=httpx.Timeout(120)) as client:
            return await asyncio.gather(*(submit(client, n) for n in range(100)))

    finals = asyncio.run(all_of_them())
    unfinished = [(conversation, final) for conversation, final in finals
                  if final["event"] != "end" or final["data"]["status"] != "completed"]
    assert not unfinished, unfinished
    assert rows(lab, "SELECT count(*) AS runs, count(DISTINCT conversation_id) AS conversations FROM runs WHERE status = 'completed'") == [(100, 100)]
    owners = dict(rows(lab, "SELECT owner_id, count(*) AS runs FROM runs GROUP BY owner_id"))
    assert set(owners) == {w.owner for w in workers} and sum(owners.values()) == 100, owners
    assert lab.model_calls() - calls_before == 100  # each run's one model call, once


async def _aevents(response):
    lines = [line async for line in response.aiter_lines()]
    for event in sse_events(iter(lines)):
        yield event


def test_a_worker_frozen_past_its_lease_is_taken_over_and_writes_nothing_once_a_resume_has_run(lab):
    server = lab.server(**ON_WORKERS, SOPHOS_LAB_LEASE_SECONDS="1.5")
    frozen = lab.pool_worker(SOPHOS_LAB_LEASE_SECONDS="1.5")
    conversation = hold_a_run(lab, server)
    frozen.freeze()
    taken = server.wait_final()  # the server's look finds the lease run out, by the database's clock
    assert (taken["event"], taken["data"]["status"]) == ("end", "interrupted"), taken
    lab.pool_worker()
    server.resume(conversation)
    assert server.wait_final()["data"]["status"] == "completed"
    before = rows(lab, "SELECT run_id, id, event FROM run_events ORDER BY run_id, id"), rows(
        lab, "SELECT checkpoint_id FROM checkpoints ORDER BY 1")

    lab.model.release()
    frozen.thaw()
    assert frozen.shutdown() == 0  # it has tried every write it had: a step, an outcome, events
    assert (rows(lab, "SELECT run_id, id, event FROM run_events ORDER BY run_id, id"), rows(
        lab, "SELECT checkpoint_id FROM checkpoints ORDER BY 1")) == before
    assert runs(lab, conversation) == [("interrupted", None), ("completed", None)]


def test_with_requeue_a_killed_worker_s_run_goes_back_in_the_queue_as_often_as_allowed(lab):
    requeue = {"SOPHOS_LAB_REQUEUE": "1"}
    server = lab.server(**ON_WORKERS, **requeue)
    first = lab.pool_worker(**requeue)
    conversation = hold_a_run(lab, server)
    second = lab.pool_worker(**requeue)
    lab.model.arm("summary")  # the summary held again, on the worker that takes the run next
    assert first.kill() == -9
    lab.model.release()  # the killed worker's stream
    lab.model.wait_paused()  # the run went back in the queue, and the second worker is answering it
    # the steps the first attempt saved (the model's tool call, the fetch) are the run's already
    assert rows(lab, "SELECT status, requeues, owner_id, steps FROM runs") == [("running", 1, second.owner, 2)]

    assert second.kill() == -9  # a second crash: the limit is one, so it stays interrupted
    lab.model.release()
    final = server.wait_final()
    assert (final["event"], final["data"]["status"]) == ("end", "interrupted"), final
    ids = [e["id"] for e in server.events() if e.get("id") is not None]
    assert ids == list(range(1, len(ids) + 1)), ids  # one stream across both workers, none twice
    assert rows(lab, "SELECT status, requeues, steps FROM runs") == [("interrupted", 1, 2)]  # counted once

    lab.pool_worker(**requeue)
    server.resume(conversation)
    assert server.wait_final()["data"]["status"] == "completed"
    assert lab.fetches("wal.html") == 1  # the fetch step, checkpointed before the first kill, ran once
    assert lab.state(conversation)["roles"] == ["user", "assistant", "tool", "assistant"]


def test_worker_pool_says_how_many_runs_the_first_death_relabelled(lab):
    """`sophos-lab worker-pool` relabels a dead worker's runs at once and says how many: 1 for the
    run its first worker died holding (its first look opens the store, whose sweep does the work)."""
    server = lab.server(**ON_WORKERS)
    pool = subprocess.Popen([sys.executable, "-m", "sophos_lab.cli", "worker-pool", "--workers", "1"],
                            env=child_environment(lab.env()), cwd=lab.root, stdout=subprocess.PIPE, text=True)
    lines, ready, relabelled = [], threading.Event(), threading.Event()

    def read() -> None:
        for line in pool.stdout:
            lines.append(line)
            if line.startswith("worker ready"):
                ready.set()
            elif "relabelled" in line:
                relabelled.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(60), lines
        worker_pid = int(lines[0].split("pid=")[1])
        conversation = hold_a_run(lab, server)
        os.kill(worker_pid, signal.SIGKILL)
        assert relabelled.wait(60), lines
        assert f"worker pid {worker_pid} exited (-9); 1 run(s) relabelled" in "".join(lines), lines
        assert runs(lab, conversation) == [("interrupted", None)]
        lab.model.release()
    finally:
        pool.send_signal(signal.SIGTERM)
        assert pool.wait(60) == 0

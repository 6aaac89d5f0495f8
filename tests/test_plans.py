"""A plan: a transaction's statements as one function, which SQLite runs whole in its
connection's thread (one hand-over instead of one a statement) and PostgreSQL as any transaction.

On both backends a plan is all or nothing and sees the acting user; on SQLite a plan that
awaits anything but its statements is refused, before anything of it is committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest

from sophos_lab.runtime import users
from sophos_lab.runtime.settings import Settings
from sophos_lab.runtime.storage import open_storage
from sophos_lab.runtime.storage.connector import Tx

pytestmark = pytest.mark.both_backends


@pytest.fixture
def opened(database):
    """`async with opened() as store:` this test's app tables, open."""
    @contextlib.asynccontextmanager
    async def opening():
        store = open_storage(Settings.from_env(database))
        await store.open()
        try:
            yield store
        finally:
            await store.aclose()
    return opening


async def conversation_ids(store) -> list[str]:
    async with store.reading() as tx:
        return [row[0] for row in await tx.tuples("SELECT id FROM conversations ORDER BY id")]


async def add_conversation(tx: Tx, conversation_id: str, user: str | None = None) -> None:
    await tx.execute("INSERT INTO conversations (id, title, created_at, updated_at, user_id)"
                     " VALUES (:id, 'a plan', '2026-12-04', '2026-12-04', :user)", {"id": conversation_id, "user": user})


async def test_a_plan_commits_its_statements_together(opened):
    async with opened() as storage:
        async def plan(tx: Tx) -> int:
            await add_conversation(tx, "c1")
            await add_conversation(tx, "c2")
            return await tx.value("SELECT count(*) FROM conversations")

        assert await storage.db.transact(plan) == 2
        assert await conversation_ids(storage) == ["c1", "c2"]


async def test_a_plan_that_fails_halfway_writes_nothing(opened):
    async with opened() as storage:
        async def plan(tx: Tx) -> None:
            await add_conversation(tx, "c1")
            raise ValueError("the second statement never comes")

        with pytest.raises(ValueError, match="never comes"):
            await storage.db.transact(plan)
        assert await conversation_ids(storage) == []


async def test_a_plan_sees_the_acting_user_of_its_caller(opened):
    async with opened() as storage:
        async def add(tx: Tx) -> None:
            await tx.execute("INSERT INTO users (id, name, token_hash, created_at) VALUES ('u1', 'ada', 'h', 'now')")
            await add_conversation(tx, "mine", user="u1")
            await add_conversation(tx, "theirs")

        async def visible(tx: Tx) -> list[str]:
            where, params = users.mine()
            return [row[0] for row in await tx.tuples("SELECT c.id FROM conversations c WHERE true" + where, params)]

        await storage.db.transact(add)
        token = users.acting_user.set("u1")
        try:
            assert await storage.db.read(visible) == ["mine"]
        finally:
            users.acting_user.reset(token)
        assert sorted(await storage.db.read(visible)) == ["mine", "theirs"]


@pytest.mark.sqlite_only
async def test_on_sqlite_a_plan_runs_whole_off_the_loop_s_thread(opened):
    async with opened() as storage:
        threads: list[int] = []

        async def plan(tx: Tx) -> None:
            threads.append(threading.get_ident())
            await add_conversation(tx, "c1")
            threads.append(threading.get_ident())

        await storage.db.transact(plan)
        assert len(set(threads)) == 1 and threads[0] != threading.get_ident()


@pytest.mark.sqlite_only
async def test_on_sqlite_a_plan_that_awaits_anything_else_is_refused_and_writes_nothing(opened):
    async with opened() as storage:
        async def plan(tx: Tx) -> None:
            await add_conversation(tx, "c1")
            await asyncio.sleep(0)  # not a statement: it would need the event loop, in another thread

        with pytest.raises(RuntimeError, match="awaited something other than its statements"):
            await storage.db.transact(plan)
        assert await conversation_ids(storage) == []


async def owner_lease_left(agent) -> tuple[float, float]:
    """This process's lease as its owner row holds it: (expiry, seconds left), monotonic clock."""
    async with agent.store.reading() as tx:
        expiry = await tx.value("SELECT lease_expires_monotonic FROM owners WHERE id = :id", {"id": agent.store.owner.id})
    return expiry, expiry - time.monotonic()


async def test_a_run_starts_with_two_thirds_of_its_owner_s_lease_left_and_a_start_just_after_writes_none(open_service):
    """A start writes the lease too only once a third of it is gone (the keeper renews it every
    third while runs are active): a run is accepted with two thirds of a lease left at least, and
    a start a moment after another writes no lease of its own."""
    lease = 6.0
    async with open_service(SOPHOS_LAB_LEASE_SECONDS=str(lease)) as agent:
        run = await agent.chat("hello")
        written, left = await owner_lease_left(agent)
        assert left >= lease * 2 / 3, left
        conversation = (await run.wait()).data["conversation"]
        await (await agent.chat("and again", conversation)).wait()
        assert (await owner_lease_left(agent))[0] == written


@pytest.mark.sqlite_only
async def test_on_sqlite_a_plan_whose_caller_is_cancelled_before_its_commit_writes_nothing(opened):
    async with opened() as storage:
        inside, go_on = threading.Event(), threading.Event()

        async def plan(tx: Tx) -> None:
            await add_conversation(tx, "c1")
            inside.set()
            go_on.wait(30)  # held in the connection's thread, its statement made, not committed

        task = asyncio.ensure_future(storage.db.transact(plan))
        assert await asyncio.to_thread(inside.wait, 30)
        task.cancel()
        asyncio.get_running_loop().call_soon(go_on.set)  # after the task has taken its cancel in
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await conversation_ids(storage) == []


async def test_a_start_after_a_run_that_is_no_longer_the_latest_writes_nothing(opened):
    """A start says which run it read as the conversation's latest (`after`): the carried
    messages and the fold were worked out from it. Once another run came first, or that one
    was relabelled, the start is refused whole and the caller reads again."""
    from sophos_lab.runtime.storage.models import LatestRunChanged

    async with opened() as storage:
        await storage.start_run("first", "talk", [{"id": "m1", "content": "hello"}], title="hello")
        await storage.finish_run("first", "completed", 1)
        read = ("first", "completed")
        await storage.start_run("second", "talk", [{"id": "m2", "content": "from another process"}], after=read)
        await storage.finish_run("second", "cancelled", 2, error_code="CANCELLED")
        with pytest.raises(LatestRunChanged):
            await storage.start_run("third", "talk", [{"id": "m3", "content": "read before the second"}], after=read)
        assert [run.id for run in await storage.list_runs("talk")] == ["first", "second"]
        assert (await storage.get_conversation("talk")).message_count == 2

        await storage.start_run("third", "talk", [{"id": "m3", "content": "read again"}], after=("second", "cancelled"))
        assert [run.status for run in await storage.list_runs("talk")] == ["completed", "cancelled", "running"]



async def test_a_refused_outcome_leaves_the_conversation_and_its_gates_as_they_were(opened):
    """An outcome is written only over a run still `running` under this owner. The transaction
    does not wait for that update's answer before its commit: the conversation's count and the
    gate follow the run's row as the update left it, so a refused one writes none of them."""
    from sophos_lab.runtime.storage.models import Gate

    async def gates(storage) -> list[tuple]:
        async with storage.reading() as tx:
            return await tx.tuples("SELECT id, run_id FROM gates WHERE conversation_id = 'talk'")

    async with opened() as storage:
        await storage.start_run("first", "talk", [{"id": "m1", "content": "hello"}], title="hello")
        assert await storage.finish_run("first", "completed", 2) is True
        recorded = await storage.get_conversation("talk")
        gate = Gate(id="g1", conversation_id="talk", run_id="first", calls=[{"name": "pay"}], created_at="")

        assert await storage.finish_run("first", "completed", 9) is False  # recorded already, the same status
        assert await storage.finish_run("first", "waiting", 7, gate=gate) is False
        now = await storage.get_conversation("talk")
        assert (now.message_count, now.updated_at) == (recorded.message_count, recorded.updated_at) == (2, recorded.updated_at)
        assert await gates(storage) == []
        assert [run.status for run in await storage.list_runs("talk")] == ["completed"]

        await storage.start_run("second", "talk", [{"id": "m2", "content": "pay"}], after=("first", "completed"))
        assert await storage.finish_run("second", "waiting", 4, gate=gate) is True
        assert (await storage.get_conversation("talk")).message_count == 4
        assert await gates(storage) == [("g1", "second")]

async def test_reads_after_a_rolled_back_transaction_find_what_was_there_before(opened):
    """A dry run's transaction is rolled back; the connection it used serves the next reads as
    before (on PostgreSQL, with the statements they prepare on their first use)."""
    async with opened() as storage:
        async with storage.transaction(rollback=True) as tx:
            await add_conversation(tx, "counted, never kept")
        for _ in range(3):
            assert await conversation_ids(storage) == []

"""No call that waits on the database runs on the event loop's thread (issue 34).

Two probes. One watches the loop's own thread through a whole conversation's life (open, chat,
listing, reading, cancel, approval, retention) and fails on any call into a blocking driver
there: SQLite's `sqlite3` (aiosqlite runs it in a thread of its own) or psycopg's synchronous
connection. The other makes the database hold a write up (another connection holds the lock the
write needs) and fails unless the loop goes on serving other tasks meanwhile.
"""

from __future__ import annotations

import asyncio
import sqlite3
import sys
import threading

import pytest

pytestmark = pytest.mark.both_backends

_SYNC_PSYCOPG = ("psycopg/connection.py", "psycopg/cursor.py")
"""The modules of psycopg's synchronous connection and cursor (`Transaction` is in a module it shares)."""


class BlockingCalls:
    """While entered, every call this thread makes into a blocking database driver: `sqlite3`'s
    connections and cursors, psycopg's synchronous connection (a profile hook sees C calls too)."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def _hook(self, frame, event, arg) -> None:
        if event == "c_call":
            owner = getattr(arg, "__self__", None)
            if isinstance(owner, (sqlite3.Connection, sqlite3.Cursor)) or arg is sqlite3.connect:
                self.seen.append(f"sqlite3 {arg.__qualname__}")
        elif event == "call" and (frame.f_code.co_filename.endswith(_SYNC_PSYCOPG)
                                  or frame.f_code.co_qualname.startswith("Transaction.")):
            self.seen.append(f"psycopg {frame.f_code.co_qualname}")

    def __enter__(self) -> BlockingCalls:
        sys.setprofile(self._hook)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)


async def test_a_conversation_s_whole_life_makes_no_blocking_database_call_on_the_loop(open_service, lab):
    async with open_service() as agent:
        with BlockingCalls() as calls:
            await agent.open()
            first = await (await agent.chat(f"Fetch {lab.page('index.html')}")).wait()
            conversation = first.data["conversation"]
            await (await agent.chat("And again?", conversation)).wait()
            await agent.list_conversations()
            await agent.conversation_page(limit=1)
            await agent.get_conversation(conversation)
            await agent.list_runs(conversation)
            await agent.state_history(conversation)
            lab.model.arm("summary")
            held = await agent.chat(f"Fetch {lab.page('wal.html')} and summarize it.")
            await asyncio.to_thread(lab.model.wait_paused)
            cancelled = await agent.cancel(held.conversation)
            lab.model.release()
            await agent.prune_conversation(conversation, keep=1, dry_run=True)
            await agent.prune_conversation(conversation, keep=1)
            await agent.delete_conversation(held.conversation, dry_run=True)
            await agent.delete_conversation(held.conversation)
            await agent.vacuum()
    assert (first.event, cancelled.data.get("code")) == ("end", "CANCELLED")
    assert calls.seen == [], sorted(set(calls.seen))


def hold_the_write_lock(database: dict[str, str], taken: threading.Event, release: threading.Event) -> None:
    """On a connection of its own, take the lock a run's start needs (SQLite's write lock; on
    PostgreSQL the conversations table, against writes), say so, and keep it until `release`."""
    if "DATABASE_URL" in database:
        import psycopg

        with psycopg.connect(database["DATABASE_URL"]) as conn:
            conn.execute("LOCK TABLE conversations IN EXCLUSIVE MODE")
            taken.set()
            release.wait(60)
            conn.rollback()
        return
    conn = sqlite3.connect(database["DATABASE_PATH"], isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        taken.set()
        release.wait(60)
        conn.execute("ROLLBACK")
    finally:
        conn.close()


async def test_the_loop_serves_other_tasks_while_a_write_waits_for_the_database(open_service, database):
    """A run's start waits for a lock another connection holds; meanwhile the loop must turn:
    the holder lets go only once a task of the loop has run 30 times while the start waited. A
    start that waited on the loop's thread would stop it (and then fail, its lock wait spent)."""
    async with open_service() as agent:
        await agent.open()
        taken, release = threading.Event(), threading.Event()
        holder = threading.Thread(target=hold_the_write_lock, args=(database, taken, release))
        holder.start()
        try:
            await asyncio.to_thread(taken.wait, 30)
            start = asyncio.create_task(agent.chat("hello"))
            turns = 0
            while not start.done() and turns < 30:
                await asyncio.sleep(0.01)  # one turn of the loop while the start waits
                turns += 1
            waited = not start.done()
            release.set()
            run = await start
        finally:
            release.set()
            await asyncio.to_thread(holder.join)
        final = await run.wait()
    assert (waited, turns) == (True, 30), "the start did not wait on the lock, or the loop stopped while it did"
    assert (final.event, final.data["status"]) == ("end", "completed")

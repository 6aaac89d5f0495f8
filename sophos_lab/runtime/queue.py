"""A pool of workers on PostgreSQL: the queue of accepted runs, and their events for every server.

With `SOPHOS_LAB_RUNS=workers` the process that accepts a message runs no graph. It commits the
run `queued`, with its input, its idempotency key and its gate decision, and its `started`
event: accepted means committed. A worker (`sophos-lab worker`) claims the next queued run (in
turns across users, oldest first within a turn) with `FOR UPDATE SKIP LOCKED`, so two workers
never take the same one, and runs it as its owner under a lease, as a process runs its own run
(recovery, the fence and the outcome's owner check are unchanged). One active run per
conversation covers `queued` too (the partial unique index `one_active_run_per_conversation`).

Events go through the database, so that any web server streams any run. The worker appends a
run's events to `run_events` (ids per run, as in a process's buffer) and, in the same
transaction, `NOTIFY`s `sophos_events`; every server `LISTEN`s on one connection and reads the
rows from the id its client has. Persist, then notify, holds: the worker publishes a step's
facts only after its checkpoint committed, and a row is in the table before anyone is told.
`run_events` is UNLOGGED: a crash of the database server empties it (what is lost is a replay
of events, never state: the checkpoints, runs and gates are logged tables, and a client that
cannot replay reloads the conversation). The id of a run's latest event is kept in its logged
row too (`runs.last_event_id`, written with each append), so a run that goes on after such a
crash numbers its events after those its followers hold, never from 1 again, and a follower
whose next event was lost is told `REPLAY_GONE` instead of skipping it. It is bounded: a run keeps its latest `EVENT_BUFFER`
events, and a conversation keeps only its latest run's.

A worker that died, or whose lease ran out, cannot write its run's final event: the process that
relabels the run writes it (`storage.postgres_queue.close_events`), in the relabel's transaction, and an owner that
wakes up after that appends nothing more (`append_events` refuses a run that has its final
event, or that is not the writer's).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import psycopg

from . import errors
from .errors import SophosError
from .events import TERMINAL_EVENTS, Event
from .storage.postgres import RECONNECT_SECONDS, SESSION_OPTIONS
from .storage.postgres_queue import EVENTS_CHANNEL, event_row

log = logging.getLogger(__name__)

_TERMINAL = tuple(TERMINAL_EVENTS)
READ_CONNECTIONS = 10
"""A server's connections for reading events: each read is one short query, shared by every follower."""
WRITE_ATTEMPTS = 35
"""A worker's tries at writing a batch of events (about a minute, the waits doubling up to 2 s)."""
STOPPED = "worker stopped"
"""With a stop point (crash and fault tests): the line a worker prints, `after=N published=M`
(`SOPHOS_LAB_STOP_AFTER_EVENT`) or `at=<point>` (`SOPHOS_LAB_STOP_AT`), just before it SIGSTOPs
itself."""


def _decode(row: dict) -> Event:
    return Event(row["id"], row["event"], json.loads(row["data"]))


async def append_events(conn: psycopg.AsyncConnection, owner_id: str, run_id: str, conversation_id: str,
                        events: list[Event], keep: int | None) -> bool:
    """Append a run's events and notify, in one transaction; False (nothing written) when the
    run is not this owner's, has its final event already (another process relabelled it), or is
    not its conversation's latest run any more."""
    async with conn.transaction():
        row = await (await conn.execute(
            "SELECT owner_id, seq = (SELECT max(seq) FROM runs later WHERE later.conversation_id = runs.conversation_id)"
            " AS latest FROM runs WHERE id = %s FOR NO KEY UPDATE", (run_id,))).fetchone()
        ended = await (await conn.execute(
            "SELECT 1 FROM run_events WHERE run_id = %s AND event = ANY(%s) LIMIT 1",
            (run_id, list(_TERMINAL)))).fetchone()
        # Not this owner's, ended by another process (a relabel wrote its final event), or
        # superseded by a newer run (which let this one's events go): nobody follows it here.
        if row is None or row["owner_id"] != owner_id or ended is not None or not row["latest"]:
            return False
        # One statement, not `executemany`: psycopg pipelines that, and a process frozen inside
        # a pipeline leaves its transaction open without the server counting it idle, so
        # `idle_in_transaction_session_timeout` never ends it and its row lock holds a takeover up.
        rows = [event_row(run_id, conversation_id, event) for event in events]
        await conn.execute(
            "INSERT INTO run_events (run_id, id, conversation_id, event, data)"
            " SELECT %s, id, %s, event, data FROM unnest(%s::int[], %s::text[], %s::text[]) AS t(id, event, data)"
            " ON CONFLICT DO NOTHING",
            (run_id, conversation_id, [row["id"] for row in rows], [row["event"] for row in rows],
             [row["data"] for row in rows]))
        await conn.execute("UPDATE runs SET last_event_id = GREATEST(last_event_id, %s) WHERE id = %s",
                           (events[-1].id, run_id))
        if keep is not None:
            await conn.execute("DELETE FROM run_events WHERE run_id = %s AND id <= %s", (run_id, events[-1].id - keep))
        await conn.execute("SELECT pg_notify(%s, %s)", (EVENTS_CHANNEL, f"{run_id} {events[-1].id}"))
    return True


class EventWriter:
    """A worker's runs' events, written in the order they were published: one task takes what
    has gathered and writes each run's share in a transaction of its own."""

    def __init__(self, pool: Any, owner_id: str, keep: int | None, stop_after: int = 0) -> None:
        self._pool, self._owner_id, self._keep = pool, owner_id, keep
        self._queue: asyncio.Queue[tuple[str, str, Event]] = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self._stop_after = stop_after
        """Crash tests (`SOPHOS_LAB_STOP_AFTER_EVENT`): once event `stop_after` of the first run
        is written, SIGSTOP this process before writing any later one (0: never)."""
        self._stop_run: str | None = None
        self._published: dict[str, int] = {}
        """Per run of a stop point, the highest event id added so far: how far its graph got."""

    def add(self, run_id: str, conversation_id: str, event: Event) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._write())
        if self._stop_after:
            self._published[run_id] = max(self._published.get(run_id, 0), event.id)
        self._queue.put_nowait((run_id, conversation_id, event))

    async def flushed(self) -> None:
        """Once every event added so far is written (or refused)."""
        await self._queue.join()

    async def aclose(self) -> None:
        await self.flushed()
        if self._task is not None:
            self._task.cancel()

    async def _write(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            try:
                by_run: dict[tuple[str, str], list[Event]] = {}
                for run_id, conversation_id, event in batch:
                    by_run.setdefault((run_id, conversation_id), []).append(event)
                for (run_id, conversation_id), events in by_run.items():
                    if self._stop_after and self._stop_run in (None, run_id):
                        events = await self._stop_within(run_id, conversation_id, events)
                    if events:
                        await self._append(run_id, conversation_id, events)
            finally:
                for _ in batch:
                    self._queue.task_done()

    async def _stop_within(self, run_id: str, conversation_id: str, events: list[Event]) -> list[Event]:
        """A stop point: write the events up to `stop_after`, say how far the graph had got,
        SIGSTOP; what is left to write once continued (if ever)."""
        self._stop_run = run_id
        if events[-1].id < self._stop_after:
            return events
        head = [event for event in events if event.id <= self._stop_after]
        if head:
            await self._append(run_id, conversation_id, head)
        print(f"{STOPPED} after={self._stop_after} published={self._published[run_id]}", flush=True)
        self._stop_after = 0
        os.kill(os.getpid(), signal.SIGSTOP)
        return events[len(head):]

    async def _append(self, run_id: str, conversation_id: str, events: list[Event]) -> None:
        """Write them, trying again while the database cannot be reached: a gap would cut every
        follower off (`REPLAY_GONE`), and a final event lost would leave them waiting. Given up
        after a minute (the run's own writes will have failed by then, and its record with them)."""
        wait = 0.1
        for attempt in range(1, WRITE_ATTEMPTS + 1):
            try:
                async with self._pool.connection() as conn:
                    if not await append_events(conn, self._owner_id, run_id, conversation_id, events, self._keep):
                        log.warning("run %s is no longer this worker's: %d event(s) not written", run_id, len(events))
                    return
            except psycopg.OperationalError:
                log.warning("could not write %d event(s) of run %s (attempt %d of %d)", len(events), run_id,
                            attempt, WRITE_ATTEMPTS, exc_info=True)
            except Exception:
                log.exception("could not write %d event(s) of run %s", len(events), run_id)
                return
            await asyncio.sleep(wait)  # a backoff, not a barrier
            wait = min(wait * 2, 2.0)


class EventFeed:
    """One `LISTEN` connection per process: wakes whoever follows a run when its events grow."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._waiters: dict[str, asyncio.Event] = {}
        self._task: asyncio.Task | None = None
        self._ready: asyncio.Event | None = None
        self._pool: Any = None
        self._starting = asyncio.Lock()

    async def start(self) -> None:
        async with self._starting:  # two first followers at once must not open two pools
            await self._start()

    async def _start(self) -> None:
        if self._task is None or self._task.done():
            from psycopg.rows import dict_row
            from psycopg_pool import AsyncConnectionPool

            self._ready = asyncio.Event()
            self._pool = AsyncConnectionPool(self.url, min_size=1, max_size=READ_CONNECTIONS, open=False,
                                             reconnect_timeout=RECONNECT_SECONDS, kwargs={
                "autocommit": True, "row_factory": dict_row, "prepare_threshold": None, "options": SESSION_OPTIONS})
            await self._pool.open(wait=True)
            self._task = asyncio.get_running_loop().create_task(self._listen())
        await self._ready.wait()

    async def read(self, run_id: str, after: int) -> list[Event]:
        """The run's kept events with an id above `after`, in order."""
        async with self._pool.connection() as conn:
            rows = await (await conn.execute(
                "SELECT id, event, data FROM run_events WHERE run_id = %s AND id > %s ORDER BY id",
                (run_id, after))).fetchall()
        return [_decode(row) for row in rows]

    async def kept(self, run_id: str) -> tuple[int | None, bool, int]:
        """The id of the run's latest kept event (None: none kept), whether its final event is
        kept, and the id of the latest event it gave (`runs.last_event_id`: kept or not)."""
        async with self._pool.connection() as conn:
            row = await (await conn.execute(
                "SELECT max(id) AS last, coalesce(bool_or(event = ANY(%s)), false) AS ended,"
                " (SELECT last_event_id FROM runs WHERE id = %s) AS given"
                " FROM run_events WHERE run_id = %s", (list(_TERMINAL), run_id, run_id))).fetchone()
        return row["last"], row["ended"], max(row["last"] or 0, row["given"] or 0)

    def waiter(self, run_id: str) -> asyncio.Event:
        """Set by the next notification for the run (take it before reading, then wait on it)."""
        return self._waiters.setdefault(run_id, asyncio.Event())

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._pool is not None:
            await self._pool.close()

    async def _listen(self) -> None:
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(
                        self.url, autocommit=True, options=SESSION_OPTIONS) as conn:
                    await conn.execute(f"LISTEN {EVENTS_CHANNEL}")
                    self._ready.set()
                    self._wake_all()  # anything appended while this was reconnecting
                    async for notice in conn.notifies():
                        waiter = self._waiters.pop(notice.payload.split(" ", 1)[0], None)
                        if waiter is not None:
                            waiter.set()
            except psycopg.OperationalError:
                log.warning("the events' LISTEN connection was lost; connecting again")
                self._wake_all()
                await asyncio.sleep(0.5)

    def _wake_all(self) -> None:
        waiters, self._waiters = self._waiters, {}
        for waiter in waiters.values():
            waiter.set()


@dataclass
class RemoteRun:
    """A run a worker runs, followed from `run_events`: `ActiveRun`'s interface to the SSE route,
    `wait()` and the service's callers, in any process on the database."""

    id: str
    conversation: str
    resume: bool
    feed: EventFeed
    look: Callable[[RemoteRun], Awaitable[None]]
    """Called when no event came for `look_seconds`: recovers the run if its worker is gone,
    which writes the final event its followers wait for."""
    look_seconds: float
    dropped: int = 0
    """Ids 1 to `dropped` are no longer kept (when this was made)."""
    last_id: int = 0
    """The latest id kept when this was made, then the latest one given."""
    replayed: bool = False

    async def events(self, after: int = 0) -> AsyncIterator[Event]:
        """Every kept event with an id above `after`, then new ones as they are appended, up to
        the final event; `REPLAY_GONE` when the next one is no longer kept."""
        await self.feed.start()
        last = after
        while True:
            woken = self.feed.waiter(self.id)  # before reading: a notice after the read wakes it
            try:
                events = await self.feed.read(self.id, last)
                kept = await self.feed.kept(self.id) if not events and last > 0 else None
            except psycopg.OperationalError:  # the pool busy or a connection lost: read again
                log.warning("could not read the events of run %s; reading again", self.id, exc_info=True)
                await asyncio.sleep(0.2)  # a backoff, not a barrier
                continue
            if events and events[0].id != last + 1:
                raise SophosError(errors.REPLAY_GONE, (
                    f"Events {last + 1} to {events[0].id - 1} of run {self.id} are no longer kept (a run "
                    f"keeps its latest events). Reload the conversation, then follow the run again without "
                    "Last-Event-ID: it starts from the oldest event kept."))
            for event in events:
                last = self.last_id = max(self.last_id, event.id)
                yield event
                if event.is_terminal:
                    return
            if events:
                continue
            if kept is not None:
                latest, ended, given = kept
                if latest is not None and latest > last:
                    continue  # appended since the read: read them
                if given != last:
                    # Events after `last` were given and none is kept (the conversation has a newer
                    # run, or a crash of the server emptied the table), or `last` is no id of this run.
                    raise SophosError(errors.REPLAY_GONE, (
                        f"Events after {last} of run {self.id} are not kept (the run gave {given}; the "
                        "conversation has a newer run, or the database server restarted). Reload the "
                        "conversation."))
                if ended:
                    return  # the follower has the final event already: nothing more will come
            try:
                await asyncio.wait_for(woken.wait(), self.look_seconds)
            except TimeoutError:
                try:
                    await self.look(self)
                except Exception:  # a look that failed (a lock timeout, a lost connection) is tried again
                    log.warning("could not look at run %s", self.id, exc_info=True)

    async def wait(self) -> Event:
        """The final event (`end` or `chat-error`)."""
        event = None
        async for event in self.events(max(self.last_id - 1, self.dropped)):
            pass
        return event

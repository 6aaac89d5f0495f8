"""The checkpoint saver the runtime uses: LangGraph's AsyncSqliteSaver (on PostgreSQL its
AsyncPostgresSaver, `storage.postgres`), faster on SQLite, with the runtime's guarantees.

- **One trip a call.** aiosqlite runs a connection's statements in a thread of its own, and
  LangGraph's async saver goes there three to six times a call (the cursor, each statement and
  fetch, the commit, the close; a delta history read one more for each batch of its rows), about
  0.1 ms a trip on two cores: twenty and more a turn. `OneTripSqliteSaver` sends each read and
  write there once, as LangGraph's own synchronous `SqliteSaver` on that connection: the same
  statements, rows and transactions (a checkpoint is serialised in that thread too, under the
  same lock). A write that fails part-way is rolled back.

- **Saved, then told.** After a checkpoint is committed, the saver calls the listener of its
  thread with the checkpoint's metadata, so a run publishes "step N finished" only once step
  N's checkpoint is on disk (see `events.DurableGate`).
- **Fencing.** On its connection, the saver refuses (in the database, inside the insert's own
  transaction) every checkpoint and pending write for a thread on which this owner does not
  hold the `running` run. A process that lost its run to another one, say after being frozen
  past its lease, can then write nothing over the new owner's work.
- **Every commit observable.** `on_write`, when set, is called right after each commit of a
  checkpoint or a task's pending writes, before anything is told: crash tests stop the process
  exactly there (see `DurableWrite`), where no event marks the moment.
- **A write is never cut in half, nor left untold.** A run stopped by cancelling its task
  (`cancel()`, or a shutdown whose drain timed out) may be inside a write: the write goes on to
  its commit (observed and told), then the cancel goes on. On SQLite the write is one function
  in the connection's thread, which a cancel cannot stop part-way; on PostgreSQL it is one
  pipeline. Cut between its INSERT and its commit, a connection would be left inside a write
  transaction that holds the file's write lock.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from langgraph.checkpoint.base import get_checkpoint_metadata
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

FENCED = "SOPHOS_FENCED"
"""The text of the error a fenced write raises (`sqlite3.IntegrityError`)."""

_FENCE = """
CREATE TEMP TRIGGER IF NOT EXISTS sophos_fence_{table} BEFORE INSERT ON main.{table}
WHEN NOT EXISTS (
    SELECT 1 FROM main.runs
    WHERE conversation_id = NEW.thread_id AND status = 'running' AND owner_id = {owner}
)
BEGIN
    SELECT RAISE(ROLLBACK, '{fenced}: this process does not own the running run of the thread');
END
"""


def _quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


@dataclass(frozen=True)
class DurableWrite:
    """One commit the runtime made for a run, in the order it made them.

    `kind` is `run` (the run's row with the messages it carries), `writes` (a task's pending
    writes: `node` and the `channels` it wrote, `__error__` and `__interrupt__` included),
    `checkpoint` (the checkpoint of `step`) or `outcome` (the run's recorded end, `status`).
    """

    kind: str
    conversation: str
    step: int | None = None
    node: str | None = None
    channels: tuple[str, ...] = ()
    status: str | None = None

    def describe(self) -> str:
        if self.kind == "writes":
            return f"writes {self.node} ({', '.join(self.channels)})"
        if self.kind == "checkpoint":
            return f"checkpoint step {self.step}"
        if self.kind == "outcome":
            return f"outcome {self.status}"
        return self.kind


WriteObserver = Callable[[DurableWrite], None]


def _task_node(task_path: str, task_id: str) -> str:
    """The node a task ran, from the path LangGraph gives its writes (`~__pregel_pull, agent`)."""
    return task_path.rsplit(",", 1)[-1].strip() if task_path else task_id


class Notifying:
    """What both backends' savers add to LangGraph's: each commit observed, then told to its
    thread's listener (see the module). Mixed in before the saver class it extends."""

    def _notifying(self, lock: asyncio.Lock | None) -> None:
        if lock is not None:
            self.lock = lock
            """The service's (`AgentService._write`): a write of a run's life (a cancel, an
            outcome) and the saver's writes go one after the other in this process."""
        self.listeners: dict[str, Callable[[dict[str, Any]], None]] = {}
        """thread id → called with a checkpoint's metadata once it is committed."""
        self.on_write: WriteObserver | None = None
        """Called with each commit, before the thread's listener (see `DurableWrite`)."""

    async def release(self) -> None:
        """Let go of what the saver holds of its connections before they are closed (PostgreSQL)."""

    async def _turn(self) -> None:
        """Wait for a write of the run's life under way (a cancel being recorded) before this
        one starts: a run stopped meanwhile stops here, with this write not begun."""
        async with self.lock:
            pass

    async def aput(self, config, checkpoint, metadata, new_versions):
        await self._turn()
        write = asyncio.ensure_future(super().aput(config, checkpoint, metadata, new_versions))
        try:
            saved = await asyncio.shield(write)
        except asyncio.CancelledError:
            await asyncio.wait([write])
            if not write.cancelled() and write.exception() is None:
                self._observe(config, "checkpoint", step=metadata.get("step"))
                self._tell(config, metadata)
            raise
        self._observe(config, "checkpoint", step=metadata.get("step"))
        self._tell(config, metadata)
        return saved

    async def aput_writes(self, config, writes, task_id, task_path=""):
        await self._turn()
        write = asyncio.ensure_future(super().aput_writes(config, writes, task_id, task_path))
        observe = dict(node=_task_node(task_path, task_id), channels=tuple(channel for channel, _ in writes))
        try:
            written = await asyncio.shield(write)
        except asyncio.CancelledError:
            await asyncio.wait([write])
            if not write.cancelled() and write.exception() is None:
                self._observe(config, "writes", **observe)
            raise
        self._observe(config, "writes", **observe)
        return written

    def _observe(self, config: Any, kind: str, **fields: Any) -> None:
        if self.on_write is not None:  # the service's, which never raises
            self.on_write(DurableWrite(kind, str(config["configurable"]["thread_id"]), **fields))

    def _tell(self, config: Any, metadata: dict[str, Any]) -> None:
        listener = self.listeners.get(str(config["configurable"]["thread_id"]))
        if listener is not None:
            listener(get_checkpoint_metadata(config, metadata))  # as stored: with the config's run_id


class _InItsThread(SqliteSaver):
    """LangGraph's synchronous saver on an aiosqlite connection's own `sqlite3` connection, called
    only in that connection's thread. A write commits once all of it went in; one that fails
    part-way is rolled back, so no half of it waits in an open transaction for the next commit."""

    @contextlib.contextmanager
    def cursor(self, transaction: bool = True):
        cur = self.conn.cursor()
        try:
            yield cur
            if transaction:
                self.conn.commit()
        except BaseException:
            if transaction and self.conn.in_transaction:  # a read leaves what it did not begin
                self.conn.rollback()
            raise
        finally:
            cur.close()


class OneTripSqliteSaver(AsyncSqliteSaver):
    """LangGraph's AsyncSqliteSaver with the calls a run makes, each checkpoint and task's writes
    and each read of a checkpoint or a channel's history, in one trip to the connection's thread
    (see the module); the rest (a history listed, a thread deleted) as LangGraph has it."""

    _in_thread: _InItsThread | None = None

    async def _one_trip(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """`SqliteSaver.<method>(*args, **kwargs)` in the connection's thread, in one trip."""
        await self.setup()  # the tables, made by LangGraph's async code (the cursor above never sets up)
        conn = self.conn._conn  # a closed connection raises here, as LangGraph's async saver's first call does
        if self._in_thread is None or self._in_thread.conn is not conn:
            self._in_thread = _InItsThread(conn, serde=self.serde)
            self._in_thread._has_task_path = self._has_task_path
        async with self.lock:  # as LangGraph's: one call at a time on the connection
            return await self.conn._execute(getattr(self._in_thread, method), *args, **kwargs)

    async def aget_tuple(self, config):
        return await self._one_trip("get_tuple", config)

    async def aget_delta_channel_history(self, *, config, channels):
        return await self._one_trip("get_delta_channel_history", config=config, channels=channels)

    async def aput(self, config, checkpoint, metadata, new_versions):
        return await self._one_trip("put", config, checkpoint, metadata, new_versions)

    async def aput_writes(self, config, writes, task_id, task_path=""):
        return await self._one_trip("put_writes", config, writes, task_id, task_path)


class NotifyingSaver(Notifying, OneTripSqliteSaver):
    """The runtime's saver on SQLite: one trip a call, each committed checkpoint reported to its
    thread's listener, fenced (`fence`)."""

    def __init__(self, conn: Any, lock: asyncio.Lock | None = None, **kwargs: Any) -> None:
        super().__init__(conn, **kwargs)
        self._notifying(lock)

    async def fence(self, owner_id: str) -> None:
        """From now on, write only threads whose `running` run `owner_id` holds.

        TEMP triggers live on this connection alone: other processes and readers are untouched.
        """
        await self.setup()
        for table in ("checkpoints", "writes"):
            await self.conn.execute(_FENCE.format(table=table, owner=_quote(owner_id), fenced=FENCED))
        await self.conn.commit()


def is_fenced(error: BaseException) -> bool:
    """Whether `error` (or what caused it) is a write the fence refused."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if FENCED in str(error):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False

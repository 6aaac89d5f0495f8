"""The SQLite backend: the app tables in the one file, through aiosqlite.

aiosqlite runs each connection's statements in a thread of its own, so a statement that waits
(for the file's write lock: `busy_timeout`, up to 5 s) waits there and never on the event loop.
It is the driver LangGraph's own async saver uses on this file, so the kit needs no other. Two
connections: one writes, holding an `asyncio.Lock` for each whole transaction (aiosqlite orders
statements, not transactions), and one reads, so that a read never queues behind a transaction
waiting for the write lock (in WAL mode readers do not wait for the writer).

What differs from PostgreSQL, and only that, is here: the dialect (`rowid` for insertion order,
JSON functions, no row locks: `BEGIN IMMEDIATE` takes the file's), leases on this host's wall
clock, `user_version` migrations, WAL, and SQLite's want of space (`STORAGE_FULL`). The fence is
the saver's (`checkpointer`, TEMP triggers on its own connection).

The read-only helpers at the end are synchronous on purpose: they serve the lab's views, which
open the file read-only in a process of their own and never run on a service's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import json
import sqlite3
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiosqlite

from ..errors import CONFIG_ERROR, SCHEMA_TOO_NEW, STORAGE_FULL, SophosError
from .connector import Conflict, Dialect, Params, Plan, T, Tx
from .sqlite_retention import SqliteRetention
from .sqlite_schema import MIGRATIONS, SCHEMA_VERSION

BUSY_TIMEOUT_MS = 5000

DIALECT = Dialect("sqlite", {
    "seq": "rowid",
    # A conversation's latest run: the last entry of the index on runs(conversation_id), whose
    # implicit rowid suffix is insertion order (clocks step back).
    "latest_run": "LEFT JOIN runs r ON r.rowid = ("
                  "SELECT rowid FROM runs WHERE conversation_id = c.id ORDER BY rowid DESC LIMIT 1)",
    "lease_until": ":wall_expiry",
    "lease_left": "o.lease_expires_at - :wall_now",
    "in_ids": "IN (SELECT value FROM json_each(:ids))",
    "greatest": "max",
    "meta_source": "json_extract(CAST(c.metadata AS TEXT), '$.source')",
    "meta_run_id": "json_extract(CAST(c.metadata AS TEXT), '$.run_id')",
    "for_update": "",
    "for_share": "",
    "skip_locked": "",
}, pyformat=False)


def is_storage_full(error: BaseException) -> bool:
    """Whether SQLite failed for want of space: `SQLITE_FULL` ("database or disk is full"), or
    the shared-memory file of a WAL database that could not be given its size (the first open
    on a full disk, when no other connection has it open: "disk I/O error")."""
    code = getattr(error, "sqlite_errorcode", None)
    return isinstance(error, sqlite3.Error) and code is not None and (
        code & 0xFF == sqlite3.SQLITE_FULL or code == sqlite3.SQLITE_IOERR_SHMSIZE)


def storage_full(path: str | Path, error: BaseException) -> SophosError:
    """The `STORAGE_FULL` refusal for a write (or an open) that SQLite could not make for want of
    space. SQLite undid it whole, so nothing of the request is on disk."""
    return SophosError(STORAGE_FULL, (
        f"The disk that holds {path} is full (SQLite: {error}). Nothing was accepted: nothing of "
        "this request was written, and what was stored before is intact. Free some space on that "
        "disk and try again."))


@contextlib.contextmanager
def full_disk_refused(path: str | Path) -> Iterator[None]:
    """Turn SQLite's want of space, inside the block, into `STORAGE_FULL` (see `storage_full`)."""
    try:
        yield
    except sqlite3.Error as error:
        if is_storage_full(error):
            raise storage_full(path, error) from error
        raise


def too_new(path: Path, version: int) -> SophosError:
    return SophosError(SCHEMA_TOO_NEW, (
        f"{path} has schema version {version}, but this sophos_lab knows versions up to "
        f"{SCHEMA_VERSION}. Upgrade sophos_lab or point DATABASE_PATH at another file; the file was not changed."))


class SqliteTx(Tx):
    """Statements on one aiosqlite connection; a list parameter goes as JSON (`{in_ids}`)."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.dialect = DIALECT

    async def _run(self, fetch: bool, sql: str, params: Params) -> Any:
        """The statement's rows (`fetch`), else how many rows it changed: one trip to the
        connection's thread, where each costs about 0.1 ms of hand-over."""
        return await self.conn._execute(_in_its_thread, self.conn, fetch, sql, params)

    async def execute(self, sql: str, params: Params = None) -> int:
        return await self._run(False, sql, params)

    async def rows(self, sql: str, params: Params = None) -> list[dict[str, Any]]:
        return [dict(zip(row.names, row)) for row in await self._run(True, sql, params)]

    async def tuples(self, sql: str, params: Params = None) -> list[tuple]:
        return await self._run(True, sql, params)

    async def has_table(self, name: str) -> bool:
        return await self.value("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = :name",
                                {"name": name}) is not None


class _ThreadTx(SqliteTx):
    """The same statements on the `sqlite3` connection itself, in its own thread: what a `Plan`
    is given there (its awaits never suspend)."""

    async def _run(self, fetch: bool, sql: str, params: Params) -> Any:
        return _statement(self.conn, fetch, sql, params)


def _in_its_thread(conn: aiosqlite.Connection, fetch: bool, sql: str, params: Params) -> Any:
    return _statement(conn._conn, fetch, sql, params)


def _statement(conn: sqlite3.Connection, fetch: bool, sql: str, params: Params) -> Any:
    """Run one statement to its end: a statement left with rows unread (a `PRAGMA`'s, a
    `SELECT ... FOR UPDATE`'s) would keep the transaction from committing."""
    with _conflicts():
        cursor = conn.execute(DIALECT.prepare(sql), _values(params))
        try:
            return cursor.fetchall() if fetch else cursor.rowcount
        finally:
            cursor.close()


def _values(params: Params) -> dict[str, Any]:
    return {name: json.dumps(list(value)) if isinstance(value, (list, tuple, set, frozenset)) else value
            for name, value in (params or {}).items()}


@contextlib.contextmanager
def _conflicts() -> Iterator[None]:
    """A unique constraint the rules decide by, as the neutral `Conflict`."""
    try:
        yield
    except sqlite3.IntegrityError as error:
        if "idempotency_keys.key" in str(error):
            raise Conflict("idempotency_key", error) from error
        if "one_running_run_per_conversation" in str(error) or "runs.conversation_id" in str(error):
            raise Conflict("active_run", error) from error
        raise


def _drive(plan: Plan[T], tx: Tx) -> T:
    """Run `plan` to its end here, in the connection's thread: each of its awaits is a statement
    that returns at once, so the coroutine never suspends; one that does awaited something else."""
    coroutine = plan(tx)
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("a plan awaited something other than its statements")


def _in_transaction(conn: aiosqlite.Connection, plan: Plan[T], cancelled: threading.Event) -> T:
    """`plan` in one write transaction, in the connection's thread; rolled back instead of
    committed if its caller was cancelled meanwhile."""
    raw = conn._conn
    raw.execute("BEGIN IMMEDIATE")
    try:
        result = _drive(plan, _ThreadTx(raw))
        raw.execute("ROLLBACK" if cancelled.is_set() else "COMMIT")
    except BaseException:
        if raw.in_transaction:  # SQLite may have rolled it back already (SQLITE_FULL)
            raw.execute("ROLLBACK")
        raise
    return result


def _reading(conn: aiosqlite.Connection, plan: Plan[T]) -> T:
    return _drive(plan, _ThreadTx(conn._conn))


class SqliteConnector:
    """The app tables of one SQLite file (see the module). Nothing is opened until `open()`."""

    dialect = DIALECT

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.where = str(self.path)
        self._writer: aiosqlite.Connection | None = None
        self._reader: aiosqlite.Connection | None = None
        self._writing = asyncio.Lock()
        self.retention = SqliteRetention(self)

    async def open(self) -> None:
        """Connect, switch to WAL and apply the missing migrations; a file whose schema is newer
        than this code is refused before anything is written to it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with full_disk_refused(self.path):  # SQLite cannot even size its shared memory on a full disk
            writer = await _connect(self.path)
            try:
                version = await SqliteTx(writer).value("PRAGMA user_version")
                if version > SCHEMA_VERSION:
                    raise too_new(self.path, version)
                await _use_wal(writer)
                # In WAL mode NORMAL keeps every commit across a process crash (kill -9 included)
                # and saves an fsync per commit (3 ms here); only a power loss can lose the last
                # run rows, and the checkpoints, written by the saver's own connection, keep FULL.
                await writer.execute("PRAGMA synchronous = NORMAL")
                if version < SCHEMA_VERSION:
                    await _migrate(writer)  # with foreign keys off (a new connection's default): see v7
                await writer.execute("PRAGMA foreign_keys = ON")
                self._reader = await _connect(self.path)
            except BaseException:
                await writer.close()
                raise
        self._writer = writer

    async def aclose(self) -> None:
        writer, reader, self._writer, self._reader = self._writer, self._reader, None, None
        for conn in (reader, writer):
            if conn is not None:
                with contextlib.suppress(sqlite3.Error, ValueError):
                    await conn.close()

    @contextlib.asynccontextmanager
    async def transaction(self, rollback: bool = False) -> AsyncIterator[Tx]:
        """One write transaction (`BEGIN IMMEDIATE`), committed when the block ends (rolled back
        with `rollback`) and rolled back when it (or the commit) raises. On a full disk it raises
        `STORAGE_FULL`, with nothing of the transaction written: SQLite undoes it whole (often by itself)."""
        async with self._writing:
            writer = self._writer
            with full_disk_refused(self.path):
                await writer.execute("BEGIN IMMEDIATE")
                try:
                    yield SqliteTx(writer)
                    await writer.execute("ROLLBACK" if rollback else "COMMIT")
                except BaseException:
                    if writer.in_transaction:  # SQLite may have rolled it back already (SQLITE_FULL)
                        await writer.execute("ROLLBACK")
                    raise

    @contextlib.asynccontextmanager
    async def reading(self) -> AsyncIterator[Tx]:
        with full_disk_refused(self.path):
            yield SqliteTx(self._reader)

    # aiosqlite runs each call it is given in the connection's thread (`_execute`, which every
    # one of its own methods goes through); a plan goes there whole, with the caller's context
    # (the acting user), instead of one hand-over a statement.

    async def transact(self, plan: Plan[T]) -> T:
        """`plan` in one write transaction (see `transaction`), in one hand-over. A cancel of the
        caller rolls it back, unless its `COMMIT` has begun: the caller cannot tell which, and
        the write lock is held until the thread is done with it."""
        context, cancelled = contextvars.copy_context(), threading.Event()
        async with self._writing:
            with full_disk_refused(self.path):
                work = asyncio.ensure_future(
                    self._writer._execute(context.run, _in_transaction, self._writer, plan, cancelled))
                try:
                    return await asyncio.shield(work)
                except asyncio.CancelledError:
                    cancelled.set()
                    await asyncio.wait([work])
                    raise

    async def read(self, plan: Plan[T]) -> T:
        """`plan`'s reads, in one hand-over to the read connection's thread."""
        context = contextvars.copy_context()
        with full_disk_refused(self.path):
            return await self._reader._execute(context.run, _reading, self._reader, plan)

    @contextlib.asynccontextmanager
    async def read_only(self) -> AsyncIterator[Tx | None]:
        """A connection of its own that only reads, never writes (not even an owner row): None
        when there is no file (nothing is created). For retention's refusals and dry runs."""
        if not self.path.exists():
            yield None
            return
        with full_disk_refused(self.path):
            conn = await aiosqlite.connect(f"{self.path.absolute().as_uri()}?mode=ro", uri=True)
            conn.row_factory = _named_row
            try:
                tx = SqliteTx(conn)
                if (version := await tx.value("PRAGMA user_version")) > SCHEMA_VERSION:
                    raise too_new(self.path, version)
                yield tx
            finally:
                await conn.close()

    @contextlib.asynccontextmanager
    async def outside_transaction(self) -> AsyncIterator[Tx]:
        """The writing connection outside any transaction, held (`VACUUM`, the WAL checkpoint)."""
        async with self._writing:
            with full_disk_refused(self.path):
                yield SqliteTx(self._writer)

    @contextlib.asynccontextmanager
    async def thread_reader(self) -> AsyncIterator[Any]:
        """The kit's SQLite saver (`checkpointer.OneTripSqliteSaver`: LangGraph's, one trip to the
        connection's thread a read), reading through the read connection (never writing)."""
        from ..checkpointer import OneTripSqliteSaver

        saver = OneTripSqliteSaver(self._reader)
        saver.is_setup = True  # the tables exist (or nothing reads them); setup() would write
        with full_disk_refused(self.path):
            yield saver

    # what only PostgreSQL does: a pool of workers

    async def requeue(self, tx: Tx, run_ids: list[str], limit: int) -> set[str]:
        return set()

    async def close_events(self, tx: Tx, runs: list[dict[str, Any]]) -> None:
        return None


class NamedRow(tuple):
    """A row as the tuple LangGraph's saver reads (it shares the read connection), which also
    carries its column names for `SqliteTx.rows`: a subclass per set of names, so a row costs
    no more than a tuple."""

    __slots__ = ()
    names: tuple[str, ...] = ()


@functools.lru_cache(maxsize=256)
def _row_class(names: tuple[str, ...]) -> type[NamedRow]:
    return type("NamedRow", (NamedRow,), {"__slots__": (), "names": names})


_last = threading.local()  # each connection's thread: its statement's description, and its row class


def _named_row(cursor: sqlite3.Cursor, row: tuple) -> NamedRow:
    description = cursor.description  # the same object for every row of a statement
    if getattr(_last, "description", None) is not description:
        _last.description, _last.row_class = description, _row_class(tuple(column[0] for column in description))
    return _last.row_class(row)


async def _connect(path: Path) -> aiosqlite.Connection:
    conn = await aiosqlite.connect(path, isolation_level=None)
    conn.row_factory = _named_row
    await conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    return conn


async def _use_wal(conn: aiosqlite.Connection, attempts: int = 100) -> None:
    """Switch the file to WAL. On a new file several processes may try at once, and SQLite
    answers a switch that meets another connection with SQLITE_BUSY without waiting for it."""
    for attempt in range(attempts):
        try:
            await conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as error:
            if "locked" not in str(error) or attempt == attempts - 1:
                raise
            await asyncio.sleep(0.01)  # a backoff between tries, not a barrier


async def _migrate(conn: aiosqlite.Connection) -> None:
    """Apply the missing migrations in one write transaction.

    The version is read again under the write lock: several processes may open an old (or a
    new, empty) file at the same moment, and only the first one may migrate it.
    """
    tx = SqliteTx(conn)
    await conn.execute("BEGIN IMMEDIATE")
    try:
        broken_before = set(await tx.tuples("PRAGMA foreign_key_check"))
        for number in range(await tx.value("PRAGMA user_version") + 1, SCHEMA_VERSION + 1):
            for statement in MIGRATIONS[number - 1].split(";"):
                if statement.strip():
                    await conn.execute(statement)
            await conn.execute(f"PRAGMA user_version = {number}")
        # Only what the migrations broke: a file may hold dangling rows written with foreign keys off.
        broken = [row for row in await tx.tuples("PRAGMA foreign_key_check") if row not in broken_before]
        if broken:
            raise SophosError(CONFIG_ERROR, (
                f"Upgrading the file's schema would break {len(broken)} references ({broken[:3]}); the "
                "file was not changed."))
    except BaseException:
        await conn.execute("ROLLBACK")
        raise
    await conn.execute("COMMIT")


# --- read-only, for the lab's views (synchronous: see the module) -------------------------


def schema_version(conn: sqlite3.Connection) -> int:
    return conn.execute("PRAGMA user_version").fetchone()[0]


def has_table(conn: sqlite3.Connection, name: str) -> bool:
    return conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)).fetchone() is not None


@contextlib.contextmanager
def read_only(path: str | Path) -> Iterator[sqlite3.Connection | None]:
    """A read-only connection to the file (None when it does not exist): it never writes."""
    path = Path(path)
    if not path.exists():
        yield None
        return
    conn = sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True, check_same_thread=False)
    try:
        with full_disk_refused(path):  # SQLite cannot even size its shared memory on a full disk
            version = schema_version(conn)
            if version > SCHEMA_VERSION:
                raise SophosError(SCHEMA_TOO_NEW, (
                    f"{path} has schema version {version}, but this sophos_lab knows versions up to "
                    f"{SCHEMA_VERSION}; the file was not changed."))
            yield conn
    finally:
        conn.close()


def shown_message_count(path: str | Path, conversation_id: str) -> int | None:
    """What `get_conversation(conversation_id)` counts (`counting`), read once through a
    read-only connection to the file; None when there is no thread to read (no file, or no
    checkpoint tables yet). For a view of a file no process has recovered yet."""
    from langgraph.checkpoint.sqlite import SqliteSaver

    from ..agent import build_graph
    from ..counting import snapshot_count

    with read_only(path) as conn:
        if conn is None or not has_table(conn, "checkpoints") or not has_table(conn, "runs"):
            return None
        conn.row_factory = sqlite3.Row
        latest = conn.execute(
            "SELECT * FROM runs WHERE conversation_id = ? ORDER BY rowid DESC LIMIT 1", (conversation_id,),
        ).fetchone()
        conn.row_factory = None  # the saver reads tuples
        saver = SqliteSaver(conn)
        saver.is_setup = True  # the tables exist; setup() would try to write
        snapshot = build_graph(None, saver).get_state({"configurable": {"thread_id": conversation_id}})
        has_input = latest is not None and "input" in latest.keys()
        return snapshot_count(snapshot, (latest["id"], latest["input"]) if has_input else None)

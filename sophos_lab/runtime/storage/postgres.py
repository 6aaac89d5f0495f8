"""The PostgreSQL backend (`DATABASE_URL`): the same tables and rules as the SQLite file, on
psycopg's async connections; the checkpoints through LangGraph's own `AsyncPostgresSaver`.

What differs from SQLite, and only that, is here and in `postgres_schema` and `postgres_queue`:

- **Migrations once.** Every process that opens the database takes one session-level advisory
  lock, then applies LangGraph's saver migrations and the kit's (`sophos_migrations`, one row per
  version) and lets go: processes that start together migrate one after the other, and only the
  first one finds anything to do.
- **Leases on the database's clock.** `owners.lease_expires_at` is `now()` plus the lease, and
  is read against `now()`: hosts whose clocks disagree still agree on who is gone. On one host
  and boot, as in SQLite, a dead pid is gone at once.
- **Row locks** where SQLite's write transaction holds the whole file (`FOR UPDATE`, `FOR SHARE`,
  `SKIP LOCKED`), and insertion order from an identity column (`seq`) where SQLite reads `rowid`.
- **The fence, in the saver's own transaction.** Each connection of this process's saver pool
  carries its owner in a session setting (`sophos.owner_id`); a trigger on LangGraph's three
  tables refuses a row for a thread whose `running` run that owner does not hold, and locks
  that run's row (`FOR SHARE`) until the insert commits, so a takeover waits for a write that
  got in first and refuses every one after. A connection without the setting (the app tables',
  a read-only view, a plain saver) is not fenced, as a connection without SQLite's TEMP triggers is not.
- **One transaction per saver write: LangGraph's own pipeline.** The saver sends each write's
  statements as one pipeline with no `BEGIN`, and PostgreSQL runs the statements up to a
  pipeline's sync as one transaction: a write is all or nothing, in one round trip
  (`tests/test_postgres.py` makes a write's last statement fail). The saver's calls, one at a
  time (they hold the service's write lock), keep one connection of its pool between them, and
  look at its socket, not an empty query, before each: one the server hung up on goes back to
  the pool, which lends another (a worker's event writer takes the pool's others).

The app tables' connections are kept for reuse, a few at a time, and each is looked at before
use: one the server hung up on (a restart) is replaced, and one that cannot be made is
`DATABASE_UNAVAILABLE` at once, so a request while the server is down is answered, not held.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import psycopg
from psycopg.rows import dict_row, tuple_row

from ..checkpointer import Notifying
from ..errors import CONFIG_ERROR, DATABASE_UNAVAILABLE, SCHEMA_TOO_NEW, STORAGE_FULL, SophosError
from . import postgres_queue
from .connector import Conflict, Dialect, Params, Plan, Sent, T, Tx
from .postgres_retention import PostgresRetention
from .postgres_schema import MIGRATION_LOCK, MIGRATIONS, SCHEMA_VERSION

SESSION_OPTIONS = "-c lock_timeout=5000 -c idle_in_transaction_session_timeout=15000"
"""Every connection of the kit: a statement waits at most 5 s for a row lock (SQLite's busy
timeout), and a transaction left open for 15 s by a frozen or cut-off process is ended by the
server, its locks with it (the default lease is 15 s), instead of holding other processes up."""
PREPARE_THRESHOLD = 0
"""Every statement prepared on its first use, as LangGraph's own saver connects: the server
parses and plans each of the few statements a run sends once a connection, not each time
(6 % of a turn on PostgreSQL, `make bench`)."""

RECONNECT_SECONDS = 5.0
"""How long a pool keeps trying, with waits doubling from 1 s, to open a connection it lost,
before it gives that attempt up (psycopg_pool's `reconnect_timeout`, 5 minutes by default). The
next request that needs a connection starts a new attempt, from a 1 s wait again: once the
database is back after a restart, a pool serves within about 2 s, however long it was down."""

IDLE_CONNECTIONS = 4
"""How many app-table connections a process keeps open between uses."""

DIALECT = Dialect("postgres", {
    "seq": "seq",
    "latest_run": "LEFT JOIN LATERAL (SELECT * FROM runs WHERE conversation_id = c.id ORDER BY seq DESC LIMIT 1)"
                  " r ON true",
    "lease_until": "now() + make_interval(secs => :lease_seconds)",
    # What the database's clock leaves of the lease: it runs out here exactly when it does there.
    "lease_left": "EXTRACT(EPOCH FROM o.lease_expires_at - now())::float8",
    "in_ids": "= ANY(:ids)",
    "greatest": "GREATEST",
    "meta_source": "c.metadata->>'source'",
    "meta_run_id": "c.metadata->>'run_id'",
    "for_update": " FOR UPDATE",
    "for_share": " FOR SHARE",
    "skip_locked": " FOR UPDATE SKIP LOCKED",
}, pyformat=True)

_CONSTRAINTS = {"idempotency_keys_pkey": "idempotency_key", "one_active_run_per_conversation": "active_run"}


@contextlib.contextmanager
def _conflicts() -> Iterator[None]:
    """A unique constraint the rules decide by, as the neutral `Conflict`."""
    try:
        yield
    except psycopg.errors.UniqueViolation as error:
        if (what := _CONSTRAINTS.get(error.diag.constraint_name)) is not None:
            raise Conflict(what, error) from error
        raise


def is_postgres_url(url: str | None) -> bool:
    return bool(url) and url.split(":", 1)[0] in ("postgres", "postgresql")


class PostgresTx(Tx):
    """Statements on one psycopg async connection (dict rows; `tuples` by position). Inside a
    transaction they go as a pipeline: a statement whose result is read waits for it (and for
    those sent before it), one that is only `send` does not."""

    def __init__(self, conn: psycopg.AsyncConnection, pipeline: psycopg.AsyncPipeline | None = None) -> None:
        self.conn = conn
        self.pipeline = pipeline
        self.dialect = DIALECT

    async def _cursor(self, sql: str, params: Params, row_factory: Any = dict_row) -> psycopg.AsyncCursor:
        cursor = self.conn.cursor(row_factory=row_factory)
        with _conflicts():
            await cursor.execute(DIALECT.prepare(sql), params or {})
            if self.pipeline is not None:
                await self.pipeline.sync()  # its result is read: not a commit, the transaction goes on
        return cursor

    async def send(self, sql: str, params: Params = None) -> None:
        if self.pipeline is None:
            await self.execute(sql, params)
            return
        with _conflicts():
            await self.conn.cursor().execute(DIALECT.prepare(sql), params or {})

    async def counted(self, sql: str, params: Params = None) -> Sent:
        if self.pipeline is None:
            return await super().counted(sql, params)
        cursor = self.conn.cursor()
        with _conflicts():
            await cursor.execute(DIALECT.prepare(sql), params or {})
        return Sent(lambda: cursor.rowcount)  # known once the pipeline has synced: at the COMMIT

    async def execute(self, sql: str, params: Params = None) -> int:
        return (await self._cursor(sql, params)).rowcount

    async def rows(self, sql: str, params: Params = None) -> list[dict[str, Any]]:
        return await (await self._cursor(sql, params)).fetchall()

    async def tuples(self, sql: str, params: Params = None) -> list[tuple]:
        return await (await self._cursor(sql, params, tuple_row)).fetchall()

    async def has_table(self, name: str) -> bool:
        return await self.value("SELECT to_regclass(:name) IS NOT NULL", {"name": name})


class PostgresConnector:
    """The app tables of one PostgreSQL database (see the module). Nothing is opened until `open()`."""

    dialect = DIALECT

    def __init__(self, url: str) -> None:
        self.url = url
        self.where = "the database at DATABASE_URL"
        self._idle: list[psycopg.AsyncConnection] = []
        self.retention = PostgresRetention(self)

    async def open(self) -> None:
        """Connect and migrate (LangGraph's saver tables, then the kit's), under the migration lock."""
        async with self.connection() as conn:
            await _take_migration_lock(conn)
            try:
                await _migrate(conn)
            finally:
                await conn.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK,))

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            with contextlib.suppress(psycopg.Error):
                await conn.close()

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[psycopg.AsyncConnection]:
        """A connection of the app tables: an idle one the server has not hung up on, else a new
        one (`DATABASE_UNAVAILABLE` at once when the server cannot be reached). Back to the idle
        ones after use if it is as it was given, else closed."""
        conn = None
        while self._idle and conn is None:
            candidate = self._idle.pop()
            if _usable(candidate):
                conn = candidate
            else:
                with contextlib.suppress(psycopg.Error):
                    await candidate.close()
        if conn is None:
            conn = await connect(self.url)
        try:
            yield conn
        finally:
            if _usable(conn) and len(self._idle) < IDLE_CONNECTIONS:
                self._idle.append(conn)
            else:
                with contextlib.suppress(psycopg.Error):
                    await conn.close()

    @contextlib.asynccontextmanager
    async def transaction(self, rollback: bool = False) -> AsyncIterator[Tx]:
        """One transaction, committed when the block ends (rolled back with `rollback`), rolled
        back when it raises. Pipelined (see `PostgresTx`): the statements sent without waiting
        go with the next one waited for, or with the `COMMIT`."""
        async with self.connection() as conn:
            try:
                with _conflicts():  # a statement sent without waiting is refused at the commit
                    try:
                        # BEGIN and COMMIT as statements of the pipeline: psycopg's own transaction
                        # block there waits for a sync of its own at the end, one round trip more.
                        async with conn.pipeline() as pipeline:
                            await conn.execute("BEGIN", prepare=False)
                            yield PostgresTx(conn, pipeline)
                            if not rollback:
                                await conn.execute("COMMIT", prepare=False)
                    except BaseException:
                        await _roll_back(conn)
                        raise
                    if rollback:  # counted, nothing changed
                        await _roll_back(conn)
            except psycopg.errors.DiskFull as error:
                raise SophosError(STORAGE_FULL, f"The database server has no space left: {error}".strip()) from error

    @contextlib.asynccontextmanager
    async def reading(self) -> AsyncIterator[Tx]:
        async with self.connection() as conn:
            yield PostgresTx(conn)

    async def transact(self, plan: Plan[T]) -> T:
        """`plan` in one transaction (see `transaction`), pipelined."""
        async with self.transaction() as tx:
            return await plan(tx)

    async def read(self, plan: Plan[T]) -> T:
        async with self.reading() as tx:
            return await plan(tx)

    @contextlib.asynccontextmanager
    async def thread_reader(self) -> AsyncIterator[Any]:
        """LangGraph's own async saver, reading through an app-table connection (not fenced)."""
        from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

        async with self.connection() as conn:
            yield AsyncPostgresSaver(conn)

    # a pool of workers (see `queue`): its SQL runs inside these transactions

    async def requeue(self, tx: Tx, run_ids: list[str], limit: int) -> set[str]:
        return await postgres_queue.requeue(tx, run_ids, limit)

    async def close_events(self, tx: Tx, runs: list[dict[str, Any]]) -> None:
        await postgres_queue.close_events(tx, runs)


async def connect(url: str, **options: Any) -> psycopg.AsyncConnection:
    """Autocommit (a statement outside a transaction is its own, as in SQLite's autocommit
    mode), dict rows (LangGraph's savers need them), statements prepared on first use
    (`PREPARE_THRESHOLD`); a server that cannot be reached is `DATABASE_UNAVAILABLE` (it may be
    restarting: the next call connects again)."""
    session = f"{SESSION_OPTIONS} {options.pop('options', '')}".strip()
    try:
        return await psycopg.AsyncConnection.connect(url, autocommit=True, row_factory=dict_row,
                                                     prepare_threshold=PREPARE_THRESHOLD, options=session, **options)
    except psycopg.OperationalError as error:
        raise SophosError(DATABASE_UNAVAILABLE, f"Cannot reach the database at DATABASE_URL: {error}".strip()) from error


async def _roll_back(conn: psycopg.AsyncConnection) -> None:
    """End the transaction a failed or cancelled block left open (a refused statement leaves it
    aborted), so the connection can be lent again; one that cannot is closed by `connection`.

    Through psycopg's `rollback`, never a `ROLLBACK` statement: psycopg forgets its prepared
    statements at any rollback (what they name may have gone with it), and `rollback` drops them
    on the server at once, where after a statement that drop would wait for the next one, which
    may be a read that prepares its own statement first and then loses it."""
    if not (conn.closed or conn.broken):
        with contextlib.suppress(psycopg.Error):
            await conn.rollback()


def _usable(conn: psycopg.AsyncConnection) -> bool:
    """Open, idle, and not hung up on (a restart, `pg_terminate_backend`): the server then has
    something to say (its last words, or the end of the stream) while no query is out. Seen
    before use, the next call connects again instead of failing once on a dead socket."""
    if conn.closed or conn.broken or conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        return False
    try:
        poller = select.poll()  # not select(): it refuses a descriptor past 1023, a busy server's
        poller.register(conn.fileno(), select.POLLIN)
        return not poller.poll(0)
    except (OSError, ValueError):
        return False


async def _check_usable(conn: psycopg.AsyncConnection) -> None:
    """psycopg_pool's check before it lends a connection, without the round trip of its own
    (`check_connection`, an empty query: eight a turn): one the server hung up on is closed
    and refused, and the pool lends another or connects again. (Closed first: libpq has not
    read the hang-up yet, and the pool would take back a connection it still thinks good.)"""
    if not _usable(conn):
        await conn.close()
        raise psycopg.OperationalError("the server closed the connection")


async def _schema_version(conn: psycopg.AsyncConnection) -> int:
    """The highest kit migration applied; 0 on a database the kit never opened."""
    if (await (await conn.execute("SELECT to_regclass('sophos_migrations') AS t")).fetchone())["t"] is None:
        return 0
    return (await (await conn.execute("SELECT coalesce(max(version), 0) AS v FROM sophos_migrations")).fetchone())["v"]


async def _take_migration_lock(conn: psycopg.AsyncConnection, timeout: float = 120.0) -> None:
    """Take the migration lock, trying again until it is free.

    Not `pg_advisory_lock`, which waits inside its statement's transaction: LangGraph's saver
    migrations build indexes `CONCURRENTLY`, which wait for every open transaction to end, the
    waiting lock's among them, while it waits for them: a deadlock the server breaks by failing
    one. Between two tries this process holds no transaction."""
    deadline = time.monotonic() + timeout
    while not (await (await conn.execute("SELECT pg_try_advisory_lock(%s) AS taken", (MIGRATION_LOCK,))).fetchone())["taken"]:
        if time.monotonic() > deadline:
            raise SophosError(CONFIG_ERROR, f"Another process has held the migration lock for over {timeout:.0f} s")
        await asyncio.sleep(0.02)  # a backoff between tries, not a barrier


async def _migrate(conn: psycopg.AsyncConnection) -> None:
    """LangGraph's saver tables, then the kit's missing migrations, each in a transaction."""
    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

    await AsyncPostgresSaver(conn).setup()  # its own migrations table; some of them cannot run in a transaction
    await conn.execute("CREATE TABLE IF NOT EXISTS sophos_migrations"
                       " (version INTEGER PRIMARY KEY, applied_at TIMESTAMPTZ NOT NULL DEFAULT now())")
    version = await _schema_version(conn)
    if version > SCHEMA_VERSION:
        raise SophosError(SCHEMA_TOO_NEW, (
            f"The database has the kit's schema version {version}, but this sophos_lab knows "
            f"versions up to {SCHEMA_VERSION}. Upgrade sophos_lab; the database was not changed."))
    for number in range(version + 1, SCHEMA_VERSION + 1):
        async with conn.transaction():
            await conn.execute(MIGRATIONS[number - 1], prepare=False)  # several statements
            await conn.execute("INSERT INTO sophos_migrations (version) VALUES (%s)", (number,))


async def unreachable(url: str, timeout: float = 2.0) -> str | None:
    """None if the database at `url` answers a query within `timeout` seconds, else why not
    (a fresh connection: what the kit's own would meet on their next use)."""
    try:
        async with asyncio.timeout(timeout):
            conn = await psycopg.AsyncConnection.connect(url, autocommit=True, connect_timeout=max(1, int(timeout)))
            async with conn:
                await conn.execute("SELECT 1")
    except TimeoutError:
        return f"no answer within {timeout:g} s"
    except psycopg.Error as error:
        return str(error).strip() or type(error).__name__
    return None


# --- the checkpoints ------------------------------------------------------------------------


def _notifying_saver_class():
    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

    class NotifyingPostgresSaver(Notifying, AsyncPostgresSaver):
        """LangGraph's AsyncPostgresSaver, saved-then-told and fenced (see the module), on one
        connection of its pool at a time."""

        def __init__(self, conn: Any, lock: asyncio.Lock | None = None, **kwargs: Any) -> None:
            super().__init__(conn, **kwargs)
            self._notifying(lock)
            self._kept: psycopg.AsyncConnection | None = None
            self._in_use = self._released = False

        @contextlib.asynccontextmanager
        async def _cursor(self, *, pipeline: bool = False) -> AsyncIterator[Any]:
            # LangGraph's own, on a connection kept between calls: every call holds the lock, so
            # two are never out at once, and lending one from the pool for each of a turn's eight
            # calls cost more than the look at its socket that keeps it (`_usable`).
            async with self.lock:
                conn = await self._connection()
                self._in_use = True
                try:
                    if pipeline:
                        async with conn.pipeline(), conn.cursor(binary=True, row_factory=dict_row) as cursor:
                            yield cursor
                    else:
                        async with conn.cursor(binary=True, row_factory=dict_row) as cursor:
                            yield cursor
                finally:
                    self._in_use = False
                    if self._released:  # the service closed meanwhile: this call gives it back
                        await self._give_back()

        async def _connection(self) -> psycopg.AsyncConnection:
            """The kept connection; one the server hung up on, or a call left mid-way (a cancel), goes
            back to the pool, which closes or resets it, and another is lent (or made)."""
            if self._kept is not None and not _usable(self._kept):
                await self._give_back()
            if self._kept is None:
                self._kept = await self.conn.getconn()
            return self._kept

        async def release(self) -> None:
            """Give the kept connection back to the pool before it is closed: now, or, while a call
            is using it, as that call ends (the pool closes a connection only once it is back)."""
            self._released = True
            if not self._in_use:
                await self._give_back()

        async def _give_back(self) -> None:
            kept, self._kept = self._kept, None
            if kept is not None:
                await asyncio.shield(self.conn.putconn(kept))  # a cancel must not lose it for the pool

    return NotifyingPostgresSaver


async def open_saver(url: str, owner_id: str | None, lock: asyncio.Lock | None = None) -> tuple[Any, Any]:
    """A pool and the saver on it. With `owner_id`, every connection of the pool is fenced to
    that owner (None: the original's single-owner rule, no fence); `lock`: see `Notifying`."""
    from psycopg_pool import AsyncConnectionPool

    async def configure(conn: psycopg.AsyncConnection) -> None:
        if owner_id is not None:
            await conn.execute("SELECT set_config('sophos.owner_id', %s, false)", (owner_id,))

    pool = AsyncConnectionPool(
        url, min_size=1, max_size=4, open=False, configure=configure, check=_check_usable,
        reconnect_timeout=RECONNECT_SECONDS,
        kwargs={"autocommit": True, "row_factory": dict_row, "prepare_threshold": PREPARE_THRESHOLD, "options": SESSION_OPTIONS},
    )
    await pool.open(wait=True)
    return pool, _notifying_saver_class()(pool, lock=lock)


# --- read-only, for the doctor and the lab's views (synchronous: they never run on a service's loop)


@contextlib.contextmanager
def read_only(url: str) -> Iterator[psycopg.Connection]:
    """A connection on which every transaction is read-only: it never writes, never migrates
    and never recovers (the lab's views). A database whose kit schema is newer is refused."""
    try:
        conn = psycopg.connect(url, autocommit=True, row_factory=dict_row, prepare_threshold=None,
                               options=f"{SESSION_OPTIONS} -c default_transaction_read_only=on")
    except psycopg.OperationalError as error:
        raise SophosError(DATABASE_UNAVAILABLE, f"Cannot reach the database at DATABASE_URL: {error}".strip()) from error
    try:
        version = 0
        if conn.execute("SELECT to_regclass('sophos_migrations') AS t").fetchone()["t"] is not None:
            version = conn.execute("SELECT coalesce(max(version), 0) AS v FROM sophos_migrations").fetchone()["v"]
        if version > SCHEMA_VERSION:
            raise SophosError(SCHEMA_TOO_NEW, (
                f"The database has the kit's schema version {version}, but this sophos_lab knows "
                f"versions up to {SCHEMA_VERSION}; nothing was changed."))
        yield conn
    finally:
        conn.close()


def check(url: str) -> tuple[bool, str]:
    """What `sophos-lab doctor` says of the database at `url`, read-only: reachable, the
    server's version, the kit's migrations and LangGraph's saver tables. (False, why) when the
    kit cannot use it as it is; a database no process has opened yet is fine (the first open
    migrates it)."""
    from langgraph.checkpoint.postgres import PostgresSaver

    try:
        with read_only(url) as conn:
            server = conn.execute("SHOW server_version").fetchone()["server_version"]
            kit = 0
            if conn.execute("SELECT to_regclass('sophos_migrations') AS t").fetchone()["t"] is not None:
                kit = conn.execute("SELECT coalesce(max(version), 0) AS v FROM sophos_migrations").fetchone()["v"]
            saver = 0
            if conn.execute("SELECT to_regclass('checkpoint_migrations') AS t").fetchone()["t"] is not None:
                saver = conn.execute("SELECT count(*) AS n FROM checkpoint_migrations").fetchone()["n"]
    except SophosError as error:
        return False, error.message
    wanted = len(PostgresSaver.MIGRATIONS)
    if kit == 0 and saver == 0:
        tables = "no tables yet (the first process to open it migrates it)"
    else:
        tables = (f"kit schema {kit} of {SCHEMA_VERSION}, LangGraph's saver migrations {saver} of {wanted}"
                  + ("" if (kit, saver) == (SCHEMA_VERSION, wanted) else " (the next open applies the rest)"))
    major = int(server.split(".")[0]) if server.split(".")[0].isdigit() else 0
    if major and major < 13:
        return False, f"PostgreSQL {server}: the kit needs 13 or newer; {tables}"
    return True, f"PostgreSQL {server}, reachable; {tables}"

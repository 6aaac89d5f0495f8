"""The second backend: everything the SQLite file holds, on PostgreSQL (`DATABASE_URL`).

The application's tables get the same rows and rules as `store` gives them in SQLite; the
checkpoints go through LangGraph's own `AsyncPostgresSaver`. What differs, and why:

- **Migrations once.** Every process that opens the database takes one session-level advisory
  lock, then applies LangGraph's saver migrations and the kit's (`sophos_migrations`, one row per
  version) and lets go: processes that start together migrate one after the other, and only the
  first one finds anything to do.
- **Leases on the database's clock.** `owners.lease_expires_at` is `now()` plus the lease, and
  is read against `now()`: hosts whose clocks disagree still agree on who is gone. On one host
  and boot, as in SQLite, a dead pid is gone at once.
- **The fence, in the saver's own transaction.** Each connection of this process's saver pool
  carries its owner in a session setting (`sophos.owner_id`); a trigger on LangGraph's three
  tables refuses a row for a thread whose `running` run that owner does not hold, and locks
  that run's row (`FOR SHARE`) until the insert commits, so a takeover waits for a write that
  got in first and refuses every one after. A connection without the setting (a read-only view,
  a plain saver) is not fenced, as a connection without SQLite's TEMP triggers is not.
- **One transaction per saver write.** The saver pipelines an autocommit connection, which
  commits each statement of a write on its own: a task's pending writes could be cut in half.
  Here every checkpoint and every task's writes is one transaction (the library's own
  no-pipeline path).
- **Insertion order** is an identity column (`seq`) where SQLite reads `rowid`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import select
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import psycopg
from psycopg.rows import dict_row, tuple_row

from .checkpointer import FENCED, Notifying
from .errors import (CONFIG_ERROR, DATABASE_UNAVAILABLE, GATE_DECIDED, IDEMPOTENCY_KEY_REUSED, NOT_FOUND,
                     SCHEMA_TOO_NEW, SESSION_IN_PROGRESS, STORAGE_FULL, SophosError)
from . import users
from .ownership import Owner, owner_gone
from .retention import Removal, Vacuum
from .store import (PAGE_SIZE, RELABELLED, Conversation, ConversationPage, Gate, IdempotencyKey, KeyedRun, ListingPosition,
                    Run, encode_cursor, run_scope, title_from_message, utc_now)

log = logging.getLogger(__name__)

MIGRATION_LOCK = 0x50F05_1AB
"""The advisory lock every process holds while it migrates (any bigint no one else uses)."""

MIGRATIONS: tuple[str, ...] = (
    # v1: the tables of SQLite's seven versions, as they are at the last one.
    """
    CREATE TABLE conversations (
        id TEXT PRIMARY KEY,
        seq BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE,
        title TEXT NOT NULL,
        created_at TEXT NOT NULL,
        updated_at TEXT NOT NULL,
        message_count INTEGER NOT NULL DEFAULT 0
    );
    CREATE INDEX conversations_by_recency ON conversations (updated_at, seq);
    CREATE TABLE owners (
        id TEXT PRIMARY KEY,
        host TEXT NOT NULL,
        boot_id TEXT NOT NULL,
        pid INTEGER NOT NULL,
        pid_started TEXT NOT NULL,
        opened_at TEXT NOT NULL,
        lease_expires_at TIMESTAMPTZ NOT NULL,
        lease_expires_monotonic DOUBLE PRECISION NOT NULL
    );
    CREATE TABLE runs (
        id TEXT PRIMARY KEY,
        seq BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE,
        conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        status TEXT NOT NULL
            CHECK (status IN ('running', 'interrupted', 'completed', 'failed', 'cancelled', 'waiting')),
        error_code TEXT,
        error_message TEXT,
        started_at TEXT NOT NULL,
        finished_at TEXT,
        owner_id TEXT,
        input TEXT,
        cancel_requested_at TEXT
    );
    CREATE INDEX runs_by_conversation ON runs (conversation_id, seq);
    CREATE UNIQUE INDEX one_running_run_per_conversation ON runs (conversation_id)
        WHERE status = 'running';
    CREATE TABLE prunes (
        id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        pruned_at TEXT NOT NULL,
        checkpoints INTEGER NOT NULL,
        writes INTEGER NOT NULL,
        bytes BIGINT NOT NULL,
        first_step INTEGER,
        last_step INTEGER,
        kept_from TEXT NOT NULL
    );
    CREATE INDEX prunes_by_conversation ON prunes (conversation_id, id);
    CREATE TABLE idempotency_keys (
        key TEXT PRIMARY KEY,
        request TEXT NOT NULL,
        conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        run_id TEXT NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
        created_at TEXT NOT NULL
    );
    CREATE INDEX idempotency_keys_by_run ON idempotency_keys (run_id);
    CREATE INDEX idempotency_keys_by_conversation ON idempotency_keys (conversation_id);
    CREATE TABLE gates (
        id TEXT NOT NULL,
        seq BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE,
        conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        run_id TEXT NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
        calls TEXT NOT NULL,
        created_at TEXT NOT NULL,
        decisions TEXT,
        decided_at TEXT,
        decided_run_id TEXT REFERENCES runs(id) ON DELETE SET NULL,
        PRIMARY KEY (conversation_id, id)
    );
    CREATE INDEX gates_by_run ON gates (run_id);
    CREATE INDEX gates_by_decided_run ON gates (decided_run_id);
    """,
    # v2: the fence on LangGraph's tables (their saver's migrations ran before these).
    f"""
    CREATE FUNCTION sophos_fence() RETURNS trigger LANGUAGE plpgsql AS $$
    DECLARE
        me TEXT := current_setting('sophos.owner_id', true);
    BEGIN
        IF me IS NULL OR me = '' THEN
            RETURN NEW;
        END IF;
        PERFORM 1 FROM runs
            WHERE conversation_id = NEW.thread_id AND status = 'running' AND owner_id = me
            FOR SHARE;
        IF NOT FOUND THEN
            RAISE EXCEPTION '{FENCED}: this process does not own the running run of the thread %',
                NEW.thread_id;
        END IF;
        RETURN NEW;
    END
    $$;
    CREATE TRIGGER sophos_fence BEFORE INSERT ON checkpoints
        FOR EACH ROW EXECUTE FUNCTION sophos_fence();
    CREATE TRIGGER sophos_fence BEFORE INSERT ON checkpoint_blobs
        FOR EACH ROW EXECUTE FUNCTION sophos_fence();
    CREATE TRIGGER sophos_fence BEFORE INSERT ON checkpoint_writes
        FOR EACH ROW EXECUTE FUNCTION sophos_fence();
    """,
    # v3: the queue of a pool of workers (see `queue`): a run accepted and not yet claimed is
    # `queued` and counts as active; its events, for every web server, in `run_events`.
    """
    ALTER TABLE runs DROP CONSTRAINT runs_status_check;
    ALTER TABLE runs ADD CONSTRAINT runs_status_check CHECK
        (status IN ('queued', 'running', 'interrupted', 'completed', 'failed', 'cancelled', 'waiting'));
    ALTER TABLE runs ADD COLUMN claimed_at TEXT, ADD COLUMN requeues INTEGER NOT NULL DEFAULT 0;
    DROP INDEX one_running_run_per_conversation;
    CREATE UNIQUE INDEX one_active_run_per_conversation ON runs (conversation_id)
        WHERE status IN ('queued', 'running');
    CREATE INDEX queued_runs ON runs (seq) WHERE status = 'queued';
    CREATE UNLOGGED TABLE run_events (
        run_id TEXT NOT NULL,
        id INTEGER NOT NULL,
        conversation_id TEXT NOT NULL,
        event TEXT NOT NULL,
        data TEXT NOT NULL,
        PRIMARY KEY (run_id, id)
    );
    CREATE INDEX run_events_by_conversation ON run_events (conversation_id);
    """,
    # v4: users of one server (see `users`), as SQLite's v8.
    """
    CREATE TABLE users (
        id TEXT PRIMARY KEY,
        name TEXT NOT NULL UNIQUE,
        token_hash TEXT NOT NULL UNIQUE,
        created_at TEXT NOT NULL,
        revoked_at TEXT
    );
    ALTER TABLE conversations ADD COLUMN user_id TEXT REFERENCES users(id);
    CREATE INDEX conversations_by_user ON conversations (user_id);
    """,
    # v5: the graph steps each run took, as SQLite's v9.
    """
    ALTER TABLE runs ADD COLUMN steps INTEGER NOT NULL DEFAULT 0;
    """,
    # v6: the id of the latest event a worker's run gave, in a logged table: `run_events` is
    # emptied by a crash of the server, and a run that goes on must number its events after
    # those its followers have, never from 1 again (see `queue`).
    """
    ALTER TABLE runs ADD COLUMN last_event_id INTEGER NOT NULL DEFAULT 0;
    """,
)
SCHEMA_VERSION = len(MIGRATIONS)


def is_postgres_url(url: str | None) -> bool:
    return bool(url) and url.split(":", 1)[0] in ("postgres", "postgresql")


def schema_version(conn: psycopg.Connection) -> int:
    """The highest kit migration applied; 0 on a database the kit never opened."""
    if conn.execute("SELECT to_regclass('sophos_migrations') AS t").fetchone()["t"] is None:
        return 0
    return conn.execute("SELECT coalesce(max(version), 0) AS v FROM sophos_migrations").fetchone()["v"]


def _take_migration_lock(conn: psycopg.Connection, timeout: float = 120.0) -> None:
    """Take the migration lock, trying again until it is free.

    Not `pg_advisory_lock`, which waits inside its statement's transaction: LangGraph's saver
    migrations build indexes `CONCURRENTLY`, which wait for every open transaction to end, the
    waiting lock's among them, while it waits for them: a deadlock the server breaks by failing
    one. Between two tries this process holds no transaction."""
    deadline = time.monotonic() + timeout
    while not conn.execute("SELECT pg_try_advisory_lock(%s) AS taken", (MIGRATION_LOCK,)).fetchone()["taken"]:
        if time.monotonic() > deadline:
            raise SophosError(CONFIG_ERROR, f"Another process has held the migration lock for over {timeout:.0f} s")
        time.sleep(0.02)


def migrate(conn: psycopg.Connection) -> None:
    """LangGraph's saver tables, then the kit's missing migrations, each in a transaction, under
    the migration lock (so several processes starting at once migrate once)."""
    from langgraph.checkpoint.postgres import PostgresSaver

    _take_migration_lock(conn)
    try:
        PostgresSaver(conn).setup()  # its own migrations table; some of them cannot run in a transaction
        conn.execute("CREATE TABLE IF NOT EXISTS sophos_migrations"
                     " (version INTEGER PRIMARY KEY, applied_at TIMESTAMPTZ NOT NULL DEFAULT now())")
        version = schema_version(conn)
        if version > SCHEMA_VERSION:
            raise SophosError(SCHEMA_TOO_NEW, (
                f"The database has the kit's schema version {version}, but this sophos_lab knows "
                f"versions up to {SCHEMA_VERSION}. Upgrade sophos_lab; the database was not changed."))
        for number in range(version + 1, SCHEMA_VERSION + 1):
            with conn.transaction():
                conn.execute(MIGRATIONS[number - 1])
                conn.execute("INSERT INTO sophos_migrations (version) VALUES (%s)", (number,))
    finally:
        conn.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK,))


SESSION_OPTIONS = "-c lock_timeout=5000 -c idle_in_transaction_session_timeout=15000"
"""Every connection of the kit: a statement waits at most 5 s for a row lock (SQLite's busy
timeout), and a transaction left open for 15 s by a frozen or cut-off process is ended by the
server, its locks with it (the default lease is 15 s), instead of holding other processes up."""


RECONNECT_SECONDS = 5.0
"""How long a pool keeps trying, with waits doubling from 1 s, to open a connection it lost,
before it gives that attempt up (psycopg_pool's `reconnect_timeout`, 5 minutes by default). The
next request that needs a connection starts a new attempt, from a 1 s wait again: once the
database is back after a restart, a pool serves within about 2 s, however long it was down."""


def _connect(url: str, **options: Any) -> psycopg.Connection:
    """Autocommit (a statement outside a `transaction()` is its own, as in SQLite's autocommit
    mode), dict rows (LangGraph's savers need them), and no prepared statements, which break
    behind a transaction-mode pooler; a server that cannot be reached is `DATABASE_UNAVAILABLE`
    (it may be restarting: the next call connects again)."""
    session = f"{SESSION_OPTIONS} {options.pop('options', '')}".strip()
    try:
        return psycopg.connect(url, autocommit=True, row_factory=dict_row, prepare_threshold=None, options=session,
                               **options)
    except psycopg.OperationalError as error:
        raise SophosError(DATABASE_UNAVAILABLE, f"Cannot reach the database at DATABASE_URL: {error}".strip()) from error


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


def connect(url: str) -> psycopg.Connection:
    """A connection for the application's tables, with every migration applied."""
    conn = _connect(url)
    try:
        migrate(conn)
    except BaseException:
        conn.close()
        raise
    return conn


@contextlib.contextmanager
def read_only(url: str) -> Iterator[psycopg.Connection]:
    """A connection on which every transaction is read-only: it never writes, never migrates
    and never recovers (the lab's views). A database whose kit schema is newer is refused."""
    conn = _connect(url, options="-c default_transaction_read_only=on")
    try:
        version = schema_version(conn)
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
            kit = schema_version(conn)
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


@contextlib.contextmanager
def _refused_when_full() -> Iterator[None]:
    try:
        yield
    except psycopg.errors.DiskFull as error:
        raise SophosError(STORAGE_FULL, f"The database server has no space left: {error}".strip()) from error


_RUNNING_SQL = """
SELECT r.id AS run_id, o.id, o.host, o.boot_id, o.pid, o.pid_started,
       EXTRACT(EPOCH FROM o.lease_expires_at - now())::float8 AS lease_left,
       o.lease_expires_monotonic, o.id IS NOT NULL AS has_owner
FROM runs r LEFT JOIN owners o ON o.id = r.owner_id
WHERE r.status = 'running'"""


# The steps a relabelled or re-queued run saved, as SQLite's (`store._SAVED_STEPS`).
_SAVED_STEPS = """
UPDATE runs SET steps = GREATEST(steps, (
    SELECT count(*) FILTER (WHERE c.metadata->>'source' = 'loop')
         - count(*) FILTER (WHERE c.metadata->>'source' = 'input')
    FROM checkpoints c
    WHERE c.thread_id = runs.conversation_id AND c.checkpoint_ns = '' AND c.metadata->>'run_id' = runs.id))
WHERE id = ANY(%s)"""


def _owner_row(row: dict) -> dict | None:
    """An `owners` row as `owner_gone` reads it. Its wall-clock lease is read on the database's
    clock: `lease_left` is what `now()` leaves of it, so it runs out here exactly when it does
    there, whatever this host's clock says."""
    if not row["has_owner"]:
        return None
    return {**row, "lease_expires_at": time.time() + row["lease_left"]}


_RELABEL = (f"UPDATE runs SET {RELABELLED} finished_at = %s WHERE status = 'running' AND id = ANY(%s)"
            " RETURNING id, conversation_id, status, error_code, error_message")


def _hung_up(conn: psycopg.Connection) -> bool:
    """Has the server hung up on this idle connection (a restart, `pg_terminate_backend`)? It
    then has something to read (its last words, or the end of the stream) while no query is out.
    Seen before use, the next call connects again instead of failing once on a dead socket."""
    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        return False
    try:
        readable, _, _ = select.select([conn.fileno()], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


class PostgresStore:
    """The application tables of one PostgreSQL database, as one owner: `store.Store`'s
    interface and rules, on the database's locks and clock."""

    def __init__(self, url: str, lease_seconds: float = 15.0, single_owner: bool = False,
                 requeue_limit: int = 0, limits: users.Limits = users.Limits()) -> None:
        self.url = url
        self.limits = limits
        """What one user may have running and queued at once and spend (`users.check_limits`,
        `queue.claim`)."""
        self.requeue_limit = requeue_limit
        """`SOPHOS_LAB_REQUEUE`: how often a worker's crashed run goes back in the queue (0: never)."""
        self.lease_seconds = lease_seconds
        self.single_owner = single_owner
        self.owner: Owner | None = None
        self._conn: psycopg.Connection | None = None
        self._lock = threading.RLock()
        self.recovered_runs = 0
        """The runs the latest open relabelled (its sweep: every gone owner's)."""
        self.opens = 0
        """How often the connection was opened (again after the server hung up), each with its sweep."""

    @property
    def is_open(self) -> bool:
        return self._conn is not None

    @property
    def conn(self) -> psycopg.Connection:
        """The connection, opened (with migrations and recovery) on first use."""
        with self._lock:
            if self._conn is not None and (self._conn.closed or self._conn.broken or _hung_up(self._conn)):
                # The server restarted or cut the connection: open again, as the same owner.
                with contextlib.suppress(psycopg.Error):
                    self._conn.close()
                self._conn = None
            if self._conn is None:
                conn = connect(self.url)
                self.owner = self.owner or Owner.here()
                self._conn = conn
                try:
                    self._open_sweep()
                except BaseException:
                    self._conn = None
                    conn.close()
                    raise
            return self._conn

    def close(self) -> None:
        """Close; this owner's runs still `running` become recoverable at once."""
        with self._lock:
            if self._conn is not None:
                with contextlib.suppress(psycopg.Error):
                    self._conn.execute("DELETE FROM owners WHERE id = %s", (self.owner.id,))
                self._conn.close()
                self._conn = None

    @contextlib.contextmanager
    def transaction(self) -> Iterator[psycopg.Connection]:
        """The connection inside one transaction, committed when the block ends, rolled back
        when it raises. Not pipelined: in a pipeline a statement's `rowcount` is not known yet
        (-1), and the outcome, the cancel and the gate decision are decided by theirs."""
        conn = self.conn
        with self._lock, _refused_when_full(), conn.transaction():
            yield conn

    # ownership

    def _lease(self, conn: psycopg.Connection) -> None:
        owner = self.owner
        conn.execute(
            "INSERT INTO owners (id, host, boot_id, pid, pid_started, opened_at, lease_expires_at,"
            " lease_expires_monotonic) VALUES (%s, %s, %s, %s, %s, %s, now() + make_interval(secs => %s), %s)"
            " ON CONFLICT (id) DO UPDATE SET lease_expires_at = excluded.lease_expires_at,"
            " lease_expires_monotonic = excluded.lease_expires_monotonic",
            (owner.id, owner.host, owner.boot_id, owner.pid, owner.pid_started, utc_now(),
             self.lease_seconds, time.monotonic() + self.lease_seconds),
        )

    def _open_sweep(self) -> None:
        self.opens += 1
        with self.transaction() as conn:
            self._lease(conn)
        if self.single_owner:
            with self.transaction() as conn:
                running = [row["id"] for row in conn.execute("SELECT id FROM runs WHERE status = 'running'")]
                self.recovered_runs = self._relabel_in(conn, running)
        else:
            self.recovered_runs = self._relabel_stale(None)
            with self.transaction() as conn:
                self._forget_gone_owners(conn)  # those that died holding no run

    def _stale_runs(self, conn: psycopg.Connection, conversation_id: str | None,
                    user_id: str | None = None) -> list[str]:
        scope, params = run_scope(conversation_id, user_id, "%s")
        return [row["run_id"] for row in conn.execute(_RUNNING_SQL + scope, params) if owner_gone(_owner_row(row), self.owner)]

    def _relabel_in(self, conn: psycopg.Connection, run_ids: list[str]) -> int:
        """Inside a transaction: relabel these runs if still `running`, and recount their
        conversations (see `counting`); how many were relabelled."""
        if not run_ids:
            return 0
        from . import queue

        relabelled = conn.execute(_RELABEL, (utc_now(), run_ids)).fetchall()
        if relabelled:
            conn.execute(_SAVED_STEPS, ([row["id"] for row in relabelled],))
        queue.close_events(conn, relabelled)  # a worker's run: its followers' final event
        for conversation_id in {row["conversation_id"] for row in relabelled}:
            try:
                count = shown_message_count(self.url, conversation_id)
            except Exception:
                log.exception("could not count the messages of %s; its message_count stays", conversation_id)
                continue
            if count is not None:
                conn.execute("UPDATE conversations SET message_count = %s WHERE id = %s", (count, conversation_id))
        return len(relabelled)

    def _relabel_stale(self, conversation_id: str | None, user_id: str | None = None) -> int:
        with self._lock:
            if not self._stale_runs(self.conn, conversation_id, user_id):
                return 0
            with self.transaction() as conn:
                stale = self._stale_runs(conn, conversation_id, user_id)
                requeued = self._requeue_in(conn, stale)
                count = self._relabel_in(conn, [run_id for run_id in stale if run_id not in requeued])
                self._forget_gone_owners(conn)
                return count + len(requeued)

    def _requeue_in(self, conn: psycopg.Connection, run_ids: list[str]) -> set[str]:
        """Inside a transaction, with `SOPHOS_LAB_REQUEUE=N`: put a worker's run whose owner is
        gone back in the queue instead of relabelling it, at most N times (`requeues`), unless a
        cancel was asked for. Its followers see no end: its events go on when a worker claims it.
        The steps the attempt saved are recorded; the outcome adds the next attempt's."""
        if not self.requeue_limit or not run_ids:
            return set()
        from . import queue

        rows = conn.execute(
            "UPDATE runs SET status = 'queued', owner_id = NULL, claimed_at = NULL, requeues = requeues + 1"
            " WHERE status = 'running' AND id = ANY(%s) AND claimed_at IS NOT NULL AND cancel_requested_at IS NULL"
            " AND requeues < %s RETURNING id", (run_ids, self.requeue_limit)).fetchall()
        if rows:  # what the attempt that died saved counts, as a relabelled run's does
            conn.execute(_SAVED_STEPS, ([row["id"] for row in rows],))
        for row in rows:
            conn.execute("SELECT pg_notify(%s, %s)", (queue.QUEUE_CHANNEL, row["id"]))
        return {row["id"] for row in rows}

    def _forget_gone_owners(self, conn: psycopg.Connection) -> None:
        """Delete the rows of gone owners that no longer hold a `running` run."""
        rows = conn.execute(
            "SELECT *, EXTRACT(EPOCH FROM lease_expires_at - now())::float8 AS lease_left, true AS has_owner"
            " FROM owners WHERE id != %s AND id NOT IN"
            " (SELECT owner_id FROM runs WHERE status = 'running' AND owner_id IS NOT NULL)",
            (self.owner.id,),
        ).fetchall()
        gone = [row["id"] for row in rows if owner_gone(_owner_row(row), self.owner)]
        if gone:
            # A row another session holds locked (a process frozen inside its lease renewal) is
            # left for a later look: waiting on it would fail the recovery it tidies up after.
            conn.execute("DELETE FROM owners WHERE id IN"
                         " (SELECT id FROM owners WHERE id = ANY(%s) FOR UPDATE SKIP LOCKED)", (gone,))

    def recover(self, conversation_id: str | None = None, user_id: str | None = None) -> int:
        """Relabel `interrupted` the `running` runs whose owner is gone (as `Store.recover`); how many."""
        self.conn  # noqa: B018 - opened (and swept) on first use
        if self.single_owner:
            return 0
        return self._relabel_stale(conversation_id, user_id)

    _recover = recover

    def relabel(self, run_ids: list[str]) -> int:
        if not run_ids:
            return 0
        with self.transaction() as conn:
            return self._relabel_in(conn, run_ids)

    def owned_runs(self) -> list[str]:
        """The ids of the runs `running` under this owner, whatever this process thinks it runs."""
        return [row["id"] for row in self.conn.execute(
            "SELECT id FROM runs WHERE status = 'running' AND owner_id = %s", (self.owner.id,))]

    def give_up(self, run_ids: list[str]) -> int:
        """This owner's runs that no task of it works on any more (see
        `AgentService._give_up_strays`), given up as a gone owner's are: re-queued
        (`SOPHOS_LAB_REQUEUE`) or relabelled `interrupted`, with their followers' final event."""
        if not run_ids:
            return 0
        with self.transaction() as conn:
            requeued = self._requeue_in(conn, run_ids)
            return self._relabel_in(conn, [run_id for run_id in run_ids if run_id not in requeued]) + len(requeued)

    def renew_lease(self, run_ids: list[str]) -> set[str]:
        with self.transaction() as conn:
            self._lease(conn)
        if not run_ids:
            return set()
        still = {row["id"] for row in self.conn.execute(
            "SELECT id FROM runs WHERE id = ANY(%s) AND status = 'running' AND owner_id = %s",
            (list(run_ids), self.owner.id))}
        return set(run_ids) - still

    # conversations

    def create_conversation(self, conversation_id: str, first_message: str) -> None:
        now = utc_now()
        with self.transaction() as conn:
            conn.execute("INSERT INTO conversations (id, title, created_at, updated_at, user_id)"
                         " VALUES (%s, %s, %s, %s, %s)",
                         (conversation_id, _title(first_message), now, now, users.acting_user.get()))

    def get_conversation(self, conversation_id: str) -> Conversation | None:
        """As `Store.get_conversation`: the acting user's only (see `users`)."""
        where, params = users.mine(placeholder="%s")
        row = self._cursor().execute(_LISTING_SQL + " WHERE c.id = %s" + where, (conversation_id, *params)).fetchone()
        return Conversation(*row[1:]) if row else None

    def list_conversations(self) -> list[Conversation]:
        where, params = users.mine(placeholder="%s")
        rows = self._cursor().execute(_LISTING_SQL + " WHERE true" + where + _LISTING_ORDER, params)
        return [Conversation(*row[1:]) for row in rows]

    def conversation_page(self, limit: int = PAGE_SIZE, after: ListingPosition | None = None) -> ConversationPage:
        """As `Store.conversation_page`: keyset pages in the listing's order."""
        where, params = users.mine(placeholder="%s")
        sql = _LISTING_SQL + " WHERE true" + where
        if after is not None:
            sql, params = sql + " AND (c.updated_at, c.seq) < (%s, %s)", (*params, after.updated_at, after.rowid)
        rows = self._cursor().execute(sql + _LISTING_ORDER + " LIMIT %s", (*params, limit + 1)).fetchall()
        more, rows = len(rows) > limit, rows[:limit]
        last = ListingPosition(rows[-1][4], rows[-1][0]) if rows else None
        return ConversationPage(conversations=[Conversation(*row[1:]) for row in rows],
                                next_cursor=encode_cursor(last) if more else None)

    def _cursor(self) -> psycopg.Cursor:
        return self.conn.cursor(row_factory=tuple_row)

    # runs

    def start_run(self, run_id: str, conversation_id: str, input_messages: list[dict[str, str]] | None = None,
                  title: str | None = None, idempotency: IdempotencyKey | None = None,
                  decision: tuple[Gate, dict[str, dict]] | None = None) -> None:
        """As `Store.start_run`, in one transaction; the partial unique index refuses a second
        active run on the conversation, whichever process or host tries."""
        self._recover(conversation_id, users.acting_user.get())  # a user's crashed runs hold no place in a limit
        with self._starting(idempotency) as conn:
            self._lease(conn)
            users.check_limits(conn, "running", self.limits, utc_now())
            self._insert_run(conn, run_id, conversation_id, "running", self.owner.id, input_messages, title,
                             idempotency, decision)

    def queue_run(self, run_id: str, conversation_id: str, input_messages: list[dict[str, str]] | None,
                  title: str | None, idempotency: IdempotencyKey | None,
                  decision: tuple[Gate, dict[str, dict]] | None, resume: bool) -> None:
        """As `start_run`, for a worker to claim (`queue`): the run `queued`, owned by no one,
        with its `started` event; the workers are woken once it is committed."""
        from . import queue

        self._recover(conversation_id, users.acting_user.get())  # a user's crashed runs hold no place in a limit
        with self._starting(idempotency) as conn:
            users.check_limits(conn, "queued", self.limits, utc_now())
            self._insert_run(conn, run_id, conversation_id, "queued", None, input_messages, title,
                             idempotency, decision)
            queue.queue_started(conn, run_id, conversation_id, resume)

    @contextlib.contextmanager
    def _starting(self, idempotency: IdempotencyKey | None) -> Iterator[psycopg.Connection]:
        try:
            with self.transaction() as conn:
                yield conn
        except psycopg.errors.UniqueViolation as error:
            constraint = error.diag.constraint_name
            if constraint == "idempotency_keys_pkey":
                raise SophosError(IDEMPOTENCY_KEY_REUSED,
                                  f"The idempotency key {idempotency.key!r} has started a run already") from error
            if constraint == "one_active_run_per_conversation":
                raise SophosError(SESSION_IN_PROGRESS, "Previous request still in progress") from error
            raise

    @staticmethod
    def _insert_run(conn: psycopg.Connection, run_id: str, conversation_id: str, status: str, owner_id: str | None,
                    input_messages: list[dict[str, str]] | None, title: str | None,
                    idempotency: IdempotencyKey | None, decision: tuple[Gate, dict[str, dict]] | None) -> None:
        now = utc_now()
        if title is not None:
            conn.execute("INSERT INTO conversations (id, title, created_at, updated_at, user_id)"
                         " VALUES (%s, %s, %s, %s, %s)", (conversation_id, _title(title), now, now,
                                                          users.acting_user.get()))
        else:
            users.check_owner(conn, conversation_id)
        conn.execute(
            "INSERT INTO runs (id, conversation_id, status, started_at, owner_id, input)"
            " VALUES (%s, %s, %s, %s, %s, %s)",
            (run_id, conversation_id, status, now, owner_id,
             json.dumps(input_messages, ensure_ascii=False) if input_messages else None))
        conn.execute("UPDATE conversations SET updated_at = %s, message_count = message_count + %s"
                     " WHERE id = %s", (now, len(input_messages or ()), conversation_id))
        if idempotency is not None:
            conn.execute("INSERT INTO idempotency_keys (key, request, conversation_id, run_id, created_at)"
                         " VALUES (%s, %s, %s, %s, %s)",
                         (users.scoped_key(idempotency.key), idempotency.request, conversation_id, run_id, now))
        if decision is not None:
            gate, decisions = decision
            decided = conn.execute(
                "UPDATE gates SET decisions = %s, decided_at = %s, decided_run_id = %s"
                " WHERE conversation_id = %s AND id = %s AND decisions IS NULL",
                (json.dumps(decisions, ensure_ascii=False), now, run_id, gate.conversation_id, gate.id),
            ).rowcount
            if not decided:
                raise SophosError(GATE_DECIDED, f"The gate {gate.id} was decided already")

    def claim_run(self) -> Run | None:
        """The next queued run in fair order, now this owner's and `running` (`queue.claim`);
        None if none may be claimed."""
        from . import queue

        with self.transaction() as conn:
            self._lease(conn)
            return _run(queue.claim(conn, self.owner.id, utc_now(), self.limits.running))

    def cancel_remote(self, run_id: str) -> bool:
        """Cancel a run of the queue from any process: a queued one is `cancelled` at once (with
        its final event); a claimed one gets its request written and its worker told. False
        when it is neither any more."""
        from . import queue

        with self.transaction() as conn:
            now = utc_now()
            return queue.cancel_queued(conn, run_id, now) or queue.request_cancel(conn, run_id, now)

    def close_orphaned_events(self, run_id: str) -> None:
        """A worker's run whose outcome is recorded but whose final event its worker never
        wrote (it died in between): write it from the row, once that worker is gone."""
        from . import queue

        with self.transaction() as conn:
            row = conn.execute(
                "SELECT r.*, o.id AS owner_row, o.host, o.boot_id, o.pid, o.pid_started, o.lease_expires_monotonic,"
                " EXTRACT(EPOCH FROM o.lease_expires_at - now())::float8 AS lease_left, o.id IS NOT NULL AS has_owner"
                " FROM runs r LEFT JOIN owners o ON o.id = r.owner_id"
                " WHERE r.id = %s AND r.status NOT IN ('queued', 'running') FOR UPDATE OF r",
                (run_id,)).fetchone()  # a live run's row is not locked: its worker's writes go on
            if row is None:
                return
            owner = _owner_row({**row, "id": row["owner_row"]})
            if owner is None or owner_gone(owner, self.owner):
                queue.close_events(conn, [row])

    def cancel_requested(self, run_id: str) -> bool:
        row = self.conn.execute("SELECT cancel_requested_at FROM runs WHERE id = %s", (run_id,)).fetchone()
        return row is not None and row["cancel_requested_at"] is not None

    def event_span(self, run_id: str) -> tuple[int, int]:
        from . import queue

        return queue.event_span(self.conn, run_id)

    def final_event_kept(self, run_id: str) -> bool:
        from . import queue

        return queue.final_event_kept(self.conn, run_id)

    def finish_run(self, run_id: str, status: str, message_count: int | None, error_code: str | None = None,
                   error_message: str | None = None, gate: Gate | None = None, steps: int = 0) -> bool:
        now = utc_now()
        mine, params = ("", ()) if self.single_owner else (" AND status = 'running' AND owner_id = %s", (self.owner.id,))
        # A cancel another process recorded first (a worker's run) wins over any other outcome:
        # this is refused, and the caller records `cancelled` (see `cancel_requested`).
        mine += " AND (cancel_requested_at IS NULL OR %s = 'cancelled')"
        with self.transaction() as conn:
            updated = conn.execute(
                "UPDATE runs SET status = %s, error_code = %s, error_message = %s, finished_at = %s, steps = steps + %s"
                " WHERE id = %s" + mine, (status, error_code, error_message, now, steps, run_id, *params, status)).rowcount
            if updated and message_count is not None:
                conn.execute("UPDATE conversations SET message_count = %s, updated_at = %s"
                             " WHERE id = (SELECT conversation_id FROM runs WHERE id = %s)", (message_count, now, run_id))
            if updated and gate is not None:
                conn.execute(
                    "INSERT INTO gates (id, conversation_id, run_id, calls, created_at) VALUES (%s, %s, %s, %s, %s)"
                    " ON CONFLICT (conversation_id, id) DO UPDATE SET run_id = excluded.run_id",
                    (gate.id, gate.conversation_id, run_id, json.dumps(gate.calls, ensure_ascii=False), now))
        return bool(updated)

    def gate(self, conversation_id: str, gate_id: str) -> Gate | None:
        return _gate(self.conn.execute("SELECT * FROM gates WHERE conversation_id = %s AND id = %s",
                                       (conversation_id, gate_id)).fetchone())

    def gates(self, conversation_id: str) -> list[Gate]:
        rows = self.conn.execute("SELECT * FROM gates WHERE conversation_id = %s ORDER BY seq", (conversation_id,))
        return [_gate(row) for row in rows]

    def run_gate(self, run_id: str) -> Gate | None:
        return _gate(self.conn.execute("SELECT * FROM gates WHERE run_id = %s ORDER BY seq DESC LIMIT 1",
                                       (run_id,)).fetchone())

    def request_cancel(self, run_id: str) -> bool:
        mine, params = ("", ()) if self.single_owner else (" AND owner_id = %s", (self.owner.id,))
        with self.transaction() as conn:
            return bool(conn.execute(
                "UPDATE runs SET cancel_requested_at = %s WHERE id = %s AND status = 'running'"
                " AND cancel_requested_at IS NULL" + mine, (utc_now(), run_id, *params)).rowcount)

    def get_run(self, run_id: str) -> Run | None:
        return _run(self.conn.execute("SELECT * FROM runs WHERE id = %s", (run_id,)).fetchone())

    def latest_run(self, conversation_id: str) -> Run | None:
        return _run(self.conn.execute("SELECT * FROM runs WHERE conversation_id = %s ORDER BY seq DESC LIMIT 1",
                                      (conversation_id,)).fetchone())

    def keyed_run(self, key: str) -> KeyedRun | None:
        row = self.conn.execute("SELECT * FROM idempotency_keys WHERE key = %s", (users.scoped_key(key),)).fetchone()
        return KeyedRun(**row) if row else None

    def list_runs(self, conversation_id: str | None = None) -> list[Run]:
        sql, params = "SELECT * FROM runs", ()
        if conversation_id is not None:
            sql, params = sql + " WHERE conversation_id = %s", (conversation_id,)
        return [_run(row) for row in self.conn.execute(sql + " ORDER BY seq", params)]


    # retention

    def delete_conversation(self, conversation_id: str, me: Owner | None, dry_run: bool = False) -> Removal:
        """`retention.delete_conversation` here: the conversation and everything keyed to it
        (LangGraph's three tables, runs, gates, keys, prune records) in one transaction; what
        went, counted, with the bytes of its rows (`pg_column_size`). A run of a live process
        refuses it (`SESSION_IN_PROGRESS`), one of a gone owner goes with the rest. `dry_run`
        counts in a transaction that is rolled back: nothing changes, not even a recovery."""
        with self._lock, _refused_when_full(), self.conn.transaction():
            conn = self.conn
            self._lock_idle_conversation(conn, conversation_id, me, "delete")  # a gone owner's run goes too
            counts: dict[str, tuple[int, int]] = {}
            for table, column in _KEYED_TO_CONVERSATION:
                row = conn.execute(f"DELETE FROM {table} t WHERE {column} = %s RETURNING pg_column_size(t.*) AS size",
                                   (conversation_id,)).fetchall()
                counts[table] = (len(row), sum(r["size"] for r in row))
            if dry_run:
                raise psycopg.Rollback()  # leaves the block quietly: counted, nothing changed
        return Removal(
            "delete", conversation_id, runs=counts["runs"][0], checkpoints=counts["checkpoints"][0],
            writes=counts["checkpoint_writes"][0], bytes=sum(size for _, size in counts.values()), dry_run=dry_run,
        )


    def _lock_idle_conversation(self, conn: psycopg.Connection, conversation_id: str, me: Owner | None,
                                action: str) -> list[str]:
        """Inside a transaction: lock the conversation's row and its runs' rows, refuse
        (`NOT_FOUND`, `SESSION_IN_PROGRESS`) as `retention` does, and return the `running` runs
        whose owner is gone. A saver's write under way (the fence holds its run's row FOR SHARE)
        ends before this goes on, and a run that starts later waits for this transaction."""
        if conn.execute("SELECT 1 FROM conversations WHERE id = %s FOR UPDATE", (conversation_id,)).fetchone() is None:
            raise SophosError(NOT_FOUND, f"Conversation Not Found: {conversation_id}")
        statuses = {row["id"]: row["status"] for row in conn.execute(
            "SELECT id, status FROM runs WHERE conversation_id = %s FOR UPDATE", (conversation_id,))}
        running = {run_id for run_id, status in statuses.items() if status == "running"}
        gone = set() if me is None else set(self._stale_runs(conn, conversation_id))
        if running - gone or "queued" in statuses.values():
            raise SophosError(SESSION_IN_PROGRESS, (
                f"Conversation {conversation_id} has a run in progress in a live process; "
                f"{action} it once the run has finished. Nothing was changed."))
        return sorted(running & gone)

    def prune_conversation(self, conversation_id: str, keep: int | None, me: Owner | None,
                           dry_run: bool = False) -> Removal:
        """`retention.prune_conversation` here, in one transaction: the thread's older
        checkpoints go with their writes and the blobs no kept checkpoint names; the oldest kept
        one gets the whole message list as a `_DeltaSnapshot` blob, as LangGraph's saver stores
        one, and becomes the root. A gone owner's run is relabelled `interrupted` first.
        `dry_run` does it all in a transaction that is rolled back: counted exactly, nothing changed."""
        from langgraph.checkpoint.postgres import PostgresSaver

        from .retention import delta_snapshots, kept_and_pruned, parse_keep, without_snapshot_counters

        keep = parse_keep(keep)
        with self._lock, _refused_when_full(), self.conn.transaction():
            conn = self.conn
            self._relabel_in(conn, self._lock_idle_conversation(conn, conversation_id, me, "prune"))
            removal = self._prune_in(conn, conversation_id, keep)
            if dry_run:
                raise psycopg.Rollback()  # leaves the block quietly: counted, nothing changed
        return replace(removal, dry_run=dry_run)

    def _prune_in(self, conn: psycopg.Connection, conversation_id: str, keep: int | None) -> Removal:
        from langgraph.checkpoint.postgres import PostgresSaver

        from .retention import delta_snapshots, kept_and_pruned, without_snapshot_counters

        rows = {row["checkpoint_id"]: (row["parent_checkpoint_id"], row["metadata"] or {}) for row in conn.execute(
            "SELECT checkpoint_id, parent_checkpoint_id, metadata FROM checkpoints"
            " WHERE thread_id = %s AND checkpoint_ns = ''", (conversation_id,))}
        if not rows:
            return Removal("prune", conversation_id)
        kept, pruned, steps = kept_and_pruned(rows, keep)
        if not pruned:
            return Removal("prune", conversation_id, kept_checkpoints=len(kept))
        root = kept[-1]
        saver = PostgresSaver(conn)
        root_tuple = saver.get_tuple({"configurable": {"thread_id": conversation_id, "checkpoint_ns": "",
                                                       "checkpoint_id": root}})
        snapshots = delta_snapshots(saver, conversation_id, root, root_tuple.checkpoint)
        root_size = ("SELECT pg_column_size(c.*) AS size FROM checkpoints c"
                     " WHERE thread_id = %s AND checkpoint_ns = '' AND checkpoint_id = %s")
        grown = -conn.execute(root_size, (conversation_id, root)).fetchone()["size"]
        if snapshots:
            versions = root_tuple.checkpoint["channel_versions"]
            for blob in saver._dump_blobs(conversation_id, "", snapshots, {k: versions[k] for k in snapshots}):
                grown += conn.execute(
                    "INSERT INTO checkpoint_blobs (thread_id, checkpoint_ns, channel, version, type, blob)"
                    " VALUES (%s, %s, %s, %s, %s, %s) RETURNING pg_column_size(checkpoint_blobs.*) AS size",
                    blob).fetchone()["size"]
            # What the saver's own put leaves inline for a snapshot stored as a blob: `true`.
            conn.execute(
                "UPDATE checkpoints SET checkpoint = jsonb_set(checkpoint, '{channel_values}',"
                " (checkpoint -> 'channel_values') || %s::jsonb), metadata = %s"
                " WHERE thread_id = %s AND checkpoint_ns = '' AND checkpoint_id = %s",
                (json.dumps(dict.fromkeys(snapshots, True)),
                 json.dumps(without_snapshot_counters(rows[root][1], list(snapshots)), ensure_ascii=False),
                 conversation_id, root))
        conn.execute("UPDATE checkpoints SET parent_checkpoint_id = NULL WHERE thread_id = %s"
                     " AND checkpoint_ns = '' AND checkpoint_id = %s", (conversation_id, root))
        grown += conn.execute(root_size, (conversation_id, root)).fetchone()["size"]
        gone = {}
        for table in ("checkpoint_writes", "checkpoints"):
            deleted = conn.execute(
                f"DELETE FROM {table} t WHERE thread_id = %s AND checkpoint_ns = '' AND checkpoint_id = ANY(%s)"
                " RETURNING pg_column_size(t.*) AS size", (conversation_id, pruned)).fetchall()
            gone[table] = (len(deleted), sum(row["size"] for row in deleted))
        # A blob is a channel's value at a version: it stays while a kept checkpoint names it.
        blobs = conn.execute(
            "DELETE FROM checkpoint_blobs b WHERE thread_id = %s AND checkpoint_ns = '' AND NOT EXISTS ("
            " SELECT 1 FROM checkpoints c WHERE c.thread_id = b.thread_id AND c.checkpoint_ns = b.checkpoint_ns"
            " AND c.checkpoint -> 'channel_versions' ->> b.channel = b.version)"
            " RETURNING pg_column_size(b.*) AS size", (conversation_id,)).fetchall()
        removal = Removal(
            "prune", conversation_id, checkpoints=gone["checkpoints"][0], writes=gone["checkpoint_writes"][0],
            bytes=gone["checkpoints"][1] + gone["checkpoint_writes"][1] + sum(row["size"] for row in blobs),
            kept_checkpoints=len(kept), snapshot_bytes=max(grown, 0) if snapshots else 0)
        conn.execute(
            "INSERT INTO prunes (conversation_id, pruned_at, checkpoints, writes, bytes, first_step, last_step,"
            " kept_from) VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
            (conversation_id, utc_now(), removal.checkpoints, removal.writes, removal.bytes, *steps, root))
        return removal

    def prune_records(self, conversation_id: str) -> list[dict[str, Any]]:
        return self.conn.execute(
            "SELECT pruned_at, checkpoints, writes, bytes, first_step, last_step, kept_from FROM prunes"
            " WHERE conversation_id = %s ORDER BY id", (conversation_id,)).fetchall()

    def conversation_ids(self) -> list[str]:
        return [row["id"] for row in self.conn.execute("SELECT id FROM conversations ORDER BY created_at, seq")]

    def vacuum(self, me: Owner | None) -> Vacuum:
        """`VACUUM FULL` of the kit's and LangGraph's tables: each is rewritten without its dead
        rows, and the space goes back to the file system (a plain `VACUUM`, which autovacuum
        runs, only lets the server reuse it). Refused while a live process runs a run anywhere:
        `VACUUM FULL` locks each table whole while it rewrites it."""
        conn = self.conn
        with self._lock:
            running = [row["id"] for row in conn.execute("SELECT id FROM runs WHERE status IN ('running', 'queued')")]
            gone = set() if me is None else set(self._stale_runs(conn, None))
            if live := [run for run in running if run not in gone]:
                raise SophosError(SESSION_IN_PROGRESS, (
                    f"{len(live)} run(s) queued or in progress in a live process; VACUUM FULL locks each table while it "
                    "rewrites it, so run it when they have finished. Nothing was changed."))
            tables = [table for table, _ in _KEYED_TO_CONVERSATION] + ["owners"]
            size = ("SELECT sum(pg_total_relation_size(t::regclass))::bigint AS size"
                    " FROM unnest(%s::text[]) AS t")
            before = conn.execute(size, (tables,)).fetchone()["size"]
            try:
                with _refused_when_full():
                    conn.execute(f"VACUUM FULL {', '.join(tables)}")
            except psycopg.errors.LockNotAvailable as error:
                raise SophosError(SESSION_IN_PROGRESS, (
                    "Another connection held a table for over 5 s; VACUUM FULL gave up on it "
                    f"(the tables before it were rewritten): {error}")) from error
            after = conn.execute(size, (tables,)).fetchone()["size"]
            name = conn.info.dbname
        return Vacuum(name, before, after, None)


def _title(message: str) -> str:
    """`title_from_message`, with U+FFFD for a NUL, which PostgreSQL's text cannot hold (the
    message itself is kept exactly: its JSON escapes NUL, and the checkpoints store bytes)."""
    return title_from_message(message).replace("\x00", "\ufffd")


# Children before parents: the checkpoint tables have no foreign keys, the kit's cascade anyway.
_KEYED_TO_CONVERSATION = (
    ("run_events", "conversation_id"), ("checkpoint_writes", "thread_id"), ("checkpoint_blobs", "thread_id"), ("checkpoints", "thread_id"),
    ("prunes", "conversation_id"), ("idempotency_keys", "conversation_id"), ("gates", "conversation_id"),
    ("runs", "conversation_id"), ("conversations", "id"),
)


# As SQLite's `_LISTING_SQL`: each conversation with its latest run, read off the index on
# (conversation_id, seq); `seq` is the position the cursor carries.
_LISTING_SQL = """
SELECT c.seq, c.id, c.title, c.created_at, c.updated_at, c.message_count,
       r.status, r.error_code, r.error_message
FROM conversations c
LEFT JOIN LATERAL (
    SELECT status, error_code, error_message FROM runs WHERE conversation_id = c.id ORDER BY seq DESC LIMIT 1
) r ON true"""
_LISTING_ORDER = " ORDER BY c.updated_at DESC, c.seq DESC"


def _run(row: dict | None) -> Run | None:
    if row is None:
        return None
    row.pop("seq")
    row.pop("last_event_id", None)  # the queue's (`queue.event_span`), not the run's
    return Run(**row)


def _gate(row: dict | None) -> Gate | None:
    if row is None:
        return None
    row.pop("seq")
    row["calls"] = json.loads(row["calls"])
    row["decisions"] = None if row["decisions"] is None else json.loads(row["decisions"])
    return Gate(**row)


def shown_message_count(url: str, conversation_id: str) -> int | None:
    """`counting.shown_message_count` on PostgreSQL: the thread read once through a connection
    of its own (which the fence does not touch: it only reads)."""
    from langgraph.checkpoint.postgres import PostgresSaver

    from .agent import build_graph
    from .counting import snapshot_count

    with _connect(url) as conn:
        latest = conn.execute("SELECT id, input FROM runs WHERE conversation_id = %s ORDER BY seq DESC LIMIT 1",
                              (conversation_id,)).fetchone()
        snapshot = build_graph(None, PostgresSaver(conn)).get_state({"configurable": {"thread_id": conversation_id}})
    return snapshot_count(snapshot, (latest["id"], latest["input"]) if latest else None)


# the checkpoints


def _notifying_saver_class():
    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

    class NotifyingPostgresSaver(Notifying, AsyncPostgresSaver):
        """LangGraph's AsyncPostgresSaver, saved-then-told and fenced (see the module)."""

        def __init__(self, conn: Any, lock: asyncio.Lock | None = None, **kwargs: Any) -> None:
            super().__init__(conn, **kwargs)
            self.supports_pipeline = False  # one transaction per write (see the module)
            self._notifying(lock)

    return NotifyingPostgresSaver


async def open_saver(url: str, owner_id: str | None, lock: asyncio.Lock | None = None) -> tuple[Any, Any]:
    """A pool and the saver on it. With `owner_id`, every connection of the pool is fenced to
    that owner (None: the original's single-owner rule, no fence)."""
    from psycopg_pool import AsyncConnectionPool

    async def configure(conn: psycopg.AsyncConnection) -> None:
        if owner_id is not None:
            await conn.execute("SELECT set_config('sophos.owner_id', %s, false)", (owner_id,))

    pool = AsyncConnectionPool(
        url, min_size=1, max_size=4, open=False, configure=configure, check=AsyncConnectionPool.check_connection,
        reconnect_timeout=RECONNECT_SECONDS,
        kwargs={"autocommit": True, "row_factory": dict_row, "prepare_threshold": None, "options": SESSION_OPTIONS},
    )
    await pool.open(wait=True)
    return pool, _notifying_saver_class()(pool, lock=lock)

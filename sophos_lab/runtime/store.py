"""The application's own tables, `conversations` and `runs`, in the one SQLite file.

LangGraph's checkpoint tables live in the same file but are owned by its saver, on a connection
of their own: the saver commits after every write, and it must not commit ours by accident.

Nothing opens the file until something needs it. The first open applies pending migrations and
then relabels `running` rows `interrupted` — only those whose owner is gone (see `ownership`):
several processes may share the file, and a live process's run is left alone. The same sweep
runs, for one conversation, before a run starts there and before a conversation is read, so a
process that died while another one was open is recovered as soon as anyone looks.

On a full disk (SQLite: "database or disk is full") every write is refused with `STORAGE_FULL`
and writes nothing (see `storage_full`). A first open that cannot write this owner's row, or
the recovery after it, still opens the file, for reading: listings and conversations read as
they are on disk (a dead process's run may still say `running`), and the owner's row and the
recovery are written by the next write or look that finds space again.

With `single_owner=True` the store does what the original did: the first open relabels every
`running` row, whoever runs it, and outcomes are written without checking who owns the run.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import logging
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, fields
from datetime import datetime, timezone
from pathlib import Path

from .errors import BAD_REQUEST, CANCELLED, CONFIG_ERROR, CANCELLED_MESSAGE, GATE_DECIDED, IDEMPOTENCY_KEY_REUSED, SCHEMA_TOO_NEW, SESSION_IN_PROGRESS, STORAGE_FULL, SophosError
from . import users
from .ownership import Owner, owner_gone

log = logging.getLogger(__name__)

RUN_STATUSES = ("running", "interrupted", "completed", "failed", "cancelled", "waiting")

MIGRATIONS: tuple[str, ...] = (
    # v1: the original's two tables, plus a partial unique index that lets the database itself
    # refuse a second running run on one conversation.
    """
    CREATE TABLE conversations (
        id TEXT PRIMARY KEY,
        title TEXT NOT NULL,
        created_at TEXT NOT NULL,
        updated_at TEXT NOT NULL,
        message_count INTEGER NOT NULL DEFAULT 0
    );
    CREATE TABLE runs (
        id TEXT PRIMARY KEY,
        conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        status TEXT NOT NULL
            CHECK (status IN ('running', 'interrupted', 'completed', 'failed', 'cancelled')),
        error_code TEXT,
        error_message TEXT,
        started_at TEXT NOT NULL,
        finished_at TEXT
    );
    CREATE INDEX runs_by_conversation ON runs (conversation_id, started_at);
    CREATE UNIQUE INDEX one_running_run_per_conversation ON runs (conversation_id)
        WHERE status = 'running';
    """,
    # v2: run ownership, and the user's message kept with the run that carries it.
    # `owners` has one row per open store; `runs.owner_id` keeps naming the owner after its row
    # is gone. `runs.input` holds the messages a run adds to the thread (JSON), written in the
    # same transaction as the run, so an accepted message is on disk before anyone is told.
    """
    CREATE TABLE owners (
        id TEXT PRIMARY KEY,
        host TEXT NOT NULL,
        boot_id TEXT NOT NULL,
        pid INTEGER NOT NULL,
        pid_started TEXT NOT NULL,
        opened_at TEXT NOT NULL,
        lease_expires_at REAL NOT NULL,
        lease_expires_monotonic REAL NOT NULL
    );
    ALTER TABLE runs ADD COLUMN owner_id TEXT;
    ALTER TABLE runs ADD COLUMN input TEXT;
    """,
    # v3: a record of every prune (see `retention`), so that the history views can say which
    # checkpoints are no longer there: how many, which steps, when. `kept_from` is the oldest
    # checkpoint kept, which holds the whole message list from then on.
    """
    CREATE TABLE prunes (
        id INTEGER PRIMARY KEY,
        conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        pruned_at TEXT NOT NULL,
        checkpoints INTEGER NOT NULL,
        writes INTEGER NOT NULL,
        bytes INTEGER NOT NULL,
        first_step INTEGER,
        last_step INTEGER,
        kept_from TEXT NOT NULL
    );
    CREATE INDEX prunes_by_conversation ON prunes (conversation_id, id);
    """,
    # v4: listing without a scan. The listing's order (updated_at DESC, rowid DESC) is read off
    # an index, so a page costs its own rows; each row's latest run (highest rowid: runs are
    # ordered by insertion, clocks step back) is the last entry of an index on conversation_id,
    # whose implicit rowid suffix is that order. It replaces (conversation_id, started_at),
    # which nothing reads in start-time order.
    """
    CREATE INDEX conversations_by_recency ON conversations (updated_at);
    DROP INDEX runs_by_conversation;
    CREATE INDEX runs_by_conversation ON runs (conversation_id);
    """,
    # v5: idempotency keys of the requests that started runs (the HTTP API's `Idempotency-Key`).
    # A key is written in the transaction that writes its run, so a repeat after any crash finds
    # either both or neither. `request` is the request in a canonical form: a repeat must match it.
    """
    CREATE TABLE idempotency_keys (
        key TEXT PRIMARY KEY,
        request TEXT NOT NULL,
        conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        run_id TEXT NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
        created_at TEXT NOT NULL
    );
    CREATE INDEX idempotency_keys_by_run ON idempotency_keys (run_id);
    CREATE INDEX idempotency_keys_by_conversation ON idempotency_keys (conversation_id);
    """,
    # v6: a cancel is written before the run is stopped, so a process that dies in between
    # leaves a run that recovery labels `cancelled`, not `interrupted` (the CHECK of v1 already
    # allows `cancelled`).
    """
    ALTER TABLE runs ADD COLUMN cancel_requested_at TEXT;
    """,
    # v7: approval gates. A run that stops before tool calls that need a person's approval is
    # `waiting` (a CHECK can only change by rebuilding the table, as SQLite documents; the
    # migration runs with foreign keys off, so the rebuild cascades into nothing). `gates` holds
    # each gate: the calls it holds back and, once decided, the decisions and the run that
    # carries them on, written in the transaction that starts that run.
    """
    CREATE TABLE runs_v7 (
        id TEXT PRIMARY KEY,
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
    INSERT INTO runs_v7 (rowid, id, conversation_id, status, error_code, error_message, started_at,
                         finished_at, owner_id, input, cancel_requested_at)
        SELECT rowid, id, conversation_id, status, error_code, error_message, started_at,
               finished_at, owner_id, input, cancel_requested_at FROM runs;
    DROP TABLE runs;
    ALTER TABLE runs_v7 RENAME TO runs;
    CREATE INDEX runs_by_conversation ON runs (conversation_id);
    CREATE UNIQUE INDEX one_running_run_per_conversation ON runs (conversation_id)
        WHERE status = 'running';
    CREATE TABLE gates (
        id TEXT NOT NULL,
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
    # v8: users of one server (see `users`): a token's SHA-256, and the user who owns each
    # conversation (NULL: made with no user acting, the single-user mode).
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
    # v9: the graph steps each run took, written with its outcome: a user's day's step budget
    # sums them (`users.step_budget`).
    """
    ALTER TABLE runs ADD COLUMN steps INTEGER NOT NULL DEFAULT 0;
    """,
)
SCHEMA_VERSION = len(MIGRATIONS)
BUSY_TIMEOUT_MS = 5000
PAGE_SIZE = 50
"""Conversations per page when the caller does not say."""
MAX_PAGE_SIZE = 1000


@dataclass(frozen=True)
class Conversation:
    """A conversation with the outcome of its latest run (`status` is None before any run)."""

    id: str
    title: str
    created_at: str
    updated_at: str
    message_count: int
    status: str | None
    error_code: str | None
    error_message: str | None


@dataclass(frozen=True)
class ConversationPage:
    """One page of the listing, most recently updated first."""

    conversations: list[Conversation]
    next_cursor: str | None
    """Pass it back for the page after this one; None when there is none."""


@dataclass(frozen=True)
class ListingPosition:
    """Where a page ends in the listing's order: the last row's `updated_at` and rowid."""

    updated_at: str
    rowid: int


def encode_cursor(position: ListingPosition) -> str:
    """The opaque cursor a client passes back (URL-safe base64 of JSON)."""
    raw = json.dumps([position.updated_at, position.rowid], separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_cursor(cursor: object) -> ListingPosition:
    """The position a cursor from `encode_cursor` names, given exactly as it wrote it; anything
    else is a `BAD_REQUEST`, never the first page: a client that mangled its cursor must not
    start over unawares."""
    shown = repr(cursor) if len(repr(cursor)) <= 60 else repr(cursor)[:57] + "..."
    bad = SophosError(
        BAD_REQUEST,
        f"Invalid cursor: {shown}. Pass back the next_cursor of the previous page unchanged, "
        "or no cursor for the first page.",
    )
    if not isinstance(cursor, str) or not cursor or len(cursor) > 512:
        raise bad
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        updated_at, rowid = json.loads(raw)
        if isinstance(updated_at, str):
            updated_at.encode("utf-8")  # JSON's \u escapes spell lone surrogates, which SQLite cannot bind
            if "\x00" in updated_at:  # and NUL, which no listing position holds (PostgreSQL cannot bind it)
                raise ValueError(updated_at)
    except (binascii.Error, ValueError, TypeError):  # UnicodeEncodeError is a ValueError
        raise bad from None
    if not isinstance(updated_at, str) or type(rowid) is not int or not 1 <= rowid <= 2**63 - 1:  # SQLite's integers
        raise bad
    position = ListingPosition(updated_at, rowid)
    # Base64 and JSON have other spellings of one position (padding, spare bits, spaces).
    if encode_cursor(position) != cursor:
        raise bad
    return position


def page_size(limit: object) -> int:
    """A page size: an int from 1 to `MAX_PAGE_SIZE`; anything else is a `BAD_REQUEST`."""
    if type(limit) is not int or not 1 <= limit <= MAX_PAGE_SIZE:
        raise SophosError(BAD_REQUEST, f"Invalid limit: {limit!r}. A page holds 1 to {MAX_PAGE_SIZE} conversations.")
    return limit


@dataclass(frozen=True)
class Run:
    """One attempt to advance a conversation's thread."""

    id: str
    conversation_id: str
    status: str
    error_code: str | None
    error_message: str | None
    started_at: str
    finished_at: str | None
    owner_id: str | None = None
    input: str | None = None
    """The user's messages this run adds to the thread, as JSON `[{"id", "content"}]`."""
    cancel_requested_at: str | None = None
    """When `cancel()` was accepted for this run (None: never asked to stop)."""
    claimed_at: str | None = None
    """PostgreSQL with workers: when a worker took the `queued` run (None: run where accepted)."""
    requeues: int = 0
    """PostgreSQL with workers: how often a crash put the run back in the queue (`RUN_REQUEUES`)."""
    steps: int = 0
    """The graph steps the run took, recorded with its outcome (0 until then); for a run a
    crash ended, the steps it saved, recorded when recovery relabels it."""


@dataclass(frozen=True)
class Gate:
    """An approval gate: tool calls held back until a person decides on each (see `approve`)."""

    id: str
    """LangGraph's id of the interrupt that holds the calls."""
    conversation_id: str
    run_id: str
    """The run that stopped at the gate (`waiting` until a decision starts the next one)."""
    calls: list[dict]
    """The calls held back, `[{"id", "name", "args"}]`, as the model made them."""
    created_at: str
    decisions: dict[str, dict] | None = None
    """Per tool call id `{"decision": "approve" | "reject", "reason"?}`; None while undecided."""
    decided_at: str | None = None
    decided_run_id: str | None = None
    """The run that carried the decisions into the thread."""

    @property
    def decided(self) -> bool:
        return self.decisions is not None

    def to_dict(self) -> dict:
        return {"gate": self.id, "run": self.run_id, "calls": self.calls, "created_at": self.created_at,
                "decisions": self.decisions, "decided_at": self.decided_at, "decided_run": self.decided_run_id}


def _gate(row: sqlite3.Row) -> Gate:
    values = dict(row)
    values["calls"] = json.loads(values["calls"])
    values["decisions"] = None if values["decisions"] is None else json.loads(values["decisions"])
    return Gate(**values)


@dataclass(frozen=True)
class IdempotencyKey:
    """A client's key for the request that starts a run, and that request in a canonical form."""

    key: str
    request: str


@dataclass(frozen=True)
class KeyedRun:
    """The run a key started (a row of `idempotency_keys`)."""

    key: str
    request: str
    conversation_id: str
    run_id: str
    created_at: str


def unapplied_input(run_id: str, run_input: str | None, checkpoint_run_id: str | None) -> list[dict[str, str]]:
    """The messages a conversation's latest run carries, if they never reached its thread.

    Every checkpoint names the run that wrote it, so the run's input is in the thread exactly
    when the thread's latest checkpoint is that run's.
    """
    if not run_input or checkpoint_run_id == run_id:
        return []
    return json.loads(run_input)


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def title_from_message(message: str) -> str:
    """The first line of the first message, trimmed, cut to 50 characters plus `...`."""
    first_line = message.strip().splitlines()[0].strip() if message.strip() else ""
    if not first_line:
        return "New Conversation"
    return first_line if len(first_line) <= 50 else first_line[:50] + "..."


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


def use_wal(conn: sqlite3.Connection, attempts: int = 100) -> None:
    """Switch the file to WAL. On a new file several processes may try at once, and SQLite
    answers a switch that meets another connection with SQLITE_BUSY without waiting for it."""
    for attempt in range(attempts):
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as error:
            if "locked" not in str(error) or attempt == attempts - 1:
                raise
            time.sleep(0.01)


def migrate(conn: sqlite3.Connection) -> None:
    """Apply the missing migrations in one write transaction.

    The version is read again under the write lock: several processes may open an old (or a
    new, empty) file at the same moment, and only the first one may migrate it.
    """
    conn.execute("BEGIN IMMEDIATE")
    try:
        broken_before = set(conn.execute("PRAGMA foreign_key_check").fetchall())
        for number in range(schema_version(conn) + 1, SCHEMA_VERSION + 1):
            for statement in MIGRATIONS[number - 1].split(";"):
                if statement.strip():
                    conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {number}")
        # Only what the migrations broke: a file may hold dangling rows written with foreign keys off.
        broken = [row for row in conn.execute("PRAGMA foreign_key_check").fetchall() if row not in broken_before]
        if broken:
            raise SophosError(CONFIG_ERROR, (
                f"Upgrading the file's schema would break {len(broken)} references ({broken[:3]}); the "
                "file was not changed."))
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def connect(path: Path) -> sqlite3.Connection:
    """Open the file for the application: WAL, busy timeout, foreign keys, migrations applied.

    A file whose schema is newer than this code is refused before anything is written to it.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    try:
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        version = schema_version(conn)
        if version > SCHEMA_VERSION:
            raise SophosError(
                SCHEMA_TOO_NEW,
                f"{path} has schema version {version}, but this sophos_lab knows versions up to "
                f"{SCHEMA_VERSION}. Upgrade sophos_lab or point DATABASE_PATH at another file; "
                "the file was not changed.",
            )
        use_wal(conn)
        # In WAL mode NORMAL keeps every commit across a process crash (kill -9 included) and
        # saves an fsync per commit (3 ms here); only a power loss can lose the last run rows,
        # and the checkpoints, written by the saver's own connection, keep SQLite's FULL.
        conn.execute("PRAGMA synchronous = NORMAL")
        if version < SCHEMA_VERSION:
            migrate(conn)  # with foreign keys off (a new connection's default): see v7
        conn.execute("PRAGMA foreign_keys = ON")
    except BaseException:
        conn.close()
        raise
    conn.row_factory = sqlite3.Row
    return conn


_RUNNING_SQL = """
SELECT r.id AS run_id, o.id, o.host, o.boot_id, o.pid, o.pid_started, o.lease_expires_at,
       o.lease_expires_monotonic, o.id IS NOT NULL AS has_owner
FROM runs r LEFT JOIN owners o ON o.id = r.owner_id
WHERE r.status = 'running'"""


def run_scope(conversation_id: str | None, user_id: str | None, mark: str = "?") -> tuple[str, tuple]:
    """A condition to add to a query of `runs r`: the runs of one user's conversations (`user_id`),
    else of one conversation, else nothing (every run). `mark`: the driver's placeholder."""
    if user_id is not None:
        return f" AND r.conversation_id IN (SELECT id FROM conversations WHERE user_id = {mark})", (user_id,)
    if conversation_id is not None:
        return f" AND r.conversation_id = {mark}", (conversation_id,)
    return "", ()


def stale_runs(conn: sqlite3.Connection, me: Owner, conversation_id: str | None = None,
               user_id: str | None = None) -> list[str]:
    """The `running` runs whose owner is gone, of `run_scope`'s runs."""
    scope, params = run_scope(conversation_id, user_id)
    return [
        row["run_id"] for row in conn.execute(_RUNNING_SQL + scope, params)
        if owner_gone(dict(row) if row["has_owner"] else None, me)
    ]


# A stranded run is `interrupted`, unless a cancel was accepted for it before its process died:
# then it is `cancelled`, as it would have been recorded.
RELABELLED = f"""
    status = CASE WHEN cancel_requested_at IS NULL THEN 'interrupted' ELSE 'cancelled' END,
    error_code = CASE WHEN cancel_requested_at IS NULL THEN error_code ELSE '{CANCELLED}' END,
    error_message = CASE WHEN cancel_requested_at IS NULL THEN error_message ELSE '{CANCELLED_MESSAGE}' END,"""
"""What a relabelled run's row becomes, in SQL both backends share (each adds `finished_at`)."""
_RELABEL = f"UPDATE runs SET {RELABELLED} finished_at = ? WHERE status = 'running'"


# A run that recorded no outcome (its process died) took as many graph steps as it checkpointed.
# Each step of the loop writes one `loop` checkpoint; a run's input writes an `input` one, and
# then its `__start__` task a `loop` one that is no step: so the steps are its `loop` checkpoints
# less its `input` ones (none, not -1, for a run killed between the two). The step in progress is
# not counted. A re-queued run (PostgreSQL) gets it at each re-queue: its attempts share its id,
# so the count covers them all, and `max` keeps what the column has if that is more.
_SAVED_STEPS = """
UPDATE runs SET steps = max(steps, (
    SELECT count(*) FILTER (WHERE json_extract(CAST(metadata AS TEXT), '$.source') = 'loop')
         - count(*) FILTER (WHERE json_extract(CAST(metadata AS TEXT), '$.source') = 'input')
    FROM checkpoints
    WHERE thread_id = runs.conversation_id AND checkpoint_ns = ''
      AND json_extract(CAST(metadata AS TEXT), '$.run_id') = runs.id))
WHERE id = ?"""


def relabel_interrupted(conn: sqlite3.Connection, run_ids: list[str], path: str | Path | None = None) -> int:
    """Mark these runs `interrupted` (`cancelled` if a cancel was accepted) if they are still
    `running`; how many were.

    With `path` (the file `conn` is open on; call it inside a transaction), the conversation of
    each run relabelled gets its `message_count` from its thread, in the same transaction: the
    run recorded no outcome, so the column still held what its row wrote (see `counting`).
    Each gets the steps it saved as its `steps` (`_SAVED_STEPS`), which its user's day counts."""
    now = utc_now()
    relabelled = [run_id for run_id in run_ids if conn.execute(_RELABEL + " AND id = ?", (now, run_id)).rowcount]
    if relabelled and has_table(conn, "checkpoints"):
        conn.executemany(_SAVED_STEPS, [(run_id,) for run_id in relabelled])
    if path is not None and relabelled:
        from .counting import recount

        recount(conn, path, relabelled)
    return len(relabelled)


def forget_gone_owners(conn: sqlite3.Connection, me: Owner) -> None:
    """Delete the rows of gone owners that no longer hold a `running` run."""
    gone = [
        row["id"] for row in conn.execute(
            "SELECT * FROM owners WHERE id != ? AND id NOT IN"
            " (SELECT owner_id FROM runs WHERE status = 'running' AND owner_id IS NOT NULL)",
            (me.id,),
        )
        if owner_gone(dict(row), me)
    ]
    conn.executemany("DELETE FROM owners WHERE id = ?", [(owner_id,) for owner_id in gone])


def recover_interrupted_runs(conn: sqlite3.Connection, path: str | Path | None = None) -> int:
    """The original's recovery: relabel every `running` row `interrupted` (or `cancelled`, see
    `_RELABEL`); how many. `path` as for `relabel_interrupted`."""
    running = [row[0] for row in conn.execute("SELECT id FROM runs WHERE status = 'running'")]
    return relabel_interrupted(conn, running, path)


class Store:
    """Lazy access to the application tables of one database file, as one owner."""

    def __init__(self, path: Path, lease_seconds: float = 15.0, single_owner: bool = False,
                 limits: users.Limits = users.Limits()) -> None:
        self.path = Path(path)
        self.limits = limits
        """What one user may have running at once and spend (see `users.check_limits`)."""
        self.lease_seconds = lease_seconds
        self.single_owner = single_owner
        self.owner: Owner | None = None
        """This store's identity in `owners`, from its first open on."""
        self._conn: sqlite3.Connection | None = None
        self._lock = threading.RLock()
        self.recovered_runs = 0
        """How many `running` rows the last open relabelled `interrupted`."""
        self._sweep_pending = False
        """The last open could not write its owner row and recovery (a full disk): the next
        `recover` writes them."""

    @property
    def is_open(self) -> bool:
        return self._conn is not None

    @property
    def conn(self) -> sqlite3.Connection:
        """The connection, opened (with migrations and recovery) on first use."""
        with self._lock:
            if self._conn is None:
                with full_disk_refused(self.path):
                    conn = connect(self.path)
                # One identity per Store: a store closed and opened again is still the same owner.
                self.owner = self.owner or Owner.here()
                try:
                    self._conn = conn
                    self.recovered_runs, self._sweep_pending = 0, True
                    try:
                        self._open_sweep()
                    except SophosError as error:
                        if error.code != STORAGE_FULL:
                            raise
                        # Open for reading: what is on disk can still be read (see the module).
                        log.info("%s is open for reading only until there is space again: %s",
                                    self.path, error.message)
                except BaseException:
                    self._conn = None
                    conn.close()
                    raise
            return self._conn

    def close(self) -> None:
        """Close the file; this owner's runs still `running` become recoverable at once."""
        with self._lock:
            if self._conn is not None:
                try:
                    self._conn.execute("DELETE FROM owners WHERE id = ?", (self.owner.id,))
                except sqlite3.Error:
                    pass  # closing anyway: the lease runs out instead
                self._conn.close()
                self._conn = None

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """The connection inside one write transaction (`BEGIN IMMEDIATE`), committed when the
        block ends and rolled back when it (or the commit) raises.

        On a full disk it raises `STORAGE_FULL`, with nothing of the transaction written: SQLite
        undoes it whole (often by itself, when a statement or the commit finds no space).
        """
        conn = self.conn
        with self._lock, full_disk_refused(self.path):
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:  # SQLite may have rolled it back already (SQLITE_FULL)
                    conn.execute("ROLLBACK")
                raise

    def _transaction(self, statements: list[tuple[str, tuple]]) -> list[int]:
        """Run the statements in one write transaction; their row counts."""
        with self.transaction() as conn:
            return [conn.execute(sql, params).rowcount for sql, params in statements]

    # ownership

    def _lease_statement(self, owner: Owner) -> tuple[str, tuple]:
        return (
            "INSERT INTO owners (id, host, boot_id, pid, pid_started, opened_at, lease_expires_at,"
            " lease_expires_monotonic) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT (id) DO UPDATE SET lease_expires_at = excluded.lease_expires_at,"
            " lease_expires_monotonic = excluded.lease_expires_monotonic",
            (owner.id, owner.host, owner.boot_id, owner.pid, owner.pid_started, utc_now(),
             time.time() + self.lease_seconds, time.monotonic() + self.lease_seconds),
        )

    def _register(self, owner: Owner) -> None:
        self._transaction([self._lease_statement(owner)])

    def _open_sweep(self) -> None:
        """What an open writes: this owner's row, then the recovery of runs left `running`."""
        conn = self._conn
        self._register(self.owner)
        with full_disk_refused(self.path):
            if self.single_owner:
                with self.transaction():
                    self.recovered_runs = recover_interrupted_runs(conn, self.path)
            else:
                self.recovered_runs = self._relabel_stale(None)
                forget_gone_owners(conn, self.owner)  # those that died holding no run
        self._sweep_pending = False

    def recover(self, conversation_id: str | None = None, user_id: str | None = None) -> int:
        """Relabel `interrupted` the `running` runs whose owner is gone (of one user's
        conversations, else of one conversation, else of all: `run_scope`); how many.

        A read decides whether there is anything to do, so the common case takes no write lock;
        the relabelling re-checks under the lock (`status = 'running'`).

        On a full disk the relabelling cannot be written: it is left for a later look (and
        logged), and 0 is returned, so that reading goes on. A run start does not read past it
        (`start_run` is refused with `STORAGE_FULL`).
        """
        self.conn  # noqa: B018 - an open that cannot even read raises STORAGE_FULL here
        try:
            return self._recover(conversation_id, user_id)
        except SophosError as error:
            if error.code != STORAGE_FULL:
                raise
            log.info("could not recover the runs of %s yet: %s", self.path, error.message)
            return 0

    def _recover(self, conversation_id: str | None = None, user_id: str | None = None) -> int:
        """`recover`, refused with `STORAGE_FULL` on a full disk. After an open that could not
        write its owner row and recovery, those first (the count is then the whole file's)."""
        self.conn  # noqa: B018 - opened (and swept, if it can be) on first use
        with self._lock:
            if self._sweep_pending:
                self._open_sweep()
                return self.recovered_runs
        if self.single_owner:
            return 0
        return self._relabel_stale(conversation_id, user_id)

    def _relabel_stale(self, conversation_id: str | None, user_id: str | None = None) -> int:
        conn = self.conn
        with self._lock:
            if not stale_runs(conn, self.owner, conversation_id, user_id):
                return 0
            with self.transaction():
                count = relabel_interrupted(conn, stale_runs(conn, self.owner, conversation_id, user_id), self.path)
                forget_gone_owners(conn, self.owner)
            return count

    def relabel(self, run_ids: list[str]) -> int:
        """Relabel these runs `interrupted` (`cancelled` if a cancel was accepted) if they are
        still `running`, in one transaction; how many were. For a live process's own runs whose
        outcome it could not write (`AgentService`); `recover` leaves a live owner's runs alone."""
        if not run_ids:
            return 0
        with self.transaction() as conn:
            return relabel_interrupted(conn, run_ids, self.path)

    def owned_runs(self) -> list[str]:
        """The ids of the runs `running` under this owner, whatever this process thinks it runs."""
        return [row[0] for row in self.conn.execute(
            "SELECT id FROM runs WHERE status = 'running' AND owner_id = ?", (self.owner.id,))]

    give_up = relabel
    """This owner's runs that no task of it works on any more, given up as a gone owner's are
    (see `AgentService._give_up_strays`); on PostgreSQL a worker's may go back in the queue."""

    def renew_lease(self, run_ids: list[str]) -> set[str]:
        """Extend this owner's lease; the ids among `run_ids` it no longer owns (taken over)."""
        conn = self.conn
        self._transaction([self._lease_statement(self.owner)])
        if not run_ids:
            return set()
        marks = ", ".join("?" * len(run_ids))
        still = {
            row[0] for row in conn.execute(
                f"SELECT id FROM runs WHERE id IN ({marks}) AND status = 'running' AND owner_id = ?",
                (*run_ids, self.owner.id),
            )
        }
        return set(run_ids) - still

    # conversations

    def create_conversation(self, conversation_id: str, first_message: str) -> None:
        now = utc_now()
        self._transaction([(
            "INSERT INTO conversations (id, title, created_at, updated_at, user_id) VALUES (?, ?, ?, ?, ?)",
            (conversation_id, title_from_message(first_message), now, now, users.acting_user.get()),
        )])

    def get_conversation(self, conversation_id: str) -> Conversation | None:
        """The conversation, if it is the acting user's (any, when no user acts: see `users`)."""
        where, params = users.mine()
        row = self.conn.execute(_LISTING_SQL + " WHERE c.id = ?" + where, (conversation_id, *params)).fetchone()
        return _conversation(row) if row else None

    def list_conversations(self) -> list[Conversation]:
        """Every conversation (the acting user's), most recently updated first (unbounded: see
        `conversation_page`)."""
        cursor = self.conn.cursor()
        cursor.row_factory = None  # plain tuples: see `_conversations`
        where, params = users.mine()
        if not params:
            return _conversations(cursor.execute(_ALL_SQL))
        return _conversations(cursor.execute(_all_sql(" WHERE true" + where), params))

    def conversation_page(self, limit: int = PAGE_SIZE, after: ListingPosition | None = None) -> ConversationPage:
        """Up to `limit` conversations after `after` in the listing's order (keyset pagination).

        A conversation created while a client walks the pages sorts before its cursor, so the
        walk shows every conversation it started with exactly once and none twice. One that is
        updated meanwhile (a new run) moves to the top: the walk shows it where it was if it got
        there first, otherwise not at all; the next first page shows it.
        """
        where, params = users.mine()
        sql = _LISTING_SQL + " WHERE true" + where
        if after is not None:
            sql, params = sql + _AFTER, (*params, after.updated_at, after.rowid)
        rows = self.conn.execute(sql + _LISTING_ORDER + " LIMIT ?", (*params, limit + 1)).fetchall()
        more, rows = len(rows) > limit, rows[:limit]
        last = ListingPosition(rows[-1]["updated_at"], rows[-1]["position"]) if rows else None
        return ConversationPage(
            conversations=[_conversation(row) for row in rows],
            next_cursor=encode_cursor(last) if more else None,
        )

    # runs

    def start_run(
        self,
        run_id: str,
        conversation_id: str,
        input_messages: list[dict[str, str]] | None = None,
        title: str | None = None,
        idempotency: IdempotencyKey | None = None,
        decision: tuple[Gate, dict[str, dict]] | None = None,
    ) -> None:
        """Start a run, in one transaction: the conversation (when `title` is given, it is new),
        this owner's lease, the `running` row with the messages it carries, `updated_at` and the
        message count (with those messages), the request's idempotency key if it has one, and the
        decisions on a gate if it carries some.

        A `running` run of a live owner on the conversation makes the database refuse the row
        (`SESSION_IN_PROGRESS`); one of a gone owner is relabelled `interrupted` first. A key
        already taken refuses the whole start (`IDEMPOTENCY_KEY_REUSED`): see `keyed_run`. A
        gate decided meanwhile (by another process) refuses it too (`GATE_DECIDED`). On a full
        disk it is refused with `STORAGE_FULL` and nothing of it is written. The acting user's
        runs of gone owners are relabelled first too: a crashed one holds no place in their limit.
        """
        self._recover(conversation_id, users.acting_user.get())
        now = utc_now()
        statements = []
        if title is not None:
            statements.append((
                "INSERT INTO conversations (id, title, created_at, updated_at, user_id) VALUES (?, ?, ?, ?, ?)",
                (conversation_id, title_from_message(title), now, now, users.acting_user.get()),
            ))
        statements += [
            self._lease_statement(self.owner),
            (
                "INSERT INTO runs (id, conversation_id, status, started_at, owner_id, input)"
                " VALUES (?, ?, 'running', ?, ?, ?)",
                (run_id, conversation_id, now, self.owner.id,
                 json.dumps(input_messages, ensure_ascii=False) if input_messages else None),
            ),
            # The messages it carries count from now on, as the conversation shows them (pending
            # until they reach the thread; see `counting`): the count before is true, recovered above.
            ("UPDATE conversations SET updated_at = ?, message_count = message_count + ? WHERE id = ?",
             (now, len(input_messages or ()), conversation_id)),
        ]
        if idempotency is not None:
            statements.append((
                "INSERT INTO idempotency_keys (key, request, conversation_id, run_id, created_at)"
                " VALUES (?, ?, ?, ?, ?)",
                (users.scoped_key(idempotency.key), idempotency.request, conversation_id, run_id, now),
            ))
        try:
            with self.transaction() as conn:
                if title is None:
                    users.check_owner(conn, conversation_id)
                users.check_limits(conn, "running", self.limits, now)
                for sql, params in statements:
                    conn.execute(sql, params)
                if decision is not None:
                    gate, decisions = decision
                    decided = conn.execute(
                        "UPDATE gates SET decisions = ?, decided_at = ?, decided_run_id = ?"
                        " WHERE conversation_id = ? AND id = ? AND decisions IS NULL",
                        (json.dumps(decisions, ensure_ascii=False), now, run_id, gate.conversation_id, gate.id),
                    ).rowcount
                    if not decided:
                        raise SophosError(GATE_DECIDED, f"The gate {gate.id} was decided already")
        except sqlite3.IntegrityError as error:
            if "idempotency_keys.key" in str(error):
                raise SophosError(IDEMPOTENCY_KEY_REUSED,
                                  f"The idempotency key {idempotency.key!r} has started a run already") from error
            if "one_running_run_per_conversation" in str(error) or "runs.conversation_id" in str(error):
                raise SophosError(SESSION_IN_PROGRESS, "Previous request still in progress") from error
            raise

    def finish_run(
        self,
        run_id: str,
        status: str,
        message_count: int | None,
        error_code: str | None = None,
        error_message: str | None = None,
        gate: Gate | None = None,
        steps: int = 0,
    ) -> bool:
        """Record a run's outcome, the graph steps it took and the conversation's message count,
        in one transaction; with `gate` (a `waiting` run), the gate it stopped at, in the same one.

        Only while the run is still this owner's and `running`: returns False, writing nothing,
        when another process has taken it over (fencing).
        """
        now = utc_now()
        mine = "" if self.single_owner else " AND status = 'running' AND owner_id = ?"
        with self.transaction() as conn:
            updated = conn.execute(
                "UPDATE runs SET status = ?, error_code = ?, error_message = ?, finished_at = ?, steps = steps + ?"
                " WHERE id = ?" + mine,
                (status, error_code, error_message, now, steps, run_id,
                 *(() if self.single_owner else (self.owner.id,))),
            ).rowcount
            if updated and message_count is not None:
                conn.execute(
                    "UPDATE conversations SET message_count = ?, updated_at = ?"
                    " WHERE id = (SELECT conversation_id FROM runs WHERE id = ?)",
                    (message_count, now, run_id),
                )
            if updated and gate is not None:
                conn.execute(
                    "INSERT INTO gates (id, conversation_id, run_id, calls, created_at) VALUES (?, ?, ?, ?, ?)"
                    " ON CONFLICT (conversation_id, id) DO UPDATE SET run_id = excluded.run_id",
                    (gate.id, gate.conversation_id, run_id, json.dumps(gate.calls, ensure_ascii=False), now),
                )
        return bool(updated)

    def gate(self, conversation_id: str, gate_id: str) -> Gate | None:
        row = self.conn.execute("SELECT * FROM gates WHERE conversation_id = ? AND id = ?",
                                (conversation_id, gate_id)).fetchone()
        return _gate(row) if row else None

    def gates(self, conversation_id: str) -> list[Gate]:
        """The conversation's gates, oldest first."""
        rows = self.conn.execute("SELECT * FROM gates WHERE conversation_id = ? ORDER BY rowid", (conversation_id,))
        return [_gate(row) for row in rows]

    def run_gate(self, run_id: str) -> Gate | None:
        """The gate a run stopped at, if it did."""
        row = self.conn.execute("SELECT * FROM gates WHERE run_id = ? ORDER BY rowid DESC LIMIT 1", (run_id,)).fetchone()
        return _gate(row) if row else None

    def request_cancel(self, run_id: str) -> bool:
        """Write that the run is to be cancelled, while it is still this owner's and `running`;
        False (nothing written) when its outcome is recorded already or it is not ours."""
        mine = "" if self.single_owner else " AND owner_id = ?"
        [updated] = self._transaction([(
            "UPDATE runs SET cancel_requested_at = ? WHERE id = ? AND status = 'running'"
            " AND cancel_requested_at IS NULL" + mine,
            (utc_now(), run_id, *(() if self.single_owner else (self.owner.id,))),
        )])
        return bool(updated)

    def cancel_requested(self, run_id: str) -> bool:
        """Whether a cancel of the run is recorded (by any process)."""
        row = self.conn.execute("SELECT cancel_requested_at FROM runs WHERE id = ?", (run_id,)).fetchone()
        return row is not None and row[0] is not None

    def get_run(self, run_id: str) -> Run | None:
        row = self.conn.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
        return Run(**row) if row else None

    def latest_run(self, conversation_id: str) -> Run | None:
        row = self.conn.execute(
            "SELECT * FROM runs WHERE conversation_id = ? ORDER BY rowid DESC LIMIT 1",
            (conversation_id,),
        ).fetchone()
        return Run(**row) if row else None

    def keyed_run(self, key: str) -> KeyedRun | None:
        """The run an idempotency key started, if it started one."""
        row = self.conn.execute("SELECT * FROM idempotency_keys WHERE key = ?", (users.scoped_key(key),)).fetchone()
        return KeyedRun(**row) if row else None

    def list_runs(self, conversation_id: str | None = None) -> list[Run]:
        """Runs in start order, of one conversation or of all."""
        sql, params = "SELECT * FROM runs", ()
        if conversation_id is not None:
            sql, params = sql + " WHERE conversation_id = ?", (conversation_id,)
        rows = self.conn.execute(sql + " ORDER BY rowid", params)  # insertion order: clocks step back
        return [Run(**row) for row in rows]


# A conversation with its latest run's outcome (the run with the highest rowid: runs are ordered
# by insertion, clocks step back), and its rowid as `position`. In the listing's order, which
# `conversations_by_recency` holds (an index on updated_at ends with the rowid), there is no
# sort, and a page reads only its own rows and their latest runs; `position` breaks ties of
# updated_at and goes into the cursor.
_LISTING_SQL = """
SELECT c.rowid AS position, c.id, c.title, c.created_at, c.updated_at, c.message_count,
       r.status, r.error_code, r.error_message
FROM conversations c
LEFT JOIN runs r ON r.rowid = (
    SELECT rowid FROM runs WHERE conversation_id = c.id ORDER BY rowid DESC LIMIT 1
)"""
_AFTER = " AND (c.updated_at, c.rowid) < (?, ?)"
_LISTING_ORDER = " ORDER BY c.updated_at DESC, c.rowid DESC"


def _conversation(row: sqlite3.Row) -> Conversation:
    # The columns after `position` are Conversation's fields in order; by position, because
    # building 10,000 of them by name costs more than the query.
    return Conversation(*row[1:])


_FIELDS = tuple(field.name for field in fields(Conversation))
# The whole listing: the pages' rows in their order, with Conversation's fields as the columns,
# by name and in order. SQLite flattens the subquery: the plan is the pages' (the index in its
# order, one indexed look-up of the latest run per row), without a LIMIT.
def _all_sql(where: str = "") -> str:
    return f"SELECT {', '.join(_FIELDS)} FROM ({_LISTING_SQL}{where}) ORDER BY updated_at DESC, position DESC"


_ALL_SQL = _all_sql()
assert not hasattr(Conversation, "__post_init__") and "__slots__" not in vars(Conversation), (
    "_conversations fills a Conversation's __dict__ and runs no __init__ (see there)")


def _conversations(rows: sqlite3.Cursor) -> list[Conversation]:
    """Conversations from tuple rows of their fields in order (`_ALL_SQL`'s), each made without
    running `Conversation.__init__`.

    A frozen dataclass's `__init__` sets every field with `object.__setattr__`, eight calls a row:
    at 10,000 conversations about half as long as the query takes (benchmarks/listing.py).
    Filling a new instance's `__dict__` from the row takes less than half of that, and gives the
    same object: Conversation has no defaults, no `__post_init__` and no slots, so `==`, `hash`,
    `repr`, `asdict`, `replace` and pickling see no difference. The price is memory: the fields
    sit in a dict of the instance's own, about 64 bytes more a conversation than `__init__`'s
    inline values, for a list that is read once and dropped. Tuples, not `sqlite3.Row`s: nothing
    here reads a column by name.
    """
    new, names = object.__new__, _FIELDS
    listed: list[Conversation] = []
    append = listed.append
    for row in rows:
        conversation = new(Conversation)
        conversation.__dict__.update(zip(names, row))
        append(conversation)
    return listed

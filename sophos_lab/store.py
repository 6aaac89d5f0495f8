"""The application's own tables, `conversations` and `runs`, in the one SQLite file.

LangGraph's checkpoint tables live in the same file but are owned by its saver, on a connection
of their own: the saver commits after every write, and it must not commit ours by accident.

Nothing opens the file until something needs it. The first open in a process applies pending
migrations and then relabels every `running` row `interrupted`: a run that was running when this
process started cannot be running any more, because one process owns the file.
"""

from __future__ import annotations

import sqlite3
import threading
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from .errors import SCHEMA_TOO_NEW, SESSION_IN_PROGRESS, SophosError

RUN_STATUSES = ("running", "interrupted", "completed", "failed", "cancelled")

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
)
SCHEMA_VERSION = len(MIGRATIONS)
BUSY_TIMEOUT_MS = 5000


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
class Run:
    """One attempt to advance a conversation's thread."""

    id: str
    conversation_id: str
    status: str
    error_code: str | None
    error_message: str | None
    started_at: str
    finished_at: str | None


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
        conn.execute("PRAGMA journal_mode = WAL")
        # In WAL mode NORMAL keeps every commit across a process crash (kill -9 included) and
        # saves an fsync per commit (3 ms here); only a power loss can lose the last run rows,
        # and the checkpoints, written by the saver's own connection, keep SQLite's FULL.
        conn.execute("PRAGMA synchronous = NORMAL")
        conn.execute("PRAGMA foreign_keys = ON")
        for number in range(version + 1, SCHEMA_VERSION + 1):
            # executescript commits on its own, so the version bump goes inside the script.
            conn.executescript(
                f"BEGIN; {MIGRATIONS[number - 1]}; PRAGMA user_version = {number}; COMMIT;"
            )
    except BaseException:
        conn.close()
        raise
    conn.row_factory = sqlite3.Row
    return conn


def recover_interrupted_runs(conn: sqlite3.Connection) -> int:
    """Relabel every `running` row `interrupted`; returns how many were relabelled."""
    cursor = conn.execute(
        "UPDATE runs SET status = 'interrupted', finished_at = ? WHERE status = 'running'",
        (utc_now(),),
    )
    return cursor.rowcount


class Store:
    """Lazy access to the application tables of one database file."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._conn: sqlite3.Connection | None = None
        self._lock = threading.RLock()
        self.recovered_runs = 0
        """How many `running` rows the last open relabelled `interrupted`."""

    @property
    def is_open(self) -> bool:
        return self._conn is not None

    @property
    def conn(self) -> sqlite3.Connection:
        """The connection, opened (with migrations and recovery) on first use."""
        with self._lock:
            if self._conn is None:
                conn = connect(self.path)
                self.recovered_runs = recover_interrupted_runs(conn)
                self._conn = conn
            return self._conn

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def _transaction(self, statements: list[tuple[str, tuple]]) -> None:
        conn = self.conn
        with self._lock:
            conn.execute("BEGIN IMMEDIATE")
            try:
                for sql, params in statements:
                    conn.execute(sql, params)
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    # conversations

    def create_conversation(self, conversation_id: str, first_message: str) -> None:
        now = utc_now()
        self._transaction([(
            "INSERT INTO conversations (id, title, created_at, updated_at) VALUES (?, ?, ?, ?)",
            (conversation_id, title_from_message(first_message), now, now),
        )])

    def get_conversation(self, conversation_id: str) -> Conversation | None:
        row = self.conn.execute(_CONVERSATION_SQL + " WHERE c.id = ?", (conversation_id,)).fetchone()
        return Conversation(**row) if row else None

    def list_conversations(self) -> list[Conversation]:
        rows = self.conn.execute(_CONVERSATION_SQL + " ORDER BY c.updated_at DESC, c.rowid DESC")
        return [Conversation(**row) for row in rows]

    # runs

    def start_run(self, run_id: str, conversation_id: str) -> None:
        """Insert a `running` row and bump the conversation's `updated_at`, in one transaction."""
        now = utc_now()
        try:
            self._transaction([
                (
                    "INSERT INTO runs (id, conversation_id, status, started_at)"
                    " VALUES (?, ?, 'running', ?)",
                    (run_id, conversation_id, now),
                ),
                ("UPDATE conversations SET updated_at = ? WHERE id = ?", (now, conversation_id)),
            ])
        except sqlite3.IntegrityError as error:
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
    ) -> None:
        """Record a run's outcome and the conversation's message count, in one transaction."""
        now = utc_now()
        statements = [(
            "UPDATE runs SET status = ?, error_code = ?, error_message = ?, finished_at = ?"
            " WHERE id = ?",
            (status, error_code, error_message, now, run_id),
        )]
        if message_count is not None:
            statements.append((
                "UPDATE conversations SET message_count = ?, updated_at = ?"
                " WHERE id = (SELECT conversation_id FROM runs WHERE id = ?)",
                (message_count, now, run_id),
            ))
        self._transaction(statements)

    def get_run(self, run_id: str) -> Run | None:
        row = self.conn.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
        return Run(**row) if row else None

    def list_runs(self, conversation_id: str | None = None) -> list[Run]:
        """Runs in start order, of one conversation or of all."""
        sql, params = "SELECT * FROM runs", ()
        if conversation_id is not None:
            sql, params = sql + " WHERE conversation_id = ?", (conversation_id,)
        rows = self.conn.execute(sql + " ORDER BY started_at, rowid", params)
        return [Run(**row) for row in rows]


_CONVERSATION_SQL = """
SELECT c.id, c.title, c.created_at, c.updated_at, c.message_count,
       r.status, r.error_code, r.error_message
FROM conversations c
LEFT JOIN runs r ON r.rowid = (
    SELECT rowid FROM runs WHERE conversation_id = c.id ORDER BY started_at DESC, rowid DESC LIMIT 1
)"""

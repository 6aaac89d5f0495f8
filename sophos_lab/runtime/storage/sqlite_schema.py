"""The SQLite file's schema: the kit's migrations, one a version (`PRAGMA user_version`).

LangGraph's saver makes its own tables (`checkpoints`, `writes`) in the same file.
"""

from .schema import GATE_COLUMNS, IDEMPOTENCY_KEYS, OWNER_COLUMNS, RUN_COLUMNS, USERS

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
    f"""
    CREATE TABLE owners (
        {OWNER_COLUMNS}
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
    f"""
    {IDEMPOTENCY_KEYS}
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
    f"""
    CREATE TABLE runs_v7 (
        id TEXT PRIMARY KEY,
        {RUN_COLUMNS}
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
        {GATE_COLUMNS}
    """,
    # v8: users of one server (see `users`): a token's SHA-256, and the user who owns each
    # conversation (NULL: made with no user acting, the single-user mode).
    f"""
    {USERS}
    """,
    # v9: the graph steps each run took, written with its outcome: a user's day's step budget
    # sums them (`users.step_budget`).
    """
    ALTER TABLE runs ADD COLUMN steps INTEGER NOT NULL DEFAULT 0;
    """,
)
SCHEMA_VERSION = len(MIGRATIONS)

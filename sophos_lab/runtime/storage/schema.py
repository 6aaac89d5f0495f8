"""What the two backends' schemas spell the same way, written once; each backend's migrations
(`sqlite_schema`, `postgres_schema`) put them where its own versions have them.
"""

OWNER_COLUMNS = """id TEXT PRIMARY KEY,
        host TEXT NOT NULL,
        boot_id TEXT NOT NULL,
        pid INTEGER NOT NULL,
        pid_started TEXT NOT NULL,
        opened_at TEXT NOT NULL,"""
"""An owner's identity (`ownership.Owner`); its lease follows, on each backend's clock."""

RUN_COLUMNS = """conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        status TEXT NOT NULL
            CHECK (status IN ('running', 'interrupted', 'completed', 'failed', 'cancelled', 'waiting')),
        error_code TEXT,
        error_message TEXT,
        started_at TEXT NOT NULL,
        finished_at TEXT,
        owner_id TEXT,
        input TEXT,
        cancel_requested_at TEXT
    );"""
"""A run after its id (and PostgreSQL's `seq`), as SQLite's version 7 has it."""

GATE_COLUMNS = """conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        run_id TEXT NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
        calls TEXT NOT NULL,
        created_at TEXT NOT NULL,
        decisions TEXT,
        decided_at TEXT,
        decided_run_id TEXT REFERENCES runs(id) ON DELETE SET NULL,
        PRIMARY KEY (conversation_id, id)
    );
    CREATE INDEX gates_by_run ON gates (run_id);
    CREATE INDEX gates_by_decided_run ON gates (decided_run_id);"""
"""An approval gate after its id (and PostgreSQL's `seq`), with its indexes."""

IDEMPOTENCY_KEYS = """CREATE TABLE idempotency_keys (
        key TEXT PRIMARY KEY,
        request TEXT NOT NULL,
        conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        run_id TEXT NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
        created_at TEXT NOT NULL
    );
    CREATE INDEX idempotency_keys_by_run ON idempotency_keys (run_id);
    CREATE INDEX idempotency_keys_by_conversation ON idempotency_keys (conversation_id);"""
"""The idempotency keys of the requests that started runs (SQLite's version 5)."""

USERS = """CREATE TABLE users (
        id TEXT PRIMARY KEY,
        name TEXT NOT NULL UNIQUE,
        token_hash TEXT NOT NULL UNIQUE,
        created_at TEXT NOT NULL,
        revoked_at TEXT
    );
    ALTER TABLE conversations ADD COLUMN user_id TEXT REFERENCES users(id);
    CREATE INDEX conversations_by_user ON conversations (user_id);"""
"""Users of one server (SQLite's version 8, PostgreSQL's 4)."""

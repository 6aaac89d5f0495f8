"""PostgreSQL's schema: the kit's migrations, one row a version in `sophos_migrations`, applied
after LangGraph's saver migrations (v2 puts the fence on the saver's tables).
"""

from ..checkpointer import FENCED
from .schema import GATE_COLUMNS, IDEMPOTENCY_KEYS, OWNER_COLUMNS, RUN_COLUMNS, USERS

MIGRATION_LOCK = 0x50F05_1AB
"""The advisory lock every process holds while it migrates (any bigint no one else uses)."""

MIGRATIONS: tuple[str, ...] = (
    # v1: the tables of SQLite's seven versions, as they are at the last one.
    f"""
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
        {OWNER_COLUMNS}
        lease_expires_at TIMESTAMPTZ NOT NULL,
        lease_expires_monotonic DOUBLE PRECISION NOT NULL
    );
    CREATE TABLE runs (
        id TEXT PRIMARY KEY,
        seq BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE,
        {RUN_COLUMNS}
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
    {IDEMPOTENCY_KEYS}
    CREATE TABLE gates (
        id TEXT NOT NULL,
        seq BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE,
        {GATE_COLUMNS}
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
    f"""
    {USERS}
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
    # v7: fewer index entries a turn. An identity column's values are unique without an index
    # of their own (the listing and the queue order by `seq` through the indexes that hold it);
    # the users' index holds only conversations that have a user, and the two updates of a
    # conversation's row a turn (no update of it is HOT: `updated_at` is indexed for the
    # listing) no longer add an entry there for each of a lab's conversations, which have none.
    """
    ALTER TABLE conversations DROP CONSTRAINT conversations_seq_key;
    ALTER TABLE runs DROP CONSTRAINT runs_seq_key;
    ALTER TABLE gates DROP CONSTRAINT gates_seq_key;
    DROP INDEX conversations_by_user;
    CREATE INDEX conversations_by_user ON conversations (user_id) WHERE user_id IS NOT NULL;
    """,
)
SCHEMA_VERSION = len(MIGRATIONS)

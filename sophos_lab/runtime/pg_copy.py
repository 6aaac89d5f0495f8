"""Copy a SQLite lab into PostgreSQL: `sophos-lab migrate-to-postgres`.

Everything the file holds goes across, in its order: the conversations, their runs with their
inputs, the approval gates, the idempotency keys and the prune records, and each thread's whole
checkpoint history with every task's pending writes, through LangGraph's own savers (read with
`SqliteSaver`, written with `PostgresSaver`, so each saver stores checkpoints its own way). Owner
rows are not copied: they name processes of the file, not of the database.

It refuses, changing nothing, while a live process runs a run in the file (stop it first), and
when the database already holds conversations (a copy is not a merge). A run whose process is gone
is relabelled first, as any open of the file would; then everything is read in one snapshot of
the file (one read transaction), so a process that writes meanwhile cannot mix two states. After the copy, every thread is read back from
both sides through the graph and compared (its messages, `next`, and its number of checkpoints);
a difference is an error, and the copy is rolled back whole: the kit's tables are written in one
transaction, and LangGraph's rows of the copied threads are deleted again.
"""

from __future__ import annotations

import json
import sqlite3
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import CONFIG_ERROR, NOT_FOUND, SESSION_IN_PROGRESS, SophosError

# The kit's tables in an order that keeps every reference valid, each with its columns and the
# order its rows were written in (SQLite's rowid; PostgreSQL hands out `seq` in that order).
TABLES = (
    ("users", ("id", "name", "token_hash", "created_at", "revoked_at"), "rowid"),
    ("conversations", ("id", "title", "created_at", "updated_at", "message_count", "user_id"), "rowid"),
    ("runs", ("id", "conversation_id", "status", "error_code", "error_message", "started_at", "finished_at",
              "owner_id", "input", "cancel_requested_at", "steps"), "rowid"),
    ("gates", ("id", "conversation_id", "run_id", "calls", "created_at", "decisions", "decided_at",
               "decided_run_id"), "rowid"),
    ("idempotency_keys", ("key", "request", "conversation_id", "run_id", "created_at"), "rowid"),
    ("prunes", ("conversation_id", "pruned_at", "checkpoints", "writes", "bytes", "first_step", "last_step",
                "kept_from"), "id"),
)


@dataclass(frozen=True)
class Copied:
    """What a copy took across, and checked."""

    conversations: int
    runs: int
    checkpoints: int
    writes: int
    relabelled: int
    """Runs of gone processes relabelled in the file before the copy."""

    def describe(self) -> str:
        return (f"copied {self.conversations} conversations, {self.runs} runs, {self.checkpoints} checkpoints and "
                f"{self.writes} writes; every thread read back the same"
                + (f" ({self.relabelled} runs of gone processes relabelled first)" if self.relabelled else ""))


def copy_to_postgres(path: str | Path, url: str) -> Copied:
    """Copy the SQLite file at `path` into the PostgreSQL database at `url` (see the module)."""
    import psycopg
    from langgraph.checkpoint.postgres import PostgresSaver
    from langgraph.checkpoint.sqlite import SqliteSaver
    from psycopg.rows import dict_row

    from .storage import postgres_storage, sqlite_storage
    from .storage.blocking import Blocking
    from .storage.postgres import SESSION_OPTIONS
    from .storage.sqlite import read_only

    path = Path(path)
    if not path.exists():
        raise SophosError(NOT_FOUND, f"No database at {path}")
    with Blocking(lambda: sqlite_storage(path)) as source:
        relabelled = source.recover()  # the first open relabels gone processes' runs, as any open would

    # A command of its own, on no event loop: plain connections, read in one snapshot of the file.
    with read_only(path) as reader, psycopg.connect(url, autocommit=True, row_factory=dict_row,
                                                    prepare_threshold=None, options=SESSION_OPTIONS) as conn:
        reader.execute("BEGIN")  # one snapshot of the file for everything read below
        live = reader.execute("SELECT count(*) FROM runs WHERE status = 'running'").fetchone()[0]
        if live:
            raise SophosError(SESSION_IN_PROGRESS, (
                f"{live} run(s) in progress in a live process on {path}; stop it (or let the runs finish) "
                "and copy then. Nothing was copied."))
        with Blocking(lambda: postgres_storage(url)) as target:
            target.open()  # migrated, as a first open does
        if conn.execute("SELECT count(*) AS n FROM conversations").fetchone()["n"]:
            raise SophosError(CONFIG_ERROR, (
                "The PostgreSQL database already holds conversations: a copy is not a merge. Point "
                "DATABASE_URL at an empty database. Nothing was copied."))
        threads = [row[0] for row in reader.execute("SELECT id FROM conversations ORDER BY rowid")]
        counts: dict[str, int] = {}
        saver = PostgresSaver(conn)
        try:
            checkpoints = writes = 0
            for thread in threads:
                copied = _copy_thread(reader, SqliteSaver(reader), saver, thread)
                checkpoints, writes = checkpoints + copied[0], writes + copied[1]
            with conn.transaction():
                for table, columns, order in TABLES:
                    rows = reader.execute(f"SELECT {', '.join(columns)} FROM {table} ORDER BY {order}").fetchall()
                    if rows:
                        with conn.cursor() as cursor:
                            cursor.executemany(
                                f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join(['%s'] * len(columns))})",
                                rows)
                    counts[table] = len(rows)
                _verify(reader, conn, threads)
        except BaseException as error:
            try:
                for thread in threads:  # LangGraph's rows are written outside the transaction
                    saver.delete_thread(thread)
            except Exception as cleanup:
                raise SophosError(CONFIG_ERROR, (
                    f"The copy failed ({error}) and undoing it failed too ({cleanup}): drop the "
                    "PostgreSQL database and copy again.")) from error
            raise
    return Copied(counts["conversations"], counts["runs"], checkpoints, writes, relabelled)


def _copy_thread(reader: sqlite3.Connection, source: Any, target: Any, thread: str) -> tuple[int, int]:
    """A thread's checkpoints, oldest first, each with its parent, then each task's writes in
    their order (task path included, which the delta channel replays by); how many of each."""
    from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

    serde = JsonPlusSerializer()
    saved = list(source.list({"configurable": {"thread_id": thread}}))[::-1]
    for tuple_ in saved:
        parent = tuple_.parent_config or {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}
        parent = {"configurable": {**parent["configurable"], "checkpoint_ns": tuple_.config["configurable"]["checkpoint_ns"]}}
        target.put(parent, tuple_.checkpoint, tuple_.metadata, tuple_.checkpoint["channel_versions"])
    grouped: dict[tuple[str, str, str, str], list[tuple[str, Any]]] = defaultdict(list)
    rows = reader.execute(
        "SELECT checkpoint_ns, checkpoint_id, task_id, task_path, channel, type, value FROM writes"
        " WHERE thread_id = ? ORDER BY checkpoint_id, task_path, task_id, idx", (thread,)).fetchall()
    for namespace, checkpoint_id, task_id, task_path, channel, type_, value in rows:
        grouped[(namespace, checkpoint_id, task_id, task_path)].append((channel, serde.loads_typed((type_, value))))
    for (namespace, checkpoint_id, task_id, task_path), task_writes in grouped.items():
        config = {"configurable": {"thread_id": thread, "checkpoint_ns": namespace, "checkpoint_id": checkpoint_id}}
        target.put_writes(config, task_writes, task_id, task_path)
    return len(saved), len(rows)


def _verify(reader: sqlite3.Connection, conn: Any, threads: list[str]) -> None:
    """Read every thread back from both databases through the graph: the same messages, the same
    work left, the same number of checkpoints; else `CONFIG_ERROR` (the caller undoes the copy)."""
    from langgraph.checkpoint.postgres import PostgresSaver
    from langgraph.checkpoint.sqlite import SqliteSaver

    from .agent import build_graph
    from .messages import message_dtos
    from .progress import work_left

    def view(saver: Any, thread: str) -> tuple:
        graph = build_graph(None, saver)
        config = {"configurable": {"thread_id": thread}}
        state = graph.get_state(config)
        messages = message_dtos(state.values.get("messages", [])) if state.created_at else []
        return (json.dumps(messages, sort_keys=True, default=str), tuple(work_left(state) if state.created_at else ()),
                len(list(saver.list(config))))

    sqlite_saver = SqliteSaver(reader)
    sqlite_saver.is_setup = True
    postgres_saver = PostgresSaver(conn)
    for thread in threads:
        if view(sqlite_saver, thread) != view(postgres_saver, thread):
            raise SophosError(CONFIG_ERROR, (
                f"Conversation {thread} does not read back the same from PostgreSQL; the copy was undone."))

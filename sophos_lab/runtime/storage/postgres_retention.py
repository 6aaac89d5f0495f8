"""Retention on PostgreSQL (the rules are `retention`'s): the bytes of a row (`pg_column_size`),
LangGraph's three checkpoint tables (a channel's value is a blob of `checkpoint_blobs`, named by
version), the queue's events, and `VACUUM FULL`. A dry run is the same work in a transaction
that is rolled back.
"""

from __future__ import annotations

import json
from typing import Any

import psycopg

from ..errors import SESSION_IN_PROGRESS, STORAGE_FULL, SophosError
from ..retention import Removal, Vacuum, delta_snapshots, without_snapshot_counters
from .connector import Tx
from .models import utc_now

# Children before parents: the checkpoint tables have no foreign keys, the kit's cascade anyway.
KEYED_TO_CONVERSATION = (
    ("run_events", "conversation_id"), ("checkpoint_writes", "thread_id"), ("checkpoint_blobs", "thread_id"),
    ("checkpoints", "thread_id"), ("prunes", "conversation_id"), ("idempotency_keys", "conversation_id"),
    ("gates", "conversation_id"), ("runs", "conversation_id"), ("conversations", "id"),
)
_ROOT_SIZE = ("SELECT pg_column_size(c.*) AS size FROM checkpoints c"
              " WHERE thread_id = :thread AND checkpoint_ns = '' AND checkpoint_id = :root")


class PostgresRetention:
    reads_first = False
    """A refusal or a dry run is decided in the transaction itself (rolled back for a dry run)."""

    def __init__(self, connector: Any) -> None:
        self.connector = connector

    async def delete(self, tx: Tx, conversation_id: str) -> Removal:
        """Everything keyed to the conversation, counted with the bytes of its rows."""
        counts: dict[str, tuple[int, int]] = {}
        for table, column in KEYED_TO_CONVERSATION:
            rows = await tx.tuples(f"DELETE FROM {table} t WHERE {column} = :id RETURNING pg_column_size(t.*)",
                                   {"id": conversation_id})
            counts[table] = (len(rows), sum(size for (size,) in rows))
        return Removal("delete", conversation_id, runs=counts["runs"][0], checkpoints=counts["checkpoints"][0],
                       writes=counts["checkpoint_writes"][0], bytes=sum(size for _, size in counts.values()))

    async def checkpoints(self, tx: Tx, conversation_id: str) -> dict[str, tuple[str | None, dict]]:
        """The thread's checkpoints, `{id: (parent id, metadata)}`."""
        return {row["checkpoint_id"]: (row["parent_checkpoint_id"], row["metadata"] or {}) for row in await tx.rows(
            "SELECT checkpoint_id, parent_checkpoint_id, metadata FROM checkpoints"
            " WHERE thread_id = :thread AND checkpoint_ns = ''", {"thread": conversation_id})}

    async def prune(self, tx: Tx, conversation_id: str, rows: dict, kept: tuple[str, ...], pruned: list[str],
                    steps: tuple[int | None, int | None], apply: bool) -> Removal:
        """The older checkpoints go with their writes and the blobs no kept checkpoint names; the
        oldest kept one gets the whole message list as a `_DeltaSnapshot` blob, as LangGraph's
        saver stores one, and becomes the root. (`apply` is always so here: a dry run is rolled
        back by the caller.)"""
        from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

        root = kept[-1]
        params = {"thread": conversation_id, "root": root}
        saver = AsyncPostgresSaver(tx.conn)
        root_tuple = await saver.aget_tuple({"configurable": {"thread_id": conversation_id, "checkpoint_ns": "",
                                                              "checkpoint_id": root}})
        snapshots = await delta_snapshots(saver, conversation_id, root, root_tuple.checkpoint)
        grown = -await tx.value(_ROOT_SIZE, params)
        if snapshots:
            versions = root_tuple.checkpoint["channel_versions"]
            for thread, namespace, channel, version, type_, blob in saver._dump_blobs(
                    conversation_id, "", snapshots, {k: versions[k] for k in snapshots}):
                grown += await tx.value(
                    "INSERT INTO checkpoint_blobs (thread_id, checkpoint_ns, channel, version, type, blob)"
                    " VALUES (:thread, :namespace, :channel, :version, :type, :blob)"
                    " RETURNING pg_column_size(checkpoint_blobs.*)",
                    {"thread": thread, "namespace": namespace, "channel": channel, "version": version,
                     "type": type_, "blob": blob})
            # What the saver's own put leaves inline for a snapshot stored as a blob: `true`.
            await tx.execute(
                "UPDATE checkpoints SET checkpoint = jsonb_set(checkpoint, '{{channel_values}}',"
                " (checkpoint -> 'channel_values') || :inline::jsonb), metadata = :metadata"
                " WHERE thread_id = :thread AND checkpoint_ns = '' AND checkpoint_id = :root",
                {**params, "inline": json.dumps(dict.fromkeys(snapshots, True)),
                 "metadata": json.dumps(without_snapshot_counters(rows[root][1], list(snapshots)), ensure_ascii=False)})
        await tx.execute("UPDATE checkpoints SET parent_checkpoint_id = NULL WHERE thread_id = :thread"
                         " AND checkpoint_ns = '' AND checkpoint_id = :root", params)
        grown += await tx.value(_ROOT_SIZE, params)
        gone = {}
        for table in ("checkpoint_writes", "checkpoints"):
            deleted = await tx.tuples(
                f"DELETE FROM {table} t WHERE thread_id = :thread AND checkpoint_ns = '' AND checkpoint_id = ANY(:pruned)"
                " RETURNING pg_column_size(t.*)", {"thread": conversation_id, "pruned": pruned})
            gone[table] = (len(deleted), sum(size for (size,) in deleted))
        # A blob is a channel's value at a version: it stays while a kept checkpoint names it.
        blobs = await tx.tuples(
            "DELETE FROM checkpoint_blobs b WHERE thread_id = :thread AND checkpoint_ns = '' AND NOT EXISTS ("
            " SELECT 1 FROM checkpoints c WHERE c.thread_id = b.thread_id AND c.checkpoint_ns = b.checkpoint_ns"
            " AND c.checkpoint -> 'channel_versions' ->> b.channel = b.version)"
            " RETURNING pg_column_size(b.*)", {"thread": conversation_id})
        removal = Removal(
            "prune", conversation_id, checkpoints=gone["checkpoints"][0], writes=gone["checkpoint_writes"][0],
            bytes=gone["checkpoints"][1] + gone["checkpoint_writes"][1] + sum(size for (size,) in blobs),
            kept_checkpoints=len(kept), snapshot_bytes=max(grown, 0) if snapshots else 0)
        await tx.execute(
            "INSERT INTO prunes (conversation_id, pruned_at, checkpoints, writes, bytes, first_step, last_step, kept_from)"
            " VALUES (:thread, :now, :checkpoints, :writes, :bytes, :first, :last, :root)",
            {**params, "now": utc_now(), "checkpoints": removal.checkpoints, "writes": removal.writes,
             "bytes": removal.bytes, "first": steps[0], "last": steps[1]})
        return removal

    async def vacuum(self) -> Vacuum:
        """`VACUUM FULL` of the kit's and LangGraph's tables: each is rewritten without its dead
        rows, and the space goes back to the file system (a plain `VACUUM`, which autovacuum
        runs, only lets the server reuse it). It locks each table whole while it rewrites it."""
        tables = [table for table, _ in KEYED_TO_CONVERSATION] + ["owners"]
        size = "SELECT sum(pg_total_relation_size(t::regclass))::bigint FROM unnest(:tables::text[]) AS t"
        async with self.connector.reading() as tx:
            before = await tx.value(size, {"tables": tables})
            try:
                await tx.execute(f"VACUUM FULL {', '.join(tables)}")
            except psycopg.errors.DiskFull as error:
                raise SophosError(STORAGE_FULL, f"The database server has no space left: {error}".strip()) from error
            except psycopg.errors.LockNotAvailable as error:
                raise SophosError(SESSION_IN_PROGRESS, (
                    "Another connection held a table for over 5 s; VACUUM FULL gave up on it "
                    f"(the tables before it were rewritten): {error}")) from error
            after = await tx.value(size, {"tables": tables})
            name = tx.conn.info.dbname
        return Vacuum(name, before, after, None)

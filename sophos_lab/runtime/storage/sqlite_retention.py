"""Retention on the SQLite file (the rules are `retention`'s): the bytes of a row, the file's
checkpoint tables (`checkpoints`, `writes`: LangGraph's own blobs, the messages serialised in the
checkpoint), `VACUUM` and the WAL, and a read-only look for refusals and dry runs, which open
the file read-only and write nothing, not even an owner row.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..retention import Removal, Vacuum, delta_snapshots, without_snapshot_counters
from .connector import Tx
from .models import utc_now

# Children before parents; each table only if the file has it (an old file may not).
_KEYED_TO_CONVERSATION = (("writes", "thread_id"), ("checkpoints", "thread_id"), ("prunes", "conversation_id"),
                          ("idempotency_keys", "conversation_id"), ("gates", "conversation_id"),
                          ("runs", "conversation_id"), ("conversations", "id"))
_NOT_KEPT = "thread_id = :thread AND checkpoint_ns = '' AND checkpoint_id NOT IN (SELECT value FROM json_each(:kept))"


class SqliteRetention:
    reads_first = True
    """Refusals and dry runs are decided on a read-only connection first (see the module)."""

    def __init__(self, connector: Any) -> None:
        self.connector = connector

    def read_only(self) -> Any:
        """A read-only look at the file (None when there is no file: nothing is created)."""
        return self.connector.read_only()

    async def count(self, tx: Tx, conversation_id: str) -> Removal:
        """What deleting the conversation takes out: its rows in every table, counted."""
        counted = {table: await _rows_and_bytes(tx, table, f"{column} = :id", {"id": conversation_id})
                   for table, column in _KEYED_TO_CONVERSATION}
        return Removal("delete", conversation_id, runs=counted["runs"][0], checkpoints=counted["checkpoints"][0],
                       writes=counted["writes"][0], bytes=sum(size for _, size in counted.values()))

    async def delete(self, tx: Tx, conversation_id: str) -> Removal:
        removal = await self.count(tx, conversation_id)
        for table, column in _KEYED_TO_CONVERSATION:
            if await tx.has_table(table):
                await tx.execute(f"DELETE FROM {table} WHERE {column} = :id", {"id": conversation_id})
        return removal

    async def checkpoints(self, tx: Tx, conversation_id: str) -> dict[str, tuple[str | None, dict]]:
        """The thread's checkpoints, `{id: (parent id, metadata)}` (none in a file without the table)."""
        if not await tx.has_table("checkpoints"):
            return {}
        return {checkpoint_id: (parent, json.loads(metadata) if metadata else {})
                for checkpoint_id, parent, metadata in await tx.tuples(
                    "SELECT checkpoint_id, parent_checkpoint_id, metadata FROM checkpoints"
                    " WHERE thread_id = :thread AND checkpoint_ns = ''", {"thread": conversation_id})}

    async def prune(self, tx: Tx, conversation_id: str, rows: dict, kept: tuple[str, ...], pruned: list[str],
                    steps: tuple[int | None, int | None], apply: bool) -> Removal:
        """What goes (counted), and what the oldest kept checkpoint must hold to keep the state
        exact; with `apply`, inside the write transaction: the new root, the deletes, the record."""
        params = {"thread": conversation_id, "kept": json.dumps(kept)}
        checkpoints, checkpoint_bytes = await _rows_and_bytes(tx, "checkpoints", _NOT_KEPT, params)
        writes, write_bytes = await _rows_and_bytes(tx, "writes", _NOT_KEPT, params)
        root = kept[-1]
        root_type, root_blob, root_metadata, grown = await _as_root(tx, conversation_id, root)
        removal = Removal("prune", conversation_id, checkpoints=checkpoints, writes=writes,
                          bytes=checkpoint_bytes + write_bytes, kept_checkpoints=len(kept), snapshot_bytes=grown)
        if not apply:
            return removal
        await tx.execute(
            "UPDATE checkpoints SET parent_checkpoint_id = NULL, type = :type, checkpoint = :blob, metadata = :metadata"
            " WHERE thread_id = :thread AND checkpoint_ns = '' AND checkpoint_id = :root",
            {"type": root_type, "blob": root_blob, "metadata": root_metadata, "thread": conversation_id, "root": root})
        deleted = (await tx.execute(f"DELETE FROM writes WHERE {_NOT_KEPT}", params),
                   await tx.execute(f"DELETE FROM checkpoints WHERE {_NOT_KEPT}", params))
        if deleted != (writes, checkpoints):
            # Counted in this very transaction, so this cannot happen; if it does, change nothing.
            raise RuntimeError(f"prune of {conversation_id} met {deleted[1]} checkpoints and {deleted[0]} writes, "
                               f"counted {checkpoints} and {writes}")
        await tx.execute(
            "INSERT INTO prunes (conversation_id, pruned_at, checkpoints, writes, bytes, first_step, last_step, kept_from)"
            " VALUES (:thread, :now, :checkpoints, :writes, :bytes, :first, :last, :root)",
            {"thread": conversation_id, "now": utc_now(), "checkpoints": checkpoints, "writes": writes,
             "bytes": removal.bytes, "first": steps[0], "last": steps[1], "root": root})
        return removal

    async def vacuum(self) -> Vacuum:
        """`VACUUM` the file on the writing connection (outside any transaction, holding it), then
        fold the WAL back into it. Measured with the WAL folded in first, so before and after
        count the same thing. VACUUM needs room for a copy of the file: on a full disk it is
        refused (`STORAGE_FULL`), undone whole."""
        path = self.connector.path
        async with self.connector.outside_transaction() as tx:
            await tx.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            before = file_bytes(path)
            free = await tx.value("PRAGMA freelist_count") * await tx.value("PRAGMA page_size")
            await tx.execute("VACUUM")
            await tx.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return Vacuum(str(path), before, file_bytes(path), free)


def file_bytes(path: str | Path) -> int:
    """The database file and its WAL, in bytes."""
    path = Path(path)
    return sum(p.stat().st_size for p in (path, Path(f"{path}-wal")) if p.exists())


async def _rows_and_bytes(tx: Tx, table: str, where: str, params: dict[str, Any]) -> tuple[int, int]:
    """How many rows of `table` match, and their bytes: the sum of their values' lengths, about
    what a `VACUUM` afterwards gives back (without SQLite's page and index overhead)."""
    if not await tx.has_table(table):
        return 0, 0
    columns = [row[1] for row in await tx.tuples(f"PRAGMA table_info({table})")]
    size = " + ".join(f'ifnull(length(CAST("{column}" AS BLOB)), 0)' for column in columns) or "0"
    [(count, total)] = await tx.tuples(f"SELECT count(*), ifnull(sum({size}), 0) FROM {table} WHERE {where}", params)
    return count, total


async def _as_root(tx: Any, thread_id: str, checkpoint_id: str) -> tuple[str, bytes, bytes, int]:
    """The checkpoint `checkpoint_id` rewritten to stand without its ancestors (`delta_snapshots`,
    read through LangGraph's own saver on this transaction's connection): its type, blob and
    metadata, and how many bytes it grows by."""
    from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

    saver = AsyncSqliteSaver(tx.conn)
    saver.is_setup = True  # the tables exist; setup() would write
    [(type_, blob, metadata)] = await tx.tuples(
        "SELECT type, checkpoint, metadata FROM checkpoints"
        " WHERE thread_id = :thread AND checkpoint_ns = '' AND checkpoint_id = :id", {"thread": thread_id, "id": checkpoint_id})
    checkpoint = saver.serde.loads_typed((type_, blob))
    snapshots = await delta_snapshots(saver, thread_id, checkpoint_id, checkpoint)
    if not snapshots:
        return type_, blob, metadata, 0
    checkpoint["channel_values"].update(snapshots)
    new_type, new_blob = saver.serde.dumps_typed(checkpoint)
    meta = without_snapshot_counters(json.loads(metadata) if metadata else {}, list(snapshots))
    new_metadata = json.dumps(meta, ensure_ascii=False).encode("utf-8")
    return new_type, new_blob, new_metadata, len(new_blob) + len(new_metadata) - len(blob) - len(metadata or b"")

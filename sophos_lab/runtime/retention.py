"""Retention: delete a conversation, prune a thread's old checkpoints, give the space back.

- **Delete** takes out, in one transaction, everything keyed to the conversation in this file:
  its checkpoints and writes, its runs, its prune records and the conversation itself.
- **Prune** keeps the newest checkpoints of the thread (by default those of the run that wrote
  the latest one) with their writes, and deletes the older ones with theirs. The thread's state
  is kept exactly, so it reads and resumes as before: the messages channel is a `DeltaChannel`,
  whose value at a checkpoint is rebuilt from its ancestors' writes back to the nearest stored
  value, so before its ancestors go, the oldest kept checkpoint is given the whole message list
  (a `_DeltaSnapshot`, what LangGraph itself writes every `snapshot_frequency` updates) and
  becomes the thread's root. A checkpoint written with LangGraph's default channel holds the
  whole list already and is left as it is. Each prune is recorded in `prunes`.
- **Vacuum** rewrites the file without its free pages (SQLite's `VACUUM`; deleted rows only
  free pages inside the file), then folds the WAL back into it, and says how big it was before
  and after.

Nothing here touches the memory server's file (`MEMORY_FILE_PATH`) or any other MCP server's
data: only this one SQLite file.

Ownership holds as everywhere else: a conversation whose run a live process is running is
refused (`SESSION_IN_PROGRESS`). A run whose owner is gone (a crash) is no obstacle: a delete
takes it with the rest, a prune relabels it `interrupted` inside the prune's transaction, as recovery
does, and the conversation resumes afterwards. A process
that lost its run can write nothing back afterwards: its saver's fence refuses every write for
a thread on which it holds no `running` run. A dry run opens the file read-only and writes
nothing, not even that recovery.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import BAD_REQUEST, NOT_FOUND, SESSION_IN_PROGRESS, SophosError
from .ownership import Owner
from .store import full_disk_refused, has_table, read_only, relabel_interrupted, stale_runs, utc_now


@dataclass(frozen=True)
class Removal:
    """What a delete or a prune takes out of the file (in a dry run: would take out)."""

    action: str
    """`delete` or `prune`."""
    conversation_id: str
    runs: int = 0
    checkpoints: int = 0
    writes: int = 0
    bytes: int = 0
    """The bytes of the rows that go (every column's value, without SQLite's page and index
    overhead): about what a `VACUUM` afterwards gives back."""
    kept_checkpoints: int = 0
    """Prune: how many checkpoints stay."""
    snapshot_bytes: int = 0
    """Prune: how many bytes the oldest kept checkpoint grows by, now that it holds the whole
    message list (0 when it held it already, or when nothing is pruned)."""
    dry_run: bool = False

    def describe(self) -> str:
        """One line for people, e.g. for the CLI."""
        done = f"would {self.action}" if self.dry_run else f"{self.action}d"
        if self.action == "delete":
            text = (f"{self.conversation_id}: {done} the conversation with {self.runs} runs, "
                    f"{self.checkpoints} checkpoints, {self.writes} writes ({self.bytes:,} bytes)")
        elif not self.checkpoints:
            text = (f"{self.conversation_id}: nothing to prune "
                    f"({self.kept_checkpoints} checkpoints, all kept)")
        else:
            text = (f"{self.conversation_id}: {done} {self.checkpoints} checkpoints and "
                    f"{self.writes} writes ({self.bytes:,} bytes), kept {self.kept_checkpoints} checkpoints")
            if self.snapshot_bytes:
                text += f" (the oldest one kept now holds every message: +{self.snapshot_bytes:,} bytes)"
        return text + (" [dry run: nothing was changed]" if self.dry_run else "")


@dataclass(frozen=True)
class PrunePlan:
    """A prune worked out under the write lock (or read-only, for a dry run), ready to apply."""

    removal: Removal
    kept: tuple[str, ...] = ()
    """The checkpoint ids that stay, newest first."""
    new_root: str | None = None
    """The oldest kept checkpoint: it becomes the thread's root."""
    root_type: str | None = None
    root_checkpoint: bytes | None = None
    root_metadata: bytes | None = None
    steps: tuple[int | None, int | None] = (None, None)
    """The first and last step of the checkpoints that go."""


@dataclass(frozen=True)
class Vacuum:
    """The file's size (with its WAL) before and after a `VACUUM`; on PostgreSQL, the kit's and
    LangGraph's tables (with their indexes and TOAST) before and after a `VACUUM FULL`."""

    path: str
    """The file, or the database's name."""
    bytes_before: int
    bytes_after: int
    free_bytes_before: int | None
    """Pages inside the file that held nothing (deleted rows), before: what `VACUUM` can give
    back. None on PostgreSQL, which does not count them without an extension."""

    def describe(self) -> str:
        command = "VACUUM" if self.free_bytes_before is not None else "VACUUM FULL"
        free = "" if self.free_bytes_before is None else f"; {self.free_bytes_before:,} bytes were free pages"
        return (f"{self.path}: {self.bytes_before:,} bytes before {command}, {self.bytes_after:,} after "
                f"({self.bytes_before - self.bytes_after:,} given back{free})")


# --- reading -----------------------------------------------------------------------------


def _bytes_of_row(conn: sqlite3.Connection, table: str) -> str:
    """An SQL expression for the bytes of one row of `table`: the sum of its values' lengths."""
    columns = [row[1] for row in conn.execute(f"PRAGMA table_info({table})")]
    return " + ".join(f'ifnull(length(CAST("{column}" AS BLOB)), 0)' for column in columns) or "0"


def _rows_and_bytes(conn: sqlite3.Connection, table: str, where: str, params: tuple) -> tuple[int, int]:
    if not has_table(conn, table):
        return 0, 0
    count, size = conn.execute(
        f"SELECT count(*), ifnull(sum({_bytes_of_row(conn, table)}), 0) FROM {table} WHERE {where}", params
    ).fetchone()
    return count, size


def conversation_ids(path: str | Path) -> list[str]:
    """Every conversation id in the file, oldest first (read-only)."""
    with read_only(path) as conn:
        if conn is None or not has_table(conn, "conversations"):
            return []
        return [row[0] for row in conn.execute("SELECT id FROM conversations ORDER BY created_at, rowid")]


def require_conversation(conn: sqlite3.Connection | None, conversation_id: str) -> None:
    """Refuse (`NOT_FOUND`) an id that is not a conversation of the file."""
    if conn is None or not has_table(conn, "conversations") or conn.execute(
        "SELECT 1 FROM conversations WHERE id = ?", (conversation_id,)
    ).fetchone() is None:
        raise SophosError(NOT_FOUND, f"Conversation Not Found: {conversation_id}")


def _stale(conn: sqlite3.Connection, me: Owner, conversation_id: str | None = None) -> set[str]:
    """`store.stale_runs` on any connection (it reads rows by name)."""
    factory, conn.row_factory = conn.row_factory, sqlite3.Row
    try:
        return set(stale_runs(conn, me, conversation_id))
    finally:
        conn.row_factory = factory


def recoverable_runs(conn: sqlite3.Connection, conversation_id: str, me: Owner | None, action: str) -> list[str]:
    """The conversation's `running` runs whose owner is gone (to be relabelled `interrupted`).

    Refuses (`SESSION_IN_PROGRESS`) when a live process runs the conversation. With `me=None`
    (the original's single-owner rule, where `running` after the first open means running),
    every `running` run counts as live.
    """
    running = {row[0] for row in conn.execute(
        "SELECT id FROM runs WHERE conversation_id = ? AND status = 'running'", (conversation_id,))}
    if not running:
        return []
    if me is None:
        gone: set[str] = set()
    elif has_table(conn, "owners"):
        gone = _stale(conn, me, conversation_id)
    else:
        gone = running  # a version-1 file: no run has an owner, none can still be running
    if running - gone:
        raise SophosError(SESSION_IN_PROGRESS, (
            f"Conversation {conversation_id} has a run in progress in a live process; "
            f"{action} it once the run has finished. Nothing was changed."))
    return sorted(gone)


# --- delete ------------------------------------------------------------------------------


def plan_delete(conn: sqlite3.Connection | None, conversation_id: str) -> Removal:
    """What deleting the conversation takes out: its rows in every table, counted."""
    require_conversation(conn, conversation_id)
    runs, run_bytes = _rows_and_bytes(conn, "runs", "conversation_id = ?", (conversation_id,))
    checkpoints, checkpoint_bytes = _rows_and_bytes(conn, "checkpoints", "thread_id = ?", (conversation_id,))
    writes, write_bytes = _rows_and_bytes(conn, "writes", "thread_id = ?", (conversation_id,))
    _, prune_bytes = _rows_and_bytes(conn, "prunes", "conversation_id = ?", (conversation_id,))
    _, key_bytes = _rows_and_bytes(conn, "idempotency_keys", "conversation_id = ?", (conversation_id,))
    _, gate_bytes = _rows_and_bytes(conn, "gates", "conversation_id = ?", (conversation_id,))
    _, own_bytes = _rows_and_bytes(conn, "conversations", "id = ?", (conversation_id,))
    return Removal(
        "delete", conversation_id, runs=runs, checkpoints=checkpoints, writes=writes,
        bytes=run_bytes + checkpoint_bytes + write_bytes + prune_bytes + key_bytes + gate_bytes + own_bytes,
    )


def delete_conversation(conn: sqlite3.Connection, conversation_id: str, me: Owner | None) -> Removal:
    """Delete the conversation and everything keyed to it, inside the caller's write transaction."""
    require_conversation(conn, conversation_id)
    recoverable_runs(conn, conversation_id, me, "delete")  # a dead owner's run goes with the rest
    removal = plan_delete(conn, conversation_id)
    for table, column in (("writes", "thread_id"), ("checkpoints", "thread_id"), ("prunes", "conversation_id"),
                          ("idempotency_keys", "conversation_id"), ("gates", "conversation_id"),
                          ("runs", "conversation_id"),
                          ("conversations", "id")):
        if has_table(conn, table):
            conn.execute(f"DELETE FROM {table} WHERE {column} = ?", (conversation_id,))
    return removal


# --- prune -------------------------------------------------------------------------------


def parse_keep(keep: object) -> int | None:
    """How many checkpoints a prune keeps: None (those of the latest run) or a whole number >= 1."""
    if keep is None:
        return None
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise SophosError(BAD_REQUEST, f"keep must be a whole number of checkpoints, 1 or more: {keep!r}")
    return keep


def kept_and_pruned(rows: dict[str, tuple[str | None, dict]], keep: int | None
                    ) -> tuple[tuple[str, ...], list[str], tuple[int | None, int | None]]:
    """Of a thread's checkpoints (`{id: (parent id, metadata)}`), the ids a prune keeps (newest
    first), those it deletes, and the first and last step of those.

    The head is what LangGraph reads as the thread's state: the greatest id. Its ancestors,
    newest first, are the thread's one branch of history; `keep=None` keeps those of the run
    that wrote the head."""
    chain, seen = [max(rows)], {max(rows)}
    while (parent := rows[chain[-1]][0]) in rows and parent not in seen:
        chain.append(parent)
        seen.add(parent)
    if keep is None:
        latest_run = rows[chain[0]][1].get("run_id")
        keep = next((n for n, cid in enumerate(chain) if rows[cid][1].get("run_id") != latest_run), len(chain))
    kept = tuple(chain[:keep])
    pruned = [cid for cid in rows if cid not in kept]
    steps = [rows[cid][1].get("step") for cid in pruned if isinstance(rows[cid][1].get("step"), int)]
    return kept, pruned, (min(steps, default=None), max(steps, default=None))


def without_snapshot_counters(metadata: dict, channels: list[str]) -> dict:
    """A checkpoint's metadata once `channels` hold a snapshot there: LangGraph's count of
    updates since each one's last snapshot starts again."""
    meta = dict(metadata)
    counters = {k: v for k, v in (meta.pop("counters_since_delta_snapshot", None) or {}).items() if k not in channels}
    if counters:
        meta["counters_since_delta_snapshot"] = counters
    return meta


def delta_snapshots(saver: Any, thread_id: str, checkpoint_id: str, checkpoint: dict) -> dict[str, Any]:
    """For a checkpoint that is to stand without its ancestors: each delta channel its step did
    not store, with its value there as a `_DeltaSnapshot` (what LangGraph writes every
    `snapshot_frequency` updates). Read through `saver`, LangGraph's own (SQLite or PostgreSQL)."""
    from langgraph.channels import DeltaChannel
    from langgraph.checkpoint.serde.types import _DeltaSnapshot

    from .agent import build_graph

    specs = build_graph(None, saver).channels
    missing = [
        key for key, spec in specs.items()
        if isinstance(spec, DeltaChannel) and key in checkpoint["channel_versions"]
        and key not in checkpoint["channel_values"]
    ]
    if not missing:
        return {}
    config = {"configurable": {"thread_id": thread_id, "checkpoint_ns": "", "checkpoint_id": checkpoint_id}}
    # What LangGraph does to read the channel at this checkpoint: the nearest stored value, then
    # the writes of the ancestors after it, in order (not the checkpoint's own pending writes).
    histories = saver.get_delta_channel_history(config=config, channels=missing)
    snapshots = {}
    for key in missing:
        channel = specs[key].from_checkpoint(histories[key].get("seed"))
        channel.replay_writes(histories[key]["writes"])
        snapshots[key] = _DeltaSnapshot(channel.get())
    return snapshots


def plan_prune(reader: sqlite3.Connection | None, conversation_id: str, keep: int | None = None) -> PrunePlan:
    """Which checkpoints go, and what the oldest kept one must hold to keep the state exact.

    `reader` is a plain connection (rows as tuples), read-only: LangGraph's own sync saver reads
    the thread through it. Opened after another connection took the write lock, it reads the
    thread as that transaction finds it: nobody else can commit in between.
    """
    require_conversation(reader, conversation_id)
    keep = parse_keep(keep)
    if not has_table(reader, "checkpoints"):
        return PrunePlan(Removal("prune", conversation_id))
    rows = {
        checkpoint_id: (parent, json.loads(metadata) if metadata else {})
        for checkpoint_id, parent, metadata in reader.execute(
            "SELECT checkpoint_id, parent_checkpoint_id, metadata FROM checkpoints"
            " WHERE thread_id = ? AND checkpoint_ns = ''", (conversation_id,))
    }
    if not rows:
        return PrunePlan(Removal("prune", conversation_id))
    kept, pruned, steps = kept_and_pruned(rows, keep)
    if not pruned:
        return PrunePlan(Removal("prune", conversation_id, kept_checkpoints=len(kept)), kept=kept)

    not_kept = "thread_id = ? AND checkpoint_ns = '' AND checkpoint_id NOT IN (SELECT value FROM json_each(?))"
    params = (conversation_id, json.dumps(kept))
    checkpoints, checkpoint_bytes = _rows_and_bytes(reader, "checkpoints", not_kept, params)
    writes, write_bytes = _rows_and_bytes(reader, "writes", not_kept, params)
    new_root = kept[-1]
    root_type, root_checkpoint, root_metadata, grown = _as_root(reader, conversation_id, new_root)
    removal = Removal(
        "prune", conversation_id, checkpoints=checkpoints, writes=writes,
        bytes=checkpoint_bytes + write_bytes, kept_checkpoints=len(kept), snapshot_bytes=grown,
    )
    return PrunePlan(
        removal, kept=kept, new_root=new_root, root_type=root_type, root_checkpoint=root_checkpoint,
        root_metadata=root_metadata, steps=steps,
    )


def _as_root(reader: sqlite3.Connection, thread_id: str, checkpoint_id: str) -> tuple[str, bytes, bytes, int]:
    """The checkpoint `checkpoint_id` rewritten to stand without its ancestors (`delta_snapshots`):
    its type, blob and metadata, and how many bytes it grows by."""
    from langgraph.checkpoint.sqlite import SqliteSaver

    saver = SqliteSaver(reader)
    saver.is_setup = True  # the tables exist; setup() would write
    type_, blob, metadata = reader.execute(
        "SELECT type, checkpoint, metadata FROM checkpoints"
        " WHERE thread_id = ? AND checkpoint_ns = '' AND checkpoint_id = ?", (thread_id, checkpoint_id),
    ).fetchone()
    checkpoint = saver.serde.loads_typed((type_, blob))
    snapshots = delta_snapshots(saver, thread_id, checkpoint_id, checkpoint)
    if not snapshots:
        return type_, blob, metadata, 0
    checkpoint["channel_values"].update(snapshots)
    new_type, new_blob = saver.serde.dumps_typed(checkpoint)
    meta = without_snapshot_counters(json.loads(metadata) if metadata else {}, list(snapshots))
    new_metadata = json.dumps(meta, ensure_ascii=False).encode("utf-8")
    return new_type, new_blob, new_metadata, len(new_blob) + len(new_metadata) - len(blob) - len(metadata or b"")


def apply_prune(conn: sqlite3.Connection, plan: PrunePlan) -> Removal:
    """Apply a plan made under this transaction's write lock: the new root, the deletes, the record."""
    removal = plan.removal
    if not removal.checkpoints:
        return removal
    thread = removal.conversation_id
    conn.execute(
        "UPDATE checkpoints SET parent_checkpoint_id = NULL, type = ?, checkpoint = ?, metadata = ?"
        " WHERE thread_id = ? AND checkpoint_ns = '' AND checkpoint_id = ?",
        (plan.root_type, plan.root_checkpoint, plan.root_metadata, thread, plan.new_root),
    )
    not_kept = "thread_id = ? AND checkpoint_ns = '' AND checkpoint_id NOT IN (SELECT value FROM json_each(?))"
    params = (thread, json.dumps(plan.kept))
    writes = conn.execute(f"DELETE FROM writes WHERE {not_kept}", params).rowcount
    checkpoints = conn.execute(f"DELETE FROM checkpoints WHERE {not_kept}", params).rowcount
    if (checkpoints, writes) != (removal.checkpoints, removal.writes):
        # The plan was made under this very lock, so this cannot happen; if it does, change nothing.
        raise RuntimeError(f"prune of {thread} met {checkpoints} checkpoints and {writes} writes, "
                           f"planned {removal.checkpoints} and {removal.writes}")
    conn.execute(
        "INSERT INTO prunes (conversation_id, pruned_at, checkpoints, writes, bytes, first_step, last_step,"
        " kept_from) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        (thread, utc_now(), checkpoints, writes, removal.bytes, *plan.steps, plan.new_root),
    )
    return removal


def prune_conversation(conn: sqlite3.Connection, path: str | Path, conversation_id: str,
                       keep: int | None, me: Owner | None) -> Removal:
    """Prune inside the caller's write transaction on `conn`; the plan is made first, through a
    read-only connection to `path`, before this transaction changes anything."""
    require_conversation(conn, conversation_id)
    gone = recoverable_runs(conn, conversation_id, me, "prune")
    with read_only(path) as reader:
        plan = plan_prune(reader, conversation_id, keep)
    relabel_interrupted(conn, gone, path)
    return apply_prune(conn, plan)


def prune_records(conn: sqlite3.Connection | None, conversation_id: str) -> list[dict[str, Any]]:
    """The prunes of the conversation, oldest first (empty for a file without `prunes`)."""
    if conn is None or not has_table(conn, "prunes"):
        return []
    cursor = conn.execute(
        "SELECT pruned_at, checkpoints, writes, bytes, first_step, last_step, kept_from FROM prunes"
        " WHERE conversation_id = ? ORDER BY id", (conversation_id,))
    names = [column[0] for column in cursor.description]
    return [dict(zip(names, row)) for row in cursor]


# --- vacuum ------------------------------------------------------------------------------


def file_bytes(path: str | Path) -> int:
    """The database file and its WAL, in bytes."""
    path = Path(path)
    return sum(p.stat().st_size for p in (path, Path(f"{path}-wal")) if p.exists())


def live_runs(conn: sqlite3.Connection, me: Owner | None) -> list[str]:
    """The `running` runs of live owners, in any conversation."""
    running = [row[0] for row in conn.execute("SELECT id FROM runs WHERE status = 'running'")]
    if me is None or not running:
        return running
    gone = _stale(conn, me)
    return [run for run in running if run not in gone]


def vacuum(conn: sqlite3.Connection, path: str | Path, me: Owner | None) -> Vacuum:
    """`VACUUM` the file through `conn` (outside any transaction), then fold the WAL back into it.

    Refused while a live process runs a run anywhere in the file: `VACUUM` holds the write lock
    for as long as it takes, and a run's next checkpoint would wait for it (5 s, then fail).
    """
    if running := live_runs(conn, me):
        raise SophosError(SESSION_IN_PROGRESS, (
            f"{len(running)} run(s) in progress in a live process; VACUUM holds the write lock until "
            "it is done, so run it when they have finished. Nothing was changed."))
    # Measured with the WAL folded in first, so before and after count the same thing. VACUUM
    # needs room for a copy of the file: on a full disk it is refused (STORAGE_FULL), undone whole.
    with full_disk_refused(path):
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        before = file_bytes(path)
        free = conn.execute("PRAGMA freelist_count").fetchone()[0] * conn.execute("PRAGMA page_size").fetchone()[0]
        conn.execute("VACUUM")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return Vacuum(str(path), before, file_bytes(path), free)

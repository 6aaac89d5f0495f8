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
data: only the database's tables.

Ownership holds as everywhere else: a conversation whose run a live process is running is
refused (`SESSION_IN_PROGRESS`). A run whose owner is gone (a crash) is no obstacle: a delete
takes it with the rest, a prune relabels it `interrupted` inside the prune's transaction, as recovery
does, and the conversation resumes afterwards. A process
that lost its run can write nothing back afterwards: its saver's fence refuses every write for
a thread on which it holds no `running` run. A dry run writes nothing, not even that recovery:
on SQLite it opens the file read-only (a refusal too: it writes no owner row either), on
PostgreSQL it does it all in a transaction that is rolled back, counted exactly.

The rules are here, once: which runs refuse, which checkpoints go, what the oldest kept one
must hold. What a backend stores differently (how a row's bytes are counted, the checkpoint
tables, `VACUUM`) is its own: `storage.sqlite_retention`, `storage.postgres_retention`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from .errors import BAD_REQUEST, NOT_FOUND, SESSION_IN_PROGRESS, SophosError
from .ownership import Owner
from .storage.rules import stale_runs


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


async def idle_or_refused(tx: Any, conversation_id: str, me: Owner | None, action: str) -> list[str]:
    """Inside the transaction (or the read-only look) of a delete or a prune: `NOT_FOUND` for a
    conversation that is not there, `SESSION_IN_PROGRESS` while a live process runs it (or a run
    of it is queued); else its `running` runs whose owner is gone, to go with it (or be
    relabelled first). On PostgreSQL its row and its runs' rows are locked to the commit: a
    saver's write under way (the fence holds its run's row) ends first, and a run that starts
    later waits. With `me=None` (the original's single-owner rule) every `running` run is live."""
    if tx is None or not await tx.has_table("conversations") or await tx.value(
            "SELECT 1 FROM conversations WHERE id = :id{for_update}", {"id": conversation_id}) is None:
        raise SophosError(NOT_FOUND, f"Conversation Not Found: {conversation_id}")
    statuses = {row[0]: row[1] for row in await tx.tuples(
        "SELECT id, status FROM runs WHERE conversation_id = :id{for_update}", {"id": conversation_id})}
    running = {run_id for run_id, status in statuses.items() if status == "running"}
    if me is None or not running:
        gone: set[str] = set()
    elif not await tx.has_table("owners"):
        gone = running  # a version-1 file: no run has an owner, none can still be running
    else:
        gone = set(await stale_runs(tx, me, conversation_id))
    if running - gone or "queued" in statuses.values():
        raise SophosError(SESSION_IN_PROGRESS, (
            f"Conversation {conversation_id} has a run in progress in a live process; "
            f"{action} it once the run has finished. Nothing was changed."))
    return sorted(running & gone)


async def live_runs(tx: Any, me: Owner | None) -> list[str]:
    """The runs of live owners, queued or running, in any conversation."""
    running = [row[0] for row in await tx.tuples("SELECT id FROM runs WHERE status IN ('running', 'queued')")]
    if me is None or not running:
        return running
    gone = set(await stale_runs(tx, me))
    return [run for run in running if run not in gone]


async def delete_conversation(storage: Any, conversation_id: str, me: Owner | None, dry_run: bool = False) -> Removal:
    """The conversation and everything keyed to it, in one transaction; what went, counted,
    with the bytes of its rows. A run of a live process refuses it, one of a gone owner goes
    with the rest; a dry run counts and changes nothing."""
    part = storage.db.retention
    if part.reads_first:
        async with part.read_only() as tx:
            await idle_or_refused(tx, conversation_id, me, "delete")
            if dry_run:
                return replace(await part.count(tx, conversation_id), dry_run=True)
    async with storage.transaction(rollback=dry_run) as tx:
        await idle_or_refused(tx, conversation_id, me, "delete")  # a gone owner's run goes too
        removal = await part.delete(tx, conversation_id)
    return replace(removal, dry_run=dry_run)


async def prune_conversation(storage: Any, conversation_id: str, keep: int | None, me: Owner | None,
                             dry_run: bool = False) -> Removal:
    """The thread's older checkpoints with their writes, in one transaction; the oldest kept one
    becomes the root and is given the whole message list (`delta_snapshots`), so the thread
    reads and resumes exactly as before. A gone owner's run is relabelled first."""
    keep = parse_keep(keep)
    part = storage.db.retention
    if part.reads_first:
        async with part.read_only() as tx:
            await idle_or_refused(tx, conversation_id, me, "prune")
            if dry_run:
                return replace(await _prune(part, tx, conversation_id, keep, apply=False), dry_run=True)
    async with storage.transaction(rollback=dry_run) as tx:
        await storage.relabel_in(tx, await idle_or_refused(tx, conversation_id, me, "prune"))
        removal = await _prune(part, tx, conversation_id, keep, apply=True)
    return replace(removal, dry_run=dry_run)


async def _prune(part: Any, tx: Any, conversation_id: str, keep: int | None, apply: bool) -> Removal:
    """Which of the thread's checkpoints go (`kept_and_pruned`); the backend counts them and,
    with `apply`, makes the oldest kept one the root and deletes the rest."""
    rows = await part.checkpoints(tx, conversation_id)
    if not rows:
        return Removal("prune", conversation_id)
    kept, pruned, steps = kept_and_pruned(rows, keep)
    if not pruned:
        return Removal("prune", conversation_id, kept_checkpoints=len(kept))
    return await part.prune(tx, conversation_id, rows, kept, pruned, steps, apply)


async def vacuum(storage: Any, me: Owner | None) -> Vacuum:
    """Give the space of deleted rows back (see the backends); refused while a live process
    runs (or has queued) a run anywhere: `VACUUM` holds the tables while it runs."""
    async with storage.reading() as tx:
        if live := await live_runs(tx, me):
            raise SophosError(SESSION_IN_PROGRESS, (
                f"{len(live)} run(s) queued or in progress in a live process; VACUUM holds the tables "
                "until it is done, so run it when they have finished. Nothing was changed."))
    return await storage.db.retention.vacuum()


async def conversation_ids(storage: Any) -> list[str]:
    """Every conversation id, oldest first (on SQLite read-only: a file that is not there has none)."""
    part = storage.db.retention
    if part.reads_first:
        async with part.read_only() as tx:
            if tx is None or not await tx.has_table("conversations"):
                return []
            return [row[0] for row in await tx.tuples("SELECT id FROM conversations ORDER BY created_at, rowid")]
    async with storage.reading() as tx:
        return [row[0] for row in await tx.tuples("SELECT id FROM conversations ORDER BY created_at, {seq}")]


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


async def delta_snapshots(saver: Any, thread_id: str, checkpoint_id: str, checkpoint: dict) -> dict[str, Any]:
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
    histories = await saver.aget_delta_channel_history(config=config, channels=missing)
    snapshots = {}
    for key in missing:
        channel = specs[key].from_checkpoint(histories[key].get("seed"))
        channel.replay_writes(histories[key]["writes"])
        snapshots[key] = _DeltaSnapshot(channel.get())
    return snapshots

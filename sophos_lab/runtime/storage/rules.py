"""The rules of the application's tables, written once for both backends.

`Storage` is what the runtime awaits for its tables: opening (migrations, then the recovery of
runs whose owner is gone), the lease, starting and queueing a run, its outcome, cancels, gates,
idempotency keys and the listing. Each rule is here once, in SQL with named parameters and a
few dialect fragments (`connector`); a backend (`sqlite`, `postgres`) runs the statements on its
async connections and keeps only what differs. Nothing opens before first use. The first open
relabels `running` rows `interrupted` (`cancelled` if a cancel was accepted) — only those whose
owner is gone (see `ownership`): several processes may share the tables, and a live process's
run is left alone. The same sweep runs, for one conversation, before a run starts there and
before a conversation is read, so a process that died while another one was open is recovered
as soon as anyone looks.

On a full disk every write is refused with `STORAGE_FULL` and writes nothing. A first open that
cannot write this owner's row, or the recovery after it, still opens, for reading: listings and
conversations read as they are on disk (a dead process's run may still say `running`), and the
owner's row and the recovery are written by the next write or look that finds space again.

With `single_owner=True` the storage does what the original did: the first open relabels every
`running` row, whoever runs it, and outcomes are written without checking who owns the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from .. import users
from ..counting import thread_count
from ..errors import (CANCELLED, CANCELLED_MESSAGE, GATE_DECIDED, IDEMPOTENCY_KEY_REUSED, NOT_FOUND,
                      SESSION_IN_PROGRESS, STORAGE_FULL, SophosError)
from ..ownership import Owner, owner_gone
from .connector import Conflict, Plan, Sent, T, Tx
from .models import (PAGE_SIZE, CONVERSATION_FIELDS, Conversation, ConversationPage, Gate, IdempotencyKey,
                     LatestRunChanged, ListingPosition, Run, Seen, as_expected, conversations_of, encode_cursor,
                     run_of, title_from_message, utc_now)
from .reads import RunReads
from .stale import owner_row, stale_runs

log = logging.getLogger(__name__)

# A stranded run is `interrupted`, unless a cancel was accepted for it before its process died:
# then it is `cancelled`, as it would have been recorded.
RELABELLED = f"""
    status = CASE WHEN cancel_requested_at IS NULL THEN 'interrupted' ELSE 'cancelled' END,
    error_code = CASE WHEN cancel_requested_at IS NULL THEN error_code ELSE '{CANCELLED}' END,
    error_message = CASE WHEN cancel_requested_at IS NULL THEN error_message ELSE '{CANCELLED_MESSAGE}' END,"""
_RELABEL = ("UPDATE runs SET" + RELABELLED + " finished_at = :now WHERE status = 'running' AND id {in_ids}"
            " RETURNING id, conversation_id, status, error_code, error_message")

# A run that recorded no outcome (its process died) took as many graph steps as it checkpointed.
# Each step of the loop writes one `loop` checkpoint; a run's input writes an `input` one, and
# then its `__start__` task a `loop` one that is no step: so the steps are its `loop` checkpoints
# less its `input` ones (none, not -1, for a run killed between the two). The step in progress is
# not counted. A re-queued run (PostgreSQL) gets it at each re-queue: its attempts share its id,
# so the count covers them all, and the greater of the two keeps what the column has if that is more.
_SAVED_STEPS = """
UPDATE runs SET steps = {greatest}(steps, (
    SELECT count(*) FILTER (WHERE {meta_source} = 'loop') - count(*) FILTER (WHERE {meta_source} = 'input')
    FROM checkpoints c
    WHERE c.thread_id = runs.conversation_id AND c.checkpoint_ns = '' AND {meta_run_id} = runs.id))
WHERE id {in_ids}"""

_LEASE = """
INSERT INTO owners (id, host, boot_id, pid, pid_started, opened_at, lease_expires_at, lease_expires_monotonic)
VALUES (:id, :host, :boot_id, :pid, :pid_started, :opened_at, {lease_until}, :monotonic)
ON CONFLICT (id) DO UPDATE SET lease_expires_at = excluded.lease_expires_at,
                               lease_expires_monotonic = excluded.lease_expires_monotonic"""

# A conversation with its latest run's outcome, and its insertion order as `position`. In the
# listing's order, which an index on updated_at holds (ending with the position), there is no
# sort, and a page reads only its own rows and their latest runs; `position` breaks ties of
# updated_at and goes into the cursor.
_LISTING = """
SELECT c.{seq} AS position, c.id, c.title, c.created_at, c.updated_at, c.message_count,
       r.status, r.error_code, r.error_message
FROM conversations c {latest_run}"""
_LISTING_ORDER = " ORDER BY c.updated_at DESC, c.{seq} DESC"
# The whole listing: the pages' rows in their order, with Conversation's fields as the columns.
_ALL = (f"SELECT {', '.join(CONVERSATION_FIELDS)} FROM ({_LISTING} WHERE true{{mine}}) AS listing"
        " ORDER BY updated_at DESC, position DESC")


def _title(message: str) -> str:
    """`title_from_message`, with U+FFFD for a NUL, which PostgreSQL's text cannot hold (the
    message itself is kept exactly: its JSON escapes NUL, and the checkpoints store bytes)."""
    return title_from_message(message).replace("\x00", "\ufffd")


class Storage(RunReads):
    """The application tables of one database, as one owner (see the module)."""

    def __init__(self, db: Any, lease_seconds: float = 15.0, single_owner: bool = False,
                 requeue_limit: int = 0, limits: users.Limits = users.Limits()) -> None:
        self.db = db
        """The backend: `sqlite.SqliteConnector` or `postgres.PostgresConnector`."""
        self.lease_seconds = lease_seconds
        self.single_owner = single_owner
        self.requeue_limit = requeue_limit
        """`SOPHOS_LAB_REQUEUE`: how often a worker's crashed run goes back in the queue (0: never)."""
        self.limits = limits
        """What one user may have running and queued at once and spend (`users.check_limits`)."""
        self.owner: Owner | None = None
        """This storage's identity in `owners`, from its first open on."""
        self.recovered_runs = 0
        """How many `running` rows the first open relabelled."""
        self._open = False
        self._opening = asyncio.Lock()
        self._sweep_pending = False
        """The open could not write its owner row and recovery (a full disk): the next look writes them."""
        self._leased_at: float | None = None
        """When this owner's lease was last committed (the monotonic clock), if it was since the open."""

    @property
    def is_open(self) -> bool:
        return self._open

    async def open(self) -> None:
        """Connect and migrate, then write this owner's row and recover (see the module)."""
        if self._open:
            return
        async with self._opening:
            if self._open:
                return
            await self.db.open()
            self.owner = self.owner or Owner.here()  # one identity: closed and opened again, the same owner
            self._open, self.recovered_runs, self._sweep_pending = True, 0, True
            try:
                await self._open_sweep()
            except SophosError as error:
                if error.code != STORAGE_FULL:
                    await self._abandon()
                    raise
                log.info("%s is open for reading only until there is space again: %s", self.db.where, error.message)
            except BaseException:
                await self._abandon()
                raise

    async def _abandon(self) -> None:
        self._open = False
        await self.db.aclose()

    async def aclose(self) -> None:
        """Close; this owner's runs still `running` become recoverable at once."""
        if not self._open:
            return
        self._open, self._leased_at = False, None
        with contextlib.suppress(Exception):  # closing anyway: the lease runs out instead
            async with self.db.transaction() as tx:
                await tx.execute("DELETE FROM owners WHERE id = :id", {"id": self.owner.id})
        await self.db.aclose()

    @contextlib.asynccontextmanager
    async def transaction(self, rollback: bool = False) -> AsyncIterator[Tx]:
        """One write transaction on the tables (opened first); `rollback`: undone at the end (a dry run)."""
        await self.open()
        async with self.db.transaction(rollback) as tx:
            yield tx

    @contextlib.asynccontextmanager
    async def reading(self) -> AsyncIterator[Tx]:
        """Reads on the tables (opened first)."""
        await self.open()
        async with self.db.reading() as tx:
            yield tx

    async def _transact(self, plan: Plan[T]) -> T:
        """`plan` in one write transaction (opened first): on SQLite, one hand-over in all."""
        await self.open()
        return await self.db.transact(plan)

    async def _read(self, plan: Plan[T]) -> T:
        await self.open()
        return await self.db.read(plan)

    # ownership and recovery

    async def _lease(self, tx: Tx) -> None:
        owner, seconds = self.owner, self.lease_seconds
        await tx.send(_LEASE, {
            "id": owner.id, "host": owner.host, "boot_id": owner.boot_id, "pid": owner.pid,
            "pid_started": owner.pid_started, "opened_at": utc_now(), "lease_seconds": seconds,
            "wall_expiry": time.time() + seconds, "monotonic": time.monotonic() + seconds})

    def _lease_due(self) -> bool:
        """Whether a run's start writes the lease too: unless it was committed less than a third
        of a lease ago. The lease keeper renews it a third of a lease after its last commit
        (`renewal_in`), so a run never starts with less than two thirds of a lease left, nor
        meets its first renewal with less."""
        return self.renewal_in() <= 0

    def renewal_in(self) -> float:
        """Seconds until this owner's lease is a third gone (0: it is, or it was never written)."""
        if self._leased_at is None:
            return 0.0
        return max(0.0, self._leased_at + self.lease_seconds / 3 - time.monotonic())

    async def _open_sweep(self) -> None:
        """What an open writes: this owner's row, then the recovery of runs left `running`."""
        leased_at = time.monotonic()
        async with self.db.transaction() as tx:
            await self._lease(tx)
        self._leased_at = leased_at
        if self.single_owner:
            async with self.db.transaction() as tx:
                running = [row["id"] for row in await tx.rows("SELECT id FROM runs WHERE status = 'running'")]
                self.recovered_runs = await self.relabel_in(tx, running)
        else:
            self.recovered_runs = await self._relabel_stale(None)
            async with self.db.transaction() as tx:
                await self._forget_gone_owners(tx)  # those that died holding no run
        self._sweep_pending = False

    async def recover(self, conversation_id: str | None = None, user_id: str | None = None) -> int:
        """Relabel `interrupted` the `running` runs whose owner is gone (of one user's
        conversations, else of one conversation, else of all); how many. The first call opens,
        and then counts what the open's sweep relabelled.

        A read decides whether there is anything to do, so the common case takes no write lock;
        the relabelling re-checks inside its transaction (`status = 'running'`). On a full disk
        the relabelling cannot be written: it is left for a later look (and logged), and 0 is
        returned, so that reading goes on (a run start is refused with `STORAGE_FULL` instead).
        """
        opening = not self._open
        await self.open()
        if opening:
            return self.recovered_runs
        try:
            return await self._recover(conversation_id, user_id)
        except SophosError as error:
            if error.code != STORAGE_FULL:
                raise
            log.info("could not recover the runs of %s yet: %s", self.db.where, error.message)
            return 0

    async def _recover(self, conversation_id: str | None = None, user_id: str | None = None) -> int:
        """`recover`, refused with `STORAGE_FULL` on a full disk. After an open that could not
        write its owner row and recovery, those first (the count is then the whole database's)."""
        await self.open()
        if self._sweep_pending:
            async with self._opening:
                if self._sweep_pending:
                    await self._open_sweep()
                    return self.recovered_runs
        if self.single_owner:
            return 0
        return await self._relabel_stale(conversation_id, user_id)

    async def _relabel_stale(self, conversation_id: str | None, user_id: str | None = None) -> int:
        async with self.db.reading() as tx:
            if not await stale_runs(tx, self.owner, conversation_id, user_id):
                return 0
        async with self.db.transaction() as tx:
            stale = await stale_runs(tx, self.owner, conversation_id, user_id)
            count = await self._give_up_in(tx, stale)
            await self._forget_gone_owners(tx)
            return count

    async def _give_up_in(self, tx: Tx, run_ids: list[str]) -> int:
        """Inside a transaction: re-queue these runs (a worker's, `SOPHOS_LAB_REQUEUE`) or
        relabel them, as a gone owner's; how many."""
        requeued = await self.db.requeue(tx, run_ids, self.requeue_limit)
        if requeued:  # what the attempt that died saved counts, as a relabelled run's does
            await tx.execute(_SAVED_STEPS, {"ids": sorted(requeued)})
        return await self.relabel_in(tx, [run_id for run_id in run_ids if run_id not in requeued]) + len(requeued)

    async def relabel_in(self, tx: Tx, run_ids: list[str]) -> int:
        """Inside a transaction: relabel these runs if they are still `running`, with the steps
        they saved (`_SAVED_STEPS`, which their user's day counts), a worker's followers' final
        event, and their conversations' message count from the thread (`recount`): the run
        recorded no outcome, so the column still held what its row wrote. How many were."""
        if not run_ids:
            return 0
        relabelled = await tx.rows(_RELABEL, {"now": utc_now(), "ids": run_ids})
        if not relabelled:
            return 0
        if await tx.has_table("checkpoints"):
            await tx.execute(_SAVED_STEPS, {"ids": [row["id"] for row in relabelled]})
        await self.db.close_events(tx, relabelled)
        await self._recount(tx, {row["conversation_id"] for row in relabelled})
        return len(relabelled)

    async def _recount(self, tx: Tx, conversation_ids: set[str]) -> None:
        """Each conversation's `message_count`, as the conversation shows it (`counting`), read
        once from its thread. A thread that cannot be read keeps its count (logged): recovery
        never fails for a count."""
        if not await tx.has_table("checkpoints"):
            return  # no thread yet: the saver makes its tables before any run's first step
        for conversation_id in sorted(conversation_ids):
            latest = await tx.row("SELECT id, input FROM runs WHERE conversation_id = :id ORDER BY {seq} DESC LIMIT 1",
                                  {"id": conversation_id})
            try:
                async with self.db.thread_reader() as saver:
                    count = await thread_count(saver, conversation_id, (latest["id"], latest["input"]) if latest else None)
            except Exception:
                log.exception("could not count the messages of %s; its message_count stays", conversation_id)
                continue
            await tx.execute("UPDATE conversations SET message_count = :count WHERE id = :id",
                             {"count": count, "id": conversation_id})

    async def _forget_gone_owners(self, tx: Tx) -> None:
        """Delete the rows of gone owners that no longer hold a `running` run. A row another
        session holds locked (a process frozen inside its lease renewal) is left for a later
        look: waiting on it would fail the recovery it tidies up after."""
        rows = await tx.rows(
            "SELECT o.*, {lease_left} AS lease_left, true AS has_owner FROM owners o WHERE id != :me AND id NOT IN"
            " (SELECT owner_id FROM runs WHERE status = 'running' AND owner_id IS NOT NULL)",
            {"me": self.owner.id, "wall_now": time.time()})
        if gone := [row["id"] for row in rows if owner_gone(owner_row(row), self.owner)]:
            await tx.execute("DELETE FROM owners WHERE id IN (SELECT id FROM owners WHERE id {in_ids}{skip_locked})",
                             {"ids": gone})

    async def relabel(self, run_ids: list[str]) -> int:
        """Relabel these runs `interrupted` (`cancelled` if a cancel was accepted) if they are
        still `running`, in one transaction; how many were. For a live process's own runs whose
        outcome it could not write (`AgentService`); `recover` leaves a live owner's runs alone."""
        if not run_ids:
            return 0
        async with self.transaction() as tx:
            return await self.relabel_in(tx, run_ids)

    async def give_up(self, run_ids: list[str]) -> int:
        """This owner's runs that no task of it works on any more (see `lease`), given up as a
        gone owner's are: re-queued (`SOPHOS_LAB_REQUEUE`) or relabelled, with their followers' final event."""
        if not run_ids:
            return 0
        async with self.transaction() as tx:
            return await self._give_up_in(tx, run_ids)

    async def owned_runs(self) -> list[str]:
        """The ids of the runs `running` under this owner, whatever this process thinks it runs."""
        async with self.reading() as tx:
            return [row[0] for row in await tx.tuples(
                "SELECT id FROM runs WHERE status = 'running' AND owner_id = :me", {"me": self.owner.id})]

    async def renew_lease(self, run_ids: list[str]) -> set[str]:
        """Extend this owner's lease; the ids among `run_ids` it no longer owns (taken over)."""
        leased_at = time.monotonic()
        async with self.transaction() as tx:
            await self._lease(tx)
        self._leased_at = leased_at
        if not run_ids:
            return set()
        async with self.db.reading() as tx:
            still = {row[0] for row in await tx.tuples(
                "SELECT id FROM runs WHERE id {in_ids} AND status = 'running' AND owner_id = :me",
                {"ids": list(run_ids), "me": self.owner.id})}
        return set(run_ids) - still

    # conversations

    async def create_conversation(self, conversation_id: str, first_message: str) -> None:
        now = utc_now()
        async with self.transaction() as tx:
            await tx.execute("INSERT INTO conversations (id, title, created_at, updated_at, user_id)"
                             " VALUES (:id, :title, :now, :now, :user_id)",
                             {"id": conversation_id, "title": _title(first_message), "now": now,
                              "user_id": users.acting_user.get()})

    async def get_conversation(self, conversation_id: str) -> Conversation | None:
        """The conversation, if it is the acting user's (any, when no user acts: see `users`)."""
        where, params = users.mine()
        async with self.reading() as tx:
            rows = await tx.tuples(_LISTING + " WHERE c.id = :id" + where, {"id": conversation_id, **params})
        return conversations_of(row[1:] for row in rows)[0] if rows else None

    async def before_message(self, conversation_id: str) -> tuple[str, Run | None, str | None]:
        """What a new message in the conversation needs, read at once: its id, its latest run and
        its owner's id (`users`); `NOT_FOUND` unless it is the acting user's (as `get_conversation`)."""
        where, params = users.mine()

        async def look(tx: Tx) -> tuple[str, Run | None, str | None] | None:
            row = await tx.row(
                "SELECT c.id AS the_conversation, c.user_id AS its_owner, r.* FROM conversations c {latest_run}"
                " WHERE c.id = :id" + where, {"id": conversation_id, **params})
            if row is None:
                return None
            return row["the_conversation"], run_of(row) if row["id"] is not None else None, row["its_owner"]

        found = await self._read(look)
        if found is None:
            raise SophosError(NOT_FOUND, f"Conversation Not Found: {conversation_id}")
        return found

    async def list_conversations(self) -> list[Conversation]:
        """Every conversation (the acting user's), most recently updated first (unbounded: see
        `conversation_page`)."""
        where, params = users.mine()
        async with self.reading() as tx:
            return conversations_of(await tx.tuples(_ALL.replace("{mine}", where), params))

    async def conversation_page(self, limit: int = PAGE_SIZE, after: ListingPosition | None = None) -> ConversationPage:
        """Up to `limit` conversations after `after` in the listing's order (keyset pagination).

        A conversation created while a client walks the pages sorts before its cursor, so the
        walk shows every conversation it started with exactly once and none twice. One that is
        updated meanwhile (a new run) moves to the top: the walk shows it where it was if it got
        there first, otherwise not at all; the next first page shows it.
        """
        where, params = users.mine()
        sql = _LISTING + " WHERE true" + where
        if after is not None:
            sql += " AND (c.updated_at, c.{seq}) < (:after_updated_at, :after_position)"
            params = {**params, "after_updated_at": after.updated_at, "after_position": after.rowid}
        async with self.reading() as tx:
            rows = await tx.tuples(sql + _LISTING_ORDER + " LIMIT :limit", {**params, "limit": limit + 1})
        more, rows = len(rows) > limit, rows[:limit]
        last = ListingPosition(rows[-1][4], rows[-1][0]) if rows else None
        return ConversationPage(conversations=conversations_of(row[1:] for row in rows),
                                next_cursor=encode_cursor(last) if more else None)

    # runs

    async def start_run(self, run_id: str, conversation_id: str, input_messages: list[dict[str, str]] | None = None,
                        title: str | None = None, idempotency: IdempotencyKey | None = None,
                        decision: tuple[Gate, dict[str, dict]] | None = None,
                        after: Seen | None = None) -> tuple[str | None] | None:
        """Start a run, in one transaction: the conversation (when `title` is given, it is new),
        this owner's lease, the `running` row with the messages it carries, `updated_at` and the
        message count (with those messages), the request's idempotency key, a gate's decisions.

        An active run on the conversation refuses the start (read with the conversation's row
        locked, and a partial unique index behind it: `SESSION_IN_PROGRESS`, whichever process or
        host tries); one of a gone owner is relabelled first (apart: it reads the thread), and the
        start tried again. With a user acting, the transaction first looks for the user's runs of
        gone owners (a crashed run holds no place in their limit). The lease is written unless it
        was a moment ago (`_lease_due`). A key already taken refuses the whole start
        (`IDEMPOTENCY_KEY_REUSED`), a gate decided meanwhile too (`GATE_DECIDED`). With `after`
        (the latest run as the caller read it, or `SETTLED`), a start after another, or on a
        conversation gone, is refused with `LatestRunChanged`. It returns the owner of an existing
        conversation, `(user id,)`. On a full disk: `STORAGE_FULL`, nothing written.
        """
        user, due, began = users.acting_user.get(), self._lease_due(), time.monotonic()
        owner: list[tuple[str | None] | None] = [None]

        async def start(tx: Tx, look: bool) -> bool:
            if look and await stale_runs(tx, self.owner, conversation_id, user):
                return False
            if due:
                await self._lease(tx)
            await users.check_limits(tx, "running", self.limits, utc_now())
            owner[0] = await self._insert_run(tx, run_id, conversation_id, "running", self.owner.id, input_messages,
                                              title, idempotency, decision, after)
            return True

        await self.open()
        try:
            started = not self._sweep_pending and await self._starting(
                idempotency, lambda tx: start(tx, look=user is not None and not self.single_owner))
        except SophosError as error:
            if error.code != SESSION_IN_PROGRESS or self.single_owner:
                raise
            started = False  # the run in the way may be a gone owner's
        if not started:
            await self._recover(conversation_id, user)  # it may take a while: is the lease due now?
            due, began = self._lease_due(), time.monotonic()
            await self._starting(idempotency, lambda tx: start(tx, look=False))
        if due:
            self._leased_at = began
        return owner[0]

    async def _starting(self, idempotency: IdempotencyKey | None, plan: Plan[T]) -> T:
        """`plan` in one transaction, a refused key or active run as the error a caller is given."""
        try:
            return await self._transact(plan)
        except Conflict as conflict:
            if conflict.what == "idempotency_key":
                raise SophosError(IDEMPOTENCY_KEY_REUSED,
                                  f"The idempotency key {idempotency.key!r} has started a run already") from conflict
            raise SophosError(SESSION_IN_PROGRESS, "Previous request still in progress") from conflict

    @staticmethod
    async def _insert_run(tx: Tx, run_id: str, conversation_id: str, status: str, owner_id: str | None,
                          input_messages: list[dict[str, str]] | None, title: str | None,
                          idempotency: IdempotencyKey | None, decision: tuple[Gate, dict[str, dict]] | None,
                          after: Seen | None = None) -> tuple[str | None] | None:
        now = utc_now()
        if title is not None:
            await tx.send("INSERT INTO conversations (id, title, created_at, updated_at, user_id)"
                             " VALUES (:id, :title, :now, :now, :user_id)",
                             {"id": conversation_id, "title": _title(title), "now": now,
                              "user_id": users.acting_user.get()})
        # The messages it carries count from now on, as the conversation shows them (pending
        # until they reach the thread; see `counting`): the count before is true, recovered above.
        await tx.send("UPDATE conversations SET updated_at = :now, message_count = message_count + :added"
                         " WHERE id = :id", {"now": now, "added": len(input_messages or ()), "id": conversation_id})
        owner = None
        if title is None:
            # The conversation's row is locked by the update above: the run read is still the
            # latest when this one commits (another start waits for this commit).
            found = await tx.tuples("SELECT c.user_id, r.id, r.status FROM conversations c {latest_run}"
                                    " WHERE c.id = :id", {"id": conversation_id})
            users.check_owner(conversation_id, found[0] if found else None)
            if after is not None and (not found or not as_expected(found[0][1:], after)):
                raise LatestRunChanged(f"the latest run of {conversation_id} is {found[0][1:] if found else 'gone'},"
                                       f" not {after}")
            if found and found[0][2] in ("running", "queued"):
                # Refused here, not by the insert: that would wait, holding this row, for a process
                # whose outcome or relabelling of the run then waits for this row (a deadlock).
                raise Conflict("active_run", LookupError(f"run {found[0][1]} is {found[0][2]}"))
            owner = (found[0][0],) if found else None
        await tx.send(
            "INSERT INTO runs (id, conversation_id, status, started_at, owner_id, input)"
            " VALUES (:id, :conversation_id, :status, :now, :owner_id, :input)",
            {"id": run_id, "conversation_id": conversation_id, "status": status, "now": now, "owner_id": owner_id,
             "input": json.dumps(input_messages, ensure_ascii=False) if input_messages else None})
        if idempotency is not None:
            await tx.send("INSERT INTO idempotency_keys (key, request, conversation_id, run_id, created_at)"
                             " VALUES (:key, :request, :conversation_id, :run_id, :now)",
                             {"key": users.scoped_key(idempotency.key), "request": idempotency.request,
                              "conversation_id": conversation_id, "run_id": run_id, "now": now})
        if decision is not None:
            gate, decisions = decision
            decided = await tx.execute(
                "UPDATE gates SET decisions = :decisions, decided_at = :now, decided_run_id = :run_id"
                " WHERE conversation_id = :conversation_id AND id = :id AND decisions IS NULL",
                {"decisions": json.dumps(decisions, ensure_ascii=False), "now": now, "run_id": run_id,
                 "conversation_id": gate.conversation_id, "id": gate.id})
            if not decided:
                raise SophosError(GATE_DECIDED, f"The gate {gate.id} was decided already")
        return owner

    async def finish_run(self, run_id: str, status: str, message_count: int | None, error_code: str | None = None,
                         error_message: str | None = None, gate: Gate | None = None, steps: int = 0,
                         input_ids: str | None = None) -> bool:
        """Record a run's outcome, the graph steps it took and the conversation's message count,
        in one transaction; with `gate` (a `waiting` run), the gate it stopped at, in the same one.
        With `input_ids` (`models.carried_ids`, once the thread's checkpoint holds the run's
        messages), `runs.input` keeps only their ids and roles: the text is stored once.

        Only while the run is still this owner's and `running` (fencing), and not over a cancel
        another process recorded first (a worker's run): that one wins, and the caller records
        `cancelled` (see `cancel_requested`). False, writing nothing, when refused.
        """
        now = utc_now()
        mine = "" if self.single_owner else " AND status = 'running' AND owner_id = :me"
        if self.single_owner:  # another process may fork the thread past this run: keep the text
            input_ids = None

        # The rest follows only the row as the run's update left it: nothing waits before COMMIT.
        written = "SELECT {what} FROM runs WHERE id = :run_id AND status = :status AND finished_at = :now"

        async def finish(tx: Tx) -> Sent:
            updated = await tx.counted(
                "UPDATE runs SET status = :status, error_code = :code, error_message = :message, finished_at = :now,"
                " steps = steps + :steps, input = coalesce(:input_ids, input) WHERE id = :run_id" + mine
                + " AND (cancel_requested_at IS NULL OR :status = 'cancelled')",
                {"status": status, "code": error_code, "message": error_message, "now": now, "steps": steps,
                 "input_ids": input_ids, "run_id": run_id, "me": self.owner.id})
            if message_count is not None:
                await tx.send("UPDATE conversations SET message_count = :count, updated_at = :now"
                              " WHERE id = (" + written.format(what="conversation_id") + ")",
                              {"count": message_count, "now": now, "run_id": run_id, "status": status})
            if gate is not None:
                await tx.send(
                    "INSERT INTO gates (id, conversation_id, run_id, calls, created_at)"
                    " SELECT :id, :conversation_id, :run_id, :calls, :now WHERE EXISTS (" + written.format(what="1") + ")"
                    " ON CONFLICT (conversation_id, id) DO UPDATE SET run_id = excluded.run_id",
                    {"id": gate.id, "conversation_id": gate.conversation_id, "run_id": run_id,
                     "calls": json.dumps(gate.calls, ensure_ascii=False), "now": now, "status": status})
            return updated

        return bool((await self._transact(finish)).rowcount)

    async def request_cancel(self, run_id: str) -> bool:
        """Write that the run is to be cancelled, while it is still this owner's and `running`;
        False (nothing written) when its outcome is recorded already or it is not ours."""
        mine = "" if self.single_owner else " AND owner_id = :me"
        async with self.transaction() as tx:
            return bool(await tx.execute(
                "UPDATE runs SET cancel_requested_at = :now WHERE id = :run_id AND status = 'running'"
                " AND cancel_requested_at IS NULL" + mine, {"now": utc_now(), "run_id": run_id, "me": self.owner.id}))

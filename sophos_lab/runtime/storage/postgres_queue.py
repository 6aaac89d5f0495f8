"""The queue's storage (a pool of workers, PostgreSQL only: see `queue`): `QueueStorage` adds to
`Storage` what a queued run needs, and the SQL here runs inside the app tables' transactions:
queue a run with its `started` event, claim the next one fairly, re-queue a dead worker's run,
write the final event a dead worker could not, cancel from any process.

The events table and its channels are `queue`'s; this module writes the rows a run's queueing,
claiming, relabelling and cancelling owe it, in the same transaction as the run's row.
"""

from __future__ import annotations

import json
import time
from typing import Any

from .. import errors, users
from ..events import TERMINAL_EVENTS, Event
from ..ownership import owner_gone
from .connector import Tx
from .models import Gate, IdempotencyKey, Run, Seen, run_of, utc_now
from .rules import Storage
from .stale import owner_row

QUEUE_CHANNEL = "sophos_queue"
"""Notified with a run id when a run is queued: a waiting worker wakes and claims."""
EVENTS_CHANNEL = "sophos_events"
"""Notified with `"<run id> <last event id>"` when a run's events were appended."""
CANCEL_CHANNEL = "sophos_cancel"
"""Notified with a run id when a cancel of a claimed run was recorded: its worker stops it."""

TERMINAL = list(TERMINAL_EVENTS)

_INSERT_EVENT = ("INSERT INTO run_events (run_id, id, conversation_id, event, data)"
                 " VALUES (:run_id, :id, :conversation_id, :event, :data)")


def event_row(run_id: str, conversation_id: str, event: Event) -> dict[str, Any]:
    # ASCII JSON: text PostgreSQL can hold whatever the data (a NUL, a lone surrogate).
    return {"run_id": run_id, "id": event.id, "conversation_id": conversation_id, "event": event.event,
            "data": json.dumps(event.data, ensure_ascii=True)}


async def queue_started(tx: Tx, run_id: str, conversation_id: str, resume: bool) -> None:
    """With the queued row: the run's `started` event (id 1), the conversation's older runs'
    events gone, and the workers woken (a notification is sent when the transaction commits)."""
    await tx.execute("DELETE FROM run_events WHERE conversation_id = :conversation_id",
                     {"conversation_id": conversation_id})
    started = Event(1, "started", {"conversation": conversation_id, "run": run_id, "resume": resume})
    await tx.execute(_INSERT_EVENT, event_row(run_id, conversation_id, started))
    await tx.execute("UPDATE runs SET last_event_id = 1 WHERE id = :run_id", {"run_id": run_id})
    await tx.execute("SELECT pg_notify(:queue, :run_id), pg_notify(:events, :payload)",
                     {"queue": QUEUE_CHANNEL, "run_id": run_id, "events": EVENTS_CHANNEL, "payload": f"{run_id} 1"})


async def claim(tx: Tx, owner_id: str, now: str, max_running: int = 2) -> dict | None:
    """The next queued run in fair order, now `running` and this owner's; None when none may be
    claimed. Rows another worker is claiming are skipped, not waited for.

    Fair across users: a queued run's turn is its user's runs running plus those queued ahead of
    it, then queue order, so users take turns (one user's 50 queued runs put another user's
    first one behind one of theirs, not all 50); a user with `max_running` runs running waits.
    Conversations of no user (the single-user mode) are one user with no cap.
    """
    return await tx.row(_CLAIM, {"max_running": max_running, "owner_id": owner_id, "now": now})


_CLAIM = """
WITH active AS (
    SELECT r.id, r.seq, r.status, c.user_id,
           count(*) FILTER (WHERE r.status = 'running') OVER (PARTITION BY c.user_id) AS running,
           row_number() OVER (PARTITION BY c.user_id, r.status ORDER BY r.seq) AS place
    FROM runs r JOIN conversations c ON c.id = r.conversation_id
    WHERE r.status IN ('queued', 'running')
), next AS (
    SELECT runs.id FROM runs JOIN active ON active.id = runs.id
    WHERE active.status = 'queued' AND runs.status = 'queued'
      AND (active.user_id IS NULL OR active.running < :max_running)
    ORDER BY active.running + active.place, active.seq
    LIMIT 1 FOR UPDATE OF runs SKIP LOCKED
)
UPDATE runs SET status = 'running', owner_id = :owner_id, claimed_at = :now FROM next WHERE runs.id = next.id
RETURNING runs.*
"""


async def requeue(tx: Tx, run_ids: list[str], limit: int) -> set[str]:
    """With `SOPHOS_LAB_REQUEUE=N`: put a worker's run whose owner is gone back in the queue
    instead of relabelling it, at most N times (`requeues`), unless a cancel was asked for. Its
    followers see no end: its events go on when a worker claims it. The steps the attempt saved
    are recorded (the caller's `SAVED_STEPS`); the outcome adds the next attempt's."""
    if not limit or not run_ids:
        return set()
    rows = await tx.rows(
        "UPDATE runs SET status = 'queued', owner_id = NULL, claimed_at = NULL, requeues = requeues + 1"
        " WHERE status = 'running' AND id {in_ids} AND claimed_at IS NOT NULL AND cancel_requested_at IS NULL"
        " AND requeues < :limit RETURNING id", {"ids": run_ids, "limit": limit})
    for row in rows:
        await tx.execute("SELECT pg_notify(:channel, :run_id)", {"channel": QUEUE_CHANNEL, "run_id": row["id"]})
    return {row["id"] for row in rows}


async def close_events(tx: Tx, runs: list[dict[str, Any]]) -> None:
    """For runs that were just given their outcome by another process than their owner (a
    relabel, a cancel of a queued run): the final event their followers wait for, after the
    events their owner got in, unless it wrote one. `runs` are rows with `id`,
    `conversation_id`, `status`, `error_code`, `error_message`."""
    for run in runs:
        data: dict[str, Any] = {"conversation": run["conversation_id"], "run": run["id"]}
        if run["error_code"]:
            name, data = "chat-error", {"code": run["error_code"], "message": run["error_message"], **data}
        else:
            name, data = "end", {**data, "status": run["status"]}
            gate = await tx.row("SELECT id, calls, decisions FROM gates WHERE run_id = :run_id ORDER BY seq DESC LIMIT 1",
                                {"run_id": run["id"]}) if run["status"] == "waiting" else None
            if gate is not None and gate["decisions"] is None:
                data["approval"] = {"gate": gate["id"], "calls": json.loads(gate["calls"])}
        last = await tx.row(
            "SELECT max(id) AS kept, bool_or(event = ANY(:terminal)) AS ended,"
            " (SELECT last_event_id FROM runs WHERE id = :run_id) AS given FROM run_events WHERE run_id = :run_id",
            {"terminal": TERMINAL, "run_id": run["id"]})
        given = max(last["kept"] or 0, last["given"] or 0)
        if not given or last["ended"]:
            continue  # not a worker's run (it gave no event), or its final event is there
        final = Event(given + 1, name, data)
        await tx.execute(_INSERT_EVENT, event_row(run["id"], run["conversation_id"], final))
        await tx.execute("UPDATE runs SET last_event_id = :id WHERE id = :run_id", {"id": final.id, "run_id": run["id"]})
        await tx.execute("SELECT pg_notify(:channel, :payload)",
                         {"channel": EVENTS_CHANNEL, "payload": f"{run['id']} {final.id}"})


async def cancel_queued(tx: Tx, run_id: str, now: str) -> bool:
    """A queued run, cancelled before any worker took it (its final event written); False if
    it is not queued any more."""
    row = await tx.row(
        "UPDATE runs SET status = 'cancelled', error_code = :code, error_message = :message,"
        " cancel_requested_at = :now, finished_at = :now WHERE id = :run_id AND status = 'queued' RETURNING *",
        {"code": errors.CANCELLED, "message": errors.CANCELLED_MESSAGE, "now": now, "run_id": run_id})
    if row is not None:
        await close_events(tx, [row])
    return row is not None


async def request_cancel(tx: Tx, run_id: str, now: str) -> bool:
    """A claimed run asked to stop, whoever owns it: recorded first, then its worker told."""
    asked = await tx.execute(
        "UPDATE runs SET cancel_requested_at = :now WHERE id = :run_id AND status = 'running'"
        " AND cancel_requested_at IS NULL", {"now": now, "run_id": run_id})
    if asked:
        await tx.execute("SELECT pg_notify(:channel, :run_id)", {"channel": CANCEL_CHANNEL, "run_id": run_id})
    return bool(asked)


async def event_span(tx: Tx, run_id: str) -> tuple[int, int]:
    """`(dropped, last_id)` of the run's events: `last_id` is the latest it gave (0: none), and
    ids `dropped + 1` to `last_id` are kept (none when a crash of the server emptied the table)."""
    row = await tx.row(
        "SELECT min(id) AS first, max(id) AS last, (SELECT last_event_id FROM runs WHERE id = :run_id) AS given"
        " FROM run_events WHERE run_id = :run_id", {"run_id": run_id})
    given = max(row["last"] or 0, row["given"] or 0)
    if row["last"] is None:
        return given, given
    return row["first"] - 1, given


async def final_event_kept(tx: Tx, run_id: str) -> bool:
    """Whether the run's final event (`end` or `chat-error`) is among its kept events."""
    row = await tx.row("SELECT EXISTS (SELECT 1 FROM run_events WHERE run_id = :run_id AND event = ANY(:terminal)) AS kept",
                       {"run_id": run_id, "terminal": TERMINAL})
    return row["kept"]


class QueueStorage(Storage):
    """`Storage` on PostgreSQL, with the queue of a pool of workers."""

    async def queue_run(self, run_id: str, conversation_id: str, input_messages: list[dict[str, str]] | None,
                        title: str | None, idempotency: IdempotencyKey | None,
                        decision: tuple[Gate, dict[str, dict]] | None, resume: bool, after: Seen | None = None) -> None:
        """As `start_run`, for a worker to claim (PostgreSQL, `queue`): the run `queued`, owned by
        no one, with its `started` event; the workers are woken once it is committed."""
        await self._recover(conversation_id, users.acting_user.get())

        async def queue(tx: Tx) -> None:
            await users.check_limits(tx, "queued", self.limits, utc_now())
            await self._insert_run(tx, run_id, conversation_id, "queued", None, input_messages, title,
                                   idempotency, decision, after)
            await queue_started(tx, run_id, conversation_id, resume)

        await self._starting(idempotency, queue)

    async def claim_run(self) -> Run | None:
        """The next queued run in fair order, now this owner's and `running`; None if none may be claimed."""
        async with self.transaction() as tx:
            await self._lease(tx)
            return run_of(await claim(tx, self.owner.id, utc_now(), self.limits.running))

    async def cancel_remote(self, run_id: str) -> bool:
        """Cancel a run of the queue from any process: a queued one is `cancelled` at once (with
        its final event); a claimed one gets its request written and its worker told. False
        when it is neither any more."""
        async with self.transaction() as tx:
            now = utc_now()
            return await cancel_queued(tx, run_id, now) or await request_cancel(tx, run_id, now)

    async def close_orphaned_events(self, run_id: str) -> None:
        """A worker's run whose outcome is recorded but whose final event its worker never
        wrote (it died in between): write it from the row, once that worker is gone."""
        async with self.transaction() as tx:
            row = await tx.row(
                "SELECT r.*, o.id AS owner_row, o.host, o.boot_id, o.pid, o.pid_started, o.lease_expires_monotonic,"
                " {lease_left} AS lease_left, o.id IS NOT NULL AS has_owner"
                " FROM runs r LEFT JOIN owners o ON o.id = r.owner_id"
                " WHERE r.id = :id AND r.status NOT IN ('queued', 'running') FOR UPDATE OF r",
                {"id": run_id, "wall_now": time.time()})  # a live run's row is not locked: its worker's writes go on
            if row is None:
                return
            owner = owner_row({**row, "id": row["owner_row"]})
            if owner is None or owner_gone(owner, self.owner):
                await self.db.close_events(tx, [row])

    async def event_span(self, run_id: str) -> tuple[int, int]:
        async with self.reading() as tx:
            return await event_span(tx, run_id)

    async def final_event_kept(self, run_id: str) -> bool:
        async with self.reading() as tx:
            return await final_event_kept(tx, run_id)

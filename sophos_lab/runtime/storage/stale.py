"""Runs whose owner is gone, as the tables say: the `running` rows with their owners' leases,
read on either backend's clock (see `ownership.owner_gone`)."""

from __future__ import annotations

import time
from typing import Any

from ..ownership import Owner, owner_gone
from .connector import Tx

_RUNNING = """
SELECT r.id AS run_id, o.id, o.host, o.boot_id, o.pid, o.pid_started, {lease_left} AS lease_left,
       o.lease_expires_monotonic, o.id IS NOT NULL AS has_owner
FROM runs r LEFT JOIN owners o ON o.id = r.owner_id
WHERE r.status = 'running'"""


def owner_row(row: dict[str, Any]) -> dict | None:
    """An owner's row as `owner_gone` reads it: its wall-clock lease read as what the
    database's clock leaves of it (`lease_left`), so one rule holds on either backend."""
    if not row["has_owner"]:
        return None
    return {**row, "lease_expires_at": time.time() + row["lease_left"]}


async def stale_runs(tx: Tx, me: Owner, conversation_id: str | None = None, user_id: str | None = None) -> list[str]:
    """The `running` runs whose owner is gone, as `me` sees it: of one user's conversations
    (`user_id`), else of one conversation, else all."""
    scope = ""
    if user_id is not None:
        scope = " AND r.conversation_id IN (SELECT id FROM conversations WHERE user_id = :user_id)"
    elif conversation_id is not None:
        scope = " AND r.conversation_id = :conversation_id"
    rows = await tx.rows(_RUNNING + scope, {"wall_now": time.time(), "user_id": user_id,
                                            "conversation_id": conversation_id})
    return [row["run_id"] for row in rows if owner_gone(owner_row(row), me)]

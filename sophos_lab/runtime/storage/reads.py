"""What the runtime reads of one run, its key and its gates: single statements, no rule.

A part of `rules.Storage` (a mixin, as the runtime's modules are of its service); `reading()` is
the storage's own.
"""

from __future__ import annotations

from .. import users
from .models import Gate, KeyedRun, Run, gate_of, run_of


class RunReads:
    """`Storage`'s reads of runs, idempotency keys and gates."""

    async def cancel_requested(self, run_id: str) -> bool:
        """Whether a cancel of the run is recorded (by any process)."""
        async with self.reading() as tx:
            return await tx.value("SELECT cancel_requested_at FROM runs WHERE id = :id", {"id": run_id}) is not None

    async def get_run(self, run_id: str) -> Run | None:
        async with self.reading() as tx:
            return run_of(await tx.row("SELECT * FROM runs WHERE id = :id", {"id": run_id}))

    async def latest_run(self, conversation_id: str) -> Run | None:
        async with self.reading() as tx:
            return run_of(await tx.row("SELECT * FROM runs WHERE conversation_id = :id ORDER BY {seq} DESC LIMIT 1",
                                       {"id": conversation_id}))

    async def list_runs(self, conversation_id: str | None = None) -> list[Run]:
        """Runs in the order they were written (clocks step back), of one conversation or of all."""
        where = "" if conversation_id is None else " WHERE conversation_id = :id"
        async with self.reading() as tx:
            return [run_of(row) for row in await tx.rows("SELECT * FROM runs" + where + " ORDER BY {seq}",
                                                         {"id": conversation_id})]

    async def keyed_run(self, key: str) -> KeyedRun | None:
        """The run an idempotency key started, if it started one."""
        async with self.reading() as tx:
            row = await tx.row("SELECT * FROM idempotency_keys WHERE key = :key", {"key": users.scoped_key(key)})
        return KeyedRun(**row) if row else None

    async def gate(self, conversation_id: str, gate_id: str) -> Gate | None:
        async with self.reading() as tx:
            return gate_of(await tx.row("SELECT * FROM gates WHERE conversation_id = :conversation_id AND id = :id",
                                        {"conversation_id": conversation_id, "id": gate_id}))

    async def gates(self, conversation_id: str) -> list[Gate]:
        """The conversation's gates, oldest first."""
        async with self.reading() as tx:
            return [gate_of(row) for row in await tx.rows(
                "SELECT * FROM gates WHERE conversation_id = :id ORDER BY {seq}", {"id": conversation_id})]

    async def run_gate(self, run_id: str) -> Gate | None:
        """The gate a run stopped at, if it did."""
        async with self.reading() as tx:
            return gate_of(await tx.row("SELECT * FROM gates WHERE run_id = :id ORDER BY {seq} DESC LIMIT 1",
                                        {"id": run_id}))

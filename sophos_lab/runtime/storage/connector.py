"""The seam between the rules and a database: a connection's statements, awaited.

The rules (`rules`) write their SQL once, with named parameters (`:run_id`) and a few named
fragments in braces where the two dialects differ (`{seq}`: SQLite's `rowid`, PostgreSQL's
`seq`); each backend (`sqlite`, `postgres`) fills them in and runs the statements on an async
connection, so no call that waits on the database runs on the event loop's thread. A unique
constraint that the rules decide by comes back as a neutral `Conflict`, whatever the driver
called it.

A rule that runs several statements in a row without waiting for anything else between them
writes them as a `Plan`: on SQLite they then cost one hand-over to the connection's thread.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

Params = Mapping[str, Any] | None
T = TypeVar("T")

Plan = Callable[["Tx"], Awaitable[T]]
"""A transaction's (or a read's) statements as one function of its `Tx`, for `transact` and
`read` on a backend. A plan awaits its statements and nothing else, so a backend may run it whole
where its connection lives: SQLite runs it in the connection's thread, one hand-over to that
thread in all where each statement was one; PostgreSQL runs it on the event loop as any of its
transactions, pipelined (a statement sent with `send` does not wait)."""


class Conflict(Exception):
    """A row a unique constraint refused: `what` is `idempotency_key` (the key started a run
    already) or `active_run` (the conversation has a running or queued run)."""

    def __init__(self, what: str, error: BaseException) -> None:
        super().__init__(f"{what}: {error}")
        self.what = what


class Dialect:
    """A backend's fragments, and its SQL from the rules' SQL (cached: the rules send few kinds)."""

    def __init__(self, name: str, fragments: Mapping[str, str], pyformat: bool) -> None:
        self.name = name
        self.fragments = dict(fragments)
        self.pyformat = pyformat
        """psycopg's `%(name)s` parameters instead of SQLite's `:name`."""
        self._prepared: dict[str, str] = {}

    def prepare(self, sql: str) -> str:
        prepared = self._prepared.get(sql)
        if prepared is None:
            prepared = sql.format_map(self.fragments) if "{" in sql else sql
            if self.pyformat:
                prepared = _NAMED.sub(r"%(\1)s", prepared.replace("%", "%%"))
            self._prepared[sql] = prepared
        return prepared


_NAMED = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")
"""A named parameter: `:name`, not a cast (`::jsonb`)."""


class Sent:
    """A statement sent with `Tx.counted`: how many rows it changed, once the transaction has
    ended (PostgreSQL reads the count with the `COMMIT`'s answer, SQLite has it at once)."""

    def __init__(self, count: Callable[[], int]) -> None:
        self._count = count

    @property
    def rowcount(self) -> int:
        return self._count()


class Tx:
    """One connection's statements: inside a transaction (`Connector.transaction`), or reads.

    Rows come back as dicts by column name (`rows`, `row`) or as tuples (`tuples`, for lists
    built by position); `execute` returns how many rows a statement changed."""

    dialect: Dialect

    async def execute(self, sql: str, params: Params = None) -> int:
        raise NotImplementedError

    async def send(self, sql: str, params: Params = None) -> None:
        """A statement whose result nobody reads: a backend may send it without waiting for it
        (PostgreSQL pipelines it), so its error, if any, may come at the next statement that
        is waited for, or at the commit."""
        await self.execute(sql, params)

    async def counted(self, sql: str, params: Params = None) -> Sent:
        """`send`, its row count kept for after the transaction (`Sent`): a rule that only
        reports the count, and decides nothing by it before the commit, waits for nothing."""
        count = await self.execute(sql, params)
        return Sent(lambda: count)

    async def rows(self, sql: str, params: Params = None) -> list[dict[str, Any]]:
        raise NotImplementedError

    async def tuples(self, sql: str, params: Params = None) -> list[tuple]:
        raise NotImplementedError

    async def row(self, sql: str, params: Params = None) -> dict[str, Any] | None:
        rows = await self.rows(sql, params)
        return rows[0] if rows else None

    async def value(self, sql: str, params: Params = None) -> Any:
        rows = await self.tuples(sql, params)
        return rows[0][0] if rows else None

    async def has_table(self, name: str) -> bool:
        raise NotImplementedError

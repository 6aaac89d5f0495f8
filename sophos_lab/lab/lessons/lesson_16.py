"""Lesson 16, outgrowing one file: the set-ups and views the lesson uses, out of its way.

Two `sophos-lab serve` processes, A and B, share the lab's PostgreSQL database. `hold_a_run`
keeps a run of A's `running` for as long as the lesson likes (the scripted model's `summary`
pause); the views read the database read-only through `lab.sql`, on the database's own clock
(`now()`) where a lease is concerned. `lease_picture` draws a takeover on a time axis from what
the lesson recorded (see `sophos_lab.lab.pictures.lease`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import pandas as pd

from ...runtime.storage.postgres_schema import SCHEMA_VERSION
from .. import postgres_server
from ..inspect import sql
from .lesson_08b import lease_picture  # the same picture as 08b's, one lane per server

if TYPE_CHECKING:
    from ..harness import Lab

__all__ = ["SCHEMA_VERSION", "Lease", "database_name", "hold_a_run", "lease_of_running_run", "lease_picture",
           "message", "migrations", "new_database", "outcome", "owners", "saved", "statuses", "tcp_listeners"]


def message(lab: Lab) -> str:
    """The lesson's long run: fetch a page and summarize it (the summary is where the model pauses)."""
    return f"Fetch {lab.page('wal.html')} and summarize it in 12 detailed bullet points."


def database_name(lab: Lab) -> str:
    """The name of the lab's database, without the rest of its URL (section 7 shows the whole)."""
    return urlsplit(lab.database_url).path.lstrip("/")


def new_database(lab: Lab, name: str) -> str:
    """A new, empty database on the lab's PostgreSQL server; its URL (for `DATABASE_URL`)."""
    return postgres_server.new_database(lab.postgres.url, name)


def migrations(database_url: str) -> pd.DataFrame:
    """The `sophos_migrations` table of that database: one row per migration applied, in order."""
    return sql(database_url, "SELECT version, applied_at FROM sophos_migrations ORDER BY version")


def hold_a_run(lab: Lab, server: Any) -> str:
    """Start the summary through `server` and hold its model half-way: a live `running` run.
    Returns the conversation."""
    lab.model.arm("summary")
    conversation = server.chat_until_tool_call(message(lab), tool="fetch__fetch")
    lab.model.wait_paused()
    return conversation


def outcome(final: dict[str, Any]) -> str:
    """A final event in one word: an `end`'s status, or the code of a `chat-error` or `rejected`."""
    return final["data"]["status"] if final["event"] == "end" else final["data"]["code"]


def statuses(lab: Lab, conversation: str) -> list[str]:
    """The statuses of the conversation's runs, oldest first."""
    return lab.peek_runs(conversation)["status"].tolist()


def owners(lab: Lab) -> pd.DataFrame:
    """The owners table, with the seconds left on each lease by the database's own clock."""
    return lab.sql("SELECT id, host, pid, round(EXTRACT(EPOCH FROM lease_expires_at - now())::numeric, 1)"
                   " AS lease_left_s FROM owners ORDER BY opened_at")


@dataclass
class Lease:
    """The lease of the owner of a conversation's `running` run, as the owners table records it."""

    deadline: float
    """`lease_expires_at`, in seconds since the epoch."""
    left: float
    """Seconds left until then, by the database's clock (`now()`)."""


def lease_of_running_run(lab: Lab, conversation: str) -> Lease:
    """The lease of the owner of the conversation's `running` run (it must have one)."""
    [[deadline, left]] = lab.sql(
        "SELECT EXTRACT(EPOCH FROM lease_expires_at)::float8 AS deadline,"
        " EXTRACT(EPOCH FROM lease_expires_at - now())::float8 AS lease_left"
        " FROM owners o JOIN runs r ON r.owner_id = o.id WHERE r.conversation_id = ? AND r.status = 'running'",
        conversation).values.tolist()
    return Lease(float(deadline), float(left))


def saved(lab: Lab) -> dict[str, list[str]]:
    """Every row of the runs and of LangGraph's three tables, to compare before and after."""
    return {table: sorted(map(repr, lab.sql(f"SELECT * FROM {table}").itertuples(index=False, name=None)))
            for table in ("runs", "checkpoints", "checkpoint_writes", "checkpoint_blobs")}


def tcp_listeners(pid: int) -> list[str]:
    """The TCP addresses (`address:port`) the process `pid` listens on, as `psutil` sees them."""
    import psutil

    return [f"{c.laddr.ip}:{c.laddr.port}" for c in psutil.Process(pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN]

"""A tiny MCP server with a real side effect: payments recorded in a SQLite ledger (lesson 07).

Run it with ``LEDGER_PATH=/abs/ledger.db python -m sophos_lab.standins.ledger_server`` (stdio transport).

- ``record_payment(to, amount)`` inserts a row on every call: repeat the call, pay twice.
- ``record_payment_once(to, amount, idempotency_key)`` inserts the row and its key in one
  statement, the key ``UNIQUE``: a repeat with the same key adds nothing and returns the first
  call's result (the same key with other arguments is refused).

After its transaction has committed, each tool makes a GET request to ``LEDGER_NOTIFY_URL`` when
that is set (the lab's web fixture server) and waits for the answer. A lab that holds that
request knows the effect is on disk and the agent's checkpoint is not: the window to kill in.
The answer itself is ignored (the fixture server answers 404).
"""

from __future__ import annotations

import os
import sqlite3
import urllib.request
from contextlib import closing
from pathlib import Path

from mcp.server.fastmcp import FastMCP

SCHEMA = """CREATE TABLE IF NOT EXISTS payments (
    id INTEGER PRIMARY KEY,
    to_account TEXT NOT NULL,
    amount INTEGER NOT NULL,
    idempotency_key TEXT UNIQUE,
    created_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
)"""

server = FastMCP("ledger", log_level="WARNING")


def _connect() -> sqlite3.Connection:
    path = Path(os.environ["LEDGER_PATH"])
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path, timeout=10)
    conn.execute(SCHEMA)
    return conn


def _committed() -> None:
    """Tell the lab the effect is committed, and wait for its answer (a lab may hold it)."""
    url = os.environ.get("LEDGER_NOTIFY_URL")
    if url:
        try:
            urllib.request.urlopen(url, timeout=300).close()
        except OSError:
            pass  # 404 or no lab listening: the payment stands either way


def _receipt(row: tuple) -> str:
    return f"payment {row[0]}: {row[2]} to {row[1]}"


@server.tool()
def record_payment(to: str, amount: int) -> str:
    """Record a payment of `amount` coins to account `to`."""
    with closing(_connect()) as conn, conn:
        cursor = conn.execute("INSERT INTO payments (to_account, amount) VALUES (?, ?)", (to, amount))
        row = (cursor.lastrowid, to, amount)
    _committed()
    return _receipt(row)


@server.tool()
def record_payment_once(to: str, amount: int, idempotency_key: str) -> str:
    """Record a payment of `amount` coins to account `to`, at most once per idempotency key."""
    with closing(_connect()) as conn, conn:
        conn.execute(
            "INSERT INTO payments (to_account, amount, idempotency_key) VALUES (?, ?, ?)"
            " ON CONFLICT (idempotency_key) DO NOTHING",
            (to, amount, idempotency_key),
        )
        row = conn.execute(
            "SELECT id, to_account, amount FROM payments WHERE idempotency_key = ?", (idempotency_key,)
        ).fetchone()
    if row[1:] != (to, amount):
        raise ValueError(f"idempotency key {idempotency_key!r} was used for another payment: {_receipt(row)}")
    _committed()
    return _receipt(row)


if __name__ == "__main__":
    server.run()

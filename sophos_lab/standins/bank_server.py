"""The bank of challenge 3 (lesson 15): an MCP stdio server whose one tool runs a learner's function.

Run it with (stdio transport)::

    python -m sophos_lab.standins.bank_server --db BANK.db --effect EFFECT.py \\
        [--function BANK_EFFECT] [--calls CALLS.jsonl] [--barrier-url URL]

each option defaulting to an environment variable (``BANK_DB``, ``BANK_EFFECT``,
``BANK_FUNCTION``, ``BANK_CALLS``, ``BANK_BARRIER_URL``).

- ``make_payment(to, amount, idempotency_key)`` calls the effect, the function named
  ``--function`` in the file ``--effect`` (a notebook cell saved as a module, by
  ``sophos_lab.lab.bank``), as ``effect(db, idempotency_key, to, amount)``, and returns what it
  returns. The runtime fills ``idempotency_key`` in (``"<thread_id>:<tool_call_id>"``); the model
  is not shown it. The server pays nothing itself: whether a replay pays twice is up to the
  effect, which is the point of the exercise.
- Each call is logged to ``--calls``, one JSON line per event with the server's pid: ``call``
  (key, to, amount) as it starts, then ``result`` or ``error``. A lab that kills servers needs to
  know which process ran what.
- The barrier. The server watches every SQLite connection the effect opens. At the first moment a
  call has committed anything to the bank (before the first SQL statement that starts outside a
  transaction after a commit, or when the effect returns), or at the end of a call that committed
  nothing, it sends ``GET --barrier-url`` once and waits for the answer. A lab that holds that
  request (``lab.web.hold``) knows exactly where the server stands, and can kill it there: right
  after the first commit, whatever the effect's author chose to commit first. It sees only what
  the effect writes through Python's ``sqlite3``.

The effect is loaded once, when the server starts: a server started after the learner changed
the cell runs the new one. An effect that fails to load makes every call fail with its error.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sqlite3
import urllib.request
import weakref
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE payments (
    id INTEGER PRIMARY KEY,              -- the receipt names it: "payment 1: 45 to carol"
    to_account TEXT NOT NULL,
    amount INTEGER NOT NULL
);
CREATE TABLE idempotency_keys (
    key TEXT PRIMARY KEY,                -- "<thread_id>:<tool_call_id>", from the runtime
    to_account TEXT NOT NULL,            -- the request the key was first used for ...
    amount INTEGER NOT NULL,
    result TEXT NOT NULL                 -- ... and the receipt that call returned
);
"""
"""The bank's two tables: the effect (`payments`) and one row per key (`idempotency_keys`)."""

TABLES = ("payments", "idempotency_keys")

Effect = Callable[[str, str, str, int], object]
"""`effect(db_path, key, to, amount)`: the learner's `pay_once`; its result is the tool's."""

_connect = sqlite3.connect  # the real one: the server's own reads must not trip the barrier


def new_bank(path: str | Path) -> None:
    """An empty bank at `path`: its two tables, no rows (any earlier file is removed)."""
    Path(path).unlink(missing_ok=True)
    with closing(_connect(path)) as conn:
        conn.executescript(SCHEMA)


def load_effect(path: str | Path, name: str = "BANK_EFFECT") -> Effect:
    """The function `name` of the Python file `path`, run as a module of its own (`bank_effect`)."""
    spec = importlib.util.spec_from_file_location("bank_effect", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the bank's effect from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


@dataclass
class Bank:
    """What a running server serves: its database, its effect (or why it has none), where it reports."""

    db: str
    effect: Effect | None
    load_error: Exception | None = None
    calls: str | None = None
    """The call log (JSON lines), or None for none."""
    barrier_url: str | None = None
    """Where the server reports its first commit of a call, and waits; None: it never waits."""


@dataclass
class _Call:
    """The call in progress: the bank's row counts before it, and whether it reached the barrier."""

    before: tuple[int, int]
    reported: bool = False


_bank: Bank | None = None
_call: _Call | None = None


def _log(**entry: Any) -> None:
    if _bank is not None and _bank.calls:
        with open(_bank.calls, "a", encoding="utf-8") as log:
            log.write(json.dumps({"pid": os.getpid(), **entry}) + "\n")


def _counts() -> tuple[int, int]:
    """How many rows each table holds, as committed (a second connection sees only that)."""
    assert _bank is not None
    with closing(_connect(_bank.db, timeout=10)) as conn:
        return conn.execute(
            "SELECT (SELECT count(*) FROM payments), (SELECT count(*) FROM idempotency_keys)"
        ).fetchone()


def _barrier() -> None:
    """Report once per call, and wait for the lab's answer (a lab may hold it)."""
    if _call is None or _call.reported:
        return
    _call.reported = True
    if _bank is None or not _bank.barrier_url:
        return
    try:
        urllib.request.urlopen(_bank.barrier_url, timeout=300).close()
    except OSError:
        pass  # 404, or no lab listening: the call goes on either way


def _before_statement(conn_ref: Callable[[], sqlite3.Connection | None]) -> Callable[[str], None]:
    def trace(sql: str) -> None:
        conn = conn_ref()
        # Outside a transaction, what this call wrote so far is committed (or was never written).
        if _call and not _call.reported and conn is not None and not conn.in_transaction:
            try:
                committed = _counts() != _call.before
            except sqlite3.Error:
                return
            if committed:
                _barrier()

    return trace


class _Watched(sqlite3.Connection):
    """A connection that can be referred to weakly (its trace callback must not keep it open)."""


def _watched_connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
    if len(args) < 6:  # `factory` is the sixth argument
        kwargs.setdefault("factory", _Watched)
    conn = _connect(*args, **kwargs)
    try:
        ref = weakref.ref(conn)
    except TypeError:  # a factory of the effect's own, without weak references
        ref = lambda: conn  # noqa: E731
    conn.set_trace_callback(_before_statement(ref))
    return conn


def watch_connections() -> None:
    """Make every `sqlite3.connect` in this process (the effect's) a watched one: the barrier."""
    sqlite3.connect = _watched_connect


def make_payment(to: str, amount: int, idempotency_key: str) -> str:
    """Pay `amount` coins to account `to`."""
    global _call
    assert _bank is not None, "the bank is not set up: run this module, or call serve()"
    _log(event="call", key=idempotency_key, to=to, amount=amount)
    _call = _Call(before=_counts())
    try:
        if _bank.effect is None:
            raise _bank.load_error or RuntimeError("the bank has no effect")
        result = str(_bank.effect(_bank.db, idempotency_key, to, amount))
    except Exception as error:
        _log(event="error", error=f"{type(error).__name__}: {error}")
        _barrier()
        _call = None
        raise
    _log(event="result", result=result)
    _barrier()
    _call = None
    return result


def serve(db: str | Path, effect: str | Path, function: str = "BANK_EFFECT",
          calls: str | Path | None = None, barrier_url: str | None = None) -> None:
    """Watch the connections, load the effect, and serve `make_payment` over stdio until EOF."""
    # Imported here: the lab imports this module for its schema, without the MCP server's weight.
    from mcp.server.fastmcp import FastMCP

    global _bank
    watch_connections()  # first: an effect that imports `connect` at its top gets the watched one
    try:
        loaded, error = load_effect(effect, function), None
    except Exception as exc:  # the tool says so on every call
        loaded, error = None, exc
    _bank = Bank(str(db), loaded, error, str(calls) if calls else None, barrier_url or None)
    server = FastMCP("bank", log_level="WARNING")
    server.tool()(make_payment)
    server.run()


def main(argv: list[str] | None = None) -> None:
    env = os.environ.get
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", default=env("BANK_DB"), help="the bank's SQLite file (BANK_DB)")
    parser.add_argument("--effect", default=env("BANK_EFFECT"), help="the Python file of the effect (BANK_EFFECT)")
    parser.add_argument("--function", default=env("BANK_FUNCTION", "BANK_EFFECT"),
                        help="the effect's name in that file (BANK_FUNCTION; default BANK_EFFECT)")
    parser.add_argument("--calls", default=env("BANK_CALLS"), help="the call log, JSON lines (BANK_CALLS)")
    parser.add_argument("--barrier-url", default=env("BANK_BARRIER_URL"),
                        help="GET at a call's first commit, and wait for the answer (BANK_BARRIER_URL)")
    args = parser.parse_args(argv)
    if not args.db or not args.effect:
        parser.error("the bank needs --db and --effect (or BANK_DB and BANK_EFFECT)")
    serve(args.db, args.effect, args.function, args.calls, args.barrier_url)


if __name__ == "__main__":
    main()

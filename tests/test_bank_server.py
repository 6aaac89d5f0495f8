"""The bank of challenge 3 (lesson 15) as an MCP stdio server, through a real MCP client.

The server runs the reference `pay_once` (or the known wrong one) from `solutions/`, as the lesson's
bank server runs the learner's cell. Its barrier reports to a small HTTP server of the test's,
which reads the bank at that moment: what a lab that kills the server there would leave on disk.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import sys
import threading
from contextlib import closing
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

from sophos_lab.lab.harness import KIT_ROOT
from sophos_lab.standins.bank_server import new_bank

SOLUTIONS = KIT_ROOT / "solutions" / "15_challenge_replay_safe_tool"


def counts(db: Path) -> tuple[int, int]:
    with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        return conn.execute(
            "SELECT (SELECT count(*) FROM payments), (SELECT count(*) FROM idempotency_keys)"
        ).fetchone()


class Barrier(ThreadingHTTPServer):
    """Answers every GET at once, after noting the bank's row counts at that moment."""

    daemon_threads = True

    def __init__(self, db: Path) -> None:
        self.db, self.seen = db, []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(handler) -> None:  # noqa: N802
                self.seen.append(counts(self.db))
                handler.send_response(404)
                handler.end_headers()

            def log_message(handler, *args) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/bank-barrier"


def pay(tmp_path: Path, effect: Path, requests: list[dict]) -> tuple[list, list, list]:
    """Start the bank server on the `pay_once` of the file `effect` and make each `make_payment`
    call in one MCP session; (the results, the barrier's counts, the call log)."""
    db, log = tmp_path / "bank.db", tmp_path / "bank-calls.jsonl"
    new_bank(db)
    barrier = Barrier(db)
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "sophos_lab.standins.bank_server", "--db", str(db), "--effect", str(effect),
              "--function", "pay_once", "--calls", str(log), "--barrier-url", barrier.url],
        cwd=str(KIT_ROOT),
    )

    async def session() -> list:
        async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
            await client.initialize()
            tools = (await client.list_tools()).tools
            assert [t.name for t in tools] == ["make_payment"]
            assert sorted(tools[0].inputSchema["properties"]) == ["amount", "idempotency_key", "to"]
            results = []
            for args in requests:
                result = await client.call_tool("make_payment", args)
                results.append((result.isError, result.content[0].text))
            return results

    try:
        results = asyncio.run(asyncio.wait_for(session(), 60))
    finally:
        barrier.shutdown()
        barrier.server_close()
    calls = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]
    return results, barrier.seen, calls


PAY = {"to": "carol", "amount": 45, "idempotency_key": "thread-1:call-1"}


def test_the_reference_pay_once_pays_once_per_key_and_commits_the_key_with_its_payment(tmp_path):
    results, at_barrier, calls = pay(tmp_path, SOLUTIONS / "pay_once.py", [
        PAY, PAY, {**PAY, "idempotency_key": "thread-1:call-2"}, {**PAY, "amount": 50},
    ])
    assert results[:3] == [(False, "payment 1: 45 to carol"), (False, "payment 1: 45 to carol"),
                           (False, "payment 2: 45 to carol")]
    assert results[3][0] and "was used for another payment" in results[3][1], results[3]  # refused
    assert counts(tmp_path / "bank.db") == (2, 2)
    # Once per call; the first call's first commit already holds the payment and its key.
    assert at_barrier == [(1, 1), (1, 1), (2, 2), (2, 2)]
    assert [c["event"] for c in calls] == ["call", "result"] * 3 + ["call", "error"]
    keys = [c["key"] for c in calls if c["event"] == "call"]
    assert keys == ["thread-1:call-1", "thread-1:call-1", "thread-1:call-2", "thread-1:call-1"]
    assert calls[-1]["error"].startswith("ValueError: idempotency key 'thread-1:call-1' was used for another")
    assert len({c["pid"] for c in calls}) == 1


def test_the_barrier_stops_the_wrong_pay_once_at_a_payment_without_its_key(tmp_path):
    results, at_barrier, _ = pay(tmp_path, SOLUTIONS / "pay_once.wrong.py", [PAY, PAY])
    assert results == [(False, "payment 1: 45 to carol")] * 2  # in one process, it looks right
    assert at_barrier == [(1, 0), (1, 1)]  # a kill at the first barrier leaves no key to find


def test_an_effect_that_does_not_load_fails_every_call_with_its_error(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("def pay_once(:\n", encoding="utf-8")
    results, at_barrier, calls = pay(tmp_path, broken, [PAY])
    assert results[0] == (True, "Error executing tool make_payment: invalid syntax (broken.py, line 1)")
    assert at_barrier == [(0, 0)] and calls[-1]["error"].startswith("SyntaxError")

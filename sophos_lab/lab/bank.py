"""The lab side of challenge 3's bank (lesson 15): a learner's payment function as a real MCP tool,
and the crash that tests it.

    lab = Lab.setup("15_challenge_replay_safe_tool")
    bank_lab = BankLab.setup(lab, child="kernel")   # the bank is the lab's only MCP server
    crash = bank_lab.crash_after_first_commit(pay_once)
    child = bank_lab.restart()
    resumed = bank_lab.resume(child, crash)
    resumed.after["payments"]                       # one payment, or the replay paid again

The learner writes `pay_once(db_path, key, to, amount)` in a notebook cell. `serve(pay_once)` saves
that cell as a file in the lab folder; each agent process starts its own bank server
(`python -m sophos_lab.standins.bank_server`, from the lab's `mcp.json`), which imports the file
when it starts and calls the function for every `make_payment` tool call. The server stops at a
barrier right after the function's first commit, so the experiment kills the machine there, with
no timer: first the agent, then the bank server, both with SIGKILL. A new agent process, with a
bank server of its own that knows only the database, then replays the tools step.
"""

from __future__ import annotations

import json
import linecache
import sqlite3
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import psutil

from ..standins.bank_server import TABLES, new_bank
from .harness import Lab

__all__ = ["BankLab", "Crash", "Resumed", "calls_table", "new_bank", "read_bank", "wait_gone", "PAY"]

SERVER_MODULE = "sophos_lab.standins.bank_server"
PAY = "Pay 45 to carol."
"""The request of the experiment (the scripted model answers it with `bank__make_payment`)."""


def read_bank(path: str | Path) -> dict[str, pd.DataFrame]:
    """The bank's tables as they are on disk, read-only: {"payments": ..., "idempotency_keys": ...}."""
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        return {table: pd.read_sql_query(f"SELECT * FROM {table} ORDER BY rowid", conn) for table in TABLES}


def calls_table(calls: list[dict[str, Any]]) -> pd.DataFrame:
    """The bank servers' log as a table: which server process (1 = the first to start), what."""
    number = {pid: n for n, pid in enumerate(dict.fromkeys(c["pid"] for c in calls), 1)}
    return pd.DataFrame([{"server": number[c["pid"]], "event": c["event"], "key": c.get("key", ""),
                          "to": c.get("to", ""), "amount": c.get("amount", ""),
                          "returned or raised": c.get("result", c.get("error", ""))} for c in calls])


def cell_source(function: Callable) -> str:
    """The whole source of the cell (or file) that defined `function`, imports included: the
    server runs it in another process, where nothing else of the notebook exists."""
    return "".join(linecache.getlines(function.__code__.co_filename))


def wait_gone(process: psutil.Process, timeout: float = 10.0) -> bool:
    """Whether `process` has exited within `timeout` s (a zombie has: it only waits to be reaped)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            process.wait(timeout=0.05)
            return True
        except psutil.NoSuchProcess:
            return True
        except psutil.TimeoutExpired:
            try:
                if process.status() == psutil.STATUS_ZOMBIE:
                    return True
            except psutil.NoSuchProcess:
                return True
        if time.monotonic() > deadline:
            return False


@dataclass
class Crash:
    """What `crash_after_first_commit` saw: the machine went down after the effect's first commit."""

    function: Callable  # the pay_once the bank server ran
    conversation: str
    call: dict          # the model's tool call, as the agent step recorded it
    agent_exit: int     # -9: SIGKILL
    server_gone: bool   # the bank server is dead too
    at_kill: dict       # the bank's tables right after the kill


@dataclass
class Resumed:
    """What `resume` saw: the replayed tools step and the bank after it."""

    final: dict         # the resume's final event
    steps: list         # (step, node) of each step it entered
    result: dict        # the tool result the resumed agent saw
    calls: list         # the bank servers' log: both processes' calls
    after: dict         # the bank's tables after the resume


@dataclass
class BankLab:
    """A lab's bank: its files in the lab folder, its tool server, and the crash experiment."""

    lab: Lab
    child: str = "kernel"
    """Where the agent runs: "kernel" (a child Jupyter kernel) or "worker" (a plain subprocess)."""
    barrier: str = "/bank-barrier"
    """The web fixture server's path where the bank server reports its first commit, and waits."""

    @property
    def db(self) -> Path:
        """The bank's database: pay_once's effect, and its keys."""
        return self.lab.root / "bank.db"

    @property
    def effect(self) -> Path:
        """The learner's cell, as the bank server imports it (`serve`)."""
        return self.lab.root / "bank_effect.py"

    @property
    def calls_log(self) -> Path:
        """The bank servers' log of their calls (JSON lines)."""
        return self.lab.root / "bank-calls.jsonl"

    @classmethod
    def setup(cls, lab: Lab, child: str = "kernel") -> BankLab:
        """The bank of `lab`: its `mcp.json` gets the bank server and nothing else. The lesson
        needs no fetch and no memory, and each agent process then starts one tool server only."""
        if child not in ("kernel", "worker"):
            raise ValueError(f'child must be "kernel" or "worker", not {child!r}')
        bank = cls(lab, child)

        def only_the_bank(config: dict) -> None:
            config.clear()
            config["bank"] = bank.mcp_entry()

        lab.edit_mcp_config(only_the_bank)
        return bank

    def mcp_entry(self) -> dict[str, Any]:
        """The bank's `mcp.json` entry: the kit's interpreter runs the server module from the kit's
        root, told where the bank, the effect, the log and the barrier are."""
        return {
            "command": "${SOPHOS_LAB_PYTHON}",
            "args": ["-m", SERVER_MODULE],
            "cwd": "${SOPHOS_LAB_ROOT}",
            "env": {"BANK_DB": str(self.db), "BANK_EFFECT": str(self.effect), "BANK_CALLS": str(self.calls_log),
                    "BANK_BARRIER_URL": self.lab.web.url + self.barrier},
        }

    # the bank

    def tables(self, path: str | Path | None = None) -> dict[str, pd.DataFrame]:
        """The bank's tables (this lab's, or the bank at `path`) as they are on disk, read-only."""
        return read_bank(self.db if path is None else path)

    def calls(self) -> list[dict[str, Any]]:
        """The bank servers' log, oldest first: `call` as a call starts, then its `result` or `error`."""
        if not self.calls_log.exists():
            return []
        return [json.loads(line) for line in self.calls_log.read_text(encoding="utf-8").splitlines()]

    def serve(self, function: Callable) -> None:
        """Save the cell that defined `function` as the module the bank server imports (the function
        is its effect), and empty the bank. The bank server of the next agent process runs it."""
        self.effect.write_text(f"{cell_source(function)}\n\nBANK_EFFECT = {function.__name__}\n", encoding="utf-8")
        new_bank(self.db)
        self.calls_log.unlink(missing_ok=True)

    # the experiment

    def start_child(self):
        """A fresh agent process (a 'restart'), of the kind chosen by `child`."""
        return self.lab.kernel() if self.child == "kernel" else self.lab.worker()

    def crash_after_first_commit(self, function: Callable, message: str = PAY) -> Crash:
        """Serve `function`, ask a new agent process to pay, and at the bank server's first commit
        kill the agent and then the bank server, both with SIGKILL: the machine goes down.

        The agent goes first: if the server died first, the agent's MCP client would see the pipe
        close and record an error result for the call."""
        self.serve(function)
        child = self.start_child()
        self.lab.web.hold(self.barrier)
        conversation = child.chat_until_tool_call(message, tool="bank__make_payment")
        call = child.wait_for("trace", event="call")["data"]["data"]
        self.lab.web.wait_held()                         # the bank server waits at the barrier
        server = psutil.Process(self.calls()[-1]["pid"])
        assert SERVER_MODULE in " ".join(server.cmdline()), server.cmdline()
        agent_exit = child.kill()                        # first the agent: it never hears the server die
        server.kill()                                    # then the server, before it writes anything more
        gone = wait_gone(server)
        self.lab.web.release()
        return Crash(function, conversation, call, agent_exit, gone, self.tables())

    def restart(self):
        """A new agent process, and its first request, which relabels the killed run `interrupted`."""
        child = self.start_child()
        child.conversations()
        return child

    def resume(self, child, crash: Crash) -> Resumed:
        """Resume the crashed conversation in `child` and wait for the run to end."""
        child.resume(crash.conversation)
        final = child.wait_final()
        events = [e["data"] for e in child.events() if e["event"] == "trace"]
        steps = [(e["step"], e["node"]) for e in events if e["event"] == "enter"]
        results = [e["data"] for e in events if e["event"] == "result"]
        return Resumed(final, steps, results[-1] if results else {}, self.calls(), self.tables())

    def runs_summary(self, conversation: str) -> str:
        """Each run's status and error code ("-" for none), one per line, numbered in start order."""
        runs = self.lab.state(conversation)["runs"]
        return "\n".join(f"run {n}: {status} {code or '-'}" for n, (status, code) in enumerate(runs, 1))

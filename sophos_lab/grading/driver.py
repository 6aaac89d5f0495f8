"""The grader's hands: a lane (one lab, its servers and a fresh world per point) and the child
processes it starts, reads, stops at a point and kills.

Every wait is on something that happens: a report line, the child's stop (SIGSTOP, seen through
the fork server), a request held at the model or the web server, a process's exit. The time
limits only stop a grading that would otherwise hang.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from ..lab.children import child_environment
from ..lab.forkserver import start_child, wait_stopped
from ..lab.harness import Lab
from ..runtime.tools import kit_variables, load_mcp_config
from . import child as child_module
from . import http_servers

BARRIER_TIMEOUT = 60.0
"""How long a point may take to be reached (a hang guard, not a budget)."""
PAGE = "wal.html"
NOTIFY = "/ledger-committed"
"""Where the ledger server reports each committed payment (`LEDGER_NOTIFY_URL`): held, a kill point."""


def epoch(iso: str) -> float:
    """A log's ISO time (`2026-01-01T00:00:00.123456Z`) as seconds since the epoch."""
    return datetime.fromisoformat(iso).timestamp()


_setting_up = threading.Lock()


@contextlib.contextmanager
def keep_score() -> Iterator[None]:
    """Keep the notebook's predictions across `Lab.setup` (which starts a new score); one lab at a
    time, so that lanes set up side by side cannot keep one another's new score."""
    from ..lab import predictions

    with _setting_up:
        saved = predictions.current_score()
        try:
            yield
        finally:
            predictions._score = saved


class Lane:
    """One lab for grading: its own scripted model (or proxy), web pages and ledger; points run
    in it one after another, each in a fresh world (an empty database and ledger)."""

    def __init__(self, name: str, ollama_host: str | None = None, ollama_model: str | None = None) -> None:
        self.name = name
        self.ollama_host, self.ollama_model = ollama_host, ollama_model
        self._servers: list[Any] = []
        self.lab = self._setup()

    def _setup(self) -> Lab:
        """The lab, with the fetch server and the ledger served over HTTP (see `http_servers`)."""
        with keep_score():
            lab = Lab.setup(self.name, extra_servers=("ledger",), quiet=True,
                            ollama_host=self.ollama_host, ollama_model=self.ollama_model)
        env = child_environment(lab.env())
        settings = lab.settings()
        (fetch,) = [s for s in load_mcp_config(settings.mcp_config_path, {**env, **kit_variables(settings)})
                    if s.name == "fetch"]
        command = {"command": fetch.command, "args": list(fetch.args), "env": dict(fetch.env), "cwd": fetch.cwd}
        urls = {}
        for kind in ("fetch", "ledger"):
            proc, urls[kind] = http_servers.start(kind, env, lab.root, lab.root / "logs" / f"mcp-{kind}-http.log",
                                                  command if kind == "fetch" else None)
            self._servers.append(proc)
        # Only these two, with nothing in front of the payment (lesson 07's way, no approval).
        lab.edit_mcp_config(lambda config: (config.clear(), config.update({k: {"url": u} for k, u in urls.items()})))
        return lab

    def reset(self) -> None:
        """A lab afresh: after a point that was not reached, a hold may still be armed."""
        self.close()
        self.lab = self._setup()

    def fresh_world(self) -> None:
        """Delete the agent's database and the ledger: each point starts from nothing."""
        for path in self.lab.root.iterdir():
            if path.name.startswith((self.lab.db_path.name, self.lab.ledger_path.name)):
                path.unlink()

    @property
    def page_url(self) -> str:
        return self.lab.page(PAGE)

    def marks(self) -> tuple[int, int]:
        """Where the model's and the web server's logs are now (counts are read from there on)."""
        return len(self.lab.model.requests()), len(self.lab.web.entries())

    def model_requests(self, since: int) -> list[dict[str, Any]]:
        return [r for r in self.lab.model.requests()[since:] if r["path"] == "/api/chat"]

    def web_requests(self, since: int) -> list[dict[str, Any]]:
        return self.lab.web.entries()[since:]

    def payments(self) -> int:
        """The ledger's rows (0 before its first payment)."""
        if not self.lab.ledger_path.exists():
            return 0
        with closing(sqlite3.connect(f"file:{self.lab.ledger_path}?mode=ro", uri=True)) as conn:
            try:
                return conn.execute("SELECT count(*) FROM payments").fetchone()[0]
            except sqlite3.OperationalError:
                return 0

    def close(self) -> None:
        for proc in self._servers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        self._servers.clear()
        self.lab.close()


@dataclass
class Child:
    """One grading child process (`sophos_lab.grading.child`) and its reports."""

    proc: Any
    reports: list[dict[str, Any]] = field(default_factory=list)
    ended: bool = False
    _changed: threading.Condition = field(default_factory=threading.Condition)

    @classmethod
    def start(cls, lane: Lane, module: Path, conversation: str, commands: list[dict[str, Any]],
              **env: str) -> Child:
        environment = child_environment(lane.lab.env(**env))
        with open(lane.lab.root / "logs" / "grading-child.log", "ab") as stderr:
            proc = start_child("sophos_lab.grading.child", [str(module), conversation, json.dumps(commands)],
                               env=environment, cwd=lane.lab.root, stderr=stderr)
        started = cls(proc)
        threading.Thread(target=started._read, daemon=True).start()
        return started

    def _read(self) -> None:
        for line in self.proc.stdout:
            report = child_module.parse_report(line)
            if report is not None:
                with self._changed:
                    self.reports.append(report)
                    self._changed.notify_all()
        with self._changed:
            self.ended = True
            self._changed.notify_all()

    def wait_until(self, done: Callable[[], bool], timeout: float) -> bool:
        """Whether `done()` (or the end of the child's output) came within `timeout` s."""
        with self._changed:
            return self._changed.wait_for(lambda: done() or self.ended, timeout)

    def wait_end(self, timeout: float) -> bool:
        """Whether the child finished its commands (its output ended) within `timeout` s."""
        return self.wait_until(lambda: False, timeout) and self.ended

    def events(self, name: str) -> list[dict[str, Any]]:
        with self._changed:
            return [r for r in self.reports if r["event"] == name]

    def kill(self) -> list[int]:
        """SIGKILL to the child's process group, as `kill -9` would; the processes it had started
        (its MCP servers' launchers, which outlive it until their stdin closes)."""
        below = descendants(self.proc.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.wait_until(lambda: False, BARRIER_TIMEOUT)  # the last lines are read
        return below

    def wait_stopped(self, timeout: float) -> bool:
        """Whether the child stopped itself (a write point) rather than ending first."""
        try:
            wait_stopped(self.proc, timeout)
            return True
        except (ChildProcessError, TimeoutError):
            return False


def descendants(pid: int) -> list[int]:
    """The processes below `pid`, from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        below = [child for child, parent in parents.items() if parent in frontier]
        found += below
        frontier = below
    return found


def wait_gone(pids: list[int], timeout: float = BARRIER_TIMEOUT) -> None:
    """Block until each process has exited (its pidfd turns readable): what a killed child's MCP
    server had in flight has then reached the web server and the ledger, so counts are exact."""
    deadline = time.monotonic() + timeout
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"process {pid} of the killed child still runs after {timeout} s")
        finally:
            os.close(fd)


def wait_held(lane: Lane, kind: str, child: Child, timeout: float = BARRIER_TIMEOUT) -> bool:
    """Block until the lane's model or web server holds a request (`kind`: "model" or "web"), or
    the child ends first; whether it is held."""
    held = threading.Event()

    def poll() -> None:
        control = lane.lab.model if kind == "model" else lane.lab.web
        wait = control.wait_paused if kind == "model" else control.wait_held
        with contextlib.suppress(TimeoutError, OSError):
            wait(timeout)
            held.set()
        with child._changed:
            child._changed.notify_all()

    threading.Thread(target=poll, daemon=True).start()
    child.wait_until(held.is_set, timeout)
    return held.is_set()

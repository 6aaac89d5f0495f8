"""Lesson 01, own the process: the process views its cells call (read any with `lesson.name??`).

They read the process table with `psutil`, so they work where `ps`, `lsof` and `ss` are missing:
`processes()` is `ps` with parents, process groups and sessions, `listening()` is `ss -ltn` for one
process, `open_files()` is `lsof -p` limited to the lab's directory.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import pandas as pd
import psutil

if TYPE_CHECKING:
    from ..harness import Lab

ROLES = [
    ("sophos_lab.cli serve", "HTTP server (sophos-lab serve)"),
    ("mcp_server_fetch", "MCP server: fetch"),
    ("server-memory", "MCP server: memory"),
    ("scripted_model", "model (scripted)"),
    ("model_proxy", "model proxy (recording)"),
    ("webfixtures", "web pages"),
]
"""What each of the lab's processes is, told by a piece of its command line."""
DB_FILES = ("sophos.db", "sophos.db-wal", "sophos.db-shm")


def role(proc: psutil.Process) -> str:
    """What `proc` is in the lab: this notebook's kernel, the HTTP server, an MCP server, ..."""
    if proc.pid == os.getpid():
        return "this notebook's kernel"
    command = " ".join(proc.cmdline())
    return next((name for key, name in ROLES if key in command), command[:50])


def listening(pid: int) -> list[str]:
    """The addresses the process `pid` accepts TCP connections on (what `ss -ltnp` shows for it)."""
    try:
        return sorted(f"{c.laddr.ip}:{c.laddr.port}" for c in psutil.Process(pid).net_connections("inet")
                      if c.status == psutil.CONN_LISTEN)
    except psutil.NoSuchProcess:
        return []


def listen_hosts(pid: int) -> list[str]:
    """The interfaces (addresses without the port) the process `pid` listens on."""
    return [address.rsplit(":", 1)[0] for address in listening(pid)]


def processes() -> pd.DataFrame:
    """This kernel and every process under it, like `ps -o pid,ppid,pgid,sid,args --forest`:
    its role, pid, parent, process group, session and the addresses it listens on."""
    kernel = psutil.Process()
    records = []
    for proc in [kernel, *kernel.children(recursive=True)]:
        try:
            records.append({"role": role(proc), "pid": proc.pid, "parent": proc.ppid(),
                            "group": os.getpgid(proc.pid), "session": os.getsid(proc.pid),
                            "listens on": ", ".join(listening(proc.pid)) or "-"})
        except (psutil.NoSuchProcess, ProcessLookupError):
            pass  # exited while we looked
    return pd.DataFrame(records, columns=["role", "pid", "parent", "group", "session", "listens on"])


def mcp_servers(server: Any) -> list[psutil.Process]:
    """The MCP server processes the HTTP server `server` started (its children)."""
    return [p for p in psutil.Process(server.pid).children() if role(p).startswith("MCP")]


def open_files(server: Any, lab: Lab) -> list[str]:
    """The files in the lab's directory that the process of `server` holds open (`lsof -p PID`)."""
    root = os.path.realpath(lab.root)
    return sorted({os.path.relpath(f.path, root) for f in psutil.Process(server.pid).open_files()
                   if f.path.startswith(root)})


def db_files(lab: Lab) -> list[str]:
    """The database files in the lab's directory (what `ls $LAB` shows of them)."""
    return sorted(p.name for p in lab.root.glob("sophos.db*"))


def wait_gone(procs: Iterable[psutil.Process], timeout: float = 15.0) -> list[psutil.Process]:
    """Wait until every process in `procs` has exited (a barrier with a deadline, not a guess);
    return the ones still running at the deadline."""
    procs = list(procs)
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in procs if _running(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False

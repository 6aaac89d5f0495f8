"""Who owns a running run, and whether that owner is still alive.

Every open `Store` is an owner: a row in `owners` with its host, its pid (and the pid's start
time, so a reused pid is not mistaken for the old process) and a lease that the runtime renews
while it has runs. An owner is gone when

- its lease ran out (a frozen or hung process, or one on another host that stopped renewing), or
- it ran on this host (same host name and boot) and its process no longer exists, which is
  known at once: a `kill -9` is recovered on the next open, not a lease later.

Only runs of gone owners are relabelled `interrupted`; a live owner's run is left alone.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path


def boot_id() -> str:
    """This boot of this machine ('' where the kernel does not say)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _stat(pid: int) -> list[str] | None:
    """`/proc/<pid>/stat` from the field after the command name on (None when unreadable)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def process_started(pid: int) -> str:
    """The process's start time in clock ticks since boot ('' where /proc does not say)."""
    fields = _stat(pid)
    return fields[19] if fields else ""


def _exists(pid: int) -> bool:
    """Whether this host has a process (a zombie too) with this pid: the null signal."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists; it belongs to someone else
    return True


def process_alive(pid: int, started: str = "") -> bool:
    """Whether `pid` runs here and is the same process that started at `started`.

    A zombie (killed, not yet reaped) counts as dead: it will never write again.
    """
    if not _exists(pid):
        return False
    fields = _stat(pid)
    if fields is None:
        # Reaped between the two looks (a zombie a moment ago), or no /proc to read: ask again,
        # which tells the first apart; without /proc the null signal is all there is.
        return _exists(pid)
    if fields[0] in ("Z", "X"):
        return False
    return not started or fields[19] == started


@dataclass(frozen=True)
class Owner:
    """One open store of one process: what it writes into `owners`."""

    id: str
    host: str
    boot_id: str
    pid: int
    pid_started: str

    @classmethod
    def here(cls) -> Owner:
        pid = os.getpid()
        return cls(
            id=f"{pid}-{uuid.uuid4().hex[:8]}",
            host=socket.gethostname(),
            boot_id=boot_id(),
            pid=pid,
            pid_started=process_started(pid),
        )


def owner_gone(row: dict | None, me: Owner) -> bool:
    """Whether the owner in `row` (a row of `owners`, None if it has none) can no longer write.

    A run whose owner row is missing was left by a closed store or by a version-1 file. On this
    host and boot the lease is read on the monotonic clock, which all processes share and which a
    change of the wall clock does not move; another host's lease can only be read on the wall clock.
    """
    if row is None:
        return True
    if row["id"] == me.id:
        return False  # this very store: its runs are in hand, whatever its lease says
    if row["host"] == me.host and row["boot_id"] == me.boot_id:
        if row["lease_expires_monotonic"] < time.monotonic():
            return True
        return not process_alive(row["pid"], row["pid_started"])
    if row["host"] == me.host:
        return True  # the machine rebooted since
    return row["lease_expires_at"] < time.time()

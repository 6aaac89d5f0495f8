"""Launch and stop the kit's helper servers as child processes.

Every helper server prints one JSON "ready line" on stdout once it is
listening, e.g. ``{"ready": true, "url": "http://127.0.0.1:8123"}``.
``spawn_module`` starts one and waits for that line.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

# The directory that holds the ``sophos_lab`` package, so ``python -m`` finds
# it from any working directory even when the kit is not installed.
_PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])


def spawn_module(
    module: str, args: Sequence[str] = (), timeout: float = 15.0
) -> tuple[subprocess.Popen, dict]:
    """Run ``python -m module *args`` and return the process and its ready line.

    The child gets its own session, so ``stop_server`` can end it together
    with anything it started. Raises RuntimeError (with the child's stderr)
    if no ready line arrives within ``timeout`` seconds.
    """
    env = dict(os.environ, SOPHOS_LAB_EXIT_WITH_PARENT="1")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (_PACKAGE_PARENT, env.get("PYTHONPATH")) if p
    )
    # A temporary file rather than a pipe: nobody reads stderr while the
    # server runs, and a full pipe would block it.
    with tempfile.TemporaryFile() as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdin=subprocess.PIPE,  # held open; the server stops when it closes (see _httpkit)
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=env,
            start_new_session=True,
        )
        line = _read_line(proc, timeout)
        try:
            ready = json.loads(line)
            if not ready.get("ready"):
                raise ValueError("ready is not true")
        except ValueError:
            status = proc.poll()
            stop_server(proc)
            stderr.seek(0)
            message = stderr.read().decode(errors="replace").strip()
            problem = (
                f"exited with status {status}" if status is not None
                else f"printed {line!r} instead of a ready line" if line
                else f"printed no ready line within {timeout} s"
            )
            raise RuntimeError(f"{module} did not start: it {problem}.\n{message}") from None
    proc.stdout.close()
    return proc, ready


def stop_server(proc: subprocess.Popen, timeout: float = 5.0) -> None:
    """Stop a server started by ``spawn_module``: SIGTERM, then SIGKILL."""
    if proc.poll() is None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout)
                break
            except subprocess.TimeoutExpired:
                continue
    proc.wait()
    for stream in (proc.stdin, proc.stdout):
        if stream and not stream.closed:
            stream.close()


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    """The child's first stdout line, or "" on EOF or timeout."""
    lines: queue.Queue[bytes] = queue.Queue()
    threading.Thread(
        target=lambda: lines.put(proc.stdout.readline()), daemon=True
    ).start()
    try:
        return lines.get(timeout=timeout).decode(errors="replace").strip()
    except queue.Empty:
        return ""

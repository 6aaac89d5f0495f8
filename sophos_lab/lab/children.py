"""Children that run the agent where a lab can kill them: a plain subprocess, a Jupyter kernel,
or the HTTP server (`sophos-lab serve`, driven over its API and SSE stream).

All have the same small interface: `chat()` and `resume()` return at once; `wait_for()` blocks
until the child's event stream shows a given event (a barrier, never a timer); `cancel()` stops a
conversation's run in the child and returns its final event (a kernel child takes it by a signal,
see `LabKernel.cancel`); `kill()` sends
SIGKILL to the child's whole process group; `shutdown()` sends SIGTERM to the child alone and
waits for it to finish its graceful path; `freeze()` and `thaw()` stop and continue it
(SIGSTOP, SIGCONT); `is_alive()`; `start()` starts a fresh child.
MCP stdio servers run in sessions of their own (the MCP client's choice), so a kill does not
reach them directly: they exit when the dead child's end of their stdin closes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .child_base import (CELL_DONE, EXITED, FATAL_EVENTS, FINAL_EVENTS, KERNEL_ERROR, AnotherPath, ChildFailed,  # noqa: F401
                         EventLog, _Child)
from .forkserver import ForkedProcess, child_environment, start_child, wait_stopped  # noqa: F401
from .kernel_child import LabKernel  # noqa: F401 - every kind of child, by one module's name
from .worker import parse_line


class LabWorker(_Child):
    """The agent in a plain subprocess (`python -m sophos_lab.lab.worker`), driven over stdin/stdout."""

    def __init__(self, env: Mapping[str, str], cwd: Path, log_path: Path) -> None:
        super().__init__(env, cwd, log_path)
        self.proc: subprocess.Popen | ForkedProcess | None = None
        """The process (forked from the fork server unless `SOPHOS_LAB_FORKSERVER=0`)."""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def wait_stopped(self, timeout: float | None = 60.0) -> None:
        """Block until the worker has stopped itself (SIGSTOP; once per stop), a barrier for
        `SOPHOS_LAB_STOP_AFTER_EVENT` and `SOPHOS_LAB_STOP_AFTER_WRITE`."""
        assert self.proc is not None
        try:
            wait_stopped(self.proc, timeout)
        except ChildProcessError as error:
            raise ChildFailed(str(error)) from None

    def start(self, timeout: float = 60.0) -> LabWorker:
        self.log = EventLog()
        with open(self.log_path, "ab") as stderr:
            self.proc = start_child("sophos_lab.lab.worker", [], env=self.env, cwd=self.cwd, stderr=stderr)
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()
        self.log.wait_for("ready", timeout=timeout, since=0)
        return self

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> int:
        """SIGKILL to the worker's process group; its exit code.

        The MCP client starts each stdio server in a session of its own, so, as after a real
        `kill -9`, the servers are not killed: each exits when its stdin closes.
        """
        assert self.proc is not None
        _killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.wait()

    def shutdown(self, timeout: float = 60.0) -> int:
        """SIGTERM to the worker alone, so it can drain and close its servers; its exit code."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return self.kill()
        # Its exit can be known before the reading thread has read its last lines.
        self.log.wait_for(EXITED, timeout=timeout, since=0)
        return code

    def close(self) -> None:
        if self.is_alive():
            self.kill()

    def _send(self, cmd: str, **args: Any) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, **args}) + "\n")
        self.proc.stdin.flush()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            event = parse_line(line)
            if event is not None:
                self.log.append(event)
        try:
            returncode = proc.wait()
        except ChildProcessError:  # its fork server died: the status is lost, the end is not
            returncode = None
        self.log.append_once({"event": EXITED, "data": {"returncode": returncode}})


class LabPoolWorker:
    """`sophos-lab worker`: one worker of a pool on the lab's PostgreSQL (see `runtime.workers`),
    in a process group of its own, to kill, freeze and drain. It takes no commands: servers with
    `SOPHOS_LAB_RUNS=workers` queue the runs it claims. `start()` returns once it listens."""

    def __init__(self, env: Mapping[str, str], cwd: Path, log_path: Path, concurrency: int = 1) -> None:
        self.env = child_environment(env)
        self.cwd, self.log_path, self.concurrency = Path(cwd), Path(log_path), concurrency
        self.proc: subprocess.Popen | ForkedProcess | None = None
        self.owner: str | None = None
        """Its owner id (as `runs.owner_id` names it), once started."""
        self.returncode: int | None = None
        self.stopped_at: tuple[int, int] | None = None
        """With `SOPHOS_LAB_STOP_AFTER_EVENT=N`, once it has stopped itself: `(N, M)`, M the
        highest event id its run had published (its graph's position; events N+1 to M unwritten)."""
        self.stopped_point: str | None = None
        """With `SOPHOS_LAB_STOP_AT=<point>`, once it has stopped itself there: that point."""
        self._stop_line = threading.Event()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 60.0) -> LabPoolWorker:
        from ..runtime.queue import STOPPED
        from ..runtime.workers import READY

        with open(self.log_path, "ab") as stderr:
            self.proc = start_child("sophos_lab.cli", ["worker", "--concurrency", str(self.concurrency)],
                                    env=self.env, cwd=self.cwd, stderr=stderr)
        ready = threading.Event()

        def read() -> None:
            for line in self.proc.stdout:
                fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
                if line.startswith(READY):
                    self.owner = fields["owner"]
                    ready.set()
                elif line.startswith(STOPPED):
                    if "at" in fields:  # SOPHOS_LAB_STOP_AT: a named point of the run's life
                        self.stopped_point = fields["at"]
                    else:
                        self.stopped_at = int(fields["after"]), int(fields["published"])
                    self._stop_line.set()
            ready.set()
            self._stop_line.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(timeout) or self.owner is None:
            code = self.proc.poll()
            raise ChildFailed(f"the worker did not start (exit code {code}); see {self.log_path}")
        return self

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> int:
        """SIGKILL to its process group (its MCP servers exit when their stdin closes); its exit code."""
        assert self.proc is not None
        _killpg(self.proc.pid, signal.SIGKILL)
        self.returncode = self.proc.wait()
        return self.returncode

    def wait_stopped(self, timeout: float = 60.0) -> tuple[int, int]:
        """Block until the worker has stopped itself at its stop point (`SOPHOS_LAB_STOP_AFTER_EVENT`
        or `SOPHOS_LAB_STOP_AT`), a barrier; `stopped_at` (None for a named point)."""
        assert self.proc is not None
        if not self._stop_line.wait(timeout):
            raise TimeoutError(f"the worker did not reach its stop point within {timeout} s; see {self.log_path}")
        try:
            wait_stopped(self.proc, timeout)
        except ChildProcessError as error:
            raise ChildFailed(str(error)) from None
        assert self.stopped_at is not None or self.stopped_point is not None
        return self.stopped_at

    def freeze(self) -> None:
        """SIGSTOP: alive, but unable to renew its lease."""
        os.kill(self.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def shutdown(self, timeout: float = 60.0) -> int:
        """SIGTERM: it stops claiming, drains its runs (each recorded) and exits; its exit code."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.returncode = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return self.kill()
        return self.returncode

    def close(self) -> None:
        if self.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)
            self.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


class LabServer(LabWorker):
    """`sophos-lab serve` on a free loopback port, in a process group of its own: the original's
    one server process, to break as its labs did.

    `chat()` and `resume()` POST to `/api/chat` and follow the conversation's SSE stream in a
    thread; its events (not the pings) go to the same event log as a worker's, so `wait_for`,
    `wait_final`, `conversation()` and `chat_until_tool_call` are barriers on what the server
    sent. A refused POST is a `rejected` event `{code, message, status}`. The process's own
    events (`ready`, `shutdown-requested`, `drained`, `process-exited`) go there too. `url` is
    the base URL for any other request (`request()` sends one, with the token if there is one).
    The server exits when this process goes (its stdin closes).
    """

    def __init__(self, env: Mapping[str, str], cwd: Path, log_path: Path, port: int = 0,
                 host: str = "127.0.0.1", fork: bool = False) -> None:
        super().__init__(env, cwd, log_path)
        self.url: str | None = None
        self.requested_port = port
        self.host = host
        self.fork = fork
        """Forked from the fork server (a test lab's, `Lab.setup(fork_servers=True)`), instead of
        a fresh `sophos-lab serve`: its imports cost about 3 CPU-s a start."""
        token = self.env.get("SOPHOS_LAB_TOKEN")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}

    @property
    def port(self) -> int:
        """The port it listens on (a new server started with `port=` this one takes its place)."""
        assert self.url is not None
        return int(self.url.rsplit(":", 1)[1])

    def start(self, timeout: float = 60.0) -> LabServer:
        self.log = EventLog()
        # A lesson's is not forked: a server is what a user starts by hand, and lessons 01 and 04
        # read its process (its parent, its command line) as `sophos-lab serve`'s own.
        with open(self.log_path, "ab") as stderr:
            self.proc = start_child(
                "sophos_lab.cli", ["serve", "--host", self.host, "--port", str(self.requested_port), "--lab-child"],
                env=self.env, cwd=self.cwd, stderr=stderr, fork=self.fork)
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()
        self.url = self.log.wait_for("ready", timeout=timeout, since=0)["data"]["url"]
        return self

    def request(self, method: str, path: str, **kwargs: Any):
        """One HTTP request to the server (an `httpx.Response`), with its token if it has one."""
        import httpx

        headers = {**self.headers, **kwargs.pop("headers", {})}
        return httpx.request(method, self.url + path, headers=headers, timeout=60, **kwargs)

    def follow(self, conversation: str, last_event_id: int | None = None) -> None:
        """Follow `/api/chat?conversation=` (from `last_event_id` on, when given) in a thread, its
        events into the log, like a command's; returns at once."""
        self.log.start_command()
        self._follow_in_thread(conversation, {} if last_event_id is None else {"Last-Event-ID": str(last_event_id)})

    def _follow_in_thread(self, conversation: str, headers: dict[str, str], accepted: dict | None = None) -> None:
        threading.Thread(target=self._follow, args=(conversation, headers, accepted), daemon=True).start()

    def _send(self, cmd: str, **args: Any) -> None:
        if cmd == "conversations":
            response = self.request("GET", "/api/conversations")
            if response.status_code == 200:
                self.log.append({"event": "conversations", "data": response.json()})
            else:
                error = response.json().get("error", {})
                self.log.append({"event": "rejected", "data": {**error, "status": response.status_code, "cmd": cmd}})
            return
        if cmd == "cancel":
            response = self.request("POST", f"/api/conversations/{args['conversation']}/cancel")
            if response.status_code == 200:
                self.log.append({"event": "cancel-answer", "data": {
                    "conversation": args["conversation"], "final": response.json()}})
            else:
                error = response.json().get("error", {})
                self.log.append({"event": "rejected", "data": {**error, "status": response.status_code, "cmd": cmd}})
            return
        if cmd in ("approve", "reject"):
            body = {"decisions": args["decisions"], "gate": args["gate"]} if cmd == "approve" else {
                "reason": args["reason"], "gate": args["gate"]}
            path = f"/api/conversations/{args['conversation']}/{cmd}"
        else:
            path = "/api/chat"
            body = {"resume": True, "conversation": args["conversation"]} if cmd == "resume" else {
                "message": args["message"], "conversation": args["conversation"]}
        response = self.request("POST", path, json=body)
        if response.status_code != 200:
            error = response.json().get("error", {})
            self.log.append({"event": "rejected", "data": {**error, "status": response.status_code, "cmd": cmd}})
            return
        accepted = response.json()
        self._follow_in_thread(accepted["conversation"], {}, accepted)

    def _follow(self, conversation: str, headers: dict[str, str], accepted: dict | None = None) -> None:
        import httpx

        started = accepted is None
        try:
            with httpx.stream("GET", f"{self.url}/api/chat", params={"conversation": conversation},
                              headers={**self.headers, **headers},
                              timeout=httpx.Timeout(60, read=None)) as response:
                for event in sse_events(response.iter_lines()):
                    if event["event"] == "ping":
                        continue
                    if not started and event["id"] is None and event["event"] in FINAL_EVENTS:
                        # The run ended before this follow attached: the server answers from the
                        # database with one id-less event, so say first that it had started.
                        self.log.append({"id": None, "event": "started", "data": accepted})
                    started = started or event["event"] == "started"
                    self.log.append(event)
        except httpx.HTTPError:
            pass  # the server went away: its `process-exited` event says so


def sse_events(lines: Any) -> Any:
    """`{"id", "event", "data"}` per SSE frame of these lines (`id` None when the frame has none)."""
    frame: dict[str, Any] = {}
    for line in lines:
        if not line:
            if "event" in frame or "data" in frame:
                yield {"id": frame.get("id"), "event": frame.get("event", "message"),
                       "data": json.loads(frame["data"]) if "data" in frame else None}
            frame = {}
        elif not line.startswith(":"):
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "id":
                frame["id"] = int(value) if value.isdigit() else value
            elif field == "data":
                frame["data"] = frame["data"] + "\n" + value if "data" in frame else value
            elif field == "event":
                frame["event"] = value

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

import abc
import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..runtime.errors import SophosError
from .forkserver import ForkedProcess, start_child, wait_stopped
from .worker import parse_line

EXITED = "process-exited"
KERNEL_ERROR = "kernel-error"
CELL_DONE = "executed"   # the lab's own mark that a kernel cell finished; not one of the run's events
FATAL_EVENTS = (EXITED, KERNEL_ERROR)


FINAL_EVENTS = ("end", "chat-error", "rejected")


class ChildFailed(RuntimeError):
    """The child died, or its cell raised, while we were waiting for one of its events."""


class AnotherPath(RuntimeError):
    """The model kept answering without the tool call a lesson's kill point needs."""


class EventLog:
    """The events a child has emitted, with a way to wait for one."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.mark = 0
        """Where `wait_for` starts looking by default: the first event of the latest command."""
        self._changed = threading.Condition()

    def append(self, event: dict[str, Any]) -> None:
        with self._changed:
            self.events.append(event)
            self._changed.notify_all()

    def append_once(self, event: dict[str, Any]) -> None:
        """Append `event` unless one of the same name is already there (e.g. the exit)."""
        with self._changed:
            if not any(e["event"] == event["event"] for e in self.events):
                self.events.append(event)
                self._changed.notify_all()

    def start_command(self) -> None:
        with self._changed:
            self.mark = len(self.events)

    def wait_for(
        self, names: str | tuple[str, ...], timeout: float = 60.0, since: int | None = None, **fields: Any
    ) -> dict[str, Any]:
        """The first event named `names` (one or several) whose data has `fields`, from `since`."""
        names = (names,) if isinstance(names, str) else names
        return self.wait_until(lambda event: _matches(event, names, fields), f"{names} {fields or ''}",
                               timeout, since, expected=names)

    def wait_until(
        self, match: Callable[[dict[str, Any]], bool], description: str, timeout: float = 60.0,
        since: int | None = None, expected: tuple[str, ...] = (),
    ) -> dict[str, Any]:
        """The first event that `match`es, from `since`; a child's death on the way raises."""
        deadline = time.monotonic() + timeout
        with self._changed:
            index = self.mark if since is None else since
            while True:
                for event in self.events[index:]:
                    if match(event):
                        return event
                    if event["event"] in FATAL_EVENTS and event["event"] not in expected:
                        raise ChildFailed(f"{event['event']} ({event['data']}) before {description}")
                index = len(self.events)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"no {description} event within {timeout} s")
                self._changed.wait(remaining)

    def of_command(self) -> list[dict[str, Any]]:
        """The events since the latest command started."""
        with self._changed:
            return list(self.events[self.mark:])

    def events_since(self, since: int, timeout: float = 0.0) -> list[dict[str, Any]]:
        """The events from index `since` on; when there are none yet, waits up to `timeout` s
        for one (an empty list if none came)."""
        with self._changed:
            self._changed.wait_for(lambda: len(self.events) > since, timeout)
            return self.events[since:]


def _matches(event: dict[str, Any], names: tuple[str, ...], fields: Mapping[str, Any]) -> bool:
    if event["event"] not in names:
        return False
    data = event.get("data")
    return all(isinstance(data, dict) and data.get(key) == value for key, value in fields.items())


def child_environment(overrides: Mapping[str, str]) -> dict[str, str]:
    """This process's environment without pytest's variables, plus the lab's settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    kit_parent = str(Path(__file__).resolve().parents[2])
    paths = [p for p in (env.get("PYTHONPATH") or "").split(os.pathsep) if p]
    # Once: a lab in a child of a lab (a lesson kernel's) gets the same PYTHON* variables, and
    # so the same fork server (`forkserver.share`).
    env["PYTHONPATH"] = os.pathsep.join([kit_parent, *(p for p in paths if p != kit_parent)])
    env["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"
    env.update(overrides)
    return env


class _Child(abc.ABC):
    """What both backends share: the event log and the commands."""

    def __init__(self, env: Mapping[str, str], cwd: Path, log_path: Path) -> None:
        self.env = child_environment(env)
        self.cwd = Path(cwd)
        self.log_path = Path(log_path)
        self.log = EventLog()

    def chat(self, message: str, conversation: str | None = None) -> None:
        """Start a chat turn in the child; returns at once (see `wait_for`)."""
        self.log.start_command()
        self._send("chat", message=message, conversation=conversation)

    def resume(self, conversation: str) -> None:
        """Start a resume of `conversation` in the child; returns at once."""
        self.log.start_command()
        self._send("resume", conversation=conversation)

    def approve(self, conversation: str, decisions: dict[str, Any] | None = None, gate: str | None = None) -> None:
        """Decide on `conversation`'s gate (`gate`, else the one waiting now; `decisions` None:
        approve every held call); returns at once, and the run that carries the decision on is
        the latest command's (`wait_final`)."""
        self.log.start_command()
        self._send("approve", conversation=conversation, decisions=decisions, gate=gate)

    def reject(self, conversation: str, reason: str | None = None, gate: str | None = None) -> None:
        """Reject every call held at `conversation`'s gate, with `reason` for the model."""
        self.log.start_command()
        self._send("reject", conversation=conversation, reason=reason, gate=gate)

    def cancel(self, conversation: str, timeout: float = 60.0) -> dict[str, Any]:
        """Cancel `conversation`'s active run in the child; the run's final event once it is
        recorded (`chat-error` `CANCELLED`, or `end` if the run finished first). A refusal
        (`RUN_NOT_ACTIVE`, ...) is returned as the `rejected` event. The latest command's events
        (`wait_final`) are still the run's."""
        since = len(self.log.events)
        self._send("cancel", conversation=conversation)
        answer = self.log.wait_until(
            lambda e: e["event"] == "cancel-answer" or _matches(e, ("rejected",), {"cmd": "cancel"}),
            "cancel answer", timeout, since)
        return answer["data"]["final"] if answer["event"] == "cancel-answer" else answer

    def conversations(self, timeout: float = 60.0) -> list[dict[str, Any]]:
        """List conversations in the child; its first database access runs recovery there. A
        refusal (`rejected`, e.g. `STORAGE_FULL`) is raised here as the `SophosError` it was."""
        self.log.start_command()
        self._send("conversations")
        answer = self.log.wait_until(
            lambda e: e["event"] == "conversations" or _matches(e, ("rejected",), {"cmd": "conversations"}),
            "conversations", timeout)
        if answer["event"] == "rejected":
            raise SophosError(answer["data"]["code"], answer["data"]["message"])
        return answer["data"]["conversations"]

    def wait_for(self, names: str | tuple[str, ...], timeout: float = 60.0, **fields: Any) -> dict[str, Any]:
        """Block until the latest command's stream shows the event (e.g. `"trace", event="result"`)."""
        return self.log.wait_for(names, timeout=timeout, **fields)

    def wait_final(self, timeout: float = 120.0) -> dict[str, Any]:
        """The latest command's final event: `end`, `chat-error` or `rejected`."""
        return self.log.wait_for(FINAL_EVENTS, timeout=timeout)

    def wait_for_tool_call(self, timeout: float = 60.0) -> dict[str, Any] | None:
        """The latest command's first tool `call` trace, or None if its run ended without one
        (a real model may answer in words instead)."""
        event = self.log.wait_until(
            lambda e: e["event"] in FINAL_EVENTS or _matches(e, ("trace",), {"event": "call"}),
            "tool call or final", timeout)
        return event if event["event"] == "trace" else None

    def chat_until_tool_call(self, message: str, tool: str | None = None, attempts: int = 3) -> str:
        """Send `message` in a new conversation until the model answers it with a tool call (of
        `tool`, when given); the conversation. A kill point that needs the tool step (a held
        page, the answer after the tool result) can then be waited for.

        The scripted model always calls the tool. A real model may answer in words instead: then
        this says so, asks again in a new conversation, and after `attempts` tries raises
        `AnotherPath` saying what to try.
        """
        for attempt in range(1, attempts + 1):
            self.chat(message)
            conversation = self.conversation()
            call = self.wait_for_tool_call()
            if call is not None:
                name = call["data"]["data"]["name"]
                if tool is None or name == tool:
                    return conversation
                raise AnotherPath(
                    f"The model called {name} instead of {tool}, so this lesson's kill point will "
                    f"not come. Run the cell again, or make the message name {tool} more plainly.")
            final = self.wait_final()
            answer = " ".join("".join(e["data"] for e in self.events() if e["event"] == "token").split())
            completed = final["event"] == "end" and final["data"].get("status", "completed") == "completed"
            outcome = (f"model answered without calling {tool or 'a tool'}" if completed else
                       f"run ended with {final['event']} {final['data'].get('code') or final['data'].get('status')}")
            print(f"Attempt {attempt} of {attempts}: the {outcome}"
                  + (f": “{answer[:160]}{'…' if len(answer) > 160 else ''}”" if answer else "."))
            if not completed:
                break
            if attempt < attempts:
                print("A real model may do that. Asking again, in a new conversation.")
        raise AnotherPath(
            f"The model did not call {tool or 'a tool'}, so this lesson cannot reach its kill point. "
            "Try a model that supports tools (`ollama show <model>` lists `tools` under "
            "Capabilities; qwen3 and llama3.1 do), or make the message name the tool more plainly.")

    def conversation(self) -> str:
        """The conversation of the latest command (from its `started` event); a refused command
        raises `ChildFailed` with the refusal's code at once."""
        event = self.wait_for(("started", "rejected"), timeout=60)
        if event["event"] == "rejected":
            raise ChildFailed(f"the child refused {event['data'].get('cmd', 'the command')}: "
                              f"{event['data'].get('code')} ({event['data'].get('message')})")
        return event["data"]["conversation"]

    def events(self) -> list[dict[str, Any]]:
        """The latest command's events, in the order they reached the lab. A kernel child's
        cell-finished marks are left out: when one lands before or after the final event is a
        race of two channels, and it is no event of the run."""
        return [e for e in self.log.of_command() if e["event"] != CELL_DONE]

    def freeze(self) -> None:
        """SIGSTOP: the child stops where it is, alive but unable to renew its lease."""
        os.kill(self.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT: a frozen child carries on from where it stopped."""
        os.kill(self.pid, signal.SIGCONT)

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @abc.abstractmethod
    def _send(self, cmd: str, **args: Any) -> None:
        """Hand one command (`chat`, `resume`, `conversations`, `cancel`) to the child."""


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


KERNEL_NAME = "sophos-lab-child"
# Run while the kernel boots, before it answers its first request: the runtime's imports (most
# of a child's start-up) overlap the client's connecting and waiting for the kernel, ~0.1 s
# sooner ready than importing them in the setup cell. A failure here only shows in the kernel's
# log; the setup cell imports again and raises it where the lab sees it.
_PRELOAD = "from sophos_lab.lab.worker import load_runtime as _load_runtime; _load_runtime()"
_SETUP = (
    "from sophos_lab.lab.worker import ChildRuntime as _ChildRuntime\n"
    "_sophos = _ChildRuntime()\n"
    "_sophos.install_signal_handlers(request_dir={request_dir!r})\n"
)
REQUEST_SIGNAL = signal.SIGUSR1
"""Tells a kernel child that a command waits in its request directory (see `LabKernel.cancel`)."""


class LabKernel(_Child):
    """The agent in a Jupyter kernel of its own (jupyter_client), killable from the notebook.

    The kernelspec is built from the running interpreter, the kernel's history stays in memory,
    and the kernel's raw output goes to a log file. Each chat or resume is one cell executed
    with a non-blocking `execute`; the events come back as stdout lines on IOPub.

    A cancel cannot be a cell: the shell runs one cell at a time, and the chat's is still
    running. It goes as a request file and a signal instead (`cancel`).
    """

    def __init__(self, env: Mapping[str, str], cwd: Path, log_path: Path, spec_dir: Path) -> None:
        super().__init__(env, cwd, log_path)
        self.spec_dir = Path(spec_dir)
        self.request_dir = self.spec_dir / "requests" / self.log_path.stem
        """Where `cancel` leaves its requests for the kernel (one directory per child)."""
        self.km = None
        self.kc = None
        self.output: list[str] = []
        self._stop = threading.Event()
        self._requests_sent = 0

    @property
    def pid(self) -> int:
        return self.km.provisioner.pid

    def start(self, timeout: float = 60.0) -> LabKernel:
        from jupyter_client import KernelManager
        from jupyter_client.kernelspec import KernelSpecManager

        self._write_kernelspec()
        self.log = EventLog()
        self._stop = threading.Event()
        self.km = KernelManager(
            kernel_name=KERNEL_NAME, kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(self.spec_dir)])
        )
        with open(self.log_path, "ab") as out:
            self.km.start_kernel(
                env=self.env, cwd=str(self.cwd), stdout=out, stderr=out,
                extra_arguments=["--HistoryManager.hist_file=:memory:"],
            )
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=timeout)
        threading.Thread(target=self._read, args=(self.km, self.kc, self._stop), daemon=True).start()
        shutil.rmtree(self.request_dir, ignore_errors=True)  # a restarted child takes no old request
        self.execute(_SETUP.format(request_dir=str(self.request_dir)), timeout=timeout)
        return self

    def execute(self, code: str, timeout: float = 60.0) -> None:
        """Run code in the child kernel and wait for it to finish; raises on an error."""
        msg_id = self.kc.execute(code, store_history=False)
        done = self.log.wait_for(CELL_DONE, timeout=timeout, since=0, msg_id=msg_id)
        if done["data"]["error"]:
            raise RuntimeError(f"the child kernel raised {done['data']['error']}")

    def is_alive(self) -> bool:
        return self.km is not None and self.km.is_alive()

    def wait_stopped(self, timeout: float | None = 60.0) -> None:
        """As a worker's: block until the kernel has stopped itself (SIGSTOP; once per stop).
        Its own `write-stop` event may not reach the lab first: the kernel stops before its
        output thread has sent it. A kernel started without the fork server cannot be waited on."""
        process = self.km.provisioner.process if self.km is not None and self.km.provisioner else None
        if not isinstance(process, ForkedProcess):
            raise ChildFailed("wait_stopped needs a forked kernel (SOPHOS_LAB_FORKSERVER is 0 here)")
        try:
            wait_stopped(process, timeout)
        except ChildProcessError as error:
            raise ChildFailed(str(error)) from None

    def kill(self) -> int:
        """SIGKILL to the kernel's process group (not `shutdown_kernel(now=True)`: no SIGINT first)."""
        self.km.signal_kernel(signal.SIGKILL)
        code = self.km.provisioner.process.wait()
        self._tidy(code)
        return code

    def shutdown(self, timeout: float = 60.0) -> int:
        """SIGTERM to the kernel process alone: the child drains, records, closes and exits."""
        process = self.km.provisioner.process
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(timeout)
        except subprocess.TimeoutExpired:
            return self.kill()
        self.log.wait_for(EXITED, timeout=timeout, since=0)  # as a worker's: the reader has read all
        self._tidy(code)
        return code

    def close(self) -> None:
        if self.km is None:
            return
        if self.is_alive():
            self.kill()
        else:
            self._tidy(self.km.provisioner.process.poll() if self.km.provisioner else None)

    def cancel(self, conversation: str, timeout: float = 60.0) -> dict[str, Any]:
        """As a worker's: the run's final event, or the `rejected` event (`RUN_NOT_ACTIVE`, ...).

        The kernel's shell is busy with the chat's cell, so the command does not go as a cell:
        it is written to the child's request directory, then SIGUSR1 tells the kernel, whose
        handler starts it on the loop the chat runs on. A dead kernel raises `ChildFailed`.
        """
        if not self.is_alive():
            raise ChildFailed("the kernel child is not running: nothing to cancel")
        return super().cancel(conversation, timeout)

    def _send(self, cmd: str, **args: Any) -> None:
        if cmd == "cancel":
            self._send_request({"cmd": cmd, **args})
            return
        if cmd == "conversations":
            code = "_sophos.conversations();"
        elif cmd == "chat":
            code = f"await _sophos.chat({args['message']!r}, {args['conversation']!r})"
        elif cmd == "approve":
            code = f"await _sophos.approve({args['conversation']!r}, {args['decisions']!r}, {args['gate']!r})"
        elif cmd == "reject":
            code = f"await _sophos.reject({args['conversation']!r}, {args['reason']!r}, {args['gate']!r})"
        else:
            code = f"await _sophos.resume({args['conversation']!r})"
        self.kc.execute(code, store_history=False)

    def _send_request(self, command: dict[str, Any]) -> None:
        """Leave `command` in the request directory (whole, by a rename; numbered, so the kernel
        takes them in order) and signal the kernel process."""
        self._requests_sent += 1
        path = self.request_dir / f"{self._requests_sent:06d}.json"
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(command), encoding="utf-8")
        os.replace(partial, path)
        try:
            os.kill(self.pid, REQUEST_SIGNAL)
        except ProcessLookupError:
            pass  # it died just now: the waiting sees its exit

    def _tidy(self, returncode: int | None) -> None:
        self._stop.set()
        self.log.append_once({"event": EXITED, "data": {"returncode": returncode}})
        self.kc.stop_channels()
        self.km.cleanup_resources()

    def _write_kernelspec(self) -> None:
        folder = self.spec_dir / KERNEL_NAME
        folder.mkdir(parents=True, exist_ok=True)
        from .kernels import kernel_spec

        # Forked from the fork server, which imported the runtime (`kernels.py`); the argv is a
        # fresh interpreter's, which `SOPHOS_LAB_FORKSERVER=0` starts instead.
        spec = kernel_spec("sophos_lab child")
        spec["argv"].append(f"--IPKernelApp.exec_lines={_PRELOAD}")
        (folder / "kernel.json").write_text(json.dumps(spec, indent=1))

    def _read(self, km: Any, kc: Any, stop: threading.Event) -> None:
        partial = ""
        errors: dict[str, str] = {}
        while not stop.is_set():
            try:
                msg = kc.get_iopub_msg(timeout=0.2)
            except queue.Empty:
                if not km.is_alive():
                    code = km.provisioner.process.poll() if km.provisioner else None
                    self.log.append_once({"event": EXITED, "data": {"returncode": code}})
                    return
                continue
            except Exception:  # channels closed under us by kill()/shutdown()
                return
            kind, content = msg["msg_type"], msg["content"]
            parent = msg.get("parent_header", {}).get("msg_id")
            if kind == "stream":
                partial += content["text"]
                *lines, partial = partial.split("\n")
                for line in lines:
                    event = parse_line(line)
                    if event is not None:
                        self.log.append(event)
                    elif line.strip():
                        self.output.append(line)
            elif kind == "error":
                errors[parent] = f"{content['ename']}: {content['evalue']}"
            elif kind == "status" and content["execution_state"] == "idle" and parent:
                error = errors.pop(parent, None)
                self.log.append({"event": CELL_DONE, "data": {"msg_id": parent, "error": error}})
                if error:
                    self.log.append({"event": KERNEL_ERROR, "data": {"msg_id": parent, "error": error}})


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

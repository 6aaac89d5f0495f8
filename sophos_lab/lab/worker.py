"""The agent as a child process that a lab can kill: a plain subprocess or a Jupyter kernel.

Both run a `ChildRuntime`, which writes each event as one line `@@sophos {json}` on stdout and
handles SIGTERM:

- by default it drains: no new runs, the active run stops at its next step boundary (or is
  cancelled when `SHUTDOWN_TIMEOUT` runs out) and is recorded `interrupted` with `SHUTDOWN`,
  then MCP and SQLite are closed and the process exits;
- with `SOPHOS_LAB_NAIVE_SHUTDOWN=1` it does what the original did: close MCP and SQLite at
  once and let the active run fail against the closed database.

`python -m sophos_lab.lab.worker` reads one JSON command per line on stdin:
`{"cmd": "chat", "message": ..., "conversation": ...}`, `{"cmd": "resume", "conversation": ...}`,
`{"cmd": "conversations"}` (opens the database: recovery runs), `{"cmd": "cancel", "conversation": ...}`
(answered with a `cancel-answer` event holding the run's final event), `{"cmd": "exit"}`. A
refused command answers with a `rejected` event `{code, message, cmd}`.

A kernel child cannot read commands while its shell runs the chat's cell, so it takes the
commands that must reach a running run (only `cancel`) as request files: the lab writes
`{"cmd": "cancel", "conversation": ...}` as one JSON file into the child's request directory and
sends SIGUSR1 (see `ChildRuntime.install_signal_handlers`); the answer is the same event.

For crash tests, `SOPHOS_LAB_STOP_AFTER_EVENT=N` makes the child SIGSTOP itself right after it
has written and flushed the N-th event (by event id) of the first run it follows, so a parent
that waits for that event can kill it at exactly that point. `SOPHOS_LAB_STOP_AFTER_WRITE=N`
stops it right after the N-th commit its runs make (the run's row, a task's pending writes, a
checkpoint, an outcome: see `DurableWrite`), before anything is told of it, once it has written
a `write-stop` line `{n, write}`: points that no event marks, such as a step's writes committed
and its checkpoint not yet. `SOPHOS_LAB_TRACE_WRITES=1` writes a `write` line `{n, write}` after
each commit (a crash test's reference run counts them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from ..runtime.errors import SophosError

if TYPE_CHECKING:  # the runtime is imported by `load_runtime`, not with this module
    from ..runtime.active import ActiveRun
    from ..runtime.service import AgentService
    from ..runtime.settings import Settings

EVENT_PREFIX = "@@sophos "


def emit_line(payload: dict[str, Any]) -> None:
    """Write one event line on stdout (the channel both backends read)."""
    sys.stdout.write(EVENT_PREFIX + json.dumps(payload, default=str) + "\n")
    sys.stdout.flush()


def exit_now() -> NoReturn:
    """`os._exit(0)`, once the events written so far have left this process.

    In a kernel child stdout goes over ZeroMQ, and `os._exit` drops what is still queued on the
    IOPub socket: often the last events, `exited` among them. The kernel app's own `close()`
    flushes the IOPub thread and ends the ZeroMQ context, which waits for the queue (the socket's
    linger). It runs in a thread, so that a part of it that hangs cannot keep the process alive.
    """
    sys.stdout.flush()
    kernel_app = sys.modules.get("ipykernel.kernelapp")
    if kernel_app is not None and kernel_app.IPKernelApp.initialized():
        closing = threading.Thread(target=kernel_app.IPKernelApp.instance().close, daemon=True)
        closing.start()
        closing.join(5.0)
    os._exit(0)


def parse_line(line: str) -> dict[str, Any] | None:
    """The event of an `@@sophos` line, or None for any other output."""
    line = line.strip()
    if not line.startswith(EVENT_PREFIX):
        return None
    return json.loads(line[len(EVENT_PREFIX):])


def warm_imports() -> None:
    """Import the model and MCP clients now, so a child's first run does not pay for them."""
    import langchain_mcp_adapters.tools  # noqa: F401
    import langchain_ollama  # noqa: F401
    import mcp.client.stdio  # noqa: F401
    import mcp.client.streamable_http  # noqa: F401


def load_runtime() -> type[AgentService]:
    """Import the runtime and the clients its first run needs, with the cyclic GC paused.

    These imports (LangGraph, LangChain, the MCP and Ollama clients: about 0.8 s) are most of a
    child's start-up. They allocate objects that live as long as the process, and the
    collections their allocations trigger took about a sixth of that time, freeing next to
    nothing (the few thousand objects they would have freed stay). `gc.freeze()` then keeps
    the imported objects out of every later collection, too.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        from ..runtime.service import AgentService

        warm_imports()
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()
    return AgentService


class ChildRuntime:
    """An `AgentService` whose events go to stdout and which shuts down on SIGTERM.

    Made once per child process (the worker's `main`, the kernel's setup cell).
    """

    def __init__(self, settings: Settings | None = None, emit: Callable[[dict], None] = emit_line) -> None:
        AgentService = load_runtime()  # noqa: N806 - the class, imported here
        log_dir = os.environ.get("SOPHOS_LAB_LOG_DIR")
        self.service = AgentService(settings, log_dir=Path(log_dir) if log_dir else None)
        self.emit = emit
        self.shutdown_requested = False
        self._following = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_after = int(os.environ.get("SOPHOS_LAB_STOP_AFTER_EVENT") or 0)
        """Stop (SIGSTOP) right after writing this event of the first run followed (0: never)."""
        self._runs_followed = 0
        stop_at_write = int(os.environ.get("SOPHOS_LAB_STOP_AFTER_WRITE") or 0)
        if stop_at_write or os.environ.get("SOPHOS_LAB_TRACE_WRITES"):
            self.service.on_write = self._watch_writes(stop_at_write, trace=bool(os.environ.get("SOPHOS_LAB_TRACE_WRITES")))
        self._request_dir: Path | None = None
        self._requests: set[asyncio.Task] = set()

    def _watch_writes(self, n: int, trace: bool) -> Callable[[Any], None]:
        commits = 0

        def counted(write: Any) -> None:
            nonlocal commits
            commits += 1
            if trace:
                self.emit({"event": "write", "data": {"n": commits, "write": write.describe()}})
            if commits == n:
                self.emit({"event": "write-stop", "data": {"n": n, "write": write.describe()}})
                os.kill(os.getpid(), signal.SIGSTOP)

        return counted

    def install_signal_handlers(self, request_dir: str | Path | None = None) -> None:
        """SIGTERM shuts the child down (see the module's docstring). With `request_dir` (a kernel
        child, whose shell is busy with the chat's cell), SIGUSR1 means "commands are waiting in
        `request_dir`": they are taken on the event loop the cells run on, beside the running chat.

        Call it on that loop's thread, in a cell. A signal carries no data, hence the files; and
        several signals may arrive as one, hence every waiting file is taken each time."""
        signal.signal(signal.SIGTERM, self._on_sigterm)
        if request_dir is not None:
            self._request_dir = Path(request_dir)
            self._request_dir.mkdir(parents=True, exist_ok=True)
            self._loop = asyncio.get_running_loop()
            signal.signal(signal.SIGUSR1, self._on_request_signal)

    async def chat(self, message: str, conversation: str | None = None) -> dict[str, Any] | None:
        """Run one chat turn to its end, emitting its events; returns the final event."""
        return await self._follow(lambda: self.service.chat(message, conversation), "chat")

    async def resume(self, conversation: str) -> dict[str, Any] | None:
        return await self._follow(lambda: self.service.resume(conversation), "resume")

    async def approve(self, conversation: str, decisions: dict[str, Any] | None = None,
                      gate: str | None = None) -> dict[str, Any] | None:
        """Decide on the gate (None: approve every call) and follow the run that carries the
        decision on (or, for a decision made already, the run it made)."""
        return await self._follow(lambda: self.service.approve(conversation, decisions, gate), "approve")

    async def reject(self, conversation: str, reason: str | None = None, gate: str | None = None) -> dict[str, Any] | None:
        return await self._follow(lambda: self.service.reject(conversation, reason, gate), "reject")

    async def cancel(self, conversation: str) -> dict[str, Any] | None:
        """Cancel the conversation's active run; emits `cancel-answer` with the run's final event
        (the run's own events go out as usual, from the command that started it)."""
        try:
            final = (await self.service.cancel(conversation)).to_dict()
        except SophosError as error:
            self.emit({"event": "rejected", "data": {**error.to_dict(), "cmd": "cancel"}})
            return None
        except Exception as error:  # never leave the parent waiting for an answer
            self.emit({"event": "rejected", "data": {"code": "AGENT_FAILURE", "message": str(error), "cmd": "cancel"}})
            return None
        self.emit({"event": "cancel-answer", "data": {"conversation": conversation, "final": final}})
        return final

    async def conversations(self) -> list[dict[str, Any]] | None:
        """Like the original's `GET /api/conversations`: the first call opens the database, so
        crash recovery runs here. Emits a `conversations` event with the list, or a `rejected`
        event (e.g. `STORAGE_FULL`: a full disk where not even reading is possible)."""
        try:
            items = [dataclasses.asdict(c) for c in await self.service.list_conversations()]
        except SophosError as error:
            self.emit({"event": "rejected", "data": {**error.to_dict(), "cmd": "conversations"}})
            return None
        self.emit({"event": "conversations", "data": {
            "conversations": items, "recovered_runs": self.service.store.recovered_runs,
        }})
        return items

    async def _follow(self, start: Callable, command: str) -> dict[str, Any] | None:
        self._loop = asyncio.get_running_loop()
        self._following += 1
        final = None
        try:
            run: ActiveRun = await start()
            self._runs_followed += 1
            stop_after = self._stop_after if self._runs_followed == 1 else 0
            async for event in run.events():
                final = event.to_dict()
                self.emit(final)
                if event.id == stop_after:  # the line is flushed: the parent sees this point
                    os.kill(os.getpid(), signal.SIGSTOP)
        except SophosError as error:
            self.emit({"event": "rejected", "data": {**error.to_dict(), "cmd": command}})
        except Exception as error:  # never leave the parent waiting for an answer
            self.emit({"event": "rejected", "data": {"code": "AGENT_FAILURE", "message": str(error), "cmd": command}})
        finally:
            self._following -= 1
        if self.shutdown_requested and self._following == 0:
            await self._exit()
        return final

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        # A Python signal handler may run inside the main thread's own write to stdout (a write
        # interrupted by the signal runs the handlers before it returns): writing an event here
        # would be a reentrant call on that buffered stream, raised into the write it
        # interrupted. That write may be any event, a reply to `conversations` included, so
        # the handler only sets flags (the drain's, at this very point) and hands the rest to
        # the loop, as for SIGUSR1. Before the loop exists nothing of ours writes.
        self.shutdown_requested = True
        if self._following and not self.service.settings.naive_shutdown:
            self.service.request_drain("sigterm")
        if self._loop is None:
            self._exit_idle()
        try:
            self._loop.call_soon_threadsafe(self._shut_down)
        except RuntimeError:  # the loop has ended: nothing of ours writes any more
            self._exit_idle()

    def _announce_shutdown(self) -> None:
        self.emit({"event": "shutdown-requested", "data": {
            "naive": self.service.settings.naive_shutdown,
            "active_runs": [run.id for run in self.service.active.values()],
        }})

    def _exit_idle(self) -> NoReturn:
        """Exit now, from a signal handler with no loop to close the store on: its owner row
        stays, and this process, gone, is seen so by its pid (`ownership`)."""
        self._announce_shutdown()
        self.emit({"event": "exited", "data": {"reason": "sigterm"}})
        exit_now()

    async def _exit_idle_closing(self) -> NoReturn:
        """Exit now, on the loop: the store closed first (its owner row goes)."""
        self._announce_shutdown()
        await self.service.store.aclose()
        self.emit({"event": "exited", "data": {"reason": "sigterm"}})
        exit_now()

    def _shut_down(self) -> None:
        """On the loop, after SIGTERM: exit at once with nothing followed; else drain (or,
        naive, close everything at once)."""
        if self._following == 0:
            asyncio.ensure_future(self._exit_idle_closing())
            return
        self._announce_shutdown()
        naive = self.service.settings.naive_shutdown
        if naive:
            async def close_now() -> None:
                await self.service.aclose()
                self.emit({"event": "connections-closed", "data": {}})

            asyncio.ensure_future(close_now())
        else:
            self._loop.call_later(self.service.settings.shutdown_timeout, self._cancel_active)

    def _on_request_signal(self, signum: int, frame: Any) -> None:
        # A Python signal handler runs on the main thread between two bytecodes, possibly in
        # the middle of the loop's own work: only hand the loop a callback (the threadsafe call
        # also wakes its selector).
        self._loop.call_soon_threadsafe(self._take_requests)

    def _take_requests(self) -> None:
        """Start every command waiting in the request directory, oldest first."""
        for path in sorted(self._request_dir.glob("*.json")):
            try:
                command = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as error:
                command = {"cmd": None, "error": str(error)}
            path.unlink(missing_ok=True)
            if not isinstance(command, dict) or command.get("cmd") != "cancel":
                self.emit({"event": "rejected", "data": {
                    "code": "BAD_REQUEST", "message": f"bad request file {path.name}: {command}"}})
                continue
            task = asyncio.ensure_future(self.cancel(command.get("conversation")))
            self._requests.add(task)
            task.add_done_callback(self._requests.discard)

    def _cancel_active(self) -> None:
        for run in self.service.active.values():
            if run.task is not None:
                run.task.cancel()

    async def _exit(self) -> None:
        await self.service.aclose()
        self.emit({"event": "exited", "data": {"reason": "sigterm"}})
        exit_now()


async def serve_stdin(runtime: ChildRuntime) -> None:
    """Read commands from stdin until `exit` or end of input; runs proceed concurrently."""
    loop = asyncio.get_running_loop()
    runtime._loop = loop
    # On the loop, not with `signal.signal`: a signal the kernel hands to the stdin reader's
    # thread runs a Python handler only once the main thread wakes, and the main thread sleeps in
    # the loop's selector until a command comes. asyncio's handler wakes the selector (its wakeup
    # fd). With `signal.signal`, 3 idle shutdowns in 100 hung until killed.
    loop.add_signal_handler(signal.SIGTERM, runtime._on_sigterm, signal.SIGTERM, None)
    runtime.emit({"event": "ready", "data": {"pid": os.getpid()}})
    running: set[asyncio.Task] = set()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line or not line.strip():
            if not line:
                break
            continue
        try:
            command = json.loads(line)
            name = command["cmd"]
        except (ValueError, KeyError, TypeError):
            runtime.emit({"event": "rejected", "data": {"code": "BAD_REQUEST", "message": f"bad command: {line.strip()}"}})
            continue
        if name == "exit":
            break
        if name == "conversations":
            await runtime.conversations()
            continue
        if name == "chat":
            coro = runtime.chat(command.get("message"), command.get("conversation"))
        elif name == "resume":
            coro = runtime.resume(command.get("conversation"))
        elif name == "cancel":
            coro = runtime.cancel(command.get("conversation"))
        elif name == "approve":
            coro = runtime.approve(command.get("conversation"), command.get("decisions"), command.get("gate"))
        elif name == "reject":
            coro = runtime.reject(command.get("conversation"), command.get("reason"), command.get("gate"))
        else:
            runtime.emit({"event": "rejected", "data": {"code": "BAD_REQUEST", "message": f"unknown command {name!r}"}})
            continue
        task = asyncio.create_task(coro)
        running.add(task)
        task.add_done_callback(running.discard)
    if running:
        await asyncio.wait(running)
    await runtime.service.aclose()


def main() -> None:
    runtime = ChildRuntime()
    runtime.install_signal_handlers()  # until the loop runs (`serve_stdin` hands SIGTERM to it)
    asyncio.run(serve_stdin(runtime))


if __name__ == "__main__":
    main()

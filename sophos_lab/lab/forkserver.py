"""Start the lab's worker children by forking a process that has already imported the runtime.

A worker child spends most of its start-up importing LangGraph, LangChain and the MCP
and Ollama clients (about 1.6 s of CPU here). A lab starts many of them (every restart, every
kill point), so the first start launches one *fork server*: `python -m sophos_lab.lab.forkserver`
imports the runtime once and then, for each start, forks. The forked child is a real process of
its own, like one `subprocess.Popen` starts: its own pid, session, stdin, stdout and stderr,
environment and working directory; it runs the module as `python -m` would (`runpy`), exits as
an interpreter does, and dies for real under `kill -9`. It starts in a few milliseconds of CPU.

What differs from a fresh interpreter: the child's parent is the fork server, so the lab learns
its exit status (and each SIGSTOP) from the server's reports over a socket (`ForkedProcess` has
the `Popen` methods the lab uses, plus `wait_stopped`); and interpreter options set by
environment variables (`PYTHON*`) are those the fork server started with, so a child whose
`PYTHON*` variables differ gets a fork server of its own.

The standard library's `multiprocessing.forkserver` does the same for `multiprocessing.Process`
objects, with that module's lifecycle (pickled targets, children joined or terminated at exit,
no stop reports, no session or stdio of their own); the lab needs a process that looks like
`python -m module`, so this is the small part of it the lab needs.

`SOPHOS_LAB_FORKSERVER=0` in the child's environment starts it with `subprocess.Popen` instead.
A lab's HTTP server (`lab.server()`) and its kernel children always start as fresh processes:
lessons 01 and 04 read the server's process as the one a user starts by hand.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import queue
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

READY_TIMEOUT = 120.0
MAX_MESSAGE = 1 << 20


def start_child(module: str, args: list[str], *, env: Mapping[str, str], cwd: Path, stderr: IO,
                fork: bool = True, stdout: IO | None = None, preload: tuple[str, ...] = ()) -> Any:
    """`python -m module *args` in a session of its own, with stdin and stdout as text pipes (or
    /dev/null and `stdout`): forked from the fork server (a `ForkedProcess`, the modules of
    `preload` imported there first), or a `subprocess.Popen` when `fork` is false or the child's
    environment says `SOPHOS_LAB_FORKSERVER=0`."""
    if not fork or not forking(env):
        piped = stdout is None
        return subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdin=subprocess.PIPE if piped else subprocess.DEVNULL, stdout=subprocess.PIPE if piped else stdout,
            stderr=stderr, env=dict(env), cwd=cwd, start_new_session=True, text=True, bufsize=1,
        )
    return _server_for(env).start(module, args, env=env, cwd=cwd, stderr=stderr, stdout=stdout, preload=preload)


def forking(env: Mapping[str, str]) -> bool:
    """Whether children with this environment are forked (`SOPHOS_LAB_FORKSERVER=0`: not)."""
    return env.get("SOPHOS_LAB_FORKSERVER", "1") != "0"


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



LAUNCHER = Path(__file__).with_name("launch_forked.py")


def launcher_command(module: str, args: list[str], env: Mapping[str, str] | None = None) -> list[str]:
    """A command that runs `python -m module *args` forked from this process's fork server (for
    children with `env`'s `PYTHON*` variables; started now if need be), for programs that start
    their own processes, such as an MCP client starting a stdio server from `mcp.json`.

    The command is a small launcher (`launch_forked.py`, the standard library only, no site):
    it hands its stdin, stdout and stderr to the forked child, passes on SIGTERM, SIGINT and
    SIGHUP, and exits as the child does, so to whoever started it it looks like the program."""
    if env is None:
        env = child_environment({})
    server = _server_for(env)
    return [sys.executable, "-S", str(LAUNCHER), server.socket_path, module, *args]


def wait_stopped(proc: Any, timeout: float | None = None) -> None:
    """Block until `proc` has stopped (SIGSTOP), once per stop; `ChildProcessError` if it ended
    (a `Popen` child is left unreaped then, so its `wait()` still gets its status)."""
    if isinstance(proc, ForkedProcess):
        proc.wait_stopped(timeout)
        return
    info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WSTOPPED | os.WNOWAIT)
    if info.si_code != os.CLD_STOPPED:
        raise ChildProcessError(f"process {proc.pid} ended (status {info.si_status}) instead of stopping")
    os.waitid(os.P_PID, proc.pid, os.WSTOPPED)  # take the stop, so the next one is seen


# --- the lab's side -------------------------------------------------------------------------


class ForkedProcess:
    """A child forked by the fork server, with the part of `subprocess.Popen` the lab uses."""

    def __init__(self, server: ForkServer, pid: int, status: _Status, args: list[str], stdin: IO | None,
                 stdout: IO | None) -> None:
        self._server = server
        self._status = status
        self.pid = pid
        self.args = args
        self.stdin = stdin
        self.stdout = stdout
        self.stderr = None

    @property
    def returncode(self) -> int | None:
        return self._status.returncode

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        status = self._status
        with self._server.changed:
            if not self._server.changed.wait_for(lambda: status.returncode is not None or self._server.gone, timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
        if status.returncode is None:
            raise ChildProcessError(f"the fork server of process {self.pid} died: its exit status is lost")
        return status.returncode

    def wait_stopped(self, timeout: float | None = None) -> None:
        status = self._status
        with self._server.changed:
            if not self._server.changed.wait_for(
                    lambda: status.stops > status.stops_seen or status.returncode is not None or self._server.gone,
                    timeout):
                raise TimeoutError(f"process {self.pid} did not stop within {timeout} s")
            if status.stops > status.stops_seen:
                status.stops_seen += 1
                return
        raise ChildProcessError(f"process {self.pid} ended (exit status {status.returncode}) instead of stopping")

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Status:
    def __init__(self) -> None:
        self.returncode: int | None = None
        self.stops = 0
        self.stops_seen = 0


class ForkServer:
    """One fork server process and the reports it sends: started pids, stops and exits."""

    def __init__(self, env: Mapping[str, str] | None, attach_to: str | None = None) -> None:
        """Start a fork server for children with `env`'s `PYTHON*` variables; or, with
        `attach_to`, use the running one that listens there (`share`), as a launcher does."""
        self.proc: subprocess.Popen | None = None
        self._folder: str | None = None
        if attach_to is not None:
            ours = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            ours.connect(attach_to)
            self.socket_path = attach_to
        else:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self._folder = tempfile.mkdtemp(prefix="sophos-fork-")
            self.socket_path = os.path.join(self._folder, "launch")
            """Where launchers connect (`launcher_command`); only this user can reach the folder."""
            self.proc = subprocess.Popen(
                [sys.executable, "-m", __name__, str(theirs.fileno()), self.socket_path],
                pass_fds=[theirs.fileno()], env=dict(env or {}), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C at the lab's terminal is not for it
            )
            theirs.close()
        self._sock = ours
        self._starting = threading.Lock()
        self._replies: queue.Queue[dict] = queue.Queue()
        self._statuses: dict[int, _Status] = {}
        self.changed = threading.Condition()
        self.gone = False
        threading.Thread(target=self._read, name="forkserver-reports", daemon=True).start()
        if self.proc is None:
            return  # a running server: it greets its own lab only
        ready = self._reply(READY_TIMEOUT)
        if "ready" not in ready:
            raise RuntimeError(f"the fork server did not start: {ready}")

    def start(self, module: str, args: list[str], *, env: Mapping[str, str], cwd: Path, stderr: IO,
              stdout: IO | None = None, preload: tuple[str, ...] = ()) -> ForkedProcess:
        """Fork `python -m module *args`; its stdin and stdout are pipes to this process, or
        /dev/null and `stdout` when one is given (a kernel, which talks over ZeroMQ). `preload`
        names modules the fork server imports first, once, for every later child too."""
        piped = stdout is None
        if piped:
            stdin_r, stdin_w = os.pipe()
            stdout_r, stdout_w = os.pipe()
        else:
            stdin_r, stdin_w = os.open(os.devnull, os.O_RDONLY), None
            stdout_r, stdout_w = None, os.dup(stdout.fileno())
        request = {"module": module, "args": args, "env": dict(env), "cwd": str(cwd), "preload": list(preload)}
        ends = [fd for fd in (stdin_w, stdout_r) if fd is not None]
        try:
            with self._starting:
                socket.send_fds(self._sock, [json.dumps(request).encode()], [stdin_r, stdout_w, stderr.fileno()])
                reply = self._reply(READY_TIMEOUT)
        except BaseException:
            for fd in ends:
                os.close(fd)
            raise
        finally:
            os.close(stdin_r)
            os.close(stdout_w)
        if "started" not in reply:
            for fd in ends:
                os.close(fd)
            raise RuntimeError(f"the fork server could not start {module}: {reply}")
        with self.changed:
            status = self._statuses[reply["started"]]
        return ForkedProcess(self, reply["started"], status, [sys.executable, "-m", module, *args],
                             stdin=open(stdin_w, "w", buffering=1) if piped else None,
                             stdout=open(stdout_r) if piped else None)

    def close(self) -> None:
        """Close the socket: the fork server exits, and its children live on until their stdin
        closes; an attached client's children go with it, as a launcher's child does."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the report reader; the server reads the end
        except OSError:
            pass
        self._sock.close()
        if self.proc is None:
            return
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self._folder, ignore_errors=True)

    def _reply(self, timeout: float) -> dict:
        try:
            return self._replies.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"the fork server did not answer within {timeout} s") from None

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                with self.changed:
                    self.gone = True
                    self.changed.notify_all()
                self._replies.put({"error": "the fork server exited"})
                return
            report = json.loads(data)
            if "pid" not in report:
                if "started" in report:  # before any report of that child: a pid the system
                    with self.changed:  # reuses gets a new status, not an old child's exit
                        self._statuses[report["started"]] = _Status()
                self._replies.put(report)
                continue
            with self.changed:
                status = self._statuses.get(report["pid"])
                if status is None:
                    continue
                if "exited" in report:
                    status.returncode = report["exited"]
                    _report(self._sock, reap=report["pid"])  # the status is read: the pid may go
                elif "stopped" in report:
                    status.stops += 1
                self.changed.notify_all()


_servers: dict[str, ForkServer] = {}
_servers_lock = threading.Lock()


SHARED = "SOPHOS_LAB_FORKSERVER_SHARED"
"""`share()`'s variable: where a fork server listens, and for which `PYTHON*` variables."""


def _key(env: Mapping[str, str]) -> list[list[str]]:
    return sorted([k, v] for k, v in env.items() if k.startswith("PYTHON"))


def _server_for(env: Mapping[str, str]) -> ForkServer:
    """The fork server for children with these `PYTHON*` variables (started on first use, or
    the one an ancestor shared for the same variables)."""
    key = _key(env)
    with _servers_lock:
        server = _servers.get(json.dumps(key))
        if server is None or server.gone:
            shared = json.loads(os.environ.get(SHARED) or "{}")
            if shared.get("key") == key and os.path.exists(shared.get("socket", "")):
                server = ForkServer(None, attach_to=shared["socket"])
            else:
                server = ForkServer(env)
            _servers[json.dumps(key)] = server
        return server


def share(env: Mapping[str, str]) -> None:
    """Let this process's descendants (a notebook kernel that starts a lab, say) fork their
    children from this process's fork server for `env`, instead of starting one of their own
    (a second of imports each): its address goes into this process's environment, which they
    inherit. Their children are still theirs: reported to them, and killed when they go."""
    server = _server_for(env)
    os.environ[SHARED] = json.dumps({"socket": server.socket_path, "key": _key(env)})


@atexit.register
def _close_servers() -> None:
    for server in list(_servers.values()):
        server.close()


# --- the fork server's side -----------------------------------------------------------------


def _report(sock: socket.socket, **report: Any) -> None:
    """One message, either way (the lab's `reap`, the server's reports); a closed peer is let be:
    a launcher that went away, or a lab whose server is going and reaps as it goes."""
    try:
        sock.send(json.dumps(report).encode())
    except OSError:
        pass


class _Children:
    """The fork server's children: who asked for each, and which have exited but are not yet
    reaped. An exited child stays a zombie until its asker has read its status and says so
    (`reap`), as a `subprocess.Popen` child stays one until `wait()`: until then its pid cannot
    be given to another process, so a signal the lab sends to it cannot reach a stranger."""

    def __init__(self) -> None:
        self.owners: dict[int, socket.socket | None] = {}
        self.exited: set[int] = set()

    def look(self) -> None:
        """Report each child's stop, and each exit once, to whoever asked for the child."""
        for pid, owner in list(self.owners.items()):
            if pid in self.exited:
                continue
            try:  # a zombie is no candidate for WSTOPPED alone: ECHILD
                stopped = os.waitid(os.P_PID, pid, os.WSTOPPED | os.WNOHANG)
            except ChildProcessError:
                stopped = None
            if stopped is not None and owner is not None:
                _report(owner, pid=pid, stopped=stopped.si_status)
            try:
                info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:  # not ours any more (cannot happen: we alone reap)
                self.owners.pop(pid, None)
                continue
            if info is None:
                continue
            self.exited.add(pid)
            if owner is None:
                self.reap(pid)
            else:
                code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
                _report(owner, pid=pid, exited=code)

    def reap(self, pid: int) -> None:
        if pid in self.exited:
            os.waitpid(pid, 0)
            self.exited.discard(pid)
            self.owners.pop(pid, None)

    def forget(self, owner: socket.socket) -> None:
        """A launcher went away (killed, say): its child goes too, as the program it stood for."""
        for pid, asker in list(self.owners.items()):
            if asker is owner:
                self.owners[pid] = None
                if pid in self.exited:
                    self.reap(pid)
                else:
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass


def _preload(module: str) -> None:
    """Import a package that a request names (`python -m package` runs its `__main__`) here,
    once, so that its children start with it imported; a plain module is left alone (importing
    it would run it)."""
    import importlib
    import importlib.util

    if module in sys.modules:
        return
    try:
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.submodule_search_locations is not None:
            importlib.import_module(module)
    except Exception:  # the child imports it again and fails where its log shows it
        pass


def serve(sock: socket.socket, listener: socket.socket) -> tuple[dict, list[int]] | None:
    """Fork one child per request until the lab closes the socket. Requests come from the lab
    (`sock`) and from launchers that connect to `listener` (`launcher_command`). Returns in each
    child only, with its request and file descriptors (the server returns None when told to exit)."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    launchers: set[socket.socket] = set()
    children = _Children()
    _report(sock, ready=os.getpid())
    while True:
        readable, _, _ = select.select([sock, listener, wake_r, *launchers], [], [])
        if wake_r in readable:
            while True:
                try:
                    if not os.read(wake_r, 512):
                        break
                except BlockingIOError:
                    break
        if listener in readable:
            try:
                launchers.add(listener.accept()[0])
            except OSError:
                pass
        for asker in [r for r in readable if r is sock or r in launchers]:
            try:
                message, fds, _, _ = socket.recv_fds(asker, MAX_MESSAGE, 3)
            except OSError:
                message, fds = b"", []
            if not message:
                if asker is sock:
                    return None
                launchers.discard(asker)
                children.forget(asker)
                asker.close()
                continue
            try:
                request = json.loads(message)
                if "reap" in request:
                    children.reap(int(request["reap"]))
                    continue
                if len(fds) != 3 or not isinstance(request.get("module"), str):
                    raise ValueError(f"a request needs a module and 3 file descriptors, got {len(fds)}")
                _preload(request["module"])
                for module in request.get("preload", []):
                    importlib.import_module(module)
            except Exception as error:  # a bad request is refused; the server goes on
                for fd in fds:
                    os.close(fd)
                _report(asker, error=f"{type(error).__name__}: {error}")
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (wake_r, wake_w):
                    os.close(fd)
                for open_socket in (sock, listener, *launchers):
                    open_socket.close()
                return request, fds
            for fd in fds:
                os.close(fd)
            children.owners[pid] = asker
            _report(asker, started=pid)
        children.look()  # after every wake-up: a child's SIGCHLD may have come while forking


def become(request: dict, fds: list[int]) -> None:
    """In the forked child: take the request's session, stdio, environment and directory."""
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    # New stdio objects on the new descriptors, as an interpreter makes them at start (the fork
    # server's were made for /dev/null, which can seek: a pipe cannot).
    encoding, errors = sys.stdout.encoding, sys.stdout.errors
    sys.stdin = sys.__stdin__ = open(0, "r", encoding=encoding, errors=errors, closefd=False, newline="\n")
    sys.stdout = sys.__stdout__ = open(1, "w", encoding=encoding, errors=errors, closefd=False, newline="\n")
    sys.stdout.reconfigure(line_buffering=os.isatty(1), write_through=bool(os.environ.get("PYTHONUNBUFFERED")))
    sys.stderr = sys.__stderr__ = open(2, "w", encoding=encoding, errors="backslashreplace",
                                       closefd=False, newline="\n")
    sys.stderr.reconfigure(line_buffering=os.isatty(2), write_through=True)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    if not sys.flags.safe_path:
        sys.path[0] = os.getcwd()  # as `python -m` sets it: the directory it was started in
    sys.argv = [sys.argv[0], *request["args"]]


def main() -> None:
    import runpy
    import warnings

    sock = socket.socket(fileno=int(sys.argv[1]))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(sys.argv[2])
    listener.listen(64)
    from .worker import load_runtime

    load_runtime()
    forked = serve(sock, listener)
    if forked is None:
        return
    become(*forked)
    # `python -m` of a module the fork server imported makes runpy warn that it runs a second
    # copy, which is what `python -m` does anyway (the fresh interpreter's copy is __main__ too).
    warnings.filterwarnings("ignore", message=r".* found in sys\.modules after import of package", category=RuntimeWarning)
    runpy.run_module(forked[0]["module"], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

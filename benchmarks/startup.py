"""Start-up and recovery latency of the agent's children (worker subprocess and Jupyter kernel),
each against bare LangGraph started the same way.

- start -> ready: from starting the child to its `ready` (worker) or to its setup cell done
  (kernel): the interpreter, the imports and the model and MCP clients, nothing opened yet.
- kill -> resume: a child is SIGKILLed while the model's answer streams (after the tool result
  was checkpointed, as in lesson 06d); then, as a lab does it, a new child starts, lists the
  conversations (its first open of the file relabels the dead run `interrupted`) and resumes.
  Timed from the SIGKILL to the resume's first event (`started`: recovery done, the run row
  written); and to the resume's first token, which adds the MCP servers' start and discovery
  (they start on a run's first model call) and the scripted model's first chunk (zero delay
  before its first token): no model time worth the name.

Each kit row has its anchor started the same way, doing the same work:

- fresh interpreter (`SOPHOS_LAB_FORKSERVER=0`): for start -> ready, a fresh interpreter that
  imports the same libraries (LangGraph, its SQLite saver, ChatOllama, the MCP adapters); for
  kill -> resume, bare LangGraph in a child of its own (`bare_agent.py`: the same graph shape,
  messages channel, saver, model client and MCP servers, nothing of the kit), killed at the same
  point of the same answer; a fresh interpreter then imports the same libraries, opens the saver,
  reads the thread's state and resumes (`graph.astream(None)`), timed to the resumed stream's
  first item (the agent task's start: nothing has run yet) and to its first token.
- forked (the lab's shortcut, its default: a child forked from the lab's fork server, which
  imported everything once): the standard library's way to do the same, `multiprocessing`'s
  fork server with `bare_agent` preloaded (`set_forkserver_preload`), each bare child forked
  from it (`bare_agent.forked`); the fork server's own start is not timed on either side.
- kernel, fresh (`SOPHOS_LAB_FORKSERVER=0`): a plain ipykernel started by jupyter_client (this
  interpreter's kernel spec, `LocalProvisioner`) whose first cell imports `bare_agent` (the same
  libraries); kill -> resume runs `await bare_agent.main(...)` in a cell of such a kernel.
- kernel, forked (the lab's shortcut): no stock Jupyter forks a kernel, so its anchor is the
  same fresh bare kernel, and the row says so.

Bare LangGraph has no run rows to recover or write and no events: what the kit adds is those,
its own modules in the child and the lab's commands to it (`conversations`, then `resume`).

Medians of ROUNDS rounds (each figure's spread is printed with it), one lab (scripted model, web
fixtures) for all of them; every kind of child takes its turn within each round.

    python benchmarks/startup.py [--quick]
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import bare_agent  # noqa: E402

from sophos_lab.lab.harness import Lab  # noqa: E402
from sophos_lab.runtime.tools import mcp_servers  # noqa: E402

BARE = (
    "started the same way as the kit's child, doing the same work: a fresh interpreter importing the same "
    "libraries (start -> ready), and bare LangGraph in a child of its own (benchmarks/bare_agent.py: the same graph "
    "shape, DeltaChannel, saver, model client and MCP servers) killed at the same point and resumed with "
    "graph.astream(None) in a fresh interpreter; for the lab's forked children, bare children forked from the "
    "standard library's multiprocessing fork server with the same libraries preloaded; for kernels, a plain "
    "ipykernel (jupyter_client) importing the same libraries and running bare_agent in a cell"
)
BARE_AGENT = HERE / "bare_agent.py"
ROUNDS = 3
SUMMARISE = "Fetch {url} and summarize it in 12 detailed bullet points."
BARE_IMPORTS = (
    "import langgraph.graph, langgraph.prebuilt, langgraph.checkpoint.sqlite.aio, "
    "langchain_ollama, langchain_mcp_adapters.tools, mcp.client.stdio"
)
KINDS = ("worker", "forked", "bare", "bare-forked", "kernel", "kernel-forked", "bare-kernel")


@contextmanager
def lab_in(folder: Path, name: str = "bench-startup", **setup: object):
    """A lab of the kit in `folder`, with the scripted model (whatever OLLAMA_HOST says);
    `setup` goes to `Lab.setup` (e.g. `postgres=True`)."""
    names = ("SOPHOS_LAB_HOME", "OLLAMA_HOST", "OLLAMA_MODEL", "JUPYTER_RUNTIME_DIR")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(SOPHOS_LAB_HOME=str(folder), JUPYTER_RUNTIME_DIR=str(folder / "jupyter-runtime"))
    os.environ.pop("OLLAMA_HOST", None)
    os.environ.pop("OLLAMA_MODEL", None)
    try:
        with Lab.setup(name, quiet=True, **setup) as lab:
            yield lab
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def bare_env(lab: Lab) -> dict[str, str]:
    """What `bare_agent` reads from its environment: the lab's model and MCP servers."""
    settings = lab.settings(MEMORY_FILE_PATH=str(lab.root / "bare-memory.jsonl"))
    servers = [
        {"name": s.name, "command": s.command, "args": list(s.args), "env": dict(s.env), "cwd": s.cwd}
        for s in mcp_servers(settings) if s.command
    ]
    return {"OLLAMA_HOST": lab.ollama_host, "OLLAMA_MODEL": lab.ollama_model,
            "BARE_SYSTEM_PROMPT": (lab.config_dir / "system.md").read_text(encoding="utf-8"),
            "BARE_SERVERS": json.dumps(servers)}


def bare_start() -> float:
    """Seconds until a plain interpreter has imported BARE_IMPORTS (its exit is not timed)."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", f"{BARE_IMPORTS}; print('ready', flush=True); input()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError(f"the bare interpreter failed (exit code {proc.wait()})")
    seconds = time.perf_counter() - start
    proc.communicate("\n")
    return seconds


class Lines:
    """A bare child's milestone lines as they come (`started`, `result`, `token`, `end N`)."""

    log: Path | None = None

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.changed = threading.Condition()

    def add(self, line: str) -> None:
        with self.changed:
            self.lines.append(line.strip())
            self.changed.notify_all()

    def mark(self) -> int:
        with self.changed:
            return len(self.lines)

    def wait_for(self, word: str, timeout: float = 60.0, since: int = 0) -> str:
        """The first line from `since` starting with `word` (waiting for it); a child that exits
        first fails."""
        def found() -> str | None:
            return next((line for line in self.lines[since:] if line.split(" ")[0] in (word, "exited")), None)

        with self.changed:
            self.changed.wait_for(lambda: found() is not None, timeout)
            line = found()
        if line is None or line == "exited":
            tail = self.log.read_text(errors="replace")[-2000:] if self.log and self.log.exists() else ""
            raise RuntimeError(f"the bare LangGraph child did not print {word!r}: {self.lines}\n{tail}")
        return line


class BareChild(Lines):
    """`bare_agent.py` in a fresh interpreter, a process group of its own."""

    def __init__(self, lab: Lab, *args: str, stdin: bool = False) -> None:
        super().__init__()
        self.log = lab.root / "logs" / "bare-agent.log"
        with open(self.log, "ab") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, str(BARE_AGENT), *args], stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=stderr, env={**os.environ, **bare_env(lab)}, cwd=lab.root,
                start_new_session=True, text=True, bufsize=1,
            )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.add(line)
        self.add("exited")

    def send(self, command: dict) -> None:
        """A command to a `serve` child."""
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)  # as the lab kills its children
        self.proc.wait()

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()


class BareForkServer:
    """The standard library's fork server with `bare_agent` (and so every library) preloaded."""

    def __init__(self) -> None:
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(["bare_agent"])
        # Python 3.11's fork server does not take the parent's sys.path before it preloads (a
        # module it cannot import is skipped without a word): give it this folder as PYTHONPATH.
        saved = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), saved]))
        try:
            self.ready()  # starts the fork server: not timed, as the lab's first forked worker
        finally:
            if saved is None:
                os.environ.pop("PYTHONPATH")
            else:
                os.environ["PYTHONPATH"] = saved

    def ready(self) -> float:
        """Seconds from asking for a child to its first word (everything is imported already)."""
        start = time.perf_counter()
        receive, send = self.context.Pipe(duplex=False)
        child = self.context.Process(target=bare_agent.forked_ready, args=(send,))
        child.start()
        send.close()
        if receive.recv() != "ready":
            raise RuntimeError("the forked bare child did not say ready")
        seconds = time.perf_counter() - start
        child.join()
        return seconds


class ForkedBareChild(Lines):
    """`bare_agent.main(...)` in a child of `BareForkServer`, its lines over a pipe."""

    def __init__(self, server: BareForkServer, lab: Lab, *args: str) -> None:
        super().__init__()
        receive, send = server.context.Pipe(duplex=False)
        self.proc = server.context.Process(target=bare_agent.forked, args=(send, bare_env(lab), str(lab.root), *args))
        self.proc.start()
        send.close()
        threading.Thread(target=self._read, args=(receive,), daemon=True).start()

    def _read(self, receive) -> None:
        try:
            while True:
                self.add(receive.recv())
        except (EOFError, OSError):
            self.add("exited")

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)  # its own session (bare_agent.forked): its servers too
        self.proc.join()

    def close(self) -> None:
        self.proc.join(timeout=30)


class BareKernel(Lines):
    """A plain ipykernel (jupyter_client's `LocalProvisioner`, a fresh interpreter) whose first
    cell imports `bare_agent`; `run` executes `await bare_agent.main(...)` in a cell, its lines
    read off IOPub. `ready` is the seconds from the start to that first cell done."""

    def __init__(self, lab: Lab) -> None:
        from jupyter_client import KernelManager
        from jupyter_client.kernelspec import KernelSpecManager

        super().__init__()
        spec = lab.root / "bare-kernels" / "bare-python"
        spec.mkdir(parents=True, exist_ok=True)
        (spec / "kernel.json").write_text(json.dumps({
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "bare LangGraph", "language": "python"}))
        start = time.perf_counter()
        self.km = KernelManager(kernel_name="bare-python", kernel_spec_manager=KernelSpecManager(
            kernel_dirs=[str(spec.parent)]))
        with open(lab.root / "logs" / "bare-kernel.log", "ab") as out:
            self.km.start_kernel(env={**os.environ, **bare_env(lab)}, cwd=str(lab.root), stdout=out, stderr=out,
                                 extra_arguments=["--HistoryManager.hist_file=:memory:"])
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)
        self.done: dict[str, dict] = {}
        threading.Thread(target=self._read, daemon=True).start()
        self.execute(f"import sys; sys.path.insert(0, {str(HERE)!r}); import bare_agent", wait=True)
        self.ready = time.perf_counter() - start

    def _read(self) -> None:
        partial = ""
        while True:
            try:
                message = self.kc.get_iopub_msg(timeout=0.2)
            except Exception:  # noqa: BLE001 - queue.Empty, or the channel closed
                if not self.km.is_alive():
                    self.add("exited")
                    return
                continue
            kind, content = message["msg_type"], message["content"]
            if kind == "stream" and content.get("name") == "stdout":
                partial += content["text"]
                *lines, partial = partial.split("\n")
                for line in lines:
                    self.add(line)
            elif kind == "error":
                self.add(f"error {content.get('ename')}: {content.get('evalue')}")
            elif kind == "status" and content.get("execution_state") == "idle":
                self.add(f"idle {message['parent_header'].get('msg_id')}")

    def execute(self, code: str, wait: bool = False) -> None:
        msg_id = self.kc.execute(code, store_history=False)
        if wait:
            self._wait_idle(msg_id)

    def _wait_idle(self, msg_id: str, timeout: float = 60.0) -> None:
        with self.changed:
            if not self.changed.wait_for(lambda: f"idle {msg_id}" in self.lines or "exited" in self.lines, timeout):
                raise RuntimeError(f"the bare kernel did not finish a cell: {self.lines}")
            errors = [line for line in self.lines if line.startswith("error ")]
        if errors:
            raise RuntimeError(f"the bare kernel raised {errors}")

    def run(self, *args: str) -> BareKernel:
        self.execute(f"await bare_agent.main(*{list(args)!r})")
        return self

    def kill(self) -> None:
        self.km.signal_kernel(signal.SIGKILL)  # its process group, as the lab kills its kernels
        self.km.provisioner.process.wait()
        self.kc.stop_channels()

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


def bare_kill_and_resume(lab: Lab, kind: str, server: BareForkServer | None = None) -> dict[str, list[float]]:
    """The kill -> resume with bare LangGraph started as `kind` says: seconds to ready, and from
    the SIGKILL to the resumed stream's first item, and to its first token."""
    db, thread = str(lab.root / f"bare-{uuid.uuid4().hex[:8]}.db"), str(uuid.uuid4())
    message = SUMMARISE.format(url=lab.page("wal.html"))
    if kind == "bare":
        ready = bare_start()
        spawn = lambda *args: BareChild(lab, *args)  # noqa: E731
    elif kind == "bare-forked":
        ready = server.ready()
        spawn = lambda *args: ForkedBareChild(server, lab, *args)  # noqa: E731
    else:
        spawn = lambda *args: BareKernel(lab).run(*args)  # noqa: E731
    lab.model.arm("summary")
    child = spawn("chat", db, thread, message)
    if kind == "bare-kernel":
        ready = child.ready
    child.wait_for("result")
    lab.model.wait_paused()
    killed = time.perf_counter()
    child.kill()
    fresh = spawn("resume", db, thread)
    fresh.wait_for("started")
    started = time.perf_counter()
    fresh.wait_for("token")
    first_token = time.perf_counter()
    final = fresh.wait_for("end")
    fresh.close()
    lab.model.release()  # the stream the killed child was reading
    if final != "end 4":  # the user's message, the tool call, its result, the answer
        raise RuntimeError(f"the bare resume did not complete: {fresh.lines}")
    return {"ready": [ready], "started": [started - killed], "token": [first_token - killed]}


def start_child(lab: Lab, kind: str):
    """The kit's child and the seconds it took to be ready: a worker or a kernel, in a fresh
    interpreter or forked from the lab's fork server (see sophos_lab/lab/forkserver.py)."""
    fresh = {"SOPHOS_LAB_FORKSERVER": "0"}
    start = time.perf_counter()
    if kind == "worker":
        child = lab.worker(**fresh)
    elif kind == "forked":
        child = lab.worker()
    elif kind == "kernel":
        child = lab.kernel(**fresh)
    else:
        child = lab.kernel()
    return child, time.perf_counter() - start


def kill_and_resume(lab: Lab, kind: str) -> dict[str, list[float]]:
    """Seconds to ready of the kit's child; from SIGKILL to the resume's `started` in a new
    child, and to its first token."""
    child, ready = start_child(lab, kind)
    lab.model.arm("summary")
    child.chat(SUMMARISE.format(url=lab.page("wal.html")))
    conversation = child.conversation()
    child.wait_for("trace", event="result")
    lab.model.wait_paused()
    killed = time.perf_counter()
    child.kill()
    fresh, _ = start_child(lab, kind)
    fresh.conversations()  # the first open: the dead run becomes `interrupted`
    fresh.resume(conversation)
    fresh.wait_for("started")
    started = time.perf_counter()
    fresh.wait_for("token")
    first_token = time.perf_counter()
    final = fresh.wait_final()
    fresh.close()
    lab.model.release()  # the stream the killed child was reading
    if final["event"] != "end":
        raise RuntimeError(f"the resume did not complete: {final}")
    return {"ready": [ready], "started": [started - killed], "token": [first_token - killed]}


MEASURED = [
    # (measure, kit kind, bare kind)
    ("worker child, fresh interpreter: start -> ready", "worker", "bare"),
    ("worker child, forked from the lab's fork server (the lab's shortcut): start -> ready", "forked", "bare-forked"),
    ("kernel child, fresh interpreter: start -> ready (setup cell done)", "kernel", "bare-kernel"),
    ("kernel child, forked (the lab's shortcut; bare: a fresh kernel, stock Jupyter forks none): start -> ready",
     "kernel-forked", "bare-kernel"),
]
RESUMES = [
    ("worker, fresh interpreter", "worker", "bare"),
    ("worker, forked (the lab's shortcut)", "forked", "bare-forked"),
    ("kernel, fresh interpreter", "kernel", "bare-kernel"),
    ("kernel, forked (the lab's shortcut; bare: a fresh kernel)", "kernel-forked", "bare-kernel"),
]


def rows(quick: bool = False) -> list[dict]:
    rounds = 1 if quick else ROUNDS
    figures: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp, lab_in(Path(tmp)) as lab:
        lab.worker().close()  # the fork server starts with a lab's first forked worker: not timed
        lab.kernel().close()  # and the kernels' preload with its first forked kernel
        server = BareForkServer()
        for _ in range(rounds):  # interleaved, so drift on the machine hits every figure alike
            for kind in KINDS:
                if kind.startswith("bare"):
                    found = bare_kill_and_resume(lab, kind, server)
                else:
                    found = kill_and_resume(lab, kind)
                for name, values in found.items():
                    figures.setdefault(f"{kind} {name}", []).extend(values)

    out = [{"benchmark": "startup", "measure": measure, "kit_runs": figures[f"{kit} ready"],
            "bare_runs": figures[f"{bare} ready"], "unit": "s"} for measure, kit, bare in MEASURED]
    for label, kit, bare in RESUMES:
        out.append({"benchmark": "startup", "unit": "s",
                    "measure": f"{label}: SIGKILL -> new child -> recovery -> resume's first event "
                               "(bare: the resumed stream's first item)",
                    "kit_runs": figures[f"{kit} started"], "bare_runs": figures[f"{bare} started"]})
        out.append({"benchmark": "startup", "unit": "s",
                    "measure": f"{label}: SIGKILL -> ... -> resume's first token (MCP start included)",
                    "kit_runs": figures[f"{kit} token"], "bare_runs": figures[f"{bare} token"]})
    return out


if __name__ == "__main__":
    from bench import format_table, machine

    print(f"Machine: {machine()}")
    print(f"bare: {BARE}")
    print(format_table(rows(quick="--quick" in sys.argv)))

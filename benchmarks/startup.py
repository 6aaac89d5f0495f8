"""Start-up and recovery latency of the agent's children (worker subprocess and Jupyter kernel).

- start-up: from starting the child to its `ready` (worker) or to its setup cell done (kernel):
  the interpreter, the runtime's imports and the model and MCP clients, nothing opened yet. A
  worker is timed both ways a lab can start one: in a fresh interpreter (`SOPHOS_LAB_FORKSERVER=0`)
  and forked from the lab's fork server, which imported all that once (the lab's default; the
  fork server's own start, with a lab's first forked worker, is not timed).
  Bare: a fresh interpreter that imports the same libraries (LangGraph, its SQLite saver,
  ChatOllama, the MCP adapters), to the line it prints then.
- kill -> resume: a child is SIGKILLed while the model's answer streams (after the tool result
  was checkpointed, as in lesson 06d); then, as a lab does it, a new child starts, lists the
  conversations (its first open of the file relabels the dead run `interrupted`) and resumes.
  Timed from the SIGKILL to the resume's first event (`started`: recovery done, the run row
  written); and to the resume's first token, which adds the MCP servers' start and discovery
  (they start on a run's first model call) and the scripted model's first chunk (zero delay
  before its first token): no model time worth the name.
  Bare, beside the worker's rows: bare LangGraph in a child of its own (`bare_agent.py`: the
  same graph shape, saver, model client and MCP servers, nothing of the kit), killed at the same
  point of the same answer; then a fresh interpreter imports the same libraries, opens the
  saver, reads the thread's state and resumes (`graph.astream(None)`). Timed from the SIGKILL to
  the resumed stream's first item (the agent task's start: nothing has run yet) and to its first
  token (which adds the MCP servers' start and discovery, as for the kit). Bare LangGraph has no
  run rows to recover or write and no events: what the kit adds is those, its own modules in the
  child and the lab's commands to it (`conversations`, then `resume`).

Medians of ROUNDS rounds (each figure's spread is printed with it), one lab (scripted model, web
fixtures) for all of them; worker, bare and kernel take turns within each round.

    python benchmarks/startup.py [--quick]
"""

from __future__ import annotations

import json
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sophos_lab.lab.harness import Lab  # noqa: E402
from sophos_lab.runtime.tools import mcp_servers  # noqa: E402

BARE = (
    "a fresh interpreter importing the same libraries (LangGraph, its SQLite saver, ChatOllama, the MCP "
    "adapters) for start -> ready; for the worker's kill -> resume, bare LangGraph in a child of its own "
    "(benchmarks/bare_agent.py: the same graph shape, saver, model client and MCP servers), killed at the same "
    "point and resumed with graph.astream(None) in a fresh interpreter"
)
BARE_AGENT = Path(__file__).resolve().parent / "bare_agent.py"
ROUNDS = 7
SUMMARISE = "Fetch {url} and summarize it in 12 detailed bullet points."
BARE_IMPORTS = (
    "import langgraph.graph, langgraph.prebuilt, langgraph.checkpoint.sqlite.aio, "
    "langchain_ollama, langchain_mcp_adapters.tools, mcp.client.stdio"
)


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


class BareChild:
    """`bare_agent.py` in a process group of its own, its stdout lines read as they come."""

    def __init__(self, lab: Lab, *args: str) -> None:
        settings = lab.settings(MEMORY_FILE_PATH=str(lab.root / "bare-memory.jsonl"))
        servers = [
            {"name": s.name, "command": s.command, "args": list(s.args), "env": dict(s.env), "cwd": s.cwd}
            for s in mcp_servers(settings) if s.command
        ]
        env = {**os.environ, "OLLAMA_HOST": lab.ollama_host, "OLLAMA_MODEL": lab.ollama_model,
               "BARE_SYSTEM_PROMPT": (lab.config_dir / "system.md").read_text(encoding="utf-8"),
               "BARE_SERVERS": json.dumps(servers)}
        self.lines: list[str] = []
        self.changed = threading.Condition()
        with open(lab.root / "logs" / "bare-agent.log", "ab") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, str(BARE_AGENT), *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=stderr, env=env, cwd=lab.root, start_new_session=True, text=True, bufsize=1,
            )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self.changed:
                self.lines.append(line.strip())
                self.changed.notify_all()
        with self.changed:
            self.lines.append("exited")
            self.changed.notify_all()

    def wait_for(self, word: str, timeout: float = 60.0) -> str:
        """The first line starting with `word` (waiting for it); a child that exits first fails."""
        with self.changed:
            found = self.changed.wait_for(
                lambda: any(line.split(" ")[0] in (word, "exited") for line in self.lines), timeout)
            line = next((line for line in self.lines if line.split(" ")[0] in (word, "exited")), None)
        if not found or line == "exited":
            raise RuntimeError(f"the bare LangGraph child did not print {word!r}: {self.lines}")
        return line

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)  # as the lab kills its children
        self.proc.wait()


def bare_kill_and_resume(lab: Lab) -> dict[str, list[float]]:
    """The same kill -> resume with bare LangGraph: seconds from the SIGKILL to the resumed
    stream's first item, and to its first token."""
    db, thread = str(lab.root / "bare.db"), str(uuid.uuid4())
    lab.model.arm("summary")
    child = BareChild(lab, "chat", db, thread, SUMMARISE.format(url=lab.page("wal.html")))
    child.wait_for("result")
    lab.model.wait_paused()
    killed = time.perf_counter()
    child.kill()
    fresh = BareChild(lab, "resume", db, thread)
    fresh.wait_for("started")
    started = time.perf_counter()
    fresh.wait_for("token")
    first_token = time.perf_counter()
    final = fresh.wait_for("end")
    fresh.proc.wait(timeout=30)
    lab.model.release()  # the stream the killed child was reading
    if final != "end 4":  # the user's message, the tool call, its result, the answer
        raise RuntimeError(f"the bare resume did not complete: {fresh.lines}")
    return {"started": [started - killed], "token": [first_token - killed]}


def start_child(lab: Lab, kind: str):
    """The child and the seconds it took to be ready: a worker in a fresh interpreter, a worker
    forked from the lab's fork server (the default, see sophos_lab/lab/forkserver.py), a kernel."""
    start = time.perf_counter()
    if kind == "worker":
        child = lab.worker(SOPHOS_LAB_FORKSERVER="0")
    elif kind == "forked":
        child = lab.worker()
    else:
        child = lab.kernel()
    return child, time.perf_counter() - start


def kill_and_resume(lab: Lab, kind: str) -> dict[str, list[float]]:
    """Seconds to ready of a child; from SIGKILL to the resume's `started` in a new child, and
    to its first token. For the worker, the bare interpreter's seconds, sampled just before the
    child starts (so both meet the same leftovers of the previous round: servers exiting)."""
    bare = [bare_start()] if kind == "worker" else []
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
    return {"bare": bare, "ready": [ready], "started": [started - killed], "token": [first_token - killed]}


def rows(quick: bool = False) -> list[dict]:
    rounds = 1 if quick else ROUNDS
    figures: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp, lab_in(Path(tmp)) as lab:
        lab.worker().close()  # the fork server starts with a lab's first forked worker: not timed
        for _ in range(rounds):  # interleaved, so drift on the machine hits every figure alike
            for kind in ("worker", "forked", "bare", "kernel"):
                found = bare_kill_and_resume(lab) if kind == "bare" else kill_and_resume(lab, kind)
                for name, values in found.items():
                    figures.setdefault(f"{kind} {name}", []).extend(values)

    measured = [
        ("worker child, fresh interpreter: start -> ready", "worker ready", "worker bare"),
        ("worker child, forked (the lab's default): start -> ready", "forked ready", "worker bare"),
        ("kernel child: start -> ready (setup cell done)", "kernel ready", None),
        ("worker: SIGKILL -> new child -> recovery -> resume's first event (bare: first item of the resumed stream)",
         "worker started", "bare started"),
        ("worker: SIGKILL -> ... -> resume's first token (MCP start included)", "worker token", "bare token"),
        ("forked worker: SIGKILL -> new child -> recovery -> resume's first event", "forked started", "bare started"),
        ("forked worker: SIGKILL -> ... -> resume's first token (MCP start included)", "forked token", "bare token"),
        ("kernel: SIGKILL -> new child -> recovery -> resume's first event", "kernel started", None),
        ("kernel: SIGKILL -> ... -> resume's first token (MCP start included)", "kernel token", None),
    ]
    return [
        {"benchmark": "startup", "measure": measure, "kit_runs": figures[kit],
         "bare_runs": figures[bare] if bare else [], "unit": "s"}
        for measure, kit, bare in measured
    ]


if __name__ == "__main__":
    from bench import format_table, machine

    print(f"Machine: {machine()}")
    print(f"bare: {BARE}")
    print(format_table(rows(quick="--quick" in sys.argv)))

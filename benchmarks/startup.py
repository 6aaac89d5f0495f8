"""Start-up and recovery latency of the agent's children (worker subprocess and Jupyter kernel).

- start-up: from starting the child to its `ready` (worker) or to its setup cell done (kernel):
  the interpreter, the runtime's imports and the model and MCP clients, nothing opened yet.
  Bare: a fresh interpreter that imports the same libraries (LangGraph, its SQLite saver,
  ChatOllama, the MCP adapters), to the line it prints then.
- kill -> resume: a child is SIGKILLed while the model's answer streams (after the tool result
  was checkpointed, as in lesson 04); then, as a lab does it, a new child starts, lists the
  conversations (its first open of the file relabels the dead run `interrupted`) and resumes.
  Timed from the SIGKILL to the resume's first event (`started`: recovery done, the run row
  written); and to the resume's first token, which adds the MCP servers' start and discovery
  (they start on a run's first model call) and the scripted model's first chunk (zero delay
  before its first token): no model time worth the name.

Medians of ROUNDS rounds, one lab (scripted model, web fixtures) for all of them.

    python benchmarks/startup.py [--quick]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sophos_lab.lab.harness import Lab  # noqa: E402

BARE = "a fresh interpreter importing the same libraries (LangGraph, its SQLite saver, ChatOllama, the MCP adapters)"
ROUNDS = 7
SUMMARISE = "Fetch {url} and summarize it in 12 detailed bullet points."
BARE_IMPORTS = (
    "import langgraph.graph, langgraph.prebuilt, langgraph.checkpoint.sqlite.aio, "
    "langchain_ollama, langchain_mcp_adapters.tools, mcp.client.stdio"
)


@contextmanager
def lab_in(folder: Path):
    """A lab of the kit in `folder`, with the scripted model (whatever OLLAMA_HOST says)."""
    names = ("SOPHOS_LAB_HOME", "OLLAMA_HOST", "OLLAMA_MODEL", "JUPYTER_RUNTIME_DIR")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(SOPHOS_LAB_HOME=str(folder), JUPYTER_RUNTIME_DIR=str(folder / "jupyter-runtime"))
    os.environ.pop("OLLAMA_HOST", None)
    os.environ.pop("OLLAMA_MODEL", None)
    try:
        with Lab.setup("bench-startup", quiet=True) as lab:
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


def start_child(lab: Lab, kind: str):
    """The child and the seconds it took to be ready."""
    start = time.perf_counter()
    child = lab.worker() if kind == "worker" else lab.kernel()
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
        for _ in range(rounds):  # interleaved, so drift on the machine hits every figure alike
            for kind in ("worker", "kernel"):
                for name, values in kill_and_resume(lab, kind).items():
                    figures.setdefault(f"{kind} {name}", []).extend(values)

    median = {name: statistics.median(values) for name, values in figures.items() if values}
    measured = [
        ("worker child: start -> ready", median["worker ready"], median["worker bare"]),
        ("kernel child: start -> ready (setup cell done)", median["kernel ready"], None),
        ("worker: SIGKILL -> new child -> recovery -> resume's first event", median["worker started"], None),
        ("worker: SIGKILL -> ... -> resume's first token (MCP start included)", median["worker token"], None),
        ("kernel: SIGKILL -> new child -> recovery -> resume's first event", median["kernel started"], None),
        ("kernel: SIGKILL -> ... -> resume's first token (MCP start included)", median["kernel token"], None),
    ]
    return [
        {"benchmark": "startup", "measure": measure, "kit": kit, "bare": bare, "unit": "s"}
        for measure, kit, bare in measured
    ]


if __name__ == "__main__":
    from bench import format_table

    print(f"bare: {BARE}")
    print(format_table(rows(quick="--quick" in sys.argv)))

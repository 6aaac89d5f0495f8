"""Lessons 03a and 03b · Durability boundaries: what the two lessons use besides themselves.

`PromptRelay` stands between the children and the model and keeps the system prompt of every
request (03a); `start_child` starts an agent process; `db_files`, `stored_in` and `tables` read the
lab's folder and database as `ls` and `sqlite3` would; `stop_cleanly` is the graceful stop with an
answer in flight (03a); `mcp_servers`, `still_running`, `tokens` and `wait_frozen` watch a child
around a kill (03b); `grep` prints lines of the runtime's source; `ITEMS` and `worksheet` are the
twelve pieces of state the two lessons sort; `test_files_to_back_up` is 03b's exercise check.
Read any of them with `??`, e.g. `lesson.PromptRelay??`.
"""

from __future__ import annotations

import http.client
import inspect
import json
import shutil
import sqlite3
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import closing
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import pandas as pd
import psutil

from .. import inspect as views

if TYPE_CHECKING:
    from ..children import LabKernel, LabWorker
    from ..harness import Lab

# --- the relay: what each model request carried -------------------------------------------


class PromptRelay(ThreadingHTTPServer):
    """Between the children and the model: passes every request and every answer on as they are,
    line by line (a streamed answer stays a stream), and keeps the system message of each
    `/api/chat` request in `prompts`, oldest first (None for a request without one).

    The model's own request log keeps counts (how many messages, which tools), not texts: this
    is how the lesson reads the prompt each request carried. `url` is the address to give a
    child as its `OLLAMA_HOST`; `shutdown()` stops it."""

    daemon_threads = True

    def __init__(self, upstream: str) -> None:
        super().__init__(("127.0.0.1", 0), _RelayHandler)
        self.upstream = urlsplit(upstream)
        self.prompts: list[str | None] = []
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()


class _RelayHandler(BaseHTTPRequestHandler):
    server: PromptRelay

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.relay(None)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if urlsplit(self.path).path == "/api/chat":
            messages = json.loads(body).get("messages") or []
            self.server.prompts.append(next((m.get("content") for m in messages if m.get("role") == "system"), None))
        self.relay(body)

    def relay(self, body: bytes | None) -> None:
        upstream = self.server.upstream
        connection = http.client.HTTPConnection(upstream.hostname, upstream.port, timeout=120)
        try:
            connection.request(self.command, self.path, body=body, headers={"Content-Type": "application/json"})
            answer = connection.getresponse()
            self.send_response(answer.status)
            self.send_header("Content-Type", answer.getheader("Content-Type", "application/json"))
            self.end_headers()   # HTTP/1.0: the answer ends when the connection closes
            for line in iter(answer.readline, b""):   # line by line: a streamed answer stays a stream
                self.wfile.write(line)
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass   # the child hung up, or was killed
        finally:
            connection.close()


# --- children ----------------------------------------------------------------------------


def start_child(lab: Lab, kind: str, relay: PromptRelay | None = None, **env: str) -> LabKernel | LabWorker:
    """A fresh agent process (a "restart"): a Jupyter kernel of its own when `kind` is "kernel",
    else a plain subprocess; talking to the model through `relay` when one is given. `env`
    overrides the lab's settings."""
    if relay is not None:
        env = {"OLLAMA_HOST": relay.url, **env}
    return lab.kernel(**env) if kind == "kernel" else lab.worker(**env)


def stop_cleanly(lab: Lab, child: LabKernel | LabWorker) -> int:
    """The original's Ctrl+C while an answer is held by the model's pause: SIGTERM to the child
    (`child.shutdown()`, which blocks until it has exited, so in a thread of its own); once the
    child has acknowledged the signal (its `shutdown-requested` event), the model is released and
    may finish. The child's exit code."""
    stopped: dict[str, int] = {}
    stopping = threading.Thread(target=lambda: stopped.update(exit_code=child.shutdown()))
    stopping.start()
    print("the child:", child.wait_for("shutdown-requested")["data"])
    lab.model.release()
    stopping.join()
    return stopped["exit_code"]


def mcp_servers(child: LabKernel | LabWorker) -> list[psutil.Process]:
    """The MCP server processes (fetch, memory) the child started."""
    servers = []
    for proc in psutil.Process(child.pid).children(recursive=True):
        try:
            command = " ".join(proc.cmdline())
        except psutil.NoSuchProcess:
            continue
        if "mcp_server_fetch" in command or "server-memory" in command:
            servers.append(proc)
    return servers


def still_running(processes: list[psutil.Process], timeout: float = 15.0) -> list[psutil.Process]:
    """Those of `processes` still running after waiting up to `timeout` seconds for them to exit
    (`psutil.wait_procs`: a wait with a deadline)."""
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    return alive


def tokens(child: LabKernel | LabWorker) -> str:
    """The answer text the child's latest run streamed."""
    return "".join(event["data"] for event in child.events() if event["event"] == "token")


def wait_frozen(child: LabKernel | LabWorker, timeout: float = 60.0) -> None:
    """Block until the child has stopped itself (SIGSTOP), as `SOPHOS_LAB_STOP_AFTER_WRITE` makes
    it do: a barrier with a deadline. (A worker's fork server reports the stop; a kernel's state
    is read from the process table.)"""
    from ..children import LabWorker

    if isinstance(child, LabWorker):
        child.wait_stopped(timeout)
        return
    process, deadline = psutil.Process(child.pid), time.monotonic() + timeout
    while process.status() != psutil.STATUS_STOPPED:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the child did not stop itself within {timeout} s")
        time.sleep(0.02)


# --- the lab's folder and its database, read as `ls` and `sqlite3` would -----------------


def db_files(lab: Lab) -> list[str]:
    """The database's files in the lab's folder (what `ls sophos.db*` shows)."""
    return sorted(path.name for path in lab.root.glob("sophos.db*"))


def _read_only(lab: Lab) -> sqlite3.Connection:
    return sqlite3.connect(f"{lab.db_path.absolute().as_uri()}?mode=ro", uri=True)


def stored_in(lab: Lab, text: str, conversation: str | None = None) -> list[str]:
    """The `table.column`s of the lab's database in which `text` is stored, byte for byte
    (read-only); only in the rows of `conversation` (rows holding its id) when it is given."""
    needle, found = text.encode(), set()
    with closing(_read_only(lab)) as conn:
        names = [name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        for table in names:
            cursor = conn.execute(f'SELECT * FROM "{table}"')
            columns = [d[0] for d in cursor.description]
            for row in cursor:
                if conversation is not None and conversation not in row:
                    continue
                for column, value in zip(columns, row):
                    data = value.encode() if isinstance(value, str) else value
                    if isinstance(data, bytes) and needle in data:
                        found.add(f"{table}.{column}")
    return sorted(found)


def tables(lab: Lab) -> tuple[list[str], list[str]]:
    """The tables of the lab's database, by name, and the columns of `checkpoints` (read-only)."""
    with closing(_read_only(lab)) as conn:
        names = [name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
        columns = [row[1] for row in conn.execute("PRAGMA table_info(checkpoints)")]
    return names, columns


def grep(module: ModuleType, word: str, before: int = 0, after: int = 0) -> None:
    """Print the lines of `module`'s source that contain `word`, numbered, with `before` and
    `after` lines around each (what `grep -n -B before -A after` prints)."""
    lines = inspect.getsource(module).splitlines()
    name = module.__name__.replace(".", "/") + ".py"
    for index, line in enumerate(lines):
        if word in line:
            for number in range(max(index - before, 0), min(index + after + 1, len(lines))):
                print(f"{name}:{number + 1}: {lines[number]}")
            print("--")


# --- the worksheet -------------------------------------------------------------------------


@dataclass(frozen=True)
class Item:
    """One piece of an agent's state on the worksheet: its name, what it is, where it lives, the
    rule's verdict ("durable" for a fact, "ephemeral" for machinery), and the lesson that
    observes it (03a reads the file alone; 03b kills the process)."""

    name: str
    what: str
    lives: str
    rule: str
    lesson: str


ITEMS = [
    Item("assistant message", "a reply of the model: text, or a request to call tools",
         "SQLite: the thread (checkpoints and their writes)", "durable", "03a"),
    Item("tool result", "what a tool returned, e.g. the text of a fetched page",
         "SQLite: the thread, the whole page", "durable", "03a"),
    Item("pending write of a failed task", "what a task wrote before its step could be checkpointed",
         "SQLite: writes (the __error__ channel)", "durable", "03a"),
    Item("compiled graph", "the agent's LangGraph graph, compiled from the kit's code",
         "the process's memory, compiled at first use", "ephemeral", "03a"),
    Item("the system prompt as sent to the model", "the instructions in front of a request's messages",
         "built per call from config/system.md; not stored", "ephemeral", "03a"),
    Item("checkpoint", "LangGraph's snapshot of the thread, written after each step",
         "SQLite: checkpoints", "durable", "03b"),
    Item("run status", "a run's running, completed, failed or interrupted",
         "SQLite: runs (a claim, relabelled when stale)", "durable", "03b"),
    Item("SSE connection", "a client's open stream of a run's events",
         "the process: a socket (here: the child's stdout)", "ephemeral", "03b"),
    Item("SSE buffer", "the events of a run kept for a client that reconnects",
         "the process's memory (the run's event buffer)", "ephemeral", "03b"),
    Item("stdio pipe", "the pipes between the agent's process and an MCP server it started",
         "the OS, between two processes; gone with either", "ephemeral", "03b"),
    Item('the "one active run" flag', "what makes the runtime refuse a second message while a run is in progress",
         "the process's memory (backed by the `running` row)", "ephemeral", "03b"),
    Item("long-term memory entity", "a fact the memory tool keeps: an entity of its knowledge graph",
         "memory.jsonl, owned by the memory MCP server", "durable", "03b"),
]
"""The twelve pieces of state the two lessons sort, 03a's five first."""

RULE = {item.name: item.rule for item in ITEMS}
"""Each item's verdict by the rule: facts are durable, machinery is ephemeral."""


def verdict(survived: bool) -> str:
    """"durable" when the item was still there without its process, else "ephemeral"."""
    return "durable" if survived else "ephemeral"


def against_the_rule(observed: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """The observed verdicts that differ from the rule's: item -> (observed, rule). Empty when the
    lab agrees with the rule on every item it observed."""
    return {item: (seen, RULE[item]) for item, seen in observed.items() if seen != RULE[item]}


def worksheet(guesses: Mapping[str, Any], observed: Mapping[str, str],
              earlier: Iterable[str] = ()) -> pd.DataFrame:
    """The worksheet as a table: for each item guessed (`guesses`: item -> your prediction), your
    guess, what the lab observed (an item this model let the lab see nothing of: the rule's
    verdict, marked so) and where it lives; then the items of `earlier` lessons (e.g. "03a"),
    with the rule's verdict, for the whole picture."""
    rows = []
    for item in ITEMS:
        if item.name in guesses:
            seen = observed.get(item.name) or f"{item.rule} (not observed with this model: the rule's)"
            rows.append({"item": item.name, "your guess": guesses[item.name] or "-", "observed": seen,
                         "where it lives": item.lives})
    for item in ITEMS:
        if item.name not in guesses and item.lesson in earlier:
            rows.append({"item": item.name, "your guess": f"(lesson {item.lesson})",
                         "observed": f"{item.rule} (lesson {item.lesson})", "where it lives": item.lives})
    return pd.DataFrame(rows)


# --- 03b's exercise: what a backup must copy -----------------------------------------------


def restored(root: Path) -> tuple[dict[str, list[tuple[str, str]]], dict[str, Any]]:
    """What a lab's folder, or a copy of some of its files, brings back (read-only): each
    conversation's messages as (role, text), a pending one included; the memory's entities
    (name -> observations)."""
    db = root / "sophos.db"
    threads = {}
    for conversation in views.conversations(db)["id"]:
        messages, _ = views.thread_view(db, conversation)
        threads[conversation] = [(m["role"], m["content"]) for m in messages]
    memory = root / "memory.jsonl"
    lines = memory.read_text(encoding="utf-8").splitlines() if memory.exists() else []
    items = [json.loads(line) for line in lines if line.strip()]
    return threads, {item["name"]: item.get("observations") for item in items if item.get("type") == "entity"}


def back_up(lab_root: Path, files: Iterable[Path | str], folder: Path) -> None:
    """Copy `files` (of the lab's folder `lab_root`) into `folder`, each to the same place under
    it; a file that is not there is skipped."""
    for name in files:
        path = Path(name) if Path(name).is_absolute() else lab_root / name
        assert path.resolve().is_relative_to(lab_root.resolve()), \
            f"{name} is not in the lab's folder: this backup copies the lab's files"
        target = folder / path.resolve().relative_to(lab_root.resolve())
        target.parent.mkdir(parents=True, exist_ok=True)
        if path.is_dir():
            shutil.copytree(path, target, dirs_exist_ok=True)
        elif path.exists():
            shutil.copy2(path, target)


def test_files_to_back_up(files_to_back_up: Callable[[Path], Iterable[Path | str]], lab: Lab,
                          names: Mapping[str, str]) -> None:
    """The exercise's check: copy exactly the files `files_to_back_up(lab.root)` lists into a fresh
    folder (while the agent process is up), read the copy read-only with the kit's views, and
    compare it with the lab: the conversations, each one's messages (an accepted message still
    pending counts), and the memory server's entities. `names` are the lesson's names for its
    conversations (id -> "c1", ...), for the message that says what the copy is missing."""
    chosen = files_to_back_up(lab.root)
    with tempfile.TemporaryDirectory() as fresh:
        back_up(lab.root, chosen, Path(fresh))   # while the agent process is up, its database open
        lab_threads, lab_memory = restored(lab.root)
        copy_threads, copy_memory = restored(Path(fresh))
    order = list(names)
    in_order = sorted(lab_threads, key=lambda c: order.index(c) if c in names else len(order))
    gone = [names.get(c, c) for c in in_order if c not in copy_threads]
    missing = []
    if gone:
        missing.append(f"all {len(lab_threads)} of the lab's conversations" if len(gone) == len(lab_threads)
                       else f"{', '.join(gone)} ({len(gone)} of the lab's {len(lab_threads)} conversations)")
    for c in in_order:
        kept, whole = copy_threads.get(c), lab_threads[c]
        if kept is not None and kept != whole:
            missing.append(f"{len(whole) - len(kept)} of {names.get(c, c)}'s {len(whole)} messages"
                           if whole[:len(kept)] == kept else f"{names.get(c, c)}'s messages as the lab has them")
    sentences = []
    if missing:
        sentences.append("The copy is missing " + ", and ".join(missing) + ".")
        if len(gone) < len(lab_threads):
            sentences.append("That is what the agent process committed last: where does a WAL database keep its "
                             "latest commits until SQLite copies them into sophos.db?")
    if copy_memory != lab_memory:
        lost = [name for name in lab_memory if name not in copy_memory]
        what = (f"the long-term memory ({'the entity' if len(lost) == 1 else 'the entities'} {', '.join(lost)})"
                if lost else "the long-term memory as the lab has it")
        sentences.append(f"It is missing {what} too" if missing else f"The copy is missing {what}")
        sentences[-1] += ": the memory server keeps it outside SQLite." if lost else "."
    assert not sentences, " ".join(sentences)

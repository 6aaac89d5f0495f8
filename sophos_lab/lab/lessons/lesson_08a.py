"""Lesson 08a, local-first: the views of the process table the lesson uses, out of its way.

The lesson lists every data flow of the kit's server in the middle of a run and checks each one
against the running processes, as the original did with `lsof`; here `psutil` reads the same
tables (so it works where `lsof` and `ss` are missing). A `Look` knows who is who: the lab's ports
(the model, the web pages, the server once it starts) and the processes the notebook started.

- `look.sockets(proc)` is `lsof -i -a -p PID` for one process: what it listens on, the
  connections clients made to it, and the connections it opened itself;
- `look.snapshot(procs)` takes that for several processes at one moment, `table(...)` sums a
  snapshot up one row per process and `outbound(...)` lists who connected where;
- `look.open_files(proc)` is `lsof -p PID`, limited to the lab's directory.

The exercise's check, `test_outbound_endpoints`, is here too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import pandas as pd
import psutil

from ..children import child_environment
from ..harness import KIT_ROOT

if TYPE_CHECKING:
    from ..harness import Lab

Snapshot = dict[str, list[dict[str, str]]]
"""{process: its sockets}: each socket a dict of `kind` (listens, inbound, outbound), `local`,
`remote` and `peer` (who is at the far end)."""

COMMANDS = [("mcp_server_fetch", "fetch"), ("server-memory", "memory"), ("scripted_model", "model"),
            ("model_proxy", "model"), ("webfixtures", "web pages")]
"""How a process the notebook did not start is named: by a word of its command line."""

TRACING = ("LANGSMITH_", "LANGCHAIN_TRACING", "LANGCHAIN_API_KEY", "LANGCHAIN_ENDPOINT")
"""The environment variables that would turn LangChain's tracing on (and send every run out)."""


@dataclass
class Look:
    """Who is who when the lesson reads the process table."""

    lab_dir: str
    """The lab's directory, with symbolic links resolved (what the process table shows)."""
    endpoints: dict[int, str]
    """Who listens at each loopback port the lab knows: the model, the web pages, the server."""
    names: dict[int, str] = field(default_factory=dict)
    """The processes this notebook started, by pid (the MCP servers are named by their command)."""
    kernel: psutil.Process = field(default_factory=psutil.Process)
    """This notebook's kernel: every process of the lab runs under it."""

    @classmethod
    def of(cls, lab: Lab) -> Look:
        """A look at this lab's processes: its model and web pages known by their ports."""
        return cls(os.path.realpath(lab.root),
                   {urlsplit(lab.ollama_host).port: "model", urlsplit(lab.web.url).port: "web pages"})

    def add(self, child: Any, name: str) -> psutil.Process:
        """Name a process the notebook started (and its port, if it listens on one); its `psutil.Process`."""
        self.names[child.pid] = name
        if getattr(child, "port", None):
            self.endpoints[child.port] = name
        return psutil.Process(child.pid)

    def role(self, proc: psutil.Process) -> str:
        """The name of a process: one the notebook started, or an MCP server or stand-in by its command."""
        if proc.pid in self.names:
            return self.names[proc.pid]
        command = " ".join(proc.cmdline())
        for key, name in COMMANDS:
            if key in command:
                return name
        return command[:40]

    def peer(self, address: Any) -> str:
        """Who is at `address`: a server of this lab (by its port), or an address elsewhere."""
        if address.ip in ("127.0.0.1", "::1") and address.port in self.endpoints:
            return self.endpoints[address.port]
        return f"{address.ip}:{address.port}"

    def sockets(self, proc: psutil.Process) -> list[dict[str, str]]:
        """The TCP sockets of `proc`: what it listens on, the connections clients made to it
        (inbound) and the connections it opened itself (outbound)."""
        connections = proc.net_connections("inet")
        listening = {c.laddr.port for c in connections if c.status == psutil.CONN_LISTEN}
        own = {c.laddr.port for c in connections}
        notebook = {c.laddr.port for c in self.kernel.net_connections("inet")}
        found = []
        for c in connections:
            local = f"{c.laddr.ip}:{c.laddr.port}"
            if c.status == psutil.CONN_LISTEN:
                found.append({"kind": "listens", "local": local, "remote": "-", "peer": "-"})
            elif c.raddr:
                inbound = c.laddr.port in listening
                if c.raddr.port in own:
                    who = "itself"   # a connection between two of its own sockets
                elif inbound:
                    who = "this notebook" if c.raddr.port in notebook else "another process"
                else:
                    who = self.peer(c.raddr)
                found.append({"kind": "inbound" if inbound else "outbound", "local": local,
                              "remote": f"{c.raddr.ip}:{c.raddr.port}", "peer": who})
        return found

    def snapshot(self, procs: Iterable[psutil.Process]) -> Snapshot:
        """{process: its sockets}, for each of `procs` still running, at this moment."""
        taken = {}
        for proc in procs:
            try:
                taken[self.role(proc)] = self.sockets(proc)
            except psutil.NoSuchProcess:
                pass  # exited while we looked
        return taken

    def open_files(self, proc: psutil.Process) -> list[str]:
        """The files in the lab's directory that `proc` holds open (what `lsof -p PID` lists)."""
        return sorted({os.path.relpath(f.path, self.lab_dir) for f in proc.open_files()
                       if f.path.startswith(self.lab_dir + os.sep)})

    def relative(self, path: str | os.PathLike) -> str:
        """A path of the lab's as the lesson shows it: relative to the lab's directory."""
        return os.path.relpath(os.path.realpath(path), self.lab_dir)

    def held_open(self) -> dict[str, list[str]]:
        """{file of the lab: the processes holding it open}, over every process under the kernel."""
        held: dict[str, list[str]] = {}
        for proc in tree(self.kernel):
            try:
                for name in self.open_files(proc):
                    held.setdefault(name, []).append(self.role(proc))
            except psutil.NoSuchProcess:
                pass
        return held

    def child(self, parent: psutil.Process, name: str) -> psutil.Process:
        """The child of `parent` with this name (e.g. the server's "fetch")."""
        return next(p for p in parent.children() if self.role(p) == name)


def tree(proc: psutil.Process) -> list[psutil.Process]:
    """`proc` and every process under it."""
    return [proc, *proc.children(recursive=True)]


def listeners(found: list[dict[str, str]]) -> list[str]:
    """The addresses a process's sockets listen on."""
    return [s["local"] for s in found if s["kind"] == "listens"]


def peers(found: list[dict[str, str]], kind: str = "outbound") -> set[str]:
    """Who is at the far end of a process's sockets of one kind (outbound by default)."""
    return {s["peer"] for s in found if s["kind"] == kind}


def table(taken: Snapshot) -> pd.DataFrame:
    """A snapshot as `lsof` would sum it up: one row per process."""
    rows = []
    for process, found in taken.items():
        def joined(kind: str, show: Callable[[dict[str, str]], str]) -> str:
            shown = [show(s) for s in found if s["kind"] == kind]
            return ", ".join(dict.fromkeys(shown)) or "-"   # each once, in order
        rows.append({"process": process,
                     "listens on": joined("listens", lambda s: s["local"]),
                     "connects to": joined("outbound", lambda s: f"{s['peer']} ({s['remote']})"),
                     "clients": joined("inbound", lambda s: s["peer"])})
    return pd.DataFrame(rows).set_index("process")


def outbound(*snapshots: Snapshot) -> dict[str, list[str]]:
    """{process: the destinations of its outbound connections} over these snapshots."""
    found: dict[str, set[str]] = {}
    for taken in snapshots:
        for process, socks in taken.items():
            found.setdefault(process, set()).update(s["peer"] for s in socks if s["kind"] == "outbound")
    return {process: sorted(destinations) for process, destinations in sorted(found.items())}


def mcp_listens(*snapshots: Snapshot) -> bool:
    """Whether either MCP server (`fetch`, `memory`) listens on a port in any of these snapshots."""
    return any(s["kind"] == "listens" for taken in snapshots for process in ("fetch", "memory")
               for s in taken.get(process, []))


def start_child(lab: Lab, look: Look, kind: str) -> Any:
    """The agent in a new process, of the kind `kind` names (`CHILD`: "kernel" or "worker")."""
    child = lab.kernel() if kind == "kernel" else lab.worker()
    look.add(child, "agent")
    return child


def access_log(lab: Lab) -> pd.DataFrame:
    """The web pages' access log: every request the page server answered."""
    return pd.DataFrame(lab.web.entries())[["method", "path", "status", "user_agent"]]


def lab_files(lab: Lab) -> list[str]:
    """Every file in the lab's directory but its configuration, relative to it."""
    return sorted(str(p.relative_to(lab.root)) for p in lab.root.rglob("*")
                  if p.is_file() and p.parent.name != "config")


def files_table(lab: Lab, files: list[str], held_by: dict[str, list[str]]) -> pd.DataFrame:
    """The lab's files: size, and which processes hold each open."""
    return pd.DataFrame([{"file": name, "bytes": (lab.root / name).stat().st_size,
                          "held open by": ", ".join(sorted(set(held_by.get(name, [])))) or "-"}
                         for name in files]).set_index("file")


def in_database(lab: Lab, phrase: str) -> bool:
    """Whether `phrase` is in the lab's database file or its write-ahead log as plain text."""
    return any(phrase.encode() in (lab.root / name).read_bytes() for name in ("sophos.db", "sophos.db-wal")
               if (lab.root / name).exists())


def tracing(env: dict[str, str] | None = None) -> list[str]:
    """The tracing variables set in an environment (by default this kernel's)."""
    return sorted(name for name in (os.environ if env is None else env) if name.startswith(TRACING))


def port(url_or_address: str) -> int | None:
    """The port of a URL (`http://127.0.0.1:11434`) or of an `address:port`."""
    if "://" in url_or_address:
        return urlsplit(url_or_address).port
    return int(url_or_address.rsplit(":", 1)[1])


def mcp_json(lab: Lab) -> dict[str, Any]:
    """The lab's `mcp.json` as it is now: the MCP servers a new process would start, by name."""
    import json

    return json.loads((lab.config_dir / "mcp.json").read_text())


def program(proc: psutil.Process) -> str:
    """A process's command line, with the kit's files relative to the kit."""
    def shown(arg: str) -> str:
        return os.path.relpath(arg, KIT_ROOT) if arg.startswith(str(KIT_ROOT) + os.sep) else arg
    return " ".join(shown(arg) for arg in proc.cmdline())


@dataclass
class Inventory:
    """Every flow: what the configuration says, and what the running processes show."""

    config: dict[str, Any]
    """The lab's `mcp.json`."""
    settings: dict[str, str]
    """The settings every child of the lab gets (`lab.env()`)."""
    server_env: dict[str, str]
    """The server process's environment, as it runs."""
    fetch: psutil.Process
    memory: psutil.Process
    memory_env: str | None
    """`MEMORY_FILE_PATH` in the memory server's environment, as it runs."""
    model_address: list[str]
    """Where the server's connections to the model go (address:port)."""
    table: pd.DataFrame


def inventory(lab: Lab, look: Look, server: psutil.Process, command: list[str],
              while_answering: Snapshot) -> Inventory:
    """The configuration (`mcp.json`, `lab.env()`) beside what runs: command lines, environments,
    sockets and open files of the server (started with `command`) and its two MCP servers."""
    config = mcp_json(lab)
    settings = lab.env()
    fetch, memory = look.child(server, "fetch"), look.child(server, "memory")
    server_env = server.environ()
    memory_env = memory.environ().get("MEMORY_FILE_PATH")
    model_address = sorted({s["remote"] for s in while_answering["server"] if s["peer"] == "model"})

    def entry(name: str) -> str:
        return " ".join([config[name]["command"], *config[name].get("args", [])])

    held = look.open_files(server)
    rows = [
        ("API and web page", f"--host {command[command.index('--host') + 1]}", ", ".join(listeners(while_answering["server"]))),
        ("inference", f"OLLAMA_HOST={settings['OLLAMA_HOST']}", "server → " + ", ".join(model_address)),
        ("tool: fetch", entry("fetch"), program(fetch) + " → the web pages, while it fetches"),
        ("tool: memory", entry("memory"), program(memory) + " → no socket"),
        ("state", f"DATABASE_PATH={look.relative(settings['DATABASE_PATH'])}",
         "server holds " + ", ".join(f for f in held if f.startswith("sophos.db"))),
        ("memory", f"MEMORY_FILE_PATH={look.relative(settings['MEMORY_FILE_PATH'])}",
         f"memory server's env: {memory_env and look.relative(memory_env)}"),
        ("logs", f"SOPHOS_LAB_LOG_DIR={look.relative(settings['SOPHOS_LAB_LOG_DIR'])}",
         "server holds " + ", ".join(f for f in held if f.startswith("logs"))),
        ("telemetry", "LANGSMITH_* in this kernel: " + (", ".join(tracing()) or "none"),
         "in the server's env: " + (", ".join(tracing(server_env)) or "none")),
    ]
    frame = pd.DataFrame(rows, columns=["flow", "the configuration says", "what runs shows"]).set_index("flow")
    return Inventory(config, settings, server_env, fetch, memory, memory_env, model_address, frame)


def serve_on_every_interface(lab: Lab) -> subprocess.CompletedProcess:
    """`sophos-lab serve --host 0.0.0.0 --port 0` with the lab's settings but no `SOPHOS_LAB_TOKEN`:
    its exit code and what it said."""
    environment = {k: v for k, v in child_environment(lab.env()).items() if k != "SOPHOS_LAB_TOKEN"}
    return subprocess.run([sys.executable, "-m", "sophos_lab.cli", "serve", "--host", "0.0.0.0", "--port", "0"],
                          env=environment, cwd=lab.root, capture_output=True, text=True, timeout=60)


# the exercise's check


def _address(text: str) -> tuple[str, int]:
    ip, port = text.rsplit(":", 1)
    return (ip, int(port))


def _endpoint(url: str) -> tuple[str | None, int | None]:
    parts = urlsplit(url)
    return (parts.hostname, parts.port)


def test_outbound_endpoints(lab: Lab, look: Look, server: Any,
                            outbound_endpoints: Callable[[int], set[tuple[str, int]]],
                            at_the_check: Snapshot) -> None:
    """The check of the exercise: hold a run while the page is fetched (`lab.web.hold`), call
    `outbound_endpoints(server.pid)` at that moment, and compare its set with the two endpoints
    the lab knows (the model at `lab.ollama_host`, the web pages at `lab.web.url`). A miss says
    which process holds that connection; an extra address says what it is instead (the
    listener's own address, a client's end, a connection's near end). `at_the_check` gets the
    check's own snapshot of the server's tree, taken at the same moment."""
    known = {_endpoint(lab.ollama_host): "the model", _endpoint(lab.web.url): "the web pages"}
    at_the_check.clear()
    lab.web.hold("/wal.html")
    server.chat_until_tool_call(f"Fetch {lab.page('wal.html')} and tell me what it says.", tool="fetch__fetch")
    lab.web.wait_held()
    try:
        at_the_check.update(look.snapshot(tree(psutil.Process(server.pid))))
        answer = outbound_endpoints(server.pid)
    finally:
        lab.web.release()
        server.wait_final()
    assert isinstance(answer, (set, frozenset)), f"Return a set of (address, port) tuples, not a {type(answer).__name__}."
    for item in answer:
        assert isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], int), \
            f"Each endpoint is an (address, port) tuple, such as ('127.0.0.1', 8080), not {item!r}."
    socks = [(process, s) for process, found in at_the_check.items() for s in found]
    for item, name in known.items():
        if item not in answer:
            holders = sorted({p for p, s in socks if s["kind"] == "outbound" and _address(s["remote"]) == item})
            where = ("the server holds a connection to it, kept open between its requests" if "server" in holders
                     else f"the connection to them belongs to {' and '.join(holders)}, a process the server "
                     "started: look at every process under pid too" if holders else "a process of the server's holds it")
            raise AssertionError(f"Your set misses {name} at {item[0]}:{item[1]}: while the page is fetched, {where}.")
    for item in sorted(set(answer) - set(known)):
        shown = f"{item[0]}:{item[1]}"
        for process, s in socks:
            if s["kind"] == "listens" and _address(s["local"]) == item:
                raise AssertionError(f"{shown} is not an outbound connection: it is the {process}'s own address, the one "
                                     "it listens on (a listening socket has no remote end).")
            if s["kind"] == "inbound" and _address(s["remote"]) == item:
                raise AssertionError(f"{shown} is not an outbound connection: it is {s['peer']}'s end of a "
                                     f"connection made TO the {process}, at the port it listens on.")
            if s["kind"] == "outbound" and _address(s["local"]) == item:
                raise AssertionError(f"{shown} is the {process}'s own end of its connection to {s['peer']}: the "
                                     "far end is the socket's raddr, not its laddr.")
        raise AssertionError(f"{shown} is not a connection the server's processes have open: the lab's endpoints "
                             f"are {' and '.join(f'{n} at {a}:{p}' for (a, p), n in known.items())}.")

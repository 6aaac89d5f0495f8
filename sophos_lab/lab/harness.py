"""The teaching harness: a disposable lab directory, the scripted model, the web pages, children.

    lab = Lab.setup("06d_crash_after_tool_result")
    child = lab.kernel()                  # the agent in a kernel this notebook can kill
    child.chat(f"Fetch {lab.page('wal.html')} and summarize it in 12 detailed bullet points.")
    child.wait_for("trace", event="result")
    child.kill()                          # SIGKILL, no cleanup runs
    lab.peek_runs()                       # still `running`: nobody has opened the file since

`lab.server()` starts the third kind of child, the HTTP server (`sophos-lab serve`), with the
same interface over its API: `server.url` is its base URL for `curl`.

Everything a lab writes lives in `.lab/<name>/` (git-ignored): the database, the memory file, a
copy of the configuration, the logs of every process. `data/` holds only inputs.

A lab's `mcp.json` is the kit's (`fetch` and `memory`). A lesson that needs one of the servers in
`config/extras/` names it: `Lab.setup("07_side_effects_and_idempotency", extra_servers=("ledger",))`
merges `config/extras/ledger.json` into the lab's copy, so only that lab offers `record_payment`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from . import inspect as views
from ..standins._proc import stop_server
from ..runtime.agent import Readiness, check_model
from . import checks
from .children import LabKernel, LabServer, LabWorker
from .predictions import new_score
from ..standins.model_proxy import ModelProxyControl, normalize_upstream, start_model_proxy
from ..standins.scripted_model import ScriptedModelControl, start_scripted_model
from ..runtime.settings import Settings
from ..standins.webfixtures import WebFixturesControl, start_web_fixtures

KIT_ROOT = Path(__file__).resolve().parents[2]
EXTRAS_DIR = KIT_ROOT / "config" / "extras"
"""MCP servers a lab adds only when asked (`extra_servers`): `<name>.json` holds `{name: entry}`."""


def extra_server(name: str) -> dict[str, Any]:
    """The `mcp.json` entries of the extra server `name` (`config/extras/<name>.json`)."""
    path = EXTRAS_DIR / f"{name}.json"
    if not path.is_file():
        known = sorted(p.stem for p in EXTRAS_DIR.glob("*.json"))
        raise ValueError(f"no extra MCP server {name!r} (config/extras/ has: {', '.join(known) or 'none'})")
    entries = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(entries, dict) or not all(isinstance(v, dict) for v in entries.values()):
        raise ValueError(f"{path} must map server names to objects, as mcp.json does")
    return entries


def lab_home() -> Path:
    return Path(os.environ.get("SOPHOS_LAB_HOME") or KIT_ROOT / ".lab")


def dead_port_url() -> str:
    """An http URL on loopback where nothing listens (a stand-in for "Ollama is down")."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def is_scripted_model(host: str) -> bool:
    """Whether `host` is a scripted model server (each lab then starts its own, for its controls)."""
    try:
        with urllib.request.urlopen(normalize_upstream(host) + "/api/version", timeout=2) as response:
            return "scripted" in json.load(response).get("version", "")
    except (OSError, ValueError):
        return False


@dataclass
class Lab:
    """One lab: its directory, its servers, the children it started, and read-only views."""

    name: str
    root: Path
    ollama_host: str
    ollama_model: str
    model: ScriptedModelControl | ModelProxyControl
    web: WebFixturesControl
    shutdown_timeout: float = 5.0
    _servers: list[subprocess.Popen] = field(default_factory=list)
    _children: list[Any] = field(default_factory=list)
    extra_servers: list[str] = field(default_factory=list)
    """The servers from `config/extras/` added to this lab's `mcp.json` (kept by `restore_mcp_config`)."""
    fork_servers: bool = False
    """Whether this lab's `python -m` stdio servers are forked (`Lab.setup(fork_servers=True)`)."""
    database_url: str | None = None
    """The PostgreSQL database of this lab (`Lab.setup(database_url=...)`); None: its SQLite file."""
    postgres: Any = None
    """The PostgreSQL server this lab started (`Lab.setup(postgres=True)`), else None."""

    @classmethod
    def setup(
        cls,
        name: str,
        *,
        ollama_host: str | None = None,
        ollama_model: str | None = None,
        shutdown_timeout: float = 5.0,
        quiet: bool = False,
        extra_servers: tuple[str, ...] | list[str] = (),
        fork_servers: bool = False,
        database_url: str | None = None,
        postgres: bool = False,
    ) -> Lab:
        """A fresh lab: wipe `.lab/<name>/`, copy the config, start the model (unless a real
        Ollama is named by argument or `OLLAMA_HOST`: then a recording proxy in front of it) and
        the web fixture server.

        `extra_servers` names servers of `config/extras/` (e.g. `("ledger",)`, lesson 07) to add
        to the lab's `mcp.json`; by default it has only the kit's `fetch` and `memory`.

        `fork_servers=True` forks every `python -m` stdio server of the lab's `mcp.json` (`fetch`,
        the ledger) from the fork server instead of starting a fresh interpreter each time
        (`fork_mcp_server`), and its `server()`s too (each a `sophos-lab serve` forked, its
        imports done): for tests that start hundreds of children, and lessons 16 to 18, which
        start many servers and workers and read none of their processes. The other lessons
        leave it off, so that the processes they show are the ones the config names and a
        user starts.

        `database_url` (a `postgresql://` URL) puts the lab's tables and checkpoints on that
        PostgreSQL database instead of the lab's SQLite file: its children get it as
        `DATABASE_URL`, and its views read it. `postgres=True` starts a real PostgreSQL server
        for the lab (`postgres_server`: its data in a short folder under the temporary
        directory, no TCP port) with a database of its own, and stops it at `close()`."""
        if isinstance(extra_servers, str):
            extra_servers = (extra_servers,)
        extras = {name: extra_server(name) for name in extra_servers}  # an unknown name fails before anything starts
        root = lab_home() / name
        shutil.rmtree(root, ignore_errors=True)
        (root / "logs").mkdir(parents=True)
        shutil.copytree(KIT_ROOT / "config", root / "config", ignore=shutil.ignore_patterns("extras"))
        servers: list[subprocess.Popen] = []
        web_proc, web_url = start_web_fixtures(KIT_ROOT / "data" / "web", log_file=root / "logs" / "web-access.jsonl")
        servers.append(web_proc)
        host = ollama_host or os.environ.get("OLLAMA_HOST")
        model_control: ScriptedModelControl | ModelProxyControl
        if host and not is_scripted_model(host):
            # Any other Ollama-protocol server: the children talk to it through a recording
            # proxy of this lab's, so the request log and the pause points work as with the
            # scripted model.
            model_name = ollama_model or os.environ.get("OLLAMA_MODEL") or Settings().ollama_model
            proxy_proc, proxy_url = start_model_proxy(host, log_file=root / "logs" / "model-requests.jsonl")
            servers.append(proxy_proc)
            model_control = ModelProxyControl(proxy_url, upstream=host)
            host = proxy_url
        else:
            model_proc, host = start_scripted_model(
                KIT_ROOT / "data" / "scripts", log_file=root / "logs" / "model-requests.jsonl"
            )
            servers.append(model_proc)
            model_control = ScriptedModelControl(host)
            model_name = ollama_model or "scripted"
        lab = cls(
            name=name, root=root, ollama_host=host, ollama_model=model_name, model=model_control,
            web=WebFixturesControl(web_url), shutdown_timeout=shutdown_timeout, _servers=servers,
        )
        for extra in extras:
            lab.add_mcp_server(extra)
        lab.fork_servers = fork_servers
        if postgres and database_url is None:
            from . import postgres_server

            # One folder per lab (short: a socket's path has at most 107 bytes), so that a lab set up
            # again after its kernel died finds that kernel's server instead of leaving it behind.
            folder = Path(tempfile.gettempdir()) / f"sophos-pg-{hashlib.sha1(str(root).encode()).hexdigest()[:10]}"
            lab.postgres = postgres_server.start(folder, stop_at_exit=True)
            database_url = postgres_server.new_database(lab.postgres.url, "lab")
        lab.database_url = database_url
        lab._fork_python_servers()
        new_score()  # a fresh lab is a fresh pass at the lesson: its predictions count from zero
        if not quiet:
            print(lab.describe())
        return lab

    # the world the agent sees

    @property
    def db_path(self) -> Path:
        return self.root / "sophos.db"

    @property
    def database(self) -> str | Path:
        """What the views read: the PostgreSQL URL, or the SQLite file."""
        return self.database_url or self.db_path

    @property
    def ledger_path(self) -> Path:
        """The ledger server's database (lesson 07)."""
        return self.root / "ledger.db"

    @property
    def config_dir(self) -> Path:
        return self.root / "config"

    @property
    def scripted(self) -> bool:
        """Whether the model is the kit's scripted one (a real Ollama cannot be paused)."""
        return isinstance(self.model, ScriptedModelControl)

    def page(self, name: str) -> str:
        """The loopback URL of a page in `data/web/`."""
        return self.web.page_url(name)

    def env(self, **overrides: str) -> dict[str, str]:
        """The settings of a child of this lab, as environment variables."""
        env = {
            "OLLAMA_HOST": self.ollama_host,
            "OLLAMA_MODEL": self.ollama_model,
            "DATABASE_PATH": str(self.db_path),
            **({"DATABASE_URL": self.database_url} if self.database_url else {}),
            "CONFIG_DIR": str(self.config_dir),
            "MEMORY_FILE_PATH": str(self.root / "memory.jsonl"),
            "LEDGER_PATH": str(self.ledger_path),
            # The ledger server reports each committed payment here, so `web.hold` can stop it there.
            "LEDGER_NOTIFY_URL": f"{self.web.url}/ledger-committed",
            "SHUTDOWN_TIMEOUT": str(self.shutdown_timeout),
            "SOPHOS_LAB_LOG_DIR": str(self.root / "logs"),
            "IPYTHONDIR": str(self.root / "ipython"),
            # One attempt per model step, as the original made: every lesson but 12 shows its
            # failures as they are (a dead port is `AGENT_FAILURE` at once). Pass it to a child to
            # retry (lesson 12).
            "SOPHOS_LAB_MODEL_ATTEMPTS": "1",
        }
        env.update({key: str(value) for key, value in overrides.items()})
        return env

    def settings(self, **overrides: str) -> Settings:
        return Settings.from_env(self.env(**overrides))

    def add_user(self, name: str, **env: str) -> str:
        """Add a user to this lab's database (or the one `env` names), as `sophos-lab user add
        NAME` does; its token, to send as `Authorization: Bearer <token>`."""
        from ..runtime import users
        from ..runtime.storage import open_storage
        from ..runtime.storage.blocking import Blocking
        from ..runtime.storage.models import utc_now

        settings = self.settings(**env)
        with Blocking(lambda: open_storage(settings)) as store:
            return store.call(users.add_user, name, utc_now())[1]

    def readiness(self, **overrides: str) -> Readiness:
        """The advisory readiness check (like the original's `readyz`) for these settings."""
        return check_model(self.settings(**overrides))

    def edit_mcp_config(self, change: Callable[[dict], None]) -> None:
        """Change this lab's `mcp.json` (a copy; the kit's own config is never touched)."""
        path = self.config_dir / "mcp.json"
        config = json.loads(path.read_text())
        change(config)
        path.write_text(json.dumps(config, indent=2))

    def add_mcp_server(self, name: str) -> None:
        """Add the extra server `name` (`config/extras/<name>.json`) to this lab's `mcp.json`.

        Do it before a child first needs tools: a process reads `mcp.json` when it discovers its
        tools, and keeps the servers it found for its life."""
        entries = extra_server(name)
        self.edit_mcp_config(lambda config: config.update(entries))
        if name not in self.extra_servers:
            self.extra_servers.append(name)
        self._fork_python_servers()

    def fork_mcp_server(self, name: str) -> None:
        """Start the stdio server `name` (a `python -m module` entry of this lab's `mcp.json`)
        forked from this process's fork server, as worker children are
        (`sophos_lab/lab/forkserver.py`): the same module, with the kit's interpreter and the
        entry's arguments and environment, started in milliseconds instead of about a second of
        imports. The entry's command becomes the fork server's launcher, which stands for the
        server to the MCP client that starts it (its stdio, its signals, its exit). Valid while
        this process runs; `restore_mcp_config()` undoes it."""
        from .forkserver import launcher_command

        def change(config: dict) -> None:
            entry = config.get(name)
            args = list(entry.get("args", [])) if isinstance(entry, dict) else []
            if len(args) < 2 or args[0] != "-m":
                raise ValueError(f"mcp.json has no `python -m module` server {name!r} to fork: {entry!r}")
            command = launcher_command(args[1], args[2:])
            entry["command"], entry["args"] = command[0], command[1:]

        self.edit_mcp_config(change)

    def _fork_python_servers(self) -> None:
        # A forked entry's command is the launcher (`python -S launch_forked.py …`), so this can
        # run again after any change to the config without forking a server twice.
        if not self.fork_servers:
            return
        config = json.loads((self.config_dir / "mcp.json").read_text())
        for name, entry in config.items():
            if isinstance(entry, dict) and entry.get("args", [None])[:1] == ["-m"]:
                self.fork_mcp_server(name)

    def without_approvals(self) -> None:
        """Let this lab's tools run without a person's approval: drop every server's `approval`
        (lesson 07 shows what a side effect does across a crash when nothing stops it first)."""
        self.edit_mcp_config(lambda config: [entry.pop("approval", None) for entry in config.values()])

    def restore_mcp_config(self) -> None:
        """Put the kit's `mcp.json` back in the lab, with the extra servers this lab was given."""
        shutil.copy(KIT_ROOT / "config" / "mcp.json", self.config_dir / "mcp.json")
        for name in self.extra_servers:
            entries = extra_server(name)
            self.edit_mcp_config(lambda config: config.update(entries))
        self._fork_python_servers()

    # children

    def kernel(self, **env: str) -> LabKernel:
        """Start the agent in a child Jupyter kernel."""
        child = LabKernel(self.env(**env), cwd=self.root, log_path=self._log("kernel"), spec_dir=self.root / "kernels")
        self._children.append(child)
        return child.start()

    def worker(self, **env: str) -> LabWorker:
        """Start the agent in a plain subprocess (same interface as `kernel()`)."""
        child = LabWorker(self.env(**env), cwd=self.root, log_path=self._log("worker"))
        self._children.append(child)
        return child.start()

    def server(self, port: int = 0, host: str = "127.0.0.1", **env: str) -> LabServer:
        """Start `sophos-lab serve` (the HTTP API) on a free loopback port, or on `port` (e.g. a
        killed server's `port`, so that a browser's page reconnects to its successor), or beyond
        loopback with `host` (it needs users or a token); `child.url` is its base URL. Same
        interface as `worker()`, over HTTP and SSE."""
        child = LabServer(self.env(**env), cwd=self.root, log_path=self._log("server"), port=port, host=host,
                          fork=self.fork_servers)
        self._children.append(child)
        return child.start()

    def pool_worker(self, concurrency: int = 1, **env: str):
        """Start one `sophos-lab worker` on this lab's PostgreSQL (`Lab.setup(postgres=True)`):
        it claims the runs that servers started with `SOPHOS_LAB_RUNS="workers"` queue. A
        `LabPoolWorker` to kill, freeze, thaw and shut down; `owner` is its `runs.owner_id`."""
        from .children import LabPoolWorker

        if not (self.database_url or env.get("DATABASE_URL")):
            raise ValueError("a pool of workers needs PostgreSQL: Lab.setup(..., postgres=True)")
        child = LabPoolWorker(self.env(**env), cwd=self.root, log_path=self._log("pool-worker"), concurrency=concurrency)
        self._children.append(child)
        return child.start()

    def worker_pool(self, workers: int = 2, concurrency: int = 1, **env: str) -> list:
        """`workers` pool workers (`pool_worker`), each a process of its own."""
        return [self.pool_worker(concurrency, **env) for _ in range(workers)]

    def service(self, **env: str):
        """An `AgentService` in this process, with this lab's settings."""
        from ..runtime.service import AgentService

        return AgentService(self.settings(**env), log_dir=self.root / "logs")

    # read-only views (they never trigger crash recovery)

    def peek_runs(self, conversation: str | None = None) -> pd.DataFrame:
        """The runs table as it is on disk right now."""
        return views.peek_runs(self.database, conversation)

    def sql(self, query: str, *params: Any) -> pd.DataFrame:
        """A read-only query on the lab's database (SQLite's SQL with `?` placeholders; on
        PostgreSQL the placeholders are translated), as a DataFrame."""
        return views.sql(self.database, query, params)

    def runs(self, conversation: str | None = None) -> pd.DataFrame:
        return views.peek_runs(self.database, conversation)

    def conversations(self) -> pd.DataFrame:
        return views.conversations(self.database)

    def gates(self, conversation: str | None = None) -> pd.DataFrame:
        """The approval gates on disk: one row per held tool call, with the decision on it."""
        return views.gates(self.database, conversation)

    def checkpoints(self, conversation: str) -> pd.DataFrame:
        return views.checkpoints(self.database, conversation)

    def writes(self, conversation: str) -> pd.DataFrame:
        return views.pending_writes(self.database, conversation)

    def messages(self, conversation: str) -> pd.DataFrame:
        return views.messages(self.database, conversation)

    def state(self, conversation: str) -> dict[str, Any]:
        """What the seed's `state()` shell helper shows."""
        return views.state(self.database, conversation)

    def timeline(self, conversation: str):
        """The runs and checkpoints of `conversation` on a time axis, with this lab's model
        requests (✕ for those that failed: an HTTP error, or no answer at all): a `Picture`,
        which a cell shows when it ends with it (`lab.timeline(c)`, no `;`). Each checkpoint is
        labelled with its step and the node whose write made it; the picture's elements name them."""
        requests = [r for r in self.model.chat_requests() if r.get("time")]
        failed = [r["time"] for r in requests if r.get("status") != 200]
        return views.timeline_picture(self.database, conversation, model_requests=[r["time"] for r in requests],
                                      failed_requests=failed)

    def ledger(self) -> pd.DataFrame:
        """The ledger server's payments, oldest first (read-only; empty before the first one)."""
        return views.ledger(self.ledger_path)

    def fetches(self, page: str) -> int:
        """How many times the fetch tool has read `page` (from the web server's access log)."""
        return self.web.hits("/" + page.lstrip("/"))

    def model_calls(self, script: str | None = None) -> int:
        """How many `/api/chat` requests the model has answered (scripted, or real via the proxy)."""
        return len(self.model.chat_requests(script))

    def check(self, claim: str, holds: bool | Callable[[], object], observed: Any = checks._NOTHING, *,
              scripted_only: bool = False) -> None:
        """Print `✅ claim`, or fail the cell with the claim and what was observed (`sophos_lab.check`).

        `scripted_only=True`: a claim about what the scripted model chose (which tool, how many
        calls); with another model it is listed as not checked, since a model's choices are its own."""
        checks.check(claim, holds, observed, scripted_only=scripted_only, scripted=self.scripted)

    # lifecycle

    def describe(self) -> str:
        if self.scripted:
            scripted = " (scripted: deterministic, not a language model)"
        else:
            upstream = getattr(self.model, "upstream", "") or "?"
            scripted = f" (real model at {upstream}, through this lab's recording proxy {self.ollama_host})"
        rows = [
            ("lab", self.name),
            ("directory", str(self.root.relative_to(KIT_ROOT) if self.root.is_relative_to(KIT_ROOT) else self.root)),
            ("model", f"{self.ollama_model}{scripted}"),
            ("web pages", self.web.url),
        ]
        return "\n".join(f"{key:<10} {value}" for key, value in rows)

    def close(self) -> None:
        """Kill the children still alive and stop the servers."""
        for child in self._children:
            child.close()
        for proc in self._servers:
            stop_server(proc)
        self._children.clear()
        self._servers.clear()
        if self.postgres is not None:
            self.postgres.stop()
            shutil.rmtree(self.postgres.folder, ignore_errors=True)
            self.postgres = None

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _log(self, kind: str) -> Path:
        return self.root / "logs" / f"{kind}-{len(self._children) + 1}.log"

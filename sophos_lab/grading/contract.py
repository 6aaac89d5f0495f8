"""The contract between your agent module and the grader, and the `World` it hands you.

Your module is a `.py` file with four async functions. The grader imports it in a process of
its own (`python -m sophos_lab.grading.child`), calls them, kills that process with SIGKILL at
a point of its choosing, and calls them again in a new process:

    async def run_turn(world, conversation: str, message: str) -> None
        Answer `message` in `conversation` (START → agent ⇄ tools → END): return once the turn
        has ended. `conversation` is your thread id. Raise if the turn failed.

    async def recover(world) -> None
        Called first in every new process after a crash, before anything else: whatever the
        dead process left behind (a run it never finished) is yours to record now.

    async def resume(world, conversation: str) -> None
        Finish the work the dead process left in `conversation`, if there is any (a turn cut
        short); return once it is done. Nothing left is not an error.

    async def read(world, conversation: str) -> dict
        What the conversation holds now: `{"messages": [...], "runs": [...]}`. Messages are
        LangChain messages (or `(role, text)` pairs, role `user`, `assistant` or `tool`), in
        order; runs are the statuses of its runs, oldest first (`running`, `completed`,
        `failed`, `interrupted`; an empty list if you keep no runs table).

`world` (a `World`) is everything outside your module, and the two doors through which the
grader sees you write:

- `world.model()`: a `ChatOllama` at the lab's model (the scripted one, or `OLLAMA_HOST`'s);
- `world.mcp_connections()`: the lab's MCP servers (`fetch`, the `ledger` of payments) as the
  dict `MultiServerMCPClient` takes;
- `world.db`: your database file, one SQLite file for everything you keep;
- `world.connect()`: a `sqlite3` connection to `world.db`. Each `commit()` (or a `with db:` block
  that commits) is a point the grader can kill you right after;
- `world.saver()`: `async with world.saver() as saver:` a LangGraph `AsyncSqliteSaver` on
  `world.db`, whose every checkpoint and every task's writes is such a point, once it is on disk.

Open your database only through these two: a write the grader cannot see is a point it cannot
test. Neither is a patch: `connect()` is `sqlite3.connect(path, factory=ReportingConnection)`,
the documented way to give a connection a subclass, and the saver is a subclass of LangGraph's.
"""

from __future__ import annotations

import contextlib
import os
import re
import sqlite3
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

CONTRACT = ("run_turn", "recover", "resume", "read")
"""The functions an agent module must define (all `async def`)."""

Watcher = Callable[[str], None]
_watcher: Watcher | None = None


def watch_writes(watcher: Watcher | None) -> None:
    """Call `watcher(description)` right after each durable write through the world (the child's hook)."""
    global _watcher
    _watcher = watcher


def _wrote(description: str) -> None:
    if _watcher is not None:
        _watcher(description)


_VERB = re.compile(r"^\s*(INSERT(?:\s+OR\s+\w+)?\s+INTO|REPLACE\s+INTO|UPDATE(?:\s+OR\s+\w+)?|DELETE\s+FROM)\s+"
                   r"([\"`\[]?\w+)", re.IGNORECASE)


class ReportingConnection(sqlite3.Connection):
    """A `sqlite3.Connection` that reports each commit that wrote something, named by the
    statements it committed (`commit: INSERT INTO runs`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._statements: list[str] = []

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        self._note(sql)
        return super().execute(sql, *args)

    def executemany(self, sql: str, *args: Any) -> sqlite3.Cursor:
        self._note(sql)
        return super().executemany(sql, *args)

    def commit(self) -> None:
        pending = self.in_transaction
        super().commit()
        if pending:
            self._report()

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> Any:
        pending = self.in_transaction
        result = super().__exit__(kind, value, traceback)
        if pending and kind is None:
            self._report()
        return result

    def _note(self, sql: str) -> None:
        found = _VERB.match(sql)
        if found:
            verb, table = " ".join(found[1].upper().split()), found[2].strip("\"`[")
            what = f"{verb} {table}"
            if what not in self._statements:
                self._statements.append(what)

    def _report(self) -> None:
        what = ", ".join(self._statements)
        self._statements = []
        _wrote(f"commit: {what}" if what else "commit")


def _task_node(task_path: str, task_id: str) -> str:
    """The node a task ran, from the path LangGraph gives its writes (`~__pregel_pull, agent`)."""
    return task_path.rsplit(",", 1)[-1].strip() if task_path else task_id


class ReportingSaver(AsyncSqliteSaver):
    """LangGraph's `AsyncSqliteSaver`, reporting each checkpoint and each task's writes once
    committed (`checkpoint step 1`, `writes tools`)."""

    async def aput(self, config, checkpoint, metadata, new_versions):
        saved = await super().aput(config, checkpoint, metadata, new_versions)
        _wrote(f"checkpoint step {metadata.get('step')}")
        return saved

    async def aput_writes(self, config, writes, task_id, task_path=""):
        written = await super().aput_writes(config, writes, task_id, task_path)
        _wrote(f"writes {_task_node(task_path, task_id)}")
        return written


_tls: list[Any] = []


def tls_context() -> Any:
    """One TLS context for every HTTP client of this process: making one loads the system's
    certificates (about 50 ms), and an agent makes several clients a turn (the model's, each MCP
    session's). The lab's servers are plain HTTP on loopback; a real model may not be."""
    if not _tls:
        import httpx

        _tls.append(httpx.create_ssl_context())
    return _tls[0]


def http_client(headers: dict[str, str] | None = None, timeout: Any = None, auth: Any = None) -> Any:
    """The HTTP client of an MCP session (the `httpx_client_factory` of `mcp_connections()`), as the
    MCP client makes it, with the process's one TLS context."""
    import httpx

    return httpx.AsyncClient(follow_redirects=True, headers=headers, auth=auth, verify=tls_context(),
                             timeout=timeout if timeout is not None else httpx.Timeout(30.0, read=300.0))


@dataclass(frozen=True)
class World:
    """What the grader gives your agent: the model, the MCP servers and your database (see the module)."""

    db: Path
    ollama_host: str
    ollama_model: str
    env: dict[str, str]
    """The environment the lab's settings are read from (the child's own)."""

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> World:
        """The world of a lab's child: `DATABASE_PATH`, `OLLAMA_HOST`, `OLLAMA_MODEL`, `CONFIG_DIR`."""
        from ..runtime.settings import Settings

        env = dict(os.environ if env is None else env)
        settings = Settings.from_env(env)
        return cls(db=settings.database_path, ollama_host=settings.ollama_host,
                   ollama_model=settings.ollama_model, env=env)

    def connect(self) -> sqlite3.Connection:
        """A connection to `world.db` whose commits the grader sees (`ReportingConnection`)."""
        return sqlite3.connect(self.db, factory=ReportingConnection, timeout=10)

    @contextlib.asynccontextmanager
    async def saver(self) -> AsyncIterator[ReportingSaver]:
        """`async with world.saver() as saver:` a LangGraph saver on `world.db` whose writes the grader sees."""
        async with ReportingSaver.from_conn_string(str(self.db)) as saver:
            yield saver

    def model(self) -> Any:
        """A `ChatOllama` at the lab's model (it does not think, as the kit's runtime by default)."""
        from langchain_ollama import ChatOllama

        return ChatOllama(model=self.ollama_model, base_url=self.ollama_host, reasoning=False,
                          client_kwargs={"verify": tls_context()})

    def mcp_connections(self) -> dict[str, dict[str, Any]]:
        """The lab's MCP servers, as `MultiServerMCPClient(world.mcp_connections())` takes them.
        A tool is named as its server names it: `fetch`, `record_payment`, `record_payment_once`."""
        from ..runtime.settings import Settings
        from ..runtime.tools import kit_variables, load_mcp_config

        settings = Settings.from_env(self.env)
        servers = load_mcp_config(settings.mcp_config_path, {**self.env, **kit_variables(settings)})
        connections: dict[str, dict[str, Any]] = {}
        for server in servers:
            if server.url:
                connections[server.name] = {"transport": "streamable_http", "url": server.url,
                                            "httpx_client_factory": http_client}
                continue
            connection: dict[str, Any] = {"transport": "stdio", "command": server.command, "args": list(server.args)}
            if server.env:
                connection["env"] = dict(server.env)
            if server.cwd:
                connection["cwd"] = server.cwd
            connections[server.name] = connection
        return connections

"""MCP tools: the `mcp.json` configuration and discovery over persistent sessions.

A server's entry may say that its tools need a person's approval before they run:
`"approval": true` (all of them) or `"approval": ["record_payment", ...]` (those, by the
server's own tool names). The tools step then stops at a gate before any call of the turn runs
(see `agent` and `AgentService.approve`).

Tools are discovered when a graph node first needs them, never when state is read. Each server
keeps one session for the life of the process (a new session per call would start a new server
process per call). A failed discovery closes whatever it started, and the next run tries again
with the configuration read afresh, so a fixed `mcp.json` needs no restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import re
import sys
import time
from collections import ChainMap
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from langchain_core.messages import ToolCall
from langchain_core.tools import BaseTool

from .errors import CONFIG_ERROR, SophosError
from .settings import Settings

DISCOVERY_TIMEOUT = 60.0
IDEMPOTENCY_KEY = "idempotency_key"
"""A tool argument the runtime fills in itself (see `model_facing` and `with_idempotency_key`)."""
_PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_SERVER_NAME = re.compile(r"[A-Za-z0-9-]+")  # fullmatch: `$` would let a trailing newline through


@dataclass(frozen=True)
class ServerConfig:
    """One MCP server: a stdio command or a streamable HTTP url."""

    name: str
    command: str | None = None
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    url: str | None = None
    approval: bool | tuple[str, ...] = False
    """Which of its tools need approval: all (True), none (False) or these (by their MCP names)."""
    per_user: bool = False
    """One server process per user (`"per_user": true`): started for a run of that user's
    conversation, with `${MEMORY_FILE_PATH}` and `${SOPHOS_LAB_USER}` that user's (see `McpTools`)."""

    @property
    def transport(self) -> str:
        return "stdio" if self.command else "http"

    def needs_approval(self, tool: str) -> bool:
        """Whether the server's tool `tool` (its MCP name) needs approval."""
        return self.approval is True or (isinstance(self.approval, tuple) and tool in self.approval)


def approval_rule(servers: list[ServerConfig]) -> Callable[[str], bool]:
    """Whether a tool, by the name the model calls it (`<server>__<tool>`), needs approval."""
    by_name = {server.name: server for server in servers}

    def needs_approval(name: str) -> bool:
        server, _, tool = name.partition("__")
        return server in by_name and by_name[server].needs_approval(tool)

    return needs_approval


class ToolsUnavailable(Exception):
    """Discovery failed: a server did not start, answer or list its tools."""


def user_memory_path(settings: Settings, user: str) -> Path:
    """Where a user's per-user memory server keeps its file: `users/<user id>/` beside the
    shared one (`MEMORY_FILE_PATH`)."""
    return settings.memory_file_path.parent / "users" / user / settings.memory_file_path.name


@functools.cache
def _kit_root() -> Path:
    """Where the kit is (resolved once: a run reads `mcp.json` a few times a turn)."""
    return Path(__file__).resolve().parents[2]


def kit_variables(settings: Settings, user: str | None = None) -> Mapping[str, str]:
    """The `${VAR}` values the kit supplies on top of the environment: for a user's servers
    (`user`, an id), `MEMORY_FILE_PATH` is that user's file and `SOPHOS_LAB_USER` its id. Each is
    worked out when it is looked up: a run checks `mcp.json` every turn, naming few of them."""
    root = _kit_root()

    def fetch_python() -> Path:
        # A venv of its own starts the fetch server in about 1 s instead of 4: the kit's venv
        # makes it import jupyter's jsonschema format checkers. Without one, ours serves.
        own = root / ".tools" / "fetch" / "bin" / "python"
        return own if own.exists() else Path(sys.executable)

    return _Values({
        "MEMORY_FILE_PATH": lambda: str(settings.memory_file_path if user is None else user_memory_path(settings, user)),
        "SOPHOS_LAB_USER": lambda: user or "",
        "SOPHOS_LAB_PYTHON": lambda: sys.executable,
        "SOPHOS_LAB_FETCH_PYTHON": lambda: str(fetch_python()),
        "SOPHOS_LAB_FETCH_BIN": lambda: str(fetch_python().parent),
        "SOPHOS_LAB_ROOT": lambda: str(root),
        # The ledger server of lesson 07: its database next to the memory file, and where it
        # reports a committed payment (a lab sets it to hold the report; unset, it reports nowhere).
        "LEDGER_PATH": lambda: os.environ.get("LEDGER_PATH") or str(settings.memory_file_path.with_name("ledger.db")),
        "LEDGER_NOTIFY_URL": lambda: os.environ.get("LEDGER_NOTIFY_URL", ""),
    })


class _Values(Mapping[str, str]):
    """A mapping whose values are computed when looked up."""

    def __init__(self, values: dict[str, Callable[[], str]]) -> None:
        self._values = values

    def __getitem__(self, key: str) -> str:
        return self._values[key]()

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


class _DuplicateKey(Exception):
    """A JSON object names the same key twice (`json` would keep the last one silently)."""


@dataclass(frozen=True)
class _FileRead:
    stamp: tuple[int, int, int, int]
    """The file's inode, size, mtime and ctime (ns) when it was read."""
    text: str


_config_reads: dict[Path, _FileRead] = {}

RECENT_CHANGE_NS = 100_000_000
"""A file changed this recently (0.1 s) is read again next time: a filesystem's timestamps are
coarse (a few ms on ext4), so a second change within the same tick could keep every stamp equal
(git's "racy clean" rule)."""


def read_config_file(path: Path, what: str) -> str:
    """A configuration file's text; missing, unreadable or not UTF-8 is a CONFIG_ERROR naming it.

    Read once per change: a run reads `mcp.json` and `system.md` several times per turn, and
    each time costs a `stat` while the file's stamps (inode, size, mtime, ctime) stay the same."""
    key = path.absolute()
    try:
        stat = key.stat()
        stamp = (stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
        known = _config_reads.get(key)
        if known is not None and known.stamp == stamp:
            return known.text
        text = key.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SophosError(CONFIG_ERROR, f"{what} not found: {key}") from None
    except OSError as error:
        raise SophosError(CONFIG_ERROR, f"{path}: cannot read the file ({error.strerror or error})") from None
    except UnicodeDecodeError as error:
        raise SophosError(CONFIG_ERROR, f"{path}: not UTF-8 text ({error})") from None
    if time.time_ns() - max(stat.st_mtime_ns, stat.st_ctime_ns) > RECENT_CHANGE_NS:
        _config_reads[key] = _FileRead(stamp, text)
    else:
        _config_reads.pop(key, None)
    return text


def mcp_servers(settings: Settings, user: str | None = None) -> list[ServerConfig]:
    """The servers of `settings`' `mcp.json`, with `${VAR}` from the environment and the kit
    (a user's values, for `user`)."""
    # Looked up only for the `${VAR}`s the file names: copying the environment costs more.
    return load_mcp_config(settings.mcp_config_path, ChainMap(kit_variables(settings, user), os.environ))


def load_mcp_config(path: Path, variables: Mapping[str, str]) -> list[ServerConfig]:
    """Read and check `mcp.json`: a JSON object mapping server names to connection objects."""
    text = read_config_file(path, "MCP configuration")
    try:
        data = json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKey as error:
        raise SophosError(CONFIG_ERROR, f"{path}: the key {error.args[0]!r} appears twice") from None
    except RecursionError:
        raise SophosError(CONFIG_ERROR, f"{path}: not valid JSON (nested too deeply)") from None
    except ValueError as error:  # JSONDecodeError, or an integer too long to convert
        raise SophosError(CONFIG_ERROR, f"{path}: not valid JSON ({error})") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise SophosError(CONFIG_ERROR, f"{path} must map server names to objects")
    return [_server_config(path, name, entry, variables) for name, entry in data.items()]


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    data = dict(pairs)
    if len(data) < len(pairs):
        keys = [key for key, _ in pairs]
        raise _DuplicateKey(next(key for key in keys if keys.count(key) > 1))
    return data


def _server_config(path: Path, name: str, entry: dict, variables: Mapping[str, str]) -> ServerConfig:
    def bad(why: str) -> SophosError:
        return SophosError(CONFIG_ERROR, f"{path}: server {name!r}: {why}")

    def check_text(value: str, where: str) -> None:
        # Neither can reach a process: argv, env and paths are NUL-terminated bytes, and a lone
        # surrogate (only a JSON `\uD800` escape makes one) has no UTF-8 encoding.
        if "\0" in value:
            raise bad(f"{where} may not contain NUL characters")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise bad(f"{where} is not valid Unicode (it has a lone surrogate)") from None

    def expand(value: object, where: str, required: bool = False) -> str:
        if not isinstance(value, str):
            raise bad(f"{where} must be a string")
        check_text(value, where)  # before expansion: the environment may hold surrogate escapes

        def lookup(match: re.Match) -> str:
            if match.group(1) not in variables:
                raise bad(f"{where} uses ${{{match.group(1)}}}, which is not set")
            return variables[match.group(1)]

        expanded = _PLACEHOLDER.sub(lookup, value)
        if required and not expanded:
            raise bad(f"{where} may not be empty")
        return expanded

    def env_name(key: str) -> str:
        check_text(key, "env names")
        if not key:
            raise bad("env names may not be empty")
        if "=" in key:
            raise bad("env names may not contain '='")
        return key

    if not _SERVER_NAME.fullmatch(name):
        raise bad("names may use letters, digits and '-' only")
    unknown = set(entry) - {"command", "args", "env", "cwd", "url", "transport", "approval", "per_user"}
    if unknown:
        raise bad(f"unknown keys {sorted(unknown)}")
    if ("command" in entry) == ("url" in entry):
        raise bad("give exactly one of 'command' (stdio) or 'url' (streamable HTTP)")
    approval = entry.get("approval", False)
    if isinstance(approval, list) and all(isinstance(tool, str) and tool for tool in approval):
        approval = tuple(approval)
    elif not isinstance(approval, bool):
        raise bad("approval must be true, false or a list of the server's tool names")
    per_user = entry.get("per_user", False)
    if not isinstance(per_user, bool):
        raise bad("per_user must be true or false")
    if "url" in entry:
        return ServerConfig(name=name, url=expand(entry["url"], "url", required=True), approval=approval,
                            per_user=per_user)
    args = entry.get("args", [])
    env = entry.get("env", {})
    if not isinstance(args, list):
        raise bad("args must be a list of strings")
    if not isinstance(env, dict):
        raise bad("env must map names to strings")
    return ServerConfig(
        name=name,
        command=expand(entry["command"], "command", required=True),
        args=tuple(expand(arg, "args") for arg in args),
        env={env_name(key): expand(value, f"env.{key}") for key, value in env.items()},
        cwd=expand(entry["cwd"], "cwd", required=True) if "cwd" in entry else None,
        approval=approval,
        per_user=per_user,
    )


@contextlib.asynccontextmanager
async def open_session(server: ServerConfig, errlog: IO[str]):
    """An initialised MCP client session to one server."""
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client
    from mcp.client.streamable_http import streamable_http_client

    if server.command:
        params = StdioServerParameters(
            command=server.command, args=list(server.args), env=dict(server.env) or None, cwd=server.cwd
        )
        transport = stdio_client(params, errlog=errlog)
    else:
        transport = streamable_http_client(server.url)
    async with transport as streams:
        async with ClientSession(streams[0], streams[1]) as session:
            await session.initialize()
            yield session


async def discover_tools(session: Any, server_name: str) -> list[BaseTool]:
    """The server's tools, renamed `<server>__<tool>` like the original."""
    from langchain_mcp_adapters.tools import load_mcp_tools

    tools = await load_mcp_tools(session, server_name=server_name)
    # The adapter's call closure keeps the MCP tool's own name, so renaming is safe.
    return [tool.model_copy(update={"name": f"{server_name}__{tool.name}"}) for tool in tools]


def takes_idempotency_key(tool: BaseTool) -> bool:
    """Whether an MCP tool's input schema (a JSON schema dict) has an `idempotency_key` property."""
    return isinstance(tool.args_schema, dict) and IDEMPOTENCY_KEY in tool.args_schema.get("properties", {})


def model_facing(tools: list[BaseTool]) -> list[BaseTool]:
    """The tools as the model is shown them: without an `idempotency_key` argument.

    A key the model invents is not replay-safe: a re-sampled agent step may invent another one,
    and a model may reuse one for a genuinely new request. So the model never sees the argument,
    and the tools node fills it in (`with_idempotency_key`).
    """
    shown = []
    for tool in tools:
        if takes_idempotency_key(tool):
            schema = dict(tool.args_schema)
            schema["properties"] = {k: v for k, v in schema["properties"].items() if k != IDEMPOTENCY_KEY}
            schema["required"] = [k for k in schema.get("required", []) if k != IDEMPOTENCY_KEY]
            tool = tool.model_copy(update={"args_schema": schema})
        shown.append(tool)
    return shown


def with_idempotency_key(call: ToolCall, tool: BaseTool | None, thread_id: str) -> ToolCall:
    """`call` with `idempotency_key = "<thread_id>:<tool_call_id>"` if its tool takes one.

    The key is derived, not stored: the tool call (and its id) is in the checkpoint before the
    tools step runs, so a resume that repeats the step derives the same key, and the server can
    tell the replay from a new request. A genuinely new tool call has a new id, hence a new key.
    Whatever the model put in that argument is overwritten.
    """
    if tool is None or not takes_idempotency_key(tool):
        return call
    return {**call, "args": {**call["args"], IDEMPOTENCY_KEY: f"{thread_id}:{call['id']}"}}


class ToolHost:
    """One set of MCP servers, discovered once on first need, over persistent sessions.

    The sessions are entered and left inside one asyncio task (the host), as the MCP client
    requires; tools found there are safe to call from any task on the same loop.
    """

    def __init__(self, servers: Callable[[], list[ServerConfig]], log_dir: Path | None = None,
                 log_name: Callable[[str], str] = lambda server: server) -> None:
        self.servers = servers
        """Reads the servers from `mcp.json` (again on each discovery)."""
        self.log_dir = log_dir
        self.log_name = log_name
        self._tools: asyncio.Future[list[BaseTool]] | None = None
        self._stop: asyncio.Event | None = None
        self._host: asyncio.Task | None = None

    @property
    def discovered(self) -> bool:
        return self.found() is not None

    def found(self) -> list[BaseTool] | None:
        """The tools, once discovered (without waiting); else None."""
        tools = self._tools
        return tools.result() if tools is not None and tools.done() and not tools.exception() else None

    async def get(self) -> list[BaseTool]:
        """All tools; concurrent first callers share one discovery attempt."""
        if self._tools is None:
            self._tools = asyncio.get_running_loop().create_future()
            self._stop = asyncio.Event()
            self._host = asyncio.create_task(self._serve(self._tools, self._stop))
        tools_future = self._tools
        try:
            return await asyncio.shield(tools_future)
        except ToolsUnavailable:
            if self._tools is tools_future:
                self._tools = None  # the next run retries with mcp.json read again
            raise

    async def aclose(self) -> None:
        """Stop the servers this host started."""
        host, stop = self._host, self._stop
        self._tools = self._host = self._stop = None
        if host is not None and stop is not None:
            stop.set()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(host, timeout=10)

    async def _serve(self, ready: asyncio.Future, stop: asyncio.Event) -> None:
        """Start every server at once, each in a task of its own; serve until `stop`.

        Whatever happens, `ready` gets an answer: a waiting run must never hang on it.
        """
        hosts: list[asyncio.Task] = []
        try:
            servers = self.servers()
            found = [asyncio.get_running_loop().create_future() for _ in servers]
            hosts = [asyncio.create_task(self._serve_one(s, f, stop)) for s, f in zip(servers, found)]
            results = await asyncio.gather(*found)
        except BaseException as error:
            stop.set()  # close what did start before saying so: the caller may retry at once
            await asyncio.gather(*hosts, return_exceptions=True)
            if not ready.done():
                ready.set_exception(_unavailable(error))
            if isinstance(error, asyncio.CancelledError):
                raise
            return
        ready.set_result([tool for tools in results for tool in tools])
        await asyncio.gather(*hosts, return_exceptions=True)

    async def _serve_one(self, server: ServerConfig, found: asyncio.Future, stop: asyncio.Event) -> None:
        """Hold one server's session open (entered and left in this task) until `stop`."""
        try:
            with self._errlog(server.name) as errlog:
                async with contextlib.AsyncExitStack() as stack:
                    # asyncio.timeout, not wait_for: on 3.11 wait_for runs the coroutine in
                    # another task, and the MCP client's cancel scopes must stay in this one.
                    async with asyncio.timeout(DISCOVERY_TIMEOUT):
                        session = await stack.enter_async_context(open_session(server, errlog))
                        tools = await discover_tools(session, server.name)
                    found.set_result(tools)
                    await stop.wait()
        except BaseException as error:  # anyio wraps failures in exception groups
            if not found.done():
                found.set_exception(
                    ToolsUnavailable(f'Failed to load tools from server "{server.name}": {_describe(error)}')
                )
            if isinstance(error, asyncio.CancelledError):
                raise

    def _errlog(self, server_name: str) -> contextlib.AbstractContextManager[IO[str]]:
        """Where a stdio server's stderr goes: a log file in the lab, else this process's stderr."""
        if self.log_dir is None:
            return contextlib.nullcontext(sys.__stderr__)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return open(self.log_dir / f"mcp-{self.log_name(server_name)}.log", "a", encoding="utf-8")


class McpTools:
    """The process's MCP tools: the shared servers, and each user's own (`"per_user": true`).

    `get()` gives every tool, one process per server for the life of the process (the
    single-user mode, and runs on conversations of no user). `get(user)` gives the shared
    servers' tools and that user's own servers' tools: a per-user server is started for the
    user on first need, with the user's `${MEMORY_FILE_PATH}` (`user_memory_path`), so one
    user's memory server never opens another's file, and the model has no say in which
    (the user is the conversation's owner, not an argument). While a run of the user holds
    them (`hold`/`release`), they stay; `idle_seconds` after the last run of the user here
    ends, they stop, and the next run starts them again.
    """

    def __init__(self, settings: Settings, log_dir: Path | None = None, idle_seconds: float = 300.0) -> None:
        self.settings = settings
        self.log_dir = log_dir
        self.idle_seconds = idle_seconds
        self._shared = ToolHost(lambda: [s for s in mcp_servers(settings) if not s.per_user], log_dir)
        self._hosts: dict[str | None, ToolHost] = {}
        """Per-user servers by user id (None: those servers for no user, at the shared file)."""
        self._holds: dict[str, int] = {}
        self._idle: dict[str, asyncio.Task] = {}

    @property
    def discovered(self) -> bool:
        return self._shared.discovered

    async def get(self, user: str | None = None) -> list[BaseTool]:
        """The tools a run on a conversation of `user` (an id; None: no user) may call; concurrent
        first callers share one discovery attempt."""
        host = self._hosts.get(user)
        if host is None:
            host = self._hosts[user] = ToolHost(self._user_servers(user), self.log_dir,
                                                (lambda name: name) if user is None else (lambda name: f"{name}-{user}"))
        shared, own = self._shared.found(), host.found()
        if shared is None or own is None:  # a discovery to wait for (after it, every step of a run)
            shared, own = await asyncio.gather(self._shared.get(), host.get())
        return [*shared, *own]

    def _user_servers(self, user: str | None) -> Callable[[], list[ServerConfig]]:
        def servers() -> list[ServerConfig]:
            found = [s for s in mcp_servers(self.settings, user) if s.per_user]
            if user is not None and found:
                user_memory_path(self.settings, user).parent.mkdir(parents=True, exist_ok=True)
            return found
        return servers

    def hold(self, user: str | None) -> None:
        """A run of `user` begins here: its servers stay up until it `release`s them."""
        if user is None:
            return
        self._holds[user] = self._holds.get(user, 0) + 1
        idle = self._idle.pop(user, None)
        if idle is not None:
            idle.cancel()

    def release(self, user: str | None) -> None:
        """A run of `user` ended here; the last one starts the idle clock of its servers."""
        if user is None or user not in self._holds:
            return
        self._holds[user] -= 1
        if self._holds[user] == 0:
            del self._holds[user]
            self._idle[user] = asyncio.get_running_loop().create_task(self._stop_when_idle(user))

    async def _stop_when_idle(self, user: str) -> None:
        await asyncio.sleep(self.idle_seconds)
        if user not in self._holds:
            self._idle.pop(user, None)
            await self.stop_user(user)

    async def stop_user(self, user: str) -> None:
        """Stop `user`'s own servers now (a deleted user's; an idle one's)."""
        host = self._hosts.pop(user, None)
        if host is not None:
            await host.aclose()

    async def aclose(self) -> None:
        """Stop the servers this process started."""
        for idle in self._idle.values():
            idle.cancel()
        self._idle.clear()
        hosts, self._hosts = list(self._hosts.values()), {}
        await asyncio.gather(self._shared.aclose(), *(host.aclose() for host in hosts))


def _unavailable(error: BaseException) -> ToolsUnavailable:
    """Any discovery failure as the one exception the agent node expects."""
    if isinstance(error, ToolsUnavailable):
        return error
    if isinstance(error, SophosError):
        return ToolsUnavailable(error.message)
    return ToolsUnavailable(f"MCP tools unavailable: {_describe(error)}")


def _describe(error: BaseException) -> str:
    """The innermost useful message of a possibly grouped exception."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    if isinstance(error, (asyncio.TimeoutError, TimeoutError)):
        return "timed out"
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__

"""The grading labs' MCP servers, over streamable HTTP: the ledger, and the fetch server.

    python -m sophos_lab.grading.http_servers ledger
    python -m sophos_lab.grading.http_servers fetch COMMAND_JSON

Each binds a loopback port, prints the kit's ready line (`{"ready": true, "url": ".../mcp"}`) and
serves until its stdin closes (its lab has gone). The ledger is the kit's own FastMCP server
(`standins/ledger_server.py`), served over HTTP instead of stdio. The fetch server
(`mcp-server-fetch`) speaks stdio only, so it runs as this process's child, behind a bridge that
passes its tools on unchanged: the same names, schemas, results and errors.

Why HTTP: LangChain's `MultiServerMCPClient.get_tools()` opens a new session for each listing and
each tool call. Over stdio that is a new server process each time (about 0.3 s to start and end);
over HTTP it is a few requests to servers that are already up, so a grading's hundred processes
spend their time on what is graded. Both servers are stateless: a client killed mid-call leaves
nothing behind in them but the call itself, which goes on to its end (a held page, a committed
payment), as a remote server's would.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
from pathlib import Path
from typing import Any

READY_TIMEOUT = 60.0


def ledger_app() -> Any:
    from ..standins import ledger_server

    ledger_server.server.settings.stateless_http = True
    return ledger_server.server.streamable_http_app()


def fetch_app(command: dict[str, Any]) -> Any:
    """A Starlette app serving the stdio server `command` (`{"command", "args", "env", "cwd"}`)'s tools."""
    from mcp import ClientSession, StdioServerParameters, types
    from mcp.client.stdio import stdio_client
    from mcp.server.lowlevel import Server
    from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
    from starlette.applications import Starlette
    from starlette.routing import Mount

    upstream: dict[str, ClientSession] = {}
    server = Server("fetch")

    @server.list_tools()
    async def list_tools() -> list[types.Tool]:
        return (await upstream["session"].list_tools()).tools

    @server.call_tool(validate_input=False)
    async def call_tool(name: str, arguments: dict[str, Any]) -> types.CallToolResult:
        return await upstream["session"].call_tool(name, arguments)

    manager = StreamableHTTPSessionManager(app=server, stateless=True)

    @contextlib.asynccontextmanager
    async def lifespan(app: Any):
        params = StdioServerParameters(command=command["command"], args=command.get("args", []),
                                       env=command.get("env") or None, cwd=command.get("cwd"))
        async with stdio_client(params, errlog=sys.stderr) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            upstream["session"] = session
            async with manager.run():
                yield

    return Starlette(routes=[Mount("/mcp", app=manager.handle_request)], lifespan=lifespan)


def serve(app: Any) -> None:
    """Bind a loopback port, print the ready line, serve until stdin closes."""
    import uvicorn

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    print(json.dumps({"ready": True, "url": f"http://127.0.0.1:{port}/mcp"}), flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))

    def exit_with_parent() -> None:
        sys.stdin.read()
        os._exit(0)

    threading.Thread(target=exit_with_parent, daemon=True).start()
    server.run(sockets=[listener])


def start(kind: str, env: dict[str, str], cwd: Path, log: Path, command: dict[str, Any] | None = None):
    """Start the `kind` server (`ledger` or `fetch`, with its stdio `command`) forked from the fork
    server; the process and its URL."""
    from ..lab.forkserver import start_child

    args = [kind] + ([json.dumps(command)] if command else [])
    with open(log, "ab") as stderr:
        proc = start_child("sophos_lab.grading.http_servers", args, env=env, cwd=cwd, stderr=stderr)
    ready: list[str] = []
    reader = threading.Thread(target=lambda: ready.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(READY_TIMEOUT)
    try:
        return proc, json.loads(ready[0])["url"]
    except (IndexError, ValueError, KeyError):
        proc.kill()
        raise RuntimeError(f"the grading lab's {kind} MCP server did not start; see {log}") from None


def main() -> None:
    kind = sys.argv[1]
    serve(ledger_app() if kind == "ledger" else fetch_app(json.loads(sys.argv[2])))


if __name__ == "__main__":
    main()

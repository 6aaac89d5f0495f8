"""A tiny MCP server over streamable HTTP, for the kit's HTTP transport test.

    python echo_http.py FD

FD is a listening socket the test opened and passed on, so the server is reachable the moment
it starts: connections wait in the socket's backlog, and the test needs no readiness probe.
"""

import sys

import uvicorn
from mcp.server.fastmcp import FastMCP

server = FastMCP("echo", log_level="WARNING")


@server.tool()
def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


@server.tool()
def fail(reason: str) -> str:
    """Always fails, with the reason as the error."""
    raise ValueError(reason)


if __name__ == "__main__":
    uvicorn.run(server.streamable_http_app(), fd=int(sys.argv[1]), log_level="warning")

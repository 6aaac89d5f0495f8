"""MCP servers over streamable HTTP, and what a failed discovery leaves behind."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from langchain_core.messages import ToolMessage

from sophos_lab.lab.harness import dead_port_url
from sophos_lab.runtime.settings import Settings
from sophos_lab.runtime.tools import McpTools, ToolsUnavailable

ECHO_SERVER = Path(__file__).parent / "servers" / "echo_http.py"


@dataclass(frozen=True)
class EchoServer:
    url: str
    pid: int


@pytest.fixture(scope="module")
def echo():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, str(ECHO_SERVER), str(listener.fileno())],
        pass_fds=[listener.fileno()], stderr=subprocess.DEVNULL,
    )
    listener.close()  # the server holds its own copy
    try:
        yield EchoServer(f"http://127.0.0.1:{port}/mcp", proc.pid)
    finally:
        proc.kill()
        proc.wait()


def settings_with(tmp_path: Path, servers: dict) -> Settings:
    config = tmp_path / "config"
    config.mkdir()
    (config / "mcp.json").write_text(json.dumps(servers))
    (config / "system.md").write_text("test")
    return Settings.from_env({"CONFIG_DIR": str(config), "MEMORY_FILE_PATH": str(tmp_path / "m.jsonl")})


def test_tools_of_a_streamable_http_server_are_prefixed_and_callable(tmp_path, echo):
    async def scenario():
        tools = McpTools(settings_with(tmp_path, {"echo": {"url": echo.url}}))
        try:
            by_name = {tool.name: tool for tool in await tools.get()}
            ok = await by_name["echo__echo"].ainvoke(
                {"type": "tool_call", "id": "c1", "name": "echo__echo", "args": {"text": "hello"}}
            )
            failed = await by_name["echo__fail"].ainvoke(
                {"type": "tool_call", "id": "c2", "name": "echo__fail", "args": {"reason": "nope"}}
            )
            return sorted(by_name), ok, failed
        finally:
            await tools.aclose()

    names, ok, failed = asyncio.run(scenario())
    assert names == ["echo__echo", "echo__fail"]
    assert isinstance(ok, ToolMessage) and ok.status == "success" and "hello" in str(ok.content)
    assert failed.status == "error" and "nope" in str(failed.content)


def test_a_failed_discovery_stops_the_servers_it_started_and_the_next_call_retries(tmp_path, echo):
    root = Path(__file__).resolve().parent.parent
    memory = {
        "command": "node",
        "args": [str(root / "node_modules/@modelcontextprotocol/server-memory/dist/index.js")],
        "env": {"MEMORY_FILE_PATH": "${MEMORY_FILE_PATH}"},
    }
    settings = settings_with(tmp_path, {"memory": memory, "broken": {"url": dead_port_url() + "/mcp"}})
    me = psutil.Process()

    async def scenario():
        tools = McpTools(settings)
        before = {p.pid for p in me.children(recursive=True)}  # other tests' servers may be running
        with pytest.raises(ToolsUnavailable, match='Failed to load tools from server "broken"'):
            await tools.get()
        left = [p.name() for p in me.children(recursive=True) if p.pid not in before]
        settings.mcp_config_path.write_text(json.dumps({"memory": memory, "echo": {"url": echo.url}}))
        try:
            names = [tool.name for tool in await tools.get()]
        finally:
            await tools.aclose()
        return left, names

    left, names = asyncio.run(scenario())
    assert left == [], f"a failed discovery left processes running: {left}"
    assert "memory__create_entities" in names and "echo__echo" in names

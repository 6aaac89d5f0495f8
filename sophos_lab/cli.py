"""`sophos-lab`: check the surroundings, serve the scripted model, reset lab state, run notebooks."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

from .agent import check_model
from .settings import Settings
from .tools import McpTools, load_mcp_config, kit_variables

KIT_ROOT = Path(__file__).resolve().parent.parent


def doctor(settings: Settings) -> int:
    """Print what is reachable: the model, each MCP server, node. Returns 0 when all is well."""
    problems = 0
    readiness = check_model(settings)
    print(f"model     {settings.ollama_host} {settings.ollama_model}: {readiness.message}")
    if not readiness.ok:
        problems += 1
        if not os.environ.get("OLLAMA_HOST"):
            print("          (no OLLAMA_HOST: the lab notebooks start the scripted model themselves)")
    node = shutil.which("node")
    print(f"node      {node or 'not found (the memory MCP server needs it)'}")
    problems += node is None
    try:
        servers = load_mcp_config(settings.mcp_config_path, {**os.environ, **kit_variables(settings)})
    except Exception as error:  # a broken config is a finding, not a crash
        print(f"mcp.json  {error}")
        return problems + 1
    tools = McpTools(settings)
    try:
        found = asyncio.run(_discover(tools))
    except Exception as error:
        print(f"mcp       {error}")
        return problems + 1
    for server in servers:
        names = [t.name for t in found if t.name.startswith(server.name + "__")]
        print(f"mcp       {server.name} ({server.transport}): {len(names)} tools {', '.join(names)}")
    return problems


async def _discover(tools: McpTools) -> list:
    try:
        return await tools.get()
    finally:
        await tools.aclose()


def start_lab(port: int, extra: list[str]) -> int:
    """Start JupyterLab on `notebooks/` (loopback only) with the kit's settings in its environment.

    Without `OLLAMA_HOST`, a scripted model server is started first and the kit is pointed at it,
    so a machine with no Ollama works; with `OLLAMA_HOST`, that Ollama is used.
    """
    from ._proc import stop_server
    from .lab import lab_home
    from .scripted_model import start_scripted_model

    env = dict(os.environ)
    env.setdefault("CONFIG_DIR", str(KIT_ROOT / "config"))
    env.setdefault("DATABASE_PATH", str(lab_home() / "default" / "sophos.db"))
    env.setdefault("MEMORY_FILE_PATH", str(lab_home() / "default" / "memory.jsonl"))
    server = None
    if not env.get("OLLAMA_HOST"):
        server, url = start_scripted_model(KIT_ROOT / "data" / "scripts")
        env.update(OLLAMA_HOST=url, OLLAMA_MODEL="scripted")
        print(f"sophos-lab: no OLLAMA_HOST, so the scripted model answers at {url} (deterministic, not an LLM)")
    command = [
        sys.executable, "-m", "jupyterlab", "--ip=127.0.0.1", f"--port={port}", "--no-browser",
        f"--ServerApp.root_dir={KIT_ROOT / 'notebooks'}", *extra,
    ]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        command.append("--allow-root")
    try:
        return subprocess.call(command, env=env)
    except KeyboardInterrupt:
        return 0
    finally:
        if server is not None:
            stop_server(server)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="sophos-lab", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    lab = commands.add_parser("lab", help="start JupyterLab on the notebooks (loopback only)")
    lab.add_argument("--port", type=int, default=8888)
    commands.add_parser("doctor", help="check the model server, the MCP servers and node")
    serve = commands.add_parser("serve-model", help="run the scripted Ollama-compatible model server")
    serve.add_argument("--port", type=int, default=11434)
    commands.add_parser("reset", help="delete all lab state (.lab/)")
    commands.add_parser("worker", help="run the agent as a child process driven over stdin")
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "lab":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")

    if args.command == "lab":
        sys.exit(start_lab(args.port, extra))
    if args.command == "doctor":
        sys.exit(1 if doctor(Settings.from_env()) else 0)
    if args.command == "serve-model":
        from .scripted_model import main as serve_main

        serve_main(["--scripts", str(KIT_ROOT / "data" / "scripts"), "--port", str(args.port)])
    elif args.command == "reset":
        from .lab import lab_home

        shutil.rmtree(lab_home(), ignore_errors=True)
        print(f"removed {lab_home()}")
    elif args.command == "worker":
        from .worker import main as worker_main

        worker_main()


if __name__ == "__main__":
    main()

"""`sophos-lab`: start JupyterLab on the lessons, check the surroundings (`doctor`), serve the
scripted model, reset lab state, keep a database small (`delete`, `prune`, `vacuum`), and copy a
SQLite lab into PostgreSQL (`migrate-to-postgres`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from .database_commands import (add_retention_commands, add_user_commands, migrate_to_postgres, retention,
                                user_command)
from .environment import KIT_ROOT, SCRIPTS_DIR, lab_environment
from .runtime.agent import check_model
from .runtime.settings import Settings
from .runtime.tools import McpTools, load_mcp_config, kit_variables

LAB_READY_TIMEOUT = 90.0
"""How long `lab` waits for JupyterLab to answer before it stops waiting to print the URL."""

# JupyterLab 4's "Would you like to receive official Jupyter news?" pop-up: answered "no" once,
# in the lab's own user settings (a choice made later in Settings is kept).
_NEWS_SETTINGS = ("@jupyterlab", "apputils-extension", "notification.jupyterlab-settings")


def learner_notebooks() -> Path:
    """The learner's copies of the lessons (`.lab/notebooks/`): the folder JupyterLab opens.

    JupyterLab saves a notebook with its outputs (and autosaves it), so a learner working in the
    committed lessons would see last time's answers beside the 🔮 prompts, and leave the git tree
    dirty. Each lesson is copied here once; the copy is the learner's from then on."""
    from .lab.harness import lab_home

    return lab_home() / "notebooks"


def copy_lessons(target: Path | None = None) -> list[str]:
    """Copy each lesson of `notebooks/` that the learner has no copy of yet; the names copied.
    A copy that exists is never overwritten (`sophos-lab reset LESSON` starts one over)."""
    target = learner_notebooks() if target is None else target
    target.mkdir(parents=True, exist_ok=True)
    copied = []
    for lesson in sorted((KIT_ROOT / "notebooks").glob("*.ipynb")):
        if not (target / lesson.name).exists():
            shutil.copy2(lesson, target / lesson.name)
            copied.append(lesson.stem)
    return copied


def lessons() -> list[str]:
    return sorted(path.stem for path in (KIT_ROOT / "notebooks").glob("*.ipynb"))


START_LESSON = "00_start_here.ipynb"
"""The lesson the lab's URL opens."""


def lab_command(port: int, extra: list[str]) -> list[str]:
    """The JupyterLab command line (the token travels in `JUPYTER_TOKEN`, not in `ps` output)."""
    command = [
        sys.executable, "-m", "jupyterlab", "--ip=127.0.0.1", f"--port={port}", "--no-browser",
        f"--ServerApp.root_dir={learner_notebooks()}", *extra,
    ]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        command.append("--allow-root")
    return command


def _switch_off_news(settings_dir: Path) -> None:
    path = settings_dir.joinpath(*_NEWS_SETTINGS)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}, indent=2) + "\n")


def _server_answers(info: dict) -> bool:
    """Does the server of this `jpserver-<pid>.json` answer `/api/status` with its token?"""
    url = info["url"].rstrip("/") + "/api/status"
    request = urllib.request.Request(url, headers={"Authorization": f"token {info['token']}"})
    try:
        with urllib.request.urlopen(request, timeout=2) as response:
            return response.status == 200
    except (OSError, ValueError):
        return False


def wait_for_lab(proc: subprocess.Popen, runtime_dir: Path, timeout: float = LAB_READY_TIMEOUT) -> dict | None:
    """The server's info (port, token, …) once it answers; None if it exited or took too long.

    The server writes `jpserver-<pid>.json` when it listens (with the port it really got: a busy
    port makes it try the next ones); then its `/api/status` must answer. Between looks this
    waits on the process itself, so an exit ends the wait at once.
    """
    info_file = runtime_dir / f"jpserver-{proc.pid}.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            proc.wait(timeout=0.1)
            return None  # it exited
        except subprocess.TimeoutExpired:
            pass
        try:
            info = json.loads(info_file.read_text())
        except (OSError, ValueError):
            continue
        if _server_answers(info):
            return info
    return None


def start_lab(port: int, extra: list[str]) -> int:
    """Start JupyterLab on `notebooks/` (loopback only) with the kit's settings in its environment,
    and print its URL, which opens `00_start_here` with the login token, as the last line: Jupyter's
    own log goes to `.lab/jupyter/lab.log`. Ctrl-C or SIGTERM stops JupyterLab (its kernels with
    it) and the scripted model, and exits 0.

    Without `OLLAMA_HOST`, a scripted model server is started first and the kit is pointed at it,
    so a machine with no Ollama works; with `OLLAMA_HOST`, that Ollama is used.
    """
    from .standins._proc import stop_server
    from .standins.scripted_model import start_scripted_model

    env = lab_environment()
    copied = copy_lessons()
    if copied:
        print(f"sophos-lab: your copies of {len(copied)} lessons are in {learner_notebooks()} "
              "(the committed ones in notebooks/ stay as they are; `sophos-lab reset LESSON` starts one over)",
              flush=True)
    env.setdefault("JUPYTER_TOKEN", secrets.token_urlsafe(24))
    _switch_off_news(Path(env["JUPYTERLAB_SETTINGS_DIR"]))
    runtime_dir = Path(env["JUPYTER_RUNTIME_DIR"])
    server = None
    if not env.get("OLLAMA_HOST"):
        server, url = start_scripted_model(SCRIPTS_DIR)
        env.update(OLLAMA_HOST=url, OLLAMA_MODEL="scripted")
        print(f"sophos-lab: no OLLAMA_HOST, so the kit's scripted model answers (deterministic, not an LLM; "
              f"on {url.removeprefix('http://')})", flush=True)
    proc = None
    # A SIGTERM (`kill`) ends the lab as Ctrl-C does: JupyterLab and the scripted model stop too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    log_path = runtime_dir.parent / "lab.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"sophos-lab: starting JupyterLab (its log: {log_path})", flush=True)
    try:
        with open(log_path, "ab") as log:
            # No terminal for JupyterLab: on Ctrl-C it stops at once instead of asking to confirm.
            proc = subprocess.Popen(lab_command(port, extra), env=env, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT)
        info = wait_for_lab(proc, runtime_dir)
        if info is None:
            print(f"sophos-lab: JupyterLab did not start; its log says why: {log_path}", flush=True)
            return proc.wait() or 1
        print(f"\nsophos-lab: JupyterLab is ready. Open this URL (it carries the login token); Ctrl-C stops it:\n\n"
              f"    http://127.0.0.1:{info['port']}/lab/tree/{START_LESSON}?token={info['token']}", flush=True)
        return proc.wait()  # JupyterLab stopped on its own (Ctrl-C and SIGTERM end this with 0)
    except KeyboardInterrupt:
        return 0
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if server is not None:
            stop_server(server)


def serve_api(host: str, port: int, lab_child: bool = False) -> int:
    """Serve the HTTP API (`sophos_lab.server`) with the kit's settings until SIGTERM or Ctrl-C.

    Anything but loopback needs users (`sophos-lab user add`) or `SOPHOS_LAB_TOKEN` (refused
    here with exit code 2 without either).
    Without `OLLAMA_HOST` a scripted model is started first, as for `lab`. A SIGTERM or Ctrl-C
    drains (see `server.process`) and then exits 0. A lab's child (`lab_child`, `Lab.server()`)
    reports as `@@sophos` event lines on stdout and shuts down when its stdin closes.
    """
    from .server.auth import is_loopback

    env = lab_environment()
    if not is_loopback(host) and not env.get("SOPHOS_LAB_TOKEN") and not _has_users(env):
        print(f"sophos-lab serve: refusing to listen on {host} without a token: anyone who can reach it "
              "could run the agent. Add users (`sophos-lab user add NAME`: each gets a token), or set "
              "SOPHOS_LAB_TOKEN to a long random secret (clients then send Authorization: Bearer <it>), "
              "or listen on 127.0.0.1.", file=sys.stderr)
        return 2
    from .server.app import ServerOptions
    from .server.process import run_server
    from .standins._proc import stop_server
    from .standins.scripted_model import start_scripted_model

    def exit_cleanly(signum: int, frame: object) -> None:
        # uvicorn handles the signal while it serves and raises it again once it has shut down
        # gracefully; then (or before it serves) it ends the process here, with 0.
        raise SystemExit(0)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, exit_cleanly)
    model = None
    try:
        if not env.get("OLLAMA_HOST"):
            model, url = start_scripted_model(SCRIPTS_DIR)
            env.update(OLLAMA_HOST=url, OLLAMA_MODEL="scripted")
            print(f"sophos-lab: no OLLAMA_HOST, so the scripted model answers at {url} (deterministic, not an LLM)",
                  flush=True)
        if lab_child:
            from .lab.worker import emit_line

            run_server(Settings.from_env(env), ServerOptions.from_env(env), host, port,
                       announce=lambda event, **data: emit_line({"event": event, "data": data}),
                       exit_with_stdin=True)
        else:
            run_server(Settings.from_env(env), ServerOptions.from_env(env), host, port)
    finally:
        if model is not None:
            stop_server(model)
    return 0


def _has_users(env: Mapping[str, str]) -> bool:
    """Whether the database has users, opening nothing that is not there yet (a SQLite file is
    only read, and only if it exists)."""
    import sqlite3

    from .runtime import users
    from .runtime.storage import open_storage
    from .runtime.storage.blocking import Blocking

    settings = Settings.from_env(env)
    if not settings.database_url:
        if not settings.database_path.exists():
            return False
        conn = sqlite3.connect(f"file:{settings.database_path}?mode=ro", uri=True)
        try:
            return conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'users'").fetchone() is not None and \
                conn.execute("SELECT 1 FROM users LIMIT 1").fetchone() is not None
        finally:
            conn.close()
    with Blocking(lambda: open_storage(settings)) as store:
        return store.call(users.has_users)


def doctor(environ: Mapping[str, str] | None = None) -> int:
    """Print what the lab would use and whether it is reachable: the model, node, each MCP server.

    Returns the number of problems (0 when all is well). Without `OLLAMA_HOST` the lab answers
    with the scripted model, so that is what is checked: one is started, asked and stopped.
    MCP servers' stderr goes to `.lab/doctor/mcp-<server>.log`, not to the terminal.
    """
    from .standins._proc import stop_server
    from .lab.harness import lab_home
    from .standins.scripted_model import start_scripted_model

    env = lab_environment(environ)
    problems = 0
    if env.get("OLLAMA_HOST"):
        settings = Settings.from_env(env)
        readiness = check_model(settings)
        print(f"model     {settings.ollama_host} {settings.ollama_model}: {readiness.message}")
        if not readiness.ok and readiness.models:
            print(f"          models there: {', '.join(readiness.models)}")
    else:
        server, url = start_scripted_model(SCRIPTS_DIR)
        try:
            settings = Settings.from_env({**env, "OLLAMA_HOST": url, "OLLAMA_MODEL": "scripted"})
            readiness = check_model(settings)
        finally:
            stop_server(server)
        print(f"model     scripted model (no OLLAMA_HOST, so the lab starts one; not an LLM): {readiness.message}")
    problems += not readiness.ok
    if settings.database_url:
        from .runtime.storage.postgres import check, is_postgres_url

        ok, said = check(settings.database_url) if is_postgres_url(settings.database_url) else (
            False, "DATABASE_URL is not a postgresql:// URL")
        print(f"database  {said}")
        problems += not ok
    else:
        there = "exists" if settings.database_path.exists() else "not created yet (the first run makes it)"
        print(f"database  SQLite file {settings.database_path}: {there}")
    node = shutil.which("node", path=env.get("PATH"))
    print(f"node      {node or 'not found (the memory MCP server needs it)'}")
    problems += node is None
    try:
        servers = load_mcp_config(settings.mcp_config_path, {**env, **kit_variables(settings)})
    except Exception as error:  # a broken config is a finding, not a crash
        print(f"mcp.json  {error}")
        return problems + 1
    log_dir = lab_home() / "doctor"
    tools = McpTools(settings, log_dir=log_dir)
    try:
        found = asyncio.run(_discover(tools))
    except Exception as error:
        print(f"mcp       {error}")
        print(f"          (the servers' stderr: {log_dir}/mcp-<server>.log)")
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


def reset(names: list[str] | None = None) -> str:
    """Delete the lab home (names: only those lessons' copies and lab folders); say what happened."""
    from .lab.harness import lab_home

    home = lab_home()
    if names:
        unknown = sorted(set(names) - set(lessons()))
        if unknown:
            raise SystemExit(f"sophos-lab reset: no lesson {', '.join(unknown)}; the lessons are: {', '.join(lessons())}")
        for name in names:
            shutil.rmtree(home / name, ignore_errors=True)
            copy = learner_notebooks() / f"{name}.ipynb"
            copy.unlink(missing_ok=True)
        copy_lessons()
        return (f"started over: {', '.join(names)} (a fresh copy of the lesson in {learner_notebooks()}, "
                "its lab folder removed; the other lessons are untouched)")
    if not home.exists():
        return f"nothing to remove: {home} does not exist"
    shutil.rmtree(home, ignore_errors=True)
    return f"removed {home}" if not home.exists() else f"could not remove all of {home}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="sophos-lab", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    lab = commands.add_parser(
        "lab", help="start JupyterLab on the notebooks (loopback only) and print its URL with the token")
    lab.add_argument("--port", type=int, default=8888,
                     help="JupyterLab's port (default 8888; 0 picks a free one; if it is busy, "
                          "JupyterLab tries the next ones and the printed URL says which)")
    commands.add_parser("doctor", help="check the model the lab would use, the MCP servers and node")
    serve = commands.add_parser("serve-model", help="run the scripted Ollama-compatible model server")
    serve.add_argument("--port", type=int, default=11434,
                       help="port to listen on (default 11434, Ollama's own; 0 picks a free one)")
    api = commands.add_parser(
        "serve", help="serve the HTTP API and SSE stream (the original's /api/...) over the agent")
    api.add_argument("--host", default="127.0.0.1",
                     help="interface to listen on (default 127.0.0.1; anything else needs users or SOPHOS_LAB_TOKEN)")
    api.add_argument("--port", type=int, default=5174, help="port (default 5174; 0 picks a free one)")
    api.add_argument("--lab-child", action="store_true", help=argparse.SUPPRESS)
    reset_parser = commands.add_parser(
        "reset", help="start lessons over: LESSON ... replaces your copy of each and removes its lab "
                      "folder; with no LESSON, deletes all lab state (.lab/: every copy, database, setting)")
    reset_parser.add_argument("lessons", nargs="*", metavar="LESSON", help="e.g. 00_start_here")
    commands.add_parser("agent-child", help="run the agent as a child process driven over stdin (the lab's)")
    worker = commands.add_parser(
        "worker", help="claim and run queued runs (PostgreSQL, with SOPHOS_LAB_RUNS=workers on the servers)",
        description="Claim runs that servers with SOPHOS_LAB_RUNS=workers queued in DATABASE_URL and run them; "
                    "SIGTERM drains (each run stops at its next step boundary, is recorded) and exits 0.")
    worker.add_argument("--concurrency", type=int, default=1, help="runs this worker runs at once (default 1)")
    pool = commands.add_parser(
        "worker-pool", help="start N workers and restart any that dies (its runs relabelled at once)")
    pool.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    pool.add_argument("--concurrency", type=int, default=1, help="runs each worker runs at once (default 1)")
    add_retention_commands(commands)
    add_user_commands(commands)
    from .grading import command as grading_command

    grading_command.add_parser(commands)
    copy = commands.add_parser(
        "migrate-to-postgres", help="copy a SQLite lab (conversations, checkpoint history, runs, gates) into PostgreSQL",
        description="Copy everything the SQLite file holds into an empty PostgreSQL database, read every "
                    "thread back from both and compare; refused while a live process runs a run in the file.")
    copy.add_argument("--database", metavar="PATH",
                      help="the SQLite file (default: DATABASE_PATH, else the lab's .lab/default/sophos.db)")
    copy.add_argument("--to", metavar="URL", help="the PostgreSQL database (default: DATABASE_URL)")
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "lab":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")

    if args.command == "lab":
        sys.exit(start_lab(args.port, extra))
    if args.command == "doctor":
        sys.exit(1 if doctor() else 0)
    if args.command == "serve-model":
        from .standins.scripted_model import main as serve_main

        serve_main(["--scripts", str(SCRIPTS_DIR), "--port", str(args.port)])
    elif args.command == "serve":
        sys.exit(serve_api(args.host, args.port, args.lab_child))
    elif args.command == "reset":
        print(reset(args.lessons))
    elif args.command == "agent-child":
        from .lab.worker import main as child_main

        child_main()
    elif args.command in ("worker", "worker-pool"):
        if args.concurrency < 1 or (args.command == "worker-pool" and args.workers < 1):
            parser.error("--workers and --concurrency must be at least 1")
        from .runtime import workers

        sys.exit(workers.worker_main(args.concurrency) if args.command == "worker"
                 else workers.worker_pool(args.workers, args.concurrency))
    elif args.command in ("delete", "prune", "vacuum"):
        sys.exit(retention(args))
    elif args.command == "migrate-to-postgres":
        sys.exit(migrate_to_postgres(args))
    elif args.command == "user":
        sys.exit(user_command(args))
    elif args.command == "grade":
        sys.exit(grading_command.run(args))


if __name__ == "__main__":
    main()

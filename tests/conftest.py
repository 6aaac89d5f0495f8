"""Shared fixtures: one lab, in-process services on fresh databases, async tests.

Everything runs against real parts: the scripted model server over HTTP (the real ChatOllama
client talks to it), the web fixture server, the real MCP servers from `config/mcp.json` over
stdio, and SQLite files in temporary directories.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import shutil
import sqlite3
from dataclasses import dataclass
from pathlib import Path

import pytest

from sophos_lab.runtime.events import Event
from sophos_lab.lab.harness import Lab
from sophos_lab.runtime.service import AgentService

ASYNC_TEST_TIMEOUT = 120.0
"""An async test that has not finished by then fails instead of hanging the suite."""


# --- async tests without a plugin ----------------------------------------------------------


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Run `async def test_...` functions with `asyncio.run`, one event loop per test."""
    if not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    args = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    asyncio.run(asyncio.wait_for(pyfuncitem.obj(**args), ASYNC_TEST_TIMEOUT))
    return True


# --- the lab --------------------------------------------------------------------------------


@pytest.fixture(scope="session", autouse=True)
def lab_home(tmp_path_factory):
    """Labs live in a temporary directory, never in the repository's `.lab/`.

    `OLLAMA_HOST` and `OLLAMA_MODEL` are cleared so that every lab starts the scripted model
    instead of pointing at a real Ollama the developer may have configured.
    """
    home = tmp_path_factory.mktemp("lab-home")
    saved = {name: os.environ.get(name) for name in ("SOPHOS_LAB_HOME", "OLLAMA_HOST", "OLLAMA_MODEL")}
    os.environ["SOPHOS_LAB_HOME"] = str(home)
    os.environ.pop("OLLAMA_HOST", None)
    os.environ.pop("OLLAMA_MODEL", None)
    yield home
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def lab(lab_home):
    """The lab (scripted model + web pages) the in-process tests share.

    Its request log and access log grow across tests: count what a test did as a difference,
    or use a lab of your own (see test_crash.py).
    """
    with Lab.setup("tests", quiet=True) as lab:
        yield lab


OLLAMA_LIKE_MODEL = "ollama-like"


@pytest.fixture(scope="session")
def ollama_like():
    """A second Ollama-protocol server (`servers/ollama_like.py`), not the kit's scripted one, on
    loopback; the URL. It exits with this process."""
    import json
    import subprocess
    import sys

    from sophos_lab.standins._proc import _read_line, stop_server

    server = Path(__file__).resolve().parent / "servers" / "ollama_like.py"
    env = dict(os.environ, SOPHOS_LAB_EXIT_WITH_PARENT="1")
    proc = subprocess.Popen([sys.executable, str(server), "--port", "0"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=env, start_new_session=True)
    line = _read_line(proc, 15)
    try:
        url = json.loads(line)["url"]
    except (ValueError, KeyError):
        stop_server(proc)
        raise RuntimeError(f"ollama_like did not start: {line!r}") from None
    yield url
    stop_server(proc)


# --- in-process services ----------------------------------------------------------------


@pytest.fixture
def db_path(tmp_path):
    """A fresh database file for this test (created on first open)."""
    return tmp_path / "sophos.db"


@pytest.fixture
def config_dir(lab, tmp_path):
    """This test's own copy of the lab's configuration, free to edit."""
    return shutil.copytree(lab.config_dir, tmp_path / "config")


@pytest.fixture
def open_service(lab, tmp_path, db_path, config_dir):
    """`async with open_service(**env) as agent:` an `AgentService` in this process.

    It uses the lab's scripted model and this test's database, memory file and configuration;
    keyword arguments override the environment variables, e.g. `OLLAMA_MODEL="does-not-exist"`.
    Every service opened this way is a fresh start: its store and MCP servers open on first use,
    as in a newly started process, and close when the block ends.
    """

    @contextlib.asynccontextmanager
    async def open_(**env):
        defaults = {
            "DATABASE_PATH": str(db_path),
            "CONFIG_DIR": str(config_dir),
            "MEMORY_FILE_PATH": str(tmp_path / "memory.jsonl"),
        }
        service = AgentService(lab.settings(**{**defaults, **env}), log_dir=tmp_path / "logs")
        try:
            yield service
        finally:
            await service.aclose()

    return open_


# --- small helpers shared by the modules ---------------------------------------------------


def integrity(path) -> str:
    """`PRAGMA integrity_check` of a database file, read-only."""
    conn = sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True)
    try:
        return conn.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        conn.close()


def statuses(service, conversation) -> list[str]:
    return [run.status for run in service.list_runs(conversation)]


def roles(detail) -> list[str]:
    return [message["role"] for message in detail.messages]


# --- a finished conversation to read ------------------------------------------------------


@dataclass
class Finished:
    """A conversation whose one run has completed, in a database of its own."""

    db_path: Path
    conversation: str
    run: str
    events: list[Event]
    page: str
    fetches: int
    """How many times the run fetched `page` from the web fixtures."""


@pytest.fixture(scope="session")
def fetched(lab, tmp_path_factory) -> Finished:
    """`Fetch <index.html>` run to completion once (the fetch-page script); only ever read."""
    root = tmp_path_factory.mktemp("fetched")
    page = lab.page("index.html")
    before = lab.fetches("index.html")

    async def chat():
        service = AgentService(lab.settings(DATABASE_PATH=str(root / "sophos.db")), log_dir=root / "logs")
        try:
            run = await service.chat(f"Fetch {page}")
            return run, [event async for event in run.events()]
        finally:
            await service.aclose()

    run, events = asyncio.run(asyncio.wait_for(chat(), ASYNC_TEST_TIMEOUT))
    return Finished(root / "sophos.db", run.conversation, run.id, events, page, lab.fetches("index.html") - before)


# --- the real browser (Debian's Chromium, driven by Playwright; never downloaded) ----------

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
needs_chromium = pytest.mark.skipif(
    not CHROMIUM.exists(), reason=f"{CHROMIUM} is missing (CI installs Debian's chromium in .ci/run)"
)


def last_bullet() -> str:
    """The last line of the scripted 12-bullet answer, without its "- "."""
    import json

    script = json.loads((Path(__file__).resolve().parent.parent / "data" / "scripts"
                         / "10_fetch_and_summarise.json").read_text())
    answer = next(turn["text"] for turn in script["turns"] if turn.get("pause") == "summary")
    return answer.splitlines()[-1].removeprefix("- ")

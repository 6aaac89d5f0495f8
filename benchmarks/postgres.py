"""The kit on PostgreSQL: time per step against bare LangGraph on `AsyncPostgresSaver`, and
against the kit on its SQLite file, in one run.

The same 10-turn conversation as `steps.py` (scripted model, zero token delay, no MCP servers),
each variant on a fresh database of one embedded PostgreSQL server (Unix socket) started here:

  (a) the kit's `AgentService` with `DATABASE_URL`
  (b) bare LangGraph, the same graph shape, `AsyncPostgresSaver` on a pool, durability "sync"
  (c) the kit's `AgentService` on a SQLite file

the whole listing and a first page of 10,000 conversations of 3 runs each (`listing.py`'s rows,
copied into PostgreSQL), the kit on PostgreSQL against the kit on its SQLite file, and the storage
of one thread of 200 turns of 4 KB (`growth.py`'s turns) in LangGraph's three
tables (`pg_total_relation_size`: rows, TOAST and indexes), the kit's delta channel against bare
LangGraph's default `add_messages` channel on `AsyncPostgresSaver`.

    python benchmarks/postgres.py

`rows(quick)` gives the figures to `benchmarks/bench.py` (`make bench`).
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from steps import TURNS, _turns, bare_graph, run_kit  # noqa: E402

from sophos_lab.lab import postgres_server  # noqa: E402
from sophos_lab.standins._proc import stop_server  # noqa: E402
from sophos_lab.standins.scripted_model import start_scripted_model  # noqa: E402

ROUNDS = 9
STORAGE_TURNS = 200
LANGGRAPH_TABLES = ("checkpoints", "checkpoint_blobs", "checkpoint_writes")


async def run_bare_postgres(url: str, database_url: str) -> float:
    """Seconds for TURNS turns of bare LangGraph on LangGraph's Postgres saver."""
    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

    kwargs = {"autocommit": True, "row_factory": dict_row, "prepare_threshold": None}
    async with AsyncConnectionPool(database_url, kwargs=kwargs, open=False) as pool:
        saver = AsyncPostgresSaver(pool)
        await saver.setup()
        return await _turns(bare_graph(url, saver), {"configurable": {"thread_id": "bench"}, "recursion_limit": 25})


async def measure(rounds: int = ROUNDS) -> dict[str, list[float]]:
    """Seconds per step of each variant, one figure per round (the rounds interleave them)."""
    folder = Path(tempfile.mkdtemp(prefix="sophos-pg-bench-"))
    server = postgres_server.start(folder / "pg")
    model, url = start_scripted_model(ROOT / "data" / "scripts")
    results: dict[str, list[float]] = {"kit": [], "bare": [], "sqlite": []}
    try:
        for _ in range(rounds):
            for name in results:
                with tempfile.TemporaryDirectory() as tmp:
                    database = postgres_server.new_database(server.url, f"bench_{name}") if name != "sqlite" else None
                    if name == "bare":
                        seconds = await run_bare_postgres(url, database)
                    else:
                        seconds = await run_kit(url, Path(tmp), database_url=database)
                    if database:
                        postgres_server.drop_database(server.url, database)
                results[name].append(seconds / TURNS)
    finally:
        stop_server(model)
        shutil.rmtree(folder, ignore_errors=True)
    return results


def table_bytes(database_url: str) -> int:
    import psycopg

    with psycopg.connect(database_url) as conn:
        return conn.execute("SELECT sum(pg_total_relation_size(c.oid))::bigint FROM pg_class c WHERE relname = ANY(%s)",
                            (list(LANGGRAPH_TABLES),)).fetchone()[0]


async def storage(turns: int = STORAGE_TURNS) -> dict[str, int]:
    """Bytes of LangGraph's tables after one thread of `turns` 4 KB turns, each side on a fresh
    database; and the raw bytes of the thread's user messages."""
    from growth import user_message
    from langchain_core.messages import HumanMessage
    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

    from sophos_lab.runtime.service import AgentService
    from sophos_lab.runtime.settings import Settings

    folder = Path(tempfile.mkdtemp(prefix="sophos-pg-bench-"))
    server = postgres_server.start(folder / "pg")
    model, url = start_scripted_model(ROOT / "data" / "scripts")
    found = {"raw": sum(len(user_message(t).encode()) for t in range(turns))}
    try:
        kit_db, bare_db = (postgres_server.new_database(server.url, name) for name in ("kit", "bare"))
        config = folder / "config"
        config.mkdir()
        (config / "mcp.json").write_text("{}")
        (config / "system.md").write_text("You are a benchmark.")
        service = AgentService(Settings.from_env({
            "OLLAMA_HOST": url, "OLLAMA_MODEL": "scripted", "DATABASE_URL": kit_db, "CONFIG_DIR": str(config),
            "MEMORY_FILE_PATH": str(folder / "memory.jsonl"), "DATABASE_PATH": str(folder / "unused.db")}))
        try:
            conversation = None
            for turn in range(turns):
                run = await service.chat(user_message(turn), conversation)
                conversation = run.conversation
                await run.wait()
        finally:
            await service.aclose()
        found["kit"] = table_bytes(kit_db)
        kwargs = {"autocommit": True, "row_factory": dict_row, "prepare_threshold": None}
        async with AsyncConnectionPool(bare_db, kwargs=kwargs, open=False) as pool:
            saver = AsyncPostgresSaver(pool)
            await saver.setup()
            graph = bare_graph(url, saver)
            config_ = {"configurable": {"thread_id": "bench"}, "recursion_limit": 25}
            for turn in range(turns):
                await graph.ainvoke({"messages": [HumanMessage(user_message(turn))]}, config_, durability="sync")
        found["bare"] = table_bytes(bare_db)
    finally:
        stop_server(model)
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)
    return found


def listing(conversations: int, repeat: int) -> dict[str, tuple[list[float], list[float]]]:
    """Milliseconds of `list_conversations()` and of a first page of 50, each on PostgreSQL
    and on the SQLite file with the same rows, alternating."""
    import psycopg
    from listing import fill, paired_ms

    from sophos_lab.runtime.storage import postgres_storage, sqlite_storage
    from sophos_lab.runtime.storage.blocking import Blocking

    folder = Path(tempfile.mkdtemp(prefix="sophos-pg-bench-"))
    server = postgres_server.start(folder / "pg")
    try:
        path = folder / "listing.db"
        fill(path, conversations)
        url = postgres_server.new_database(server.url, "listing")
        with Blocking(lambda: postgres_storage(url)) as store:
            store.open()  # migrated
        import sqlite3

        source = sqlite3.connect(path)
        with psycopg.connect(url) as conn, conn.cursor() as cursor:
            cursor.executemany("INSERT INTO conversations (id, title, created_at, updated_at, message_count)"
                               " VALUES (%s, %s, %s, %s, %s)", source.execute(
                                   "SELECT id, title, created_at, updated_at, message_count FROM conversations ORDER BY rowid"))
            cursor.executemany("INSERT INTO runs (id, conversation_id, status, started_at, finished_at)"
                               " VALUES (%s, %s, %s, %s, %s)", source.execute(
                                   "SELECT id, conversation_id, status, started_at, finished_at FROM runs ORDER BY rowid"))
            cursor.execute("ANALYZE")
        source.close()
        # Each awaited on a loop of its own (`Blocking`): the same hop on both sides.
        on_postgres, on_sqlite = Blocking(lambda: postgres_storage(url)), Blocking(lambda: sqlite_storage(path))
        try:
            assert on_postgres.list_conversations() == on_sqlite.list_conversations()  # the same rows, in order
            return {
                "whole": paired_ms(on_postgres.list_conversations, on_sqlite.list_conversations, repeat),
                "page": paired_ms(on_postgres.conversation_page, on_sqlite.conversation_page, repeat),
            }
        finally:
            on_postgres.close()
            on_sqlite.close()
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


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


def takeover(rounds: int) -> dict[str, list[float]]:
    """`kill_then_the_other_resumes` on a PostgreSQL lab and on a SQLite lab, interleaved."""
    from startup import lab_in

    found: dict[str, list[float]] = {"postgres": [], "sqlite": []}
    with tempfile.TemporaryDirectory() as home, lab_in(Path(home), "bench-pg-takeover", postgres=True) as on_postgres, \
            lab_in(Path(home), "bench-sqlite-takeover") as on_sqlite:
        for _ in range(rounds):
            found["postgres"].append(kill_then_the_other_resumes(on_postgres))
            found["sqlite"].append(kill_then_the_other_resumes(on_sqlite))
    return found


def rows(quick: bool = False) -> list[dict]:
    count = 1000 if quick else 10_000
    taken = takeover(1 if quick else 5)
    listed = listing(count, 5 if quick else 21)
    sizes = asyncio.run(storage(turns=50 if quick else STORAGE_TURNS))
    results = asyncio.run(measure(rounds=3 if quick else ROUNDS))
    ms = {name: [value * 1000 for value in values] for name, values in results.items()}
    scale = f"{TURNS}-turn conversation, embedded PostgreSQL 18 on a Unix socket"
    return [
        {"benchmark": "postgres", "measure": f"time per step on PostgreSQL, bare = LangGraph with AsyncPostgresSaver ({scale})",
         "kit_runs": ms["kit"], "bare_runs": ms["bare"], "unit": "ms"},
        {"benchmark": "postgres", "measure": f"time per step, kit on PostgreSQL; bare column = the kit on its SQLite file ({scale})",
         "kit_runs": ms["kit"], "bare_runs": ms["sqlite"], "unit": "ms"},
        {"benchmark": "postgres", "measure": f"LangGraph's tables after one {50 if quick else STORAGE_TURNS}-turn thread of 4 KB "
         f"turns ({sizes['raw'] / 1e6:.2f} MB of user text); bare = the default add_messages channel",
         "kit_runs": [sizes["kit"] / 1e6], "bare_runs": [sizes["bare"] / 1e6], "unit": "MB"},
        {"benchmark": "postgres", "measure": f"the whole listing of {count:,} conversations (3 runs each), kit on "
         "PostgreSQL; bare column = the kit on its SQLite file, the same rows",
         "kit_runs": listed["whole"][0], "bare_runs": listed["whole"][1], "unit": "ms"},
        {"benchmark": "postgres", "measure": f"the first page (50) of {count:,} conversations, kit on PostgreSQL; "
         "bare column = the kit on its SQLite file",
         "kit_runs": listed["page"][0], "bare_runs": listed["page"][1], "unit": "ms"},
        {"benchmark": "postgres", "measure": "SIGKILL of one worker mid-answer -> the other worker's resume, first event "
         "(forked workers, one host), kit on PostgreSQL; bare column = the kit on its SQLite file",
         "kit_runs": taken["postgres"], "bare_runs": taken["sqlite"], "unit": "s"},
    ]


async def main() -> None:
    from bench import machine

    sizes = await storage()
    print(f"{STORAGE_TURNS}-turn thread of 4 KB turns ({sizes['raw'] / 1e6:.2f} MB of user text), LangGraph's tables: "
          f"kit {sizes['kit'] / 1e6:.1f} MB, bare add_messages {sizes['bare'] / 1e6:.1f} MB")
    results = await measure()
    print(f"Machine: {machine()}")
    for label, name in (("(a) kit on PostgreSQL", "kit"), ("(b) LangGraph + AsyncPostgresSaver", "bare"),
                        ("(c) kit on SQLite", "sqlite")):
        values = results[name]
        print(f"{label:<36} {statistics.median(values) * 1000:7.1f} ms/step  "
              f"(n={len(values)}, min-max {min(values) * 1000:.1f}-{max(values) * 1000:.1f} ms)")
    median = {name: statistics.median(values) for name, values in results.items()}
    print(f"ratio (a)/(b) = {median['kit'] / median['bare']:.2f}   ratio (a)/(c) = {median['kit'] / median['sqlite']:.2f}")


if __name__ == "__main__":
    asyncio.run(main())

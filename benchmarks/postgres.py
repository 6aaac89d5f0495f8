"""The kit on PostgreSQL: time per step against bare LangGraph on `AsyncPostgresSaver`, and
against the kit on its SQLite file, in one run.

The same 10-turn conversation as `steps.py` (scripted model, zero token delay, no MCP servers),
each variant on a fresh database of one embedded PostgreSQL server (Unix socket) started here:

  (a) the kit's `AgentService` with `DATABASE_URL`
  (b) bare LangGraph, the same graph shape, `AsyncPostgresSaver` on a pool, durability "sync"
  (c) the kit's `AgentService` on a SQLite file

    python benchmarks/postgres.py

`rows(quick)` gives the figures to `benchmarks/bench.py` (`make bench`).
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import sys
import tempfile
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


def rows(quick: bool = False) -> list[dict]:
    results = asyncio.run(measure(rounds=3 if quick else ROUNDS))
    ms = {name: [value * 1000 for value in values] for name, values in results.items()}
    scale = f"{TURNS}-turn conversation, embedded PostgreSQL 18 on a Unix socket"
    return [
        {"benchmark": "postgres", "measure": f"time per step on PostgreSQL, bare = LangGraph with AsyncPostgresSaver ({scale})",
         "kit_runs": ms["kit"], "bare_runs": ms["bare"], "unit": "ms"},
        {"benchmark": "postgres", "measure": f"time per step, kit on PostgreSQL; bare column = the kit on its SQLite file ({scale})",
         "kit_runs": ms["kit"], "bare_runs": ms["sqlite"], "unit": "ms"},
    ]


async def main() -> None:
    from bench import machine

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

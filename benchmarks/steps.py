"""Per-step cost of the kit's run service against bare LangGraph doing the same work.

A 10-turn conversation with the scripted model (zero token delay, no MCP servers, so the model
and the kit are all that is measured), run side by side:

  (a) the kit's `AgentService` (run rows, events, outcome transaction, the system prompt read)
  (b) bare LangGraph as `anchors.py` writes it: the same two-node graph, the same messages
      channel (`DeltaChannel`, LangGraph's batch reducer, a snapshot every 100 updates),
      `AsyncSqliteSaver`, durability "sync"

Both sides store every step before the next one runs, so what (a) costs over (b) is the kit's
own work, not durability. A third side, (c), is (b) with a run record of its own, as a user
would add one: a `running` row committed before each turn and its outcome after (the least the
contract's "on disk before anyone is told" adds, whoever writes it). A fourth, (d), is (b) on the
kit's own SQLite saver (`OneTripSqliteSaver`: LangGraph's saver, each call in one trip to its
connection's thread) without the kit around it: not an anchor a user would pick, but the figure
that shows what the kit's run costs beyond its faster saver. Each variant runs the
conversation ROUNDS times on a fresh database,
interleaved; the median time per graph step is printed, with the ratio (a)/(b). Target: <= 1.10.

    python benchmarks/steps.py

`rows(quick)` gives the same figures to `benchmarks/bench.py` (`make bench`).
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

from langchain_core.messages import HumanMessage

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from anchors import PROMPT, bare_graph, sqlite_saver, thread  # noqa: E402

from sophos_lab.standins._proc import stop_server  # noqa: E402
from sophos_lab.standins.scripted_model import start_scripted_model  # noqa: E402
from sophos_lab.runtime.service import AgentService  # noqa: E402
from sophos_lab.runtime.settings import Settings  # noqa: E402

TURNS = 10
ROUNDS = 15
MESSAGE = "Hello, benchmark turn {}"
BARE = ("the same graph with LangGraph alone: DeltaChannel with LangGraph's batch reducer "
        "(_messages_delta_reducer, a snapshot every 100 updates, as the kit), AsyncSqliteSaver, durability sync")


async def run_bare(url: str, folder: Path) -> float:
    """Seconds for TURNS turns of bare LangGraph (the saver opened and set up untimed)."""
    config = thread()
    async with sqlite_saver(str(folder / "bare.db")) as saver:
        return await _turns(bare_graph(url, saver), config)


async def run_bare_one_trip(url: str, folder: Path) -> float:
    """As `run_bare`, on the kit's saver class (`OneTripSqliteSaver`), set up untimed."""
    from sophos_lab.runtime.checkpointer import OneTripSqliteSaver

    config = thread()
    async with sqlite_saver(str(folder / "bare.db"), OneTripSqliteSaver) as saver:
        return await _turns(bare_graph(url, saver), config)


async def run_bare_with_run_records(url: str, folder: Path) -> float:
    """As `run_bare`, each turn's run recorded as the kit's contract asks: a `running` row
    committed before the graph starts, its outcome committed after it ends, on a connection of
    their own to the same file (aiosqlite, WAL, `synchronous = NORMAL` as the kit's app tables)."""
    import uuid

    import aiosqlite

    config = thread()
    async with sqlite_saver(str(folder / "bare.db")) as saver, aiosqlite.connect(folder / "bare.db") as records:
        await records.execute("PRAGMA synchronous = NORMAL")
        await records.execute("CREATE TABLE runs (id TEXT PRIMARY KEY, thread_id TEXT NOT NULL,"
                              " status TEXT NOT NULL, started_at TEXT NOT NULL, finished_at TEXT)")
        graph = bare_graph(url, saver)
        start = time.perf_counter()
        for turn in range(TURNS):
            run_id = str(uuid.uuid4())
            await records.execute("INSERT INTO runs VALUES (?, ?, 'running', datetime('now'), NULL)",
                                  (run_id, config["configurable"]["thread_id"]))
            await records.commit()
            async for _ in graph.astream({"messages": [HumanMessage(MESSAGE.format(turn))]}, config,
                                         stream_mode="messages", durability="sync"):
                pass
            await records.execute("UPDATE runs SET status = 'completed', finished_at = datetime('now') WHERE id = ?",
                                  (run_id,))
            await records.commit()
        return time.perf_counter() - start


async def _turns(graph, config) -> float:
    start = time.perf_counter()
    for turn in range(TURNS):
        async for _ in graph.astream(
            {"messages": [HumanMessage(MESSAGE.format(turn))]}, config, stream_mode="messages", durability="sync"
        ):
            pass
    return time.perf_counter() - start


async def run_kit(url: str, folder: Path, database_url: str | None = None) -> float:
    """Seconds for TURNS turns through the kit's service, every event consumed (on the SQLite
    file in `folder`, or on PostgreSQL at `database_url`)."""
    config = folder / "config"
    config.mkdir(exist_ok=True)
    (config / "mcp.json").write_text("{}")
    (config / "system.md").write_text(PROMPT)
    settings = Settings.from_env({
        "OLLAMA_HOST": url, "OLLAMA_MODEL": "scripted", "DATABASE_PATH": str(folder / "kit.db"),
        "CONFIG_DIR": str(config), "MEMORY_FILE_PATH": str(folder / "memory.jsonl"),
        **({"DATABASE_URL": database_url} if database_url else {}),
    })
    service = AgentService(settings)
    try:
        await service.open()  # as for (b) and (c), building the graph is not timed
        start = time.perf_counter()
        conversation = None
        for turn in range(TURNS):
            run = await service.chat(MESSAGE.format(turn), conversation)
            conversation = run.conversation
            async for _ in run.events():
                pass
        return time.perf_counter() - start
    finally:
        await service.aclose()


async def measure(rounds: int = ROUNDS, trace_memory: bool = True) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Seconds per step of each variant, one figure per round; and each one's peak traced memory
    (tracing slows every variant down, so `rows` measures time without it)."""
    server, url = start_scripted_model(ROOT / "data" / "scripts")
    results: dict[str, list[float]] = {"kit": [], "bare": [], "bare_with_run_records": [], "bare_one_trip": []}
    peaks: dict[str, int] = {}
    try:
        for _ in range(rounds):
            for name in results:  # interleaved, so drift on the machine hits both alike
                with tempfile.TemporaryDirectory() as tmp:
                    if trace_memory:
                        tracemalloc.start()
                    if name == "kit":
                        seconds = await run_kit(url, Path(tmp))
                    elif name == "bare":
                        seconds = await run_bare(url, Path(tmp))
                    elif name == "bare_one_trip":
                        seconds = await run_bare_one_trip(url, Path(tmp))
                    else:
                        seconds = await run_bare_with_run_records(url, Path(tmp))
                    if trace_memory:
                        peaks[name] = max(peaks.get(name, 0), tracemalloc.get_traced_memory()[1])
                        tracemalloc.stop()
                results[name].append(seconds / TURNS)  # one graph step (agent) per turn
    finally:
        stop_server(server)
    return results, peaks


def rows(quick: bool = False) -> list[dict]:
    """Milliseconds per step of every round, each variant (the rounds interleave the variants)."""
    results, _ = asyncio.run(measure(rounds=3 if quick else ROUNDS, trace_memory=False))
    ms = {name: [value * 1000 for value in values] for name, values in results.items()}
    scale = f"{TURNS}-turn conversation"
    return [
        {"benchmark": "steps", "measure": f"time per step on SQLite, durability sync ({scale})",
         "kit_runs": ms["kit"], "bare_runs": ms["bare"], "unit": "ms"},
        {"benchmark": "steps", "measure": "time per step on SQLite, bare with a run record of its own: a `running` "
         f"row committed before each turn, its outcome after ({scale})",
         "kit_runs": ms["kit"], "bare_runs": ms["bare_with_run_records"], "unit": "ms"},
        {"benchmark": "steps", "measure": "time per step on SQLite, bare on the kit's own saver class "
         f"(OneTripSqliteSaver, not an anchor: what the kit costs beyond its saver) ({scale})",
         "kit_runs": ms["kit"], "bare_runs": ms["bare_one_trip"], "unit": "ms"},
    ]


async def main() -> None:
    from bench import machine

    results, peaks = await measure()
    median = {name: statistics.median(values) for name, values in results.items()}
    print(f"Machine: {machine()}")
    print(f"{TURNS}-turn conversation, {ROUNDS} rounds, scripted model with zero token delay")
    for label, name in (("(a) kit service", "kit"), ("(b) LangGraph, DeltaChannel, AsyncSqliteSaver", "bare"),
                        ("(c) (b) with a run record before and after", "bare_with_run_records"),
                        ("(d) (b) on the kit's OneTripSqliteSaver", "bare_one_trip")):
        spread = f"{min(results[name]) * 1000:.1f}-{max(results[name]) * 1000:.1f}"
        print(f"{label:<46} {median[name] * 1000:7.1f} ms/step  (min-max {spread} ms, peak traced {peaks[name] / 1e6:.1f} MB)")
    print(f"ratio (a)/(b) = {median['kit'] / median['bare']:.2f}   (target <= 1.10)")


if __name__ == "__main__":
    asyncio.run(main())

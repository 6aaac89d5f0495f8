"""The retry policy's waits, observed: the kit against bare LangGraph with the same policy.

- Observed, with a small base (BASE s; the doubling and the code path are the defaults'): the
  scripted model answers the next RETRIES chat requests with HTTP 500 (`fail_next`) and the
  model step is retried RETRIES times, then gets its answer. The gap between failed request n
  and the request after it, from the scripted model's own request log (the time each request
  was answered), is the wait the run really had: the policy's wait plus the failed request's
  round trip and LangGraph's scheduling. Kit: its `AgentService` (no MCP servers). Anchor: bare
  LangGraph (`anchors.bare_graph`, DeltaChannel, `AsyncSqliteSaver`, durability "sync") with
  the same `RetryPolicy` on its agent node (initial interval BASE, factor 2, no jitter, the same
  attempts, retrying 5xx answers, broken connections and time-outs): what a user of LangGraph
  writes to get these waits. ROUNDS rounds of each, interleaved; the last row is (observed -
  asked) over every retry.
- A time limit: the model never answers one request (`hang_next`), the model step's limit is
  LIMIT s (the kit's setting; the anchor's `TimeoutPolicy(run_timeout=LIMIT)`); the gap from that
  request to the next attempt's is the limit plus the first wait (HANG_ROUNDS runs each).

The defaults' waits (`Settings.backoff(1..8)`: min(1 s x 2^(n-1), 30 s)) are computed, not
measured: printed apart, after the table.

    python benchmarks/retries.py [--quick]
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from datetime import datetime
from pathlib import Path

from langchain_core.messages import HumanMessage
from langgraph.types import RetryPolicy, TimeoutPolicy

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from anchors import PROMPT, bare_graph, sqlite_saver, thread  # noqa: E402

from sophos_lab.runtime.service import AgentService  # noqa: E402
from sophos_lab.runtime.settings import Settings  # noqa: E402
from sophos_lab.standins._proc import stop_server  # noqa: E402
from sophos_lab.standins.scripted_model import ScriptedModelControl, start_scripted_model  # noqa: E402

DEFAULT_RETRIES = 8
"""How many of the defaults' waits to list."""
BASE, RETRIES, ROUNDS = 0.2, 4, 3
QUICK_BASE, QUICK_RETRIES, QUICK_ROUNDS = 0.05, 3, 1
LIMIT = 0.5
"""The model step's time limit in the hang measurement, in seconds."""
HANG_ROUNDS, QUICK_HANG_ROUNDS = 3, 1
MESSAGE = "Hello, benchmark"
BARE = ("bare LangGraph (DeltaChannel, AsyncSqliteSaver, durability sync) with the same RetryPolicy on its agent "
        "node (initial interval, factor 2, no jitter, the same attempts) and, for the hung request, "
        "TimeoutPolicy(run_timeout=limit)")


def seconds_between(earlier: str, later: str) -> float:
    return (datetime.fromisoformat(later.replace("Z", "+00:00"))
            - datetime.fromisoformat(earlier.replace("Z", "+00:00"))).total_seconds()


def service(url: str, folder: Path, **env: str) -> AgentService:
    config = folder / "config"
    config.mkdir(exist_ok=True)
    (config / "mcp.json").write_text("{}")
    (config / "system.md").write_text(PROMPT)
    return AgentService(Settings.from_env({
        "OLLAMA_HOST": url, "OLLAMA_MODEL": "scripted", "DATABASE_PATH": str(folder / "kit.db"),
        "CONFIG_DIR": str(config), "MEMORY_FILE_PATH": str(folder / "memory.jsonl"), **env,
    }))


def transient(error: BaseException) -> bool:
    """What the anchor retries: an HTTP 5xx, a broken connection, a time-out (as a user writes it)."""
    import httpx
    from langgraph.errors import NodeTimeoutError
    from ollama import ResponseError

    if isinstance(error, ResponseError):
        return error.status_code >= 500
    return isinstance(error, (NodeTimeoutError, httpx.TransportError, ConnectionError))


def gaps(model: ScriptedModelControl, since: int) -> list[float]:
    """Seconds between consecutive model requests from the `since`-th on (the model's log)."""
    times = [r["time"] for r in model.chat_requests()[since:]]
    return [seconds_between(a, b) for a, b in zip(times, times[1:])]


async def kit_run(url: str, model: ScriptedModelControl, attempts: int, base: float,
                  limit: float | None = None) -> tuple[list[float], list[float]]:
    """Run MESSAGE once through a fresh service; the waits its `retry` events asked for, and the
    gaps between its consecutive model requests."""
    env = {"SOPHOS_LAB_MODEL_ATTEMPTS": str(attempts), "SOPHOS_LAB_RETRY_BASE_SECONDS": str(base),
           **({"SOPHOS_LAB_MODEL_TIMEOUT_SECONDS": str(limit)} if limit else {})}
    with tempfile.TemporaryDirectory() as tmp:
        agent = service(url, Path(tmp), **env)
        try:
            await agent.open()
            since = len(model.chat_requests())
            run = await agent.chat(MESSAGE)
            events = [event async for event in run.events()]
        finally:
            await agent.aclose()
    if events[-1].event != "end":
        raise RuntimeError(f"the kit's run did not complete: {events[-1].data}")
    asked = [e.data["data"]["wait"] for e in events if e.event == "trace" and e.data["event"] == "retry"]
    return asked, gaps(model, since)


async def bare_run(url: str, model: ScriptedModelControl, attempts: int, base: float,
                   limit: float | None = None) -> list[float]:
    """The same run with bare LangGraph and the same policy; the gaps between its model requests."""
    policy = RetryPolicy(initial_interval=base, backoff_factor=2.0, max_interval=30.0, max_attempts=attempts,
                         jitter=False, retry_on=transient)
    with tempfile.TemporaryDirectory() as tmp:
        async with sqlite_saver(str(Path(tmp) / "bare.db")) as saver:
            graph = bare_graph(url, saver, retry_policy=policy,
                               **({"timeout": TimeoutPolicy(run_timeout=limit)} if limit else {}))
            since = len(model.chat_requests())
            config = thread()
            async for _ in graph.astream({"messages": [HumanMessage(MESSAGE)]}, config, stream_mode="messages",
                                         durability="sync"):
                pass
            if (await graph.aget_state(config)).next:
                raise RuntimeError("the bare run did not complete")
    return gaps(model, since)


async def measure(base: float, retries: int, rounds: int, hang_rounds: int = HANG_ROUNDS) -> dict:
    """Each side's gaps per round (interleaved, kit first then bare), the waits the kit asked for,
    and the hung request's gaps."""
    server, url = start_scripted_model(ROOT / "data" / "scripts")
    model = ScriptedModelControl(url)
    found: dict = {"kit": [], "bare": [], "kit_hang": [], "bare_hang": []}
    try:
        for _ in range(rounds):
            model.fail_next(retries, status=500)
            asked, observed = await kit_run(url, model, retries + 1, base)
            found["kit"].append(observed)
            model.fail_next(retries, status=500)
            found["bare"].append(await bare_run(url, model, retries + 1, base))
        found["asked"] = asked
        for _ in range(hang_rounds):
            model.hang_next(1)
            hang_asked, hang_gaps = await kit_run(url, model, 2, base, LIMIT)
            found["kit_hang"].append(hang_gaps[0])
            model.hang_next(1)
            found["bare_hang"].append((await bare_run(url, model, 2, base, LIMIT))[0])
        found["hang_wait"] = hang_asked[0]
    finally:
        stop_server(server)
    for side in ("kit", "bare"):
        if any(len(observed) != retries for observed in found[side]):
            raise RuntimeError(f"{side}: expected {retries} retries a round, the model saw {found[side]}")
    return found


def rows(quick: bool = False) -> list[dict]:
    from bench import note

    base, retries, rounds = (QUICK_BASE, QUICK_RETRIES, QUICK_ROUNDS) if quick else (BASE, RETRIES, ROUNDS)
    found = asyncio.run(measure(base, retries, rounds, QUICK_HANG_ROUNDS if quick else HANG_ROUNDS))
    out = []
    for n, wait in enumerate(found["asked"], 1):
        out.append({"benchmark": "retries",
                    "measure": f"base {base:g} s: retry {n} asked {wait:g} s, gap observed between the model requests",
                    "kit_runs": [gaps[n - 1] for gaps in found["kit"]],
                    "bare_runs": [gaps[n - 1] for gaps in found["bare"]], "unit": "s"})
    over = {side: [(gap - wait) * 1000 for gaps in found[side] for gap, wait in zip(gaps, found["asked"])]
            for side in ("kit", "bare")}
    out.append({"benchmark": "retries",
                "measure": f"base {base:g} s: observed - asked, over all {len(over['kit'])} retries",
                "kit_runs": over["kit"], "bare_runs": over["bare"], "unit": "ms"})
    out.append({"benchmark": "retries",
                "measure": f"a hung request, limit {LIMIT:g} s + wait {found['hang_wait']:g} s: gap to the next attempt",
                "kit_runs": found["kit_hang"], "bare_runs": found["bare_hang"], "unit": "s"})
    defaults = Settings()
    waits = ", ".join(f"{defaults.backoff(n):g}" for n in range(1, DEFAULT_RETRIES + 1))
    out.append(note("retries", f"computed expectation, not measured: the defaults' wait before retries 1-{DEFAULT_RETRIES} "
                               f"(Settings.backoff, min(1 s x 2^(n-1), 30 s)): {waits} s"))
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench import format_table, machine

    print(f"Machine: {machine()}")
    found = rows(quick="--quick" in sys.argv)
    print(format_table([row for row in found if "note" not in row]))
    print("\n".join(row["note"] for row in found if "note" in row))

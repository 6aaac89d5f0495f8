"""The retry policy's waits: as the settings compute them, and as they are observed.

- The defaults: the wait before retry n is `Settings.backoff(n)` = min(1 s * 2^(n-1), 30 s),
  for n = 1..8. Computed, not measured: it is what the runtime hands LangGraph's RetryPolicy.
- Observed, with a small base (BASE s; the doubling and the code path are the defaults'): the
  scripted model answers the next RETRIES chat requests with HTTP 500 (`fail_next`) and the
  kit's `AgentService` (no MCP servers) retries its model step RETRIES times, then gets its
  answer. The gap between failed request n and the request after it, from the scripted model's
  own request log (the time each request was answered), is the wait the run really had: the
  policy's wait plus the failed request's round trip and LangGraph's scheduling. Medians of
  ROUNDS rounds; the last row is the median of (observed - asked) over every retry.
- A time limit: the model never answers one request (`hang_next`), the model step's limit is
  LIMIT s; the gap from that request to the next attempt's is the limit plus the first wait
  (HANG_ROUNDS runs).

Bare LangGraph has no counterpart here (its RetryPolicy is what the kit configures).

    python benchmarks/retries.py [--quick]
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sophos_lab.runtime.service import AgentService  # noqa: E402
from sophos_lab.runtime.settings import Settings  # noqa: E402
from sophos_lab.standins._proc import stop_server  # noqa: E402
from sophos_lab.standins.scripted_model import ScriptedModelControl, start_scripted_model  # noqa: E402

DEFAULT_RETRIES = 8
"""How many of the defaults' waits to list."""
BASE, RETRIES, ROUNDS = 0.2, 4, 5
QUICK_BASE, QUICK_RETRIES, QUICK_ROUNDS = 0.05, 3, 1
LIMIT = 0.5
"""The model step's time limit in the hang measurement, in seconds."""
HANG_ROUNDS, QUICK_HANG_ROUNDS = 3, 1


def seconds_between(earlier: str, later: str) -> float:
    return (datetime.fromisoformat(later.replace("Z", "+00:00"))
            - datetime.fromisoformat(earlier.replace("Z", "+00:00"))).total_seconds()


def service(url: str, folder: Path, **env: str) -> AgentService:
    config = folder / "config"
    config.mkdir(exist_ok=True)
    (config / "mcp.json").write_text("{}")
    (config / "system.md").write_text("You are a benchmark.")
    return AgentService(Settings.from_env({
        "OLLAMA_HOST": url, "OLLAMA_MODEL": "scripted", "DATABASE_PATH": str(folder / "kit.db"),
        "CONFIG_DIR": str(config), "MEMORY_FILE_PATH": str(folder / "memory.jsonl"), **env,
    }))


async def one_run(url: str, model: ScriptedModelControl, env: dict[str, str]) -> tuple[list[float], list[float]]:
    """Run "Hello" once through a fresh service; the waits its `retry` events asked for, and the
    gaps between its consecutive model requests (from the model's log)."""
    with tempfile.TemporaryDirectory() as tmp:
        agent = service(url, Path(tmp), **env)
        try:
            await agent.open()
            since = len(model.chat_requests())
            run = await agent.chat("Hello, benchmark")
            events = [event async for event in run.events()]
        finally:
            await agent.aclose()
    if events[-1].event != "end":
        raise RuntimeError(f"the benchmark run did not complete: {events[-1].data}")
    asked = [e.data["data"]["wait"] for e in events if e.event == "trace" and e.data["event"] == "retry"]
    times = [r["time"] for r in model.chat_requests()[since:]]
    return asked, [seconds_between(a, b) for a, b in zip(times, times[1:])]


async def measure(base: float, retries: int, rounds: int, hang_rounds: int = HANG_ROUNDS) -> dict:
    server, url = start_scripted_model(ROOT / "data" / "scripts")
    model = ScriptedModelControl(url)
    env = {"SOPHOS_LAB_MODEL_ATTEMPTS": str(retries + 1), "SOPHOS_LAB_RETRY_BASE_SECONDS": str(base)}
    gaps: list[list[float]] = []
    asked: list[float] = []
    try:
        for _ in range(rounds):
            model.fail_next(retries, status=500)
            asked, observed = await one_run(url, model, env)
            gaps.append(observed)
        hangs = []
        for _ in range(hang_rounds):
            model.hang_next(1)
            hang_asked, hang_gaps = await one_run(url, model, {
                "SOPHOS_LAB_MODEL_ATTEMPTS": "2", "SOPHOS_LAB_RETRY_BASE_SECONDS": str(base),
                "SOPHOS_LAB_MODEL_TIMEOUT_SECONDS": str(LIMIT)})
            hangs.append(hang_gaps[0])
    finally:
        stop_server(server)
    return {"asked": asked, "gaps": gaps, "hang": (LIMIT + hang_asked[0], hangs)}


def rows(quick: bool = False) -> list[dict]:
    base, retries, rounds = (QUICK_BASE, QUICK_RETRIES, QUICK_ROUNDS) if quick else (BASE, RETRIES, ROUNDS)
    defaults = Settings()
    out = [
        {"benchmark": "retries",
         "measure": f"defaults: wait before retry {n} (attempt {n + 1}), min(1 s x 2^{n - 1}, 30 s)",
         "kit": defaults.backoff(n), "computed": True, "unit": "s"}
        for n in range(1, DEFAULT_RETRIES + 1)
    ]
    found = asyncio.run(measure(base, retries, rounds, QUICK_HANG_ROUNDS if quick else HANG_ROUNDS))
    for n, wait in enumerate(found["asked"], 1):
        out.append({"benchmark": "retries",
                    "measure": f"base {base:g} s: retry {n} asked {wait:g} s, gap observed between the model requests",
                    "kit_runs": [gaps[n - 1] for gaps in found["gaps"]], "unit": "s"})
    over = [gap - wait for gaps in found["gaps"] for gap, wait in zip(gaps, found["asked"])]
    out.append({"benchmark": "retries",
                "measure": f"base {base:g} s: observed - asked, over all {len(over)} retries",
                "kit_runs": [value * 1000 for value in over], "unit": "ms"})
    asked, observed = found["hang"]
    out.append({"benchmark": "retries",
                "measure": f"a hung request, limit {LIMIT:g} s + wait {asked - LIMIT:g} s: gap to the next attempt",
                "kit_runs": observed, "unit": "s"})
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench import format_table, machine

    print(f"Machine: {machine()}")
    print(format_table(rows(quick="--quick" in sys.argv)))

"""A pool of workers on PostgreSQL: queue latency, runs per second, and SSE through another server.

- **Queue latency**: from `chat()` returning in a `SOPHOS_LAB_RUNS=workers` process (the run is
  committed `queued`) to the first event after `started` reaching that process's follower: the
  worker woke on NOTIFY, claimed, read the thread, ran its first step's first event, appended it
  and notified. The scripted model's one-line answer, so the model costs almost nothing.
- **Runs per second** with 1, 2 and 4 workers (one run at a time each, warmed up: a worker starts
  its MCP servers with its first run): a batch of one-line runs submitted at once, until the last
  one's final event. On two cores the workers, the model server
  and PostgreSQL share the same two CPUs: past two workers, more workers mostly wait their turn.
- **SSE through another server**: `POST /api/chat` to server A and the whole run followed on B,
  against a server that runs the run itself and streams it from memory (the bare column).

    python benchmarks/workers.py [--quick]
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

ON_WORKERS = {"SOPHOS_LAB_RUNS": "workers"}


async def queue_latency(lab, samples: int) -> list[float]:
    service = lab.service(**ON_WORKERS)
    found = []
    try:
        for n in range(samples):
            run = await service.chat(f"Hello! ({n})")
            committed = time.perf_counter()
            async for event in run.events(1):
                found.append(time.perf_counter() - committed)
                break
            await run.wait()
    finally:
        await service.aclose()
    return found


async def throughput(lab, workers: int, runs: int) -> float:
    pool = lab.worker_pool(workers)
    service = lab.service(**ON_WORKERS)
    try:
        # Warm-up, untimed: a worker starts its MCP servers with its first run.
        warm = [await service.chat(f"Hello! (warm-up {n})") for n in range(2 * workers)]
        await asyncio.gather(*(run.wait() for run in warm))
        started = time.perf_counter()
        submitted = [await service.chat(f"Hello! ({n})") for n in range(runs)]
        await asyncio.gather(*(run.wait() for run in submitted))
        return runs / (time.perf_counter() - started)
    finally:
        await service.aclose()
        for worker in pool:
            worker.shutdown()


def whole_run(post_to: str, follow_on: str, n: int) -> float:
    """Seconds from the POST to the final event, followed on `follow_on`."""
    with httpx.Client(timeout=60) as client:
        started = time.perf_counter()
        accepted = client.post(f"{post_to}/api/chat", json={"message": f"Hello! ({n})"}).json()
        with client.stream("GET", f"{follow_on}/api/chat", params={"conversation": accepted["conversation"]}) as response:
            for line in response.iter_lines():
                if line.startswith("event: end") or line.startswith("event: chat-error"):
                    break
        return time.perf_counter() - started


def fan_out(lab, samples: int) -> tuple[list[float], list[float]]:
    here = lab.server()
    a, b = lab.server(**ON_WORKERS), lab.server(**ON_WORKERS)
    lab.pool_worker()
    through_b, same = [], []
    for n in range(samples):
        through_b.append(whole_run(a.url, b.url, n))
        same.append(whole_run(here.url, here.url, n))
    return through_b, same


def rows(quick: bool = False) -> list[dict]:
    from startup import lab_in

    samples = 3 if quick else 15
    batch = 8 if quick else 24
    with tempfile.TemporaryDirectory() as home, lab_in(Path(home), "bench-workers", postgres=True) as lab:
        lab.pool_worker()
        latency = asyncio.run(queue_latency(lab, samples))
        for child in list(lab._children):
            child.close()
        rates = {n: asyncio.run(throughput(lab, n, batch)) for n in (1, 2, 4)}
        through_b, same = fan_out(lab, samples)
    ms = lambda values: [value * 1000 for value in values]  # noqa: E731
    out = [{"benchmark": "workers", "measure": "queue latency: run committed queued -> claimed -> its first event "
            "at the follower (one worker, LISTEN/NOTIFY)", "kit_runs": ms(latency), "unit": "ms"}]
    for n, rate in rates.items():
        out.append({"benchmark": "workers", "measure": f"runs per second, {n} worker(s), a batch of {batch} "
                    "one-line runs (2 cores: the model server and PostgreSQL share them)",
                    "kit_runs": [rate], "unit": "runs/s"})
    out.append({"benchmark": "workers", "measure": "POST to server A -> the final event followed on server B "
                "(a one-line run on a worker); bare column = one server that runs and streams it itself",
                "kit_runs": ms(through_b), "bare_runs": ms(same), "unit": "ms"})
    return out


def main() -> None:
    from bench import machine

    print(f"Machine: {machine()}")
    for row in rows(quick="--quick" in sys.argv):
        kit = statistics.median(row["kit_runs"])
        bare = statistics.median(row["bare_runs"]) if row.get("bare_runs") else None
        print(f"{row['measure']}: {kit:.1f} {row['unit']}" + (f" (bare {bare:.1f}, {kit / bare:.2f}x)" if bare else ""))


if __name__ == "__main__":
    main()

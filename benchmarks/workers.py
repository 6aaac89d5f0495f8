"""A pool of workers on PostgreSQL: the first token through the queue, runs per second, and SSE
through another server; each against bare LangGraph on `AsyncPostgresSaver` on the same server.

- **First token through the queue**: from calling `chat()` in a `SOPHOS_LAB_RUNS=workers`
  process (the run is committed `queued`) to the run's first token reaching that process's
  follower: a worker woke on NOTIFY, claimed, read the thread, ran the model step, appended its
  events and notified. The scripted model's one-line answer, so the model costs almost nothing.
  Anchor: bare LangGraph has no queue; the same run in this process (`anchors.bare_graph` on
  `AsyncPostgresSaver`, DeltaChannel, durability "sync"), from the call to its first token.
  What the kit's figure has over it is the whole hand-off to another process.
- **Runs per second** with 1, 2 and 4 workers (one run at a time each, warmed up: a worker starts
  its MCP servers with its first run): a batch of one-line runs submitted at once, until the last
  one's final event; BATCHES batches. Anchor: as many bare LangGraph processes
  (`bare_agent.py serve`, the same graph, MCP servers and saver, on `AsyncPostgresSaver`), each
  given the next run of the batch as soon as it finished one, warmed up the same way. On two
  cores the workers, the model server and PostgreSQL share the same two CPUs: past two workers,
  more workers mostly wait their turn.
- **SSE**: `POST /api/chat` to server A and the whole run followed on server B (its worker runs
  it); and one kit server that runs the run itself and streams it from memory. Anchor for both:
  bare LangGraph served on the same stack (`bare_server.py` on `AsyncPostgresSaver`), which runs
  the run itself and streams it (bare LangGraph has no second server to follow it on).

    python benchmarks/workers.py [--quick]
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

ON_WORKERS = {"SOPHOS_LAB_RUNS": "workers"}
SAMPLES = 15
BATCH = 24
BATCHES = 3
POOLS = (1, 2, 4)
BARE = ("bare LangGraph on AsyncPostgresSaver on the same server (DeltaChannel, durability sync): for the first "
        "token, the same run in this process, no queue; for runs per second, as many bare_agent.py processes as "
        "workers, each fed the next run of the batch; for SSE, bare_server.py running and streaming the run itself")


async def queue_latency(lab, samples: int) -> list[float]:
    """Seconds from calling `chat()` to the run's first token at the follower (one worker)."""
    service = lab.service(**ON_WORKERS)
    found = []
    try:
        for n in range(samples):
            start = time.perf_counter()
            run = await service.chat(f"Hello! ({n})")
            async for event in run.events():
                if event.event == "token":
                    found.append(time.perf_counter() - start)
                    break
            await run.wait()
    finally:
        await service.aclose()
    return found


async def bare_latency(lab, database_url: str, samples: int) -> list[float]:
    """The same one-line runs with bare LangGraph in this process: from the call to the first token."""
    from anchors import bare_graph, postgres_saver
    from langchain_core.messages import HumanMessage

    found = []
    async with postgres_saver(database_url) as saver:
        graph = bare_graph(lab.ollama_host, saver)
        for n in range(samples):
            config = {"configurable": {"thread_id": str(uuid.uuid4())}, "recursion_limit": 25}
            start = time.perf_counter()
            first = None
            async for chunk, _ in graph.astream({"messages": [HumanMessage(f"Hello! ({n})")]}, config,
                                                stream_mode="messages", durability="sync"):
                if first is None and chunk.content:
                    first = time.perf_counter() - start
            found.append(first)
    return found


async def throughput(lab, workers: int, runs: int, batches: int) -> list[float]:
    """Runs per second of each batch through a pool of `workers`."""
    pool = lab.worker_pool(workers)
    service = lab.service(**ON_WORKERS)
    rates = []
    try:
        # Warm-up, untimed: a worker starts its MCP servers with its first run.
        warm = [await service.chat(f"Hello! (warm-up {n})") for n in range(2 * workers)]
        await asyncio.gather(*(run.wait() for run in warm))
        for _ in range(batches):
            started = time.perf_counter()
            submitted = [await service.chat(f"Hello! ({n})") for n in range(runs)]
            await asyncio.gather(*(run.wait() for run in submitted))
            rates.append(runs / (time.perf_counter() - started))
    finally:
        await service.aclose()
        for worker in pool:
            worker.shutdown()
    return rates


def bare_throughput(lab, database_url: str, workers: int, runs: int, batches: int) -> list[float]:
    """Runs per second of each batch through `workers` bare LangGraph processes."""
    from anchors import postgres_saver
    from startup import BareChild

    async def setup() -> None:  # once, before the processes start: each one's setup() would race
        async with postgres_saver(database_url):
            pass

    asyncio.run(setup())
    children = [BareChild(lab, "serve", database_url, stdin=True) for _ in range(workers)]
    try:
        for child in children:
            child.wait_for("ready")

        def batch(count: int) -> float:
            left = list(range(count))
            lock = threading.Lock()

            def feed(child) -> None:
                while True:
                    with lock:
                        if not left:
                            return
                        n = left.pop()
                    mark = child.mark()
                    child.send({"op": "chat", "thread": str(uuid.uuid4()), "message": f"Hello! ({n})"})
                    child.wait_for("end", since=mark)

            started = time.perf_counter()
            threads = [threading.Thread(target=feed, args=(child,)) for child in children]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            return count / (time.perf_counter() - started)

        batch(2 * workers)  # warm-up, untimed, as the kit's
        return [batch(runs) for _ in range(batches)]
    finally:
        for child in children:
            child.close()


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


def fan_out(lab, database_url: str, samples: int) -> dict[str, list[float]]:
    from bare_server import BareServer

    here = lab.server()
    a, b = lab.server(**ON_WORKERS), lab.server(**ON_WORKERS)
    lab.pool_worker()
    bare = BareServer(database_url, lab.ollama_host, lab.root / "logs" / "bare-server.log")
    found: dict[str, list[float]] = {"through_b": [], "same": [], "bare": []}
    try:
        for n in range(2):  # warm-up, untimed: each server's first run (and the worker's MCP servers)
            whole_run(a.url, b.url, n), whole_run(here.url, here.url, n), whole_run(bare.url, bare.url, n)
        for n in range(samples):
            found["through_b"].append(whole_run(a.url, b.url, n))
            found["same"].append(whole_run(here.url, here.url, n))
            found["bare"].append(whole_run(bare.url, bare.url, n))
    finally:
        bare.close()
    return found


def rows(quick: bool = False) -> list[dict]:
    from startup import lab_in

    from sophos_lab.lab import postgres_server

    samples = 3 if quick else SAMPLES
    batch, batches = (8, 1) if quick else (BATCH, BATCHES)
    with tempfile.TemporaryDirectory() as home, lab_in(Path(home), "bench-workers", postgres=True) as lab:
        def bare_database(name: str) -> str:
            return postgres_server.new_database(lab.postgres.url, name)

        lab.pool_worker()
        latency = asyncio.run(queue_latency(lab, samples))
        bare_first = asyncio.run(bare_latency(lab, bare_database("bare_latency"), samples))
        for child in list(lab._children):
            child.close()
        rates = {n: asyncio.run(throughput(lab, n, batch, batches)) for n in POOLS}
        bare_rates = {n: bare_throughput(lab, bare_database(f"bare_pool_{n}"), n, batch, batches) for n in POOLS}
        sse = fan_out(lab, bare_database("bare_sse"), samples)
    ms = lambda values: [value * 1000 for value in values]  # noqa: E731
    out = [{"benchmark": "workers", "measure": "a one-line run: chat() called -> its first token at the caller "
            "(kit: queued, one worker claims it on NOTIFY; bare: run in this process, no queue)",
            "kit_runs": ms(latency), "bare_runs": ms(bare_first), "unit": "ms"}]
    for n in POOLS:
        out.append({"benchmark": "workers", "measure": f"runs per second, {n} worker(s) (bare: {n} process(es)), "
                    f"a batch of {batch} one-line runs (2 cores: the model server and PostgreSQL share them)",
                    "kit_runs": rates[n], "bare_runs": bare_rates[n], "unit": "runs/s"})
    out.append({"benchmark": "workers", "measure": "POST to server A -> the final event followed on server B (a "
                "one-line run on a worker; bare: one server runs and streams it)",
                "kit_runs": ms(sse["through_b"]), "bare_runs": ms(sse["bare"]), "unit": "ms"})
    out.append({"benchmark": "workers", "measure": "POST -> the final event on the same server, which runs it "
                "(kit on PostgreSQL, no workers)", "kit_runs": ms(sse["same"]), "bare_runs": ms(sse["bare"]),
                "unit": "ms"})
    return out


def main() -> None:
    from bench import machine

    print(f"Machine: {machine()}")
    for row in rows(quick="--quick" in sys.argv):
        kit, bare = statistics.median(row["kit_runs"]), statistics.median(row["bare_runs"])
        print(f"{row['measure']}: {kit:.1f} {row['unit']} (bare {bare:.1f}, {kit / bare:.2f}x)")


if __name__ == "__main__":
    main()

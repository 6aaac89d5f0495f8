"""The SSE stream of `sophos-lab serve`: events per second to one client, and one run fanned out
to 100 concurrent subscribers.

A real server process (`LabServer`, the lab's third child) over a scripted model that answers
with TOKENS word tokens at zero delay (a script written for this benchmark; no MCP servers), so
what is measured is the run's event pipeline (the graph's stream, the run's buffer, sse-starlette,
uvicorn, loopback TCP) and the client reading raw frames:

- one client: from `POST /api/chat` to the stream's `end`, every frame counted (`started`,
  `trace`, each `token`, `end`); events per second, median of ROUNDS runs.
- 100 subscribers: the answer is held half-way (the scripted model's pause point); 100 streams
  connect (each is replayed the events so far), then the model is released. Timed from the
  release to the last subscriber's `end`; then every subscriber's frames are compared, byte for
  byte, with the first one's, and their ids must be 1, 2, 3, … with nothing missing. FAN_ROUNDS
  runs, one conversation each.

The anchor: bare LangGraph has no HTTP stream, so it is what a user writes to serve it on the same
stack (`bare_server.py`: Starlette, sse-starlette and uvicorn; `POST /api/chat` runs the same
graph with `DeltaChannel` on `AsyncSqliteSaver` in a task, `GET /api/chat` streams its frames
framed as the kit's, each subscriber replayed what it missed from a list of the run's frames and
then woken by an `asyncio.Event` at each append): the same answer, the same clients, the same
measures. The kit's stream has a few more frames (its `trace` events); the rows time the answer.
Kit and anchor take turns, each in a server process of its own.

    python benchmarks/sse.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bare_server import BareServer  # noqa: E402

from sophos_lab.lab.children import LabServer  # noqa: E402
from sophos_lab.standins._proc import stop_server  # noqa: E402
from sophos_lab.standins.scripted_model import ScriptedModelControl, start_scripted_model  # noqa: E402

TOKENS = 4000
SUBSCRIBERS = 100
ROUNDS = 5
FAN_ROUNDS = 3
MESSAGE = "Stream benchmark, please."
BARE = ("bare LangGraph served on the same stack (benchmarks/bare_server.py: Starlette, sse-starlette, uvicorn; the "
        "same graph with DeltaChannel on AsyncSqliteSaver run in a task; its frames kept in a list per run, each "
        "subscriber replayed and then woken by an asyncio.Event), the same answer and clients")
FRAME_ID = re.compile(rb"\Aid: (\d+)\n")


def write_script(folder: Path, tokens: int) -> Path:
    """A scripts folder with one script: `tokens` word tokens, no delay, a pause point half-way."""
    scripts = folder / "scripts"
    scripts.mkdir()
    text = " ".join(f"w{n}" for n in range(tokens))
    (scripts / "stream.json").write_text(json.dumps({
        "name": "stream-benchmark", "match": "(?i)stream benchmark",
        "turns": [{"text": text, "pause": "fan-out"}],
    }))
    return scripts


def start_server(folder: Path, model_url: str) -> LabServer:
    config = folder / "config"
    config.mkdir()
    (config / "mcp.json").write_text("{}")
    (config / "system.md").write_text("You are a benchmark.")
    env = {
        "OLLAMA_HOST": model_url, "OLLAMA_MODEL": "scripted", "DATABASE_PATH": str(folder / "sophos.db"),
        "CONFIG_DIR": str(config), "MEMORY_FILE_PATH": str(folder / "memory.jsonl"),
    }
    return LabServer(env, cwd=folder, log_path=folder / "server.log").start()


async def frames_of(client: httpx.AsyncClient, url: str, conversation: str, connected: asyncio.Event | None = None) -> list[bytes]:
    """Every frame of the conversation's stream, as bytes, up to the stream's end."""
    frames: list[bytes] = []
    pending = b""
    async with client.stream("GET", f"{url}/api/chat", params={"conversation": conversation}) as response:
        async for chunk in response.aiter_bytes():
            pending += chunk
            *complete, pending = pending.split(b"\n\n")
            frames += [frame + b"\n\n" for frame in complete if not is_ping(frame)]
            if connected is not None and frames:
                connected.set()
    return frames


def is_ping(frame: bytes) -> bool:
    """A keep-alive, not an event: the kit's `event: ping` (no id) or a comment line (sse-starlette's
    default ping). A stream that lasts longer than the ping interval (a loaded machine) has some,
    at no fixed place: they are left out of the comparison."""
    return frame.startswith((b"event: ping\n", b":"))


def ids_in_order(frames: list[bytes]) -> bool:
    ids = [int(found[1]) for found in map(FRAME_ID.match, frames) if found]
    return ids == list(range(1, len(ids) + 1)) and len(ids) == len(frames)


async def one_client(url: str) -> tuple[float, int]:
    """Seconds from the POST to the stream's end, and the events received."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(120)) as client:
        start = time.perf_counter()
        started = (await client.post(f"{url}/api/chat", json={"message": MESSAGE})).json()
        frames = await frames_of(client, url, started["conversation"])
        seconds = time.perf_counter() - start
    assert frames[-1].startswith(b"id: ") and b"event: end\n" in frames[-1], frames[-1]
    assert ids_in_order(frames)
    return seconds, len(frames)


async def fan_out(url: str, model: ScriptedModelControl, subscribers: int) -> tuple[float, int, int]:
    """Seconds from the release to the last subscriber's end; subscribers with every event in
    order (the same frames as the first one's); events per subscriber."""
    model.arm("fan-out")
    limits = httpx.Limits(max_connections=subscribers + 10, max_keepalive_connections=subscribers + 10)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120), limits=limits) as client:
        started = (await client.post(f"{url}/api/chat", json={"message": MESSAGE})).json()
        await asyncio.to_thread(model.wait_paused, 60)
        connected = [asyncio.Event() for _ in range(subscribers)]
        streams = [asyncio.create_task(frames_of(client, url, started["conversation"], event)) for event in connected]
        await asyncio.gather(*(event.wait() for event in connected))  # all subscribed, replay under way
        start = time.perf_counter()
        await asyncio.to_thread(model.release)
        received = await asyncio.gather(*streams)
        seconds = time.perf_counter() - start
    reference = received[0]
    matched = sum(frames == reference and ids_in_order(frames) for frames in received)
    assert b"event: end\n" in reference[-1], reference[-1]
    return seconds, matched, len(reference)


def measure(quick: bool = False) -> dict:
    """Every round's figures, each side: seconds from the POST to the end with one client, and
    per fan-out its seconds and the subscribers that got every event in order."""
    tokens, rounds, fan_rounds = (500, 3, 1) if quick else (TOKENS, ROUNDS, FAN_ROUNDS)
    subscribers = SUBSCRIBERS
    found: dict = {"kit": {"single": [], "fans": []}, "bare": {"single": [], "fans": []}}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model_proc, model_url = start_scripted_model(write_script(folder, tokens))
        model = ScriptedModelControl(model_url)
        servers: dict = {}
        try:
            servers["kit"] = start_server(folder, model_url)
            servers["bare"] = BareServer(str(folder / "bare.db"), model_url, folder / "bare-server.log")
            for server in servers.values():
                asyncio.run(one_client(server.url))  # warm-up: imports, the database, the model client
            for _ in range(rounds):
                for name, server in servers.items():
                    found[name]["single"].append(asyncio.run(one_client(server.url)))
            for _ in range(fan_rounds):
                for name, server in servers.items():
                    found[name]["fans"].append(asyncio.run(fan_out(server.url, model, subscribers)))
        finally:
            for server in servers.values():
                server.close()
            stop_server(model_proc)
    return {"tokens": tokens, "subscribers": subscribers, **found}


def rows(quick: bool = False) -> list[dict]:
    figures = measure(quick)
    n, tokens = figures["subscribers"], figures["tokens"]
    events = {name: figures[name]["single"][0][1] for name in ("kit", "bare")}

    def runs(name: str, part: str, at: int, scale: float = 1.0) -> list[float]:
        return [figure[at] * scale for figure in figures[name][part]]

    return [
        {"benchmark": "sse", "measure": f"a {tokens}-token answer to one SSE client: POST -> the stream's end "
         f"({events['kit']} events; bare: {events['bare']})",
         "kit_runs": runs("kit", "single", 0, 1000), "bare_runs": runs("bare", "single", 0, 1000), "unit": "ms"},
        {"benchmark": "sse", "measure": f"{n} subscribers on one run: release to the last one's end (second half of the answer)",
         "kit_runs": runs("kit", "fans", 0, 1000), "bare_runs": runs("bare", "fans", 0, 1000), "unit": "ms"},
        {"benchmark": "sse", "measure": f"{n} subscribers on one run: those with every event, in order",
         "kit_runs": runs("kit", "fans", 1), "bare_runs": runs("bare", "fans", 1), "unit": f"of {n}"},
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short answer and few rounds: a smoke run")
    args = parser.parse_args(argv)
    from bench import format_table, machine

    print(f"Machine: {machine()}")
    print()
    print(format_table(rows(quick=args.quick)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Bare LangGraph behind HTTP: the anchor of the SSE rows (`sse.py`) and of the A -> B row
(`workers.py`).

What a user would write to serve the agent with LangGraph alone, on the same stack as the kit's
server (Starlette, sse-starlette, uvicorn): `POST /api/chat` with `{message}` starts a run of
`anchors.bare_graph` (DeltaChannel, durability "sync", on `AsyncSqliteSaver` or
`AsyncPostgresSaver`: DB is a file's path or a PostgreSQL URL) in a task of the server and
answers `{conversation, run}`; `GET /api/chat?conversation=ID` streams that run's events as SSE
frames as the kit frames them (`id: N`, `event: started | token | end`, `data: <JSON>`), each
subscriber replayed what it missed (after `Last-Event-ID`) and then following live: the events
are kept in a list per run and every subscriber waits on one `asyncio.Event` that the run
replaces at each append. No run rows, no recovery, no limits, no auth.

    python benchmarks/bare_server.py DB      # prints `listening http://127.0.0.1:PORT`

Environment: OLLAMA_HOST (the model), OLLAMA_MODEL is not read (the scripted model's name).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import uvicorn  # noqa: E402
from anchors import bare_graph, saver_for  # noqa: E402
from langchain_core.messages import HumanMessage  # noqa: E402
from sse_starlette import EventSourceResponse  # noqa: E402
from starlette.applications import Starlette  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402


def frame(id: int, event: str, data: object) -> bytes:
    return f"id: {id}\nevent: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


class Run:
    """One run's frames, kept for its subscribers."""

    def __init__(self, conversation: str) -> None:
        self.id = str(uuid.uuid4())
        self.conversation = conversation
        self.frames: list[bytes] = []
        self.done = False
        self.changed = asyncio.Event()

    def append(self, event: str, data: object) -> None:
        self.frames.append(frame(len(self.frames) + 1, event, data))
        self.changed.set()
        self.changed = asyncio.Event()

    async def follow(self, after: int):
        sent = after
        while True:
            changed = self.changed
            while sent < len(self.frames):
                sent += 1
                yield self.frames[sent - 1]
            if self.done:
                return
            await changed.wait()


async def execute(graph, run: Run, message: str) -> None:
    config = {"configurable": {"thread_id": run.conversation}, "recursion_limit": 25}
    run.append("started", {"conversation": run.conversation, "run": run.id})
    try:
        async for chunk, _ in graph.astream({"messages": [HumanMessage(message)]}, config, stream_mode="messages",
                                            durability="sync"):
            if chunk.content:
                run.append("token", chunk.content)
        run.append("end", {"conversation": run.conversation, "run": run.id})
    except Exception as error:  # noqa: BLE001 - the stream says so, as the kit's does
        run.append("chat-error", {"conversation": run.conversation, "message": str(error)})
    finally:
        run.done = True


def app_for(target: str) -> Starlette:
    runs: dict[str, Run] = {}
    tasks: set[asyncio.Task] = set()

    @asynccontextmanager
    async def lifespan(app: Starlette):
        async with saver_for(target) as saver:
            app.state.graph = bare_graph(os.environ["OLLAMA_HOST"], saver)
            yield
            await asyncio.gather(*tasks, return_exceptions=True)

    async def post_chat(request: Request) -> JSONResponse:
        body = await request.json()
        run = Run(body.get("conversation") or str(uuid.uuid4()))
        runs[run.conversation] = run
        task = asyncio.create_task(execute(request.app.state.graph, run, body["message"]))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return JSONResponse({"conversation": run.conversation, "run": run.id})

    async def get_chat(request: Request) -> EventSourceResponse:
        run = runs[request.query_params["conversation"]]
        after = int(request.headers.get("last-event-id") or 0)
        return EventSourceResponse(run.follow(after), sep="\n", ping=15)

    return Starlette(routes=[Route("/api/chat", post_chat, methods=["POST"]), Route("/api/chat", get_chat)],
                     lifespan=lifespan)


class BareServer:
    """This script in a process of its own (for the benchmarks): `url` once it listens."""

    def __init__(self, target: str, model_url: str, log_path: Path) -> None:
        self.log = open(log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, __file__, target], stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, env={**os.environ, "OLLAMA_HOST": model_url})
        line = self.proc.stdout.readline().split()
        if line[:1] != ["listening"]:
            raise RuntimeError(f"the bare server did not start (see {log_path})")
        self.url = line[1]

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def main(target: str) -> None:
    # IPPROTO_TCP named, as uvicorn's own socket has it: asyncio sets TCP_NODELAY only on a socket
    # whose protocol says TCP, and without it each response waits out the client's delayed ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    print(f"listening http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    server = uvicorn.Server(uvicorn.Config(app_for(target), log_level="warning", lifespan="on"))
    server.run(sockets=[sock])


if __name__ == "__main__":
    main(sys.argv[1])

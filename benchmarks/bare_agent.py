"""Bare LangGraph in a child process: the anchor of the kill -> resume and takeover rows.

The agent as one would write it with LangGraph alone, in the original's shape: the two-node graph
(agent <-> tools) with the kit's messages channel (`anchors.DeltaState`: `DeltaChannel`,
LangGraph's batch reducer) on `AsyncSqliteSaver` or `AsyncPostgresSaver` (DB is a file's path or
a PostgreSQL URL) with durability "sync", `ChatOllama`, and the MCP servers of the lab's
`mcp.json` (the same commands, one persistent session each, tools renamed `<server>__<tool>`),
started on the agent's first model call, as the kit's and the original's graphs resolve their
tools. Nothing of the kit: no run rows, no recovery, no events, no ownership; stdout gets one
line per milestone.

    python benchmarks/bare_agent.py chat DB THREAD MESSAGE   # start a thread, run it to its end
    python benchmarks/bare_agent.py resume DB THREAD         # graph.astream(None) on the thread
    python benchmarks/bare_agent.py serve DB                 # `ready`, then one JSON command a line:
        {"op": "chat", "thread": ..., "message": ...} or {"op": "resume", "thread": ...}

Environment: OLLAMA_HOST, OLLAMA_MODEL, BARE_SYSTEM_PROMPT, BARE_SERVERS (a JSON list of
`{name, command, args, env, cwd}`, the lab's servers with their `${VAR}`s expanded).

Lines written: `started` when the stream yields its first item (with `tasks` streamed, that is
the first task's start, after the checkpoint is read: nothing has run yet), `result` after a
tools step, `token` at the first token, `end N` with the thread's message count. A resume
first reads the thread's state (`aget_state`) and refuses a thread with nothing to resume.

`forked(...)` runs the same in a child of `multiprocessing`'s fork server (the standard
library's way to start a child from an interpreter that imported everything once: the anchor
of the lab's forked workers), its lines sent over a pipe.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import langchain_mcp_adapters.tools  # noqa: E402
import langgraph.prebuilt  # noqa: E402,F401 - the imports of startup.py's BARE_IMPORTS, all of them
import mcp.client.stdio  # noqa: E402
from anchors import DELTA, saver_for  # noqa: E402
from langchain_core.messages import HumanMessage, SystemMessage  # noqa: E402
from langchain_ollama import ChatOllama  # noqa: E402
from langgraph.graph import END, START, StateGraph  # noqa: E402
from mcp import ClientSession, StdioServerParameters  # noqa: E402

_emit = None
"""Where `say` sends a line when not to stdout (a forked child's pipe)."""


def say(line: str) -> None:
    if _emit is not None:
        _emit(line)
        return
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Tools:
    """The MCP tools, discovered once, on first need; each server's session held open by a task
    of its own (the MCP client's sessions must be entered and left in one task)."""

    def __init__(self, servers: list[dict]) -> None:
        self.servers = servers
        self.tools: asyncio.Future | None = None
        self.stop = asyncio.Event()
        self.hosts: list[asyncio.Task] = []

    async def get(self) -> list:
        if self.tools is None:
            loop = asyncio.get_running_loop()
            self.tools = loop.create_future()
            found = [loop.create_future() for _ in self.servers]
            self.hosts = [asyncio.create_task(self._serve(s, f)) for s, f in zip(self.servers, found)]
            gathered = asyncio.gather(*found)
            gathered.add_done_callback(
                lambda done: self.tools.set_exception(done.exception()) if done.exception()
                else self.tools.set_result([tool for tools in done.result() for tool in tools]))
        return await asyncio.shield(self.tools)

    async def _serve(self, server: dict, found: asyncio.Future) -> None:
        params = StdioServerParameters(command=server["command"], args=server["args"],
                                       env=server["env"] or None, cwd=server["cwd"])
        try:
            async with mcp.client.stdio.stdio_client(params) as (read, write):
                async with ClientSession(read, write) as session:
                    await session.initialize()
                    tools = await langchain_mcp_adapters.tools.load_mcp_tools(session, server_name=server["name"])
                    found.set_result([t.model_copy(update={"name": f"{server['name']}__{t.name}"}) for t in tools])
                    await self.stop.wait()
        except BaseException as error:
            if not found.done():
                found.set_exception(RuntimeError(f"server {server['name']}: {error!r}"))
            raise

    async def aclose(self) -> None:
        self.stop.set()
        await asyncio.gather(*self.hosts, return_exceptions=True)


def build(saver, tools: Tools):
    model = ChatOllama(model=os.environ["OLLAMA_MODEL"], base_url=os.environ["OLLAMA_HOST"])
    prompt = os.environ.get("BARE_SYSTEM_PROMPT", "")

    async def agent(state: dict) -> dict:
        bound = model.bind_tools(await tools.get())
        return {"messages": [await bound.ainvoke([SystemMessage(prompt), *state["messages"]])]}

    async def run_tools(state: dict) -> dict:
        by_name = {tool.name: tool for tool in await tools.get()}
        calls = state["messages"][-1].tool_calls
        return {"messages": [await by_name[call["name"]].ainvoke({**call, "type": "tool_call"}) for call in calls]}

    builder = StateGraph(DELTA)
    builder.add_node("agent", agent)
    builder.add_node("tools", run_tools)
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", lambda state: "tools" if state["messages"][-1].tool_calls else END,
                                  ["tools", END])
    builder.add_edge("tools", "agent")
    return builder.compile(checkpointer=saver)


async def run(graph, config: dict, message: str | None) -> int:
    """One run on the thread of `config`: a new message, or a resume (`message` None)."""
    if message is None:
        if not (await graph.aget_state(config)).next:
            say("nothing to resume")
            return 1
        graph_input = None
    else:
        graph_input = {"messages": [HumanMessage(message)]}
    started = token = False
    async for kind, chunk in graph.astream(graph_input, config, stream_mode=["tasks", "updates", "messages"],
                                           durability="sync"):
        if not started:
            started = True
            say("started")
        if kind == "updates" and "tools" in chunk:
            say("result")
        elif kind == "messages" and chunk[0].content and not token:
            token = True
            say("token")
    say(f"end {len((await graph.aget_state(config)).values['messages'])}")
    return 0


def config_of(thread: str) -> dict:
    return {"configurable": {"thread_id": thread}, "recursion_limit": 25}


async def main(mode: str, db: str, thread: str | None = None, message: str | None = None) -> int:
    tools = Tools(json.loads(os.environ.get("BARE_SERVERS", "[]")))
    try:
        async with saver_for(db) as saver:
            graph = build(saver, tools)
            if mode != "serve":
                return await run(graph, config_of(thread), message if mode == "chat" else None)
            say("ready")
            loop = asyncio.get_running_loop()
            while line := await loop.run_in_executor(None, sys.stdin.readline):
                command = json.loads(line)
                await run(graph, config_of(command["thread"]), command.get("message"))
            return 0
    finally:
        await tools.aclose()


def forked(pipe, env: dict, cwd: str, *args: str) -> None:
    """`main(*args)` in a child of the standard library's fork server, in a session of its own
    (so that killing its group ends its MCP servers too), its lines sent through `pipe`."""
    global _emit
    os.setsid()
    os.environ.update(env)
    os.chdir(cwd)
    _emit = pipe.send
    try:
        code = asyncio.run(main(*args))
    finally:
        pipe.close()
    os._exit(code)


def forked_ready(pipe) -> None:
    """A child of the fork server that only says it is ready (everything is imported already)."""
    pipe.send("ready")
    pipe.close()


if __name__ == "__main__":
    sys.exit(asyncio.run(main(*sys.argv[1:])))

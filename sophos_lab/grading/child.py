"""The process the grader kills: your agent module, driven through the contract.

    python -m sophos_lab.grading.child MODULE_PATH CONVERSATION COMMANDS_JSON

imports the module from its path (its folder goes first on `sys.path`, so it may import its
neighbours), then runs the commands in order, each in its own `asyncio` task under a time bound:
`{"cmd": "turn", "turn": 2, "message": ...}`, `{"cmd": "recover"}`, `{"cmd": "resume"}`,
`{"cmd": "read"}`. A command that raises is reported and the next one runs. It reports on stdout,
one JSON object per line after `@@grade `: `start` and `done` or `failed` per command (a read's
`done` carries what it read, normalised to roles, texts and statuses), `finished` at the end.

Two environment variables make the world's writes kill points (see `contract.World`):
`SOPHOS_GRADER_STOP_AFTER_WRITE=N` stops the process (SIGSTOP) right after its N-th durable write,
once a `stopped` line says which write it was; `SOPHOS_GRADER_TRACE_WRITES=1` reports a `write`
line after each (the reference run lists its points so). `SOPHOS_GRADER_BOUND` is the time bound
of one command in seconds (30).
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

from . import contract

PREFIX = "@@grade "
STOP_AFTER_WRITE = "SOPHOS_GRADER_STOP_AFTER_WRITE"
TRACE_WRITES = "SOPHOS_GRADER_TRACE_WRITES"
BOUND = "SOPHOS_GRADER_BOUND"
DEFAULT_BOUND = 30.0


def report(event: str, **fields: Any) -> None:
    """One report line, flushed: the grader reads it before any later point."""
    sys.stdout.write(PREFIX + json.dumps({"event": event, "time": time.time(), **fields}, default=str) + "\n")
    sys.stdout.flush()


def parse_report(line: str) -> dict[str, Any] | None:
    """The report of a `@@grade` line, or None for anything else the module printed."""
    line = line.strip()
    return json.loads(line[len(PREFIX):]) if line.startswith(PREFIX) else None


def load_module(path: Path) -> ModuleType:
    """Import the agent module at `path`; `TypeError` naming what the contract misses."""
    path = Path(path).resolve()
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    missing = [name for name in contract.CONTRACT if not inspect.iscoroutinefunction(getattr(module, name, None))]
    if missing:
        raise TypeError(f"{path.name} has no `async def` {', '.join(missing)} (the contract: "
                        f"{', '.join(contract.CONTRACT)})")
    return module


def normalise_read(value: Any) -> dict[str, Any]:
    """`read()`'s answer as plain JSON: messages as `{role, text, calls}` (calls: how many tool
    calls an assistant message makes) and runs as statuses."""
    if not isinstance(value, dict):
        raise TypeError(f"read() must return a dict with 'messages' and 'runs', not {type(value).__name__}")
    messages = [m for m in map(_message, value.get("messages") or []) if m is not None]
    runs = [_status(run) for run in value.get("runs") or []]
    return {"messages": messages, "runs": runs}


def _message(message: Any) -> dict[str, Any] | None:
    from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage

    from ..runtime.messages import content_text

    if isinstance(message, BaseMessage):
        role = ("user" if isinstance(message, HumanMessage) else "assistant" if isinstance(message, AIMessage)
                else "tool" if isinstance(message, ToolMessage) else None)
        if role is None:
            return None  # a system message is not the conversation's
        calls = len(message.tool_calls) if isinstance(message, AIMessage) else 0
        return {"role": role, "text": content_text(message.content), "calls": calls}
    if isinstance(message, dict):
        role, text = message.get("role"), message.get("content", message.get("text", ""))
        calls = len(message.get("toolCalls") or message.get("tool_calls") or [])
    else:
        role, text = message[0], message[1]
        calls = 0
    role = {"human": "user", "ai": "assistant"}.get(role, role)
    return {"role": role, "text": content_text(text), "calls": calls}


def _status(run: Any) -> str:
    if isinstance(run, str):
        return run
    if isinstance(run, dict):
        return str(run.get("status"))
    return str(getattr(run, "status", run))


def _on_write(stop_after: int, trace: bool):
    count = 0

    def wrote(description: str) -> None:
        nonlocal count
        count += 1
        if trace:
            report("write", n=count, what=description)
        if count == stop_after:
            report("stopped", n=count, what=description)
            os.kill(os.getpid(), signal.SIGSTOP)

    return wrote


async def run(module_path: Path, conversation: str, commands: list[dict[str, Any]]) -> None:
    """Run `commands` against the module, reporting each (see the module's docstring)."""
    bound = float(os.environ.get(BOUND) or DEFAULT_BOUND)
    contract.watch_writes(_on_write(int(os.environ.get(STOP_AFTER_WRITE) or 0), bool(os.environ.get(TRACE_WRITES))))
    try:
        module = load_module(module_path)
    except BaseException as error:  # the module itself is the learner's: any failure is an answer
        report("module-error", error=_describe(error, module_path))
        return
    world = contract.World.from_env()
    report("ready", pid=os.getpid())
    for index, command in enumerate(commands):
        report("start", index=index, **command)
        name = command["cmd"]
        call = {"turn": lambda: module.run_turn(world, conversation, command["message"]),
                "recover": lambda: module.recover(world),
                "resume": lambda: module.resume(world, conversation),
                "read": lambda: module.read(world, conversation)}[name]
        try:
            result = await asyncio.wait_for(call(), bound)
            answer = normalise_read(result) if name == "read" else None
        except asyncio.TimeoutError:
            report("failed", index=index, cmd=name, turn=command.get("turn"), error=f"did not end within {bound:g} s",
                   timeout=True)
        except BaseException as error:  # noqa: BLE001 - the learner's code: every failure is reported
            report("failed", index=index, cmd=name, turn=command.get("turn"), error=_describe(error, module_path),
                   not_done=isinstance(error, NotImplementedError))
        else:
            report("done", index=index, cmd=name, result=answer)
    report("finished")


def _describe(error: BaseException, module_path: Path | None = None) -> str:
    """`Type: message (line N of your module)`: the last line of the module the error went through."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    frames = traceback.extract_tb(error.__traceback__) if error.__traceback__ else []
    mine = [f for f in frames if module_path is not None and Path(f.filename) == module_path.resolve()]
    where = (mine or frames)[-1:]
    line = f" (line {where[0].lineno} of {Path(where[0].filename).name})" if where else ""
    said = f": {error}" if str(error) else ""
    return f"{type(error).__name__}{said}{line}"


def main() -> None:
    module_path, conversation, commands = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    asyncio.run(run(module_path, conversation, commands))
    sys.stdout.flush()
    os._exit(0)  # MCP sessions the module left open must not keep the process alive


if __name__ == "__main__":
    main()

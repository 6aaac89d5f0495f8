"""A scripted, Ollama-compatible chat server for reproducible agent runs.

It answers ``POST /api/chat`` the way Ollama does (NDJSON streaming or a
single JSON object), but every reply comes from a script: a JSON file that
says, turn by turn, what text, reasoning, tool calls or errors to send.
The real ``langchain_ollama.ChatOllama`` client talks to it unchanged.

Run it with::

    python -m sophos_lab.standins.scripted_model --scripts DIR [--port 0] [--log FILE]

Choosing a reply is stateless, so a request repeated after a crash gets the
same turn: the script is the first (by file name) whose ``match`` regex is
found in the last user message, and the turn index is the number of
assistant messages after that user message.

A turn may branch on the tool results it answers: its ``on_tool_error`` (a
turn of its own, e.g. ``{"text": "The fetch failed: {tool_error}"}``) is sent
instead when a tool result since the last assistant message is an error; the
failed result's text fills ``{tool_error}``. Ollama's protocol carries no
status for a tool message (``ChatOllama`` sends a ``ToolMessage`` as
``{"role": "tool", "content": ...}``, its ``status`` dropped), so an error is
recognised by its text: a result that starts with ``Error`` (LangGraph's
``ToolNode`` and the MCP adapters: ``Error: ...``, ``Error executing tool
...``), ``Failed to`` (the fetch server: ``Failed to fetch URL - status code
404``, ``... due to a connection issue``), ``The sites robots.txt`` (the
fetch server refusing a page) or ``Not run:`` (the runtime's result for a call
a person rejected at an approval gate). A script can give its own regex as
``tool_error_match`` (searched in each result), e.g. for the memory server,
whose errors read ``Entity with name X not found``. A real model reads the text too.

A turn's tool call is sent under the name the request offers that tool by
(``fetch__fetch`` as the kit names it, ``fetch`` as LangChain's MCP client does),
and may name alternatives: see ``offered_tools``.

A control API under ``/_scripted/`` lets a notebook or test read the request
log, freeze a stream half-way at a named pause point, answer the next N chat
requests with an HTTP error (``fail_next``) or not at all (``hang_next``: no
headers, until released or the client hangs up), or hold the n-th request from
now when it is received or after its first chunk (``hold_request``) (see
``ScriptedModelControl``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from sophos_lab.standins._httpkit import (FIRST_CHUNK, HANG, RECEIVED, Faults, Holds, JsonHandler, RequestLog, call,
                                          long_poll, now_iso, prompt_digest, serve)
from sophos_lab.standins.offered_tools import offered, offered_call
from sophos_lab.standins._proc import spawn_module, stop_server
from sophos_lab.standins.scripts import (TOOL_ERROR, Choice, Script, Turn, _text, choose_turn, failed_tool_result,
                                         load_scripts, tokenize)

__all__ = [
    "Choice",
    "Script",
    "ScriptedModelControl",
    "TOOL_ERROR",
    "Turn",
    "choose_turn",
    "failed_tool_result",
    "load_scripts",
    "start_scripted_model",
    "stop_server",
    "tokenize",
]

VERSION = "0.0.0-scripted"
# --- the server -------------------------------------------------------------


class ScriptedModelServer(ThreadingHTTPServer):
    """The HTTP server, holding the scripts, request log and pause points."""

    daemon_threads = True
    # socketserver's default backlog is 5: a cold service starting 20 runs at once overflowed
    # it, and the kernel reset the connections it could not queue (httpx.ReadError).
    request_queue_size = 128

    def __init__(
        self,
        address: tuple[str, int],
        scripts: list[Script],
        model: str = "scripted",
        log: RequestLog | None = None,
        thinking: bool = True,
    ) -> None:
        super().__init__(address, _Handler)
        self.scripts = scripts
        self.model = model
        self.thinking = thinking
        """Whether the model can think; without, `think: true` is refused as Ollama refuses it."""
        self.tag = model if ":" in model else f"{model}:latest"
        self.log = log or RequestLog()
        self.pauses = Holds()
        self.faults = Faults()

    def server_close(self) -> None:
        self.pauses.close()
        super().server_close()


class _Handler(JsonHandler):
    server: ScriptedModelServer

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        if url.path == "/api/tags":
            self._api({"models": [self._model_card()]})
        elif url.path == "/api/version":
            self._api({"version": VERSION})
        elif url.path == "/_scripted/requests":
            self.send_json(200, {"requests": self.server.log.entries()})
        elif url.path == "/_scripted/scripts":
            self.send_json(200, {"scripts": [
                {"name": s.name, "description": s.description}
                for s in self.server.scripts
            ]})
        elif url.path == "/_scripted/wait_paused":
            self.answer_wait(self.server.pauses, query, "paused")
        else:
            self._not_found(url.path)

    def do_POST(self) -> None:
        path = urlsplit(self.path).path
        body = self.read_json()
        if path == "/api/chat":
            self._chat(body)
        elif path == "/api/show":
            if self._known(body.get("model")):
                self._api(self._show(), model=body.get("model"))
            else:
                self._unknown_model(body.get("model"))
        elif path == "/_scripted/arm":
            if isinstance(body.get("pause"), str):
                self.server.pauses.arm(body["pause"])
                self.send_json(200, {"armed": body["pause"]})
            else:
                self.send_json(400, {"error": 'expected a body like {"pause": "summary"}'})
        elif path == "/_scripted/release":
            self.send_json(200, {"released": self.server.pauses.release()})
        elif path in ("/_scripted/fail_next", "/_scripted/hang_next", "/_scripted/hold_request"):
            self.send_json(*self.server.faults.control(path.rsplit("/", 1)[1], body, "scripted failure"))
        else:
            self._not_found(path)

    # --- Ollama API -----------------------------------------------------

    def _chat(self, body: dict) -> None:
        messages = body.get("messages") or []
        functions = [t.get("function", {}) for t in body.get("tools") or []]
        entry = {
            "n_messages": len(messages),
            "last_role": messages[-1].get("role") if messages else None,
            "tools": [f.get("name") for f in functions],
            # What the model was shown of each tool: its parameter names.
            "tool_args": {f.get("name"): list(f.get("parameters", {}).get("properties", {})) for f in functions},
            "prompt": prompt_digest(messages),
        }
        model = body.get("model")
        if not self._known(model):
            self._unknown_model(model, **entry)
            return
        if body.get("think") is True and not self.server.thinking:
            self._api({"error": f'"{model}" does not support thinking'}, 400, model=model, **entry)
            return
        choice = choose_turn(self.server.scripts, messages)
        entry.update(script=choice.script, turn=choice.index, branch=choice.branch)
        fault = self.server.faults.take()
        if fault == HANG:
            self._record(0, model=model, fault="hang", **entry)  # status 0: never answered
            self.server.pauses.arm(HANG)
            self.server.pauses.hold_if_armed(HANG, self.connection)
            self.close_connection = True  # released or abandoned: either way, no answer
            return
        if fault is not None:
            status, message = fault
            self._api({"error": message}, status, model=model, fault="error", **entry)
            return
        turn = choice.turn
        if turn.error:
            status = int(turn.error.get("status", 500))
            self._api({"error": turn.error.get("message", "")}, status, model=model, **entry)
            return
        self._record(200, model=model, **entry)
        reply = _Reply(model, turn, prompt_tokens=_count_tokens(messages),
                       think=body.get("think") is not False, tools=offered(body.get("tools")))
        held = self.server.faults.counted()
        if held == RECEIVED and not self.hold_request(self.server.pauses, held):
            return
        try:
            if body.get("stream", True):
                self._stream(reply, held)
            elif self._hold(turn.pause) and (held != FIRST_CHUNK or self.hold_request(self.server.pauses, held)):
                self.send_json(200, reply.whole())
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _stream(self, reply: _Reply, held: str | None = None) -> None:
        self.start_chunked(200, "application/x-ndjson")
        for line in reply.lines():
            if line is not None:
                self.send_chunk(json.dumps(line).encode() + b"\n")
                if held == FIRST_CHUNK:
                    held = None
                    if not self.hold_request(self.server.pauses, FIRST_CHUNK):
                        return
            elif not self._hold(reply.turn.pause):
                self.close_connection = True
                return
        self.send_chunk(b"")

    def _hold(self, pause: str | None) -> bool:
        """Wait if ``pause`` is armed; False if the client hung up meanwhile."""
        if pause is None:
            return True
        return self.server.pauses.hold_if_armed(pause, self.connection)

    def _known(self, model: Any) -> bool:
        return model in (self.server.model, self.server.tag)

    def _unknown_model(self, model: Any, **entry: Any) -> None:
        self._api({"error": f"model '{model}' not found"}, 404, model=model, **entry)

    def _not_found(self, path: str) -> None:
        body = {"error": f"the scripted model does not serve {path}"}
        if path.startswith("/api/"):
            self._api(body, 404)
        else:
            self.send_json(404, body)

    def _api(self, body: dict, status: int = 200, **entry: Any) -> None:
        self._record(status, **entry)
        self.send_json(status, body)

    def _record(self, status: int, **values: Any) -> None:
        values["status"] = status
        self.server.log.add({
            "time": now_iso(),
            "path": urlsplit(self.path).path,
            **{key: values.get(key) for key in _LOG_FIELDS},
        })

    def _model_card(self) -> dict:
        return {
            "name": self.server.tag,
            "model": self.server.tag,
            "modified_at": "2024-01-01T00:00:00Z",
            "size": 0,
            "digest": "0" * 64,
            "details": _DETAILS,
        }

    def _show(self) -> dict:
        return {
            "modelfile": f"# {self.server.tag} is scripted: replies come from JSON "
            "scripts, not from a language model.",
            "parameters": "",
            "template": "",
            "license": "",
            "details": _DETAILS,
            "model_info": {
                "general.architecture": "scripted",
                "general.description": "Scripted replies for reproducible lab runs.",
            },
            "capabilities": ["completion", "tools", *(["thinking"] if self.server.thinking else [])],
        }


_LOG_FIELDS = ("model", "script", "turn", "branch", "n_messages", "last_role", "status", "tools", "tool_args",
               "fault", "prompt")
_DETAILS = {
    "parent_model": "",
    "format": "scripted",
    "family": "scripted",
    "families": ["scripted"],
    "parameter_size": "0 (scripted)",
    "quantization_level": "none",
}


@dataclass
class _Reply:
    """Renders one turn as Ollama chat responses."""

    model: str
    turn: Turn
    prompt_tokens: int
    think: bool = True
    tools: dict[str, list[str]] = field(default_factory=dict)
    """The tools the request offers (`offered_tools.offered`): the calls are sent by their names."""
    started: float = field(default_factory=time.monotonic)

    def lines(self) -> Iterator[dict | None]:
        """The streamed responses, with ``None`` marking the pause point.

        The pause point comes after half of the text tokens (at least one),
        or before the tool calls when there is no text.
        """
        tokens = tokenize(self.turn.text)
        if self.think:
            for token in tokenize(self.turn.thinking):
                yield self._line(content="", thinking=token)
        for n, token in enumerate(tokens, 1):
            if n > 1 and self.turn.token_delay:
                time.sleep(self.turn.token_delay)  # simulated generation speed
            yield self._line(content=token)
            if n == max(1, len(tokens) // 2):
                yield None
        if not tokens:
            yield None
        if self.turn.tool_calls:
            yield self._line(content="", tool_calls=self._tool_calls())
        yield self._done(len(tokens))

    def whole(self) -> dict:
        """The complete reply as one response (``"stream": false``)."""
        message = {"content": self.turn.text}
        if self.think and self.turn.thinking:
            message["thinking"] = self.turn.thinking
        if self.turn.tool_calls:
            message["tool_calls"] = self._tool_calls()
        return {**self._done(len(tokenize(self.turn.text))),
                "message": {"role": "assistant", **message}}

    def _tool_calls(self) -> list[dict]:
        return [{"function": offered_call(dict(call), self.tools)} for call in self.turn.tool_calls]

    def _line(self, **message: Any) -> dict:
        return {
            "model": self.model,
            "created_at": now_iso(),
            "message": {"role": "assistant", **message},
            "done": False,
        }

    def _done(self, eval_count: int) -> dict:
        total = int((time.monotonic() - self.started) * 1e9)
        return {
            **self._line(content=""),
            "done": True,
            "done_reason": "stop",
            "total_duration": total,
            "load_duration": 0,
            "prompt_eval_count": self.prompt_tokens,
            "prompt_eval_duration": 0,
            "eval_count": eval_count,
            "eval_duration": total,
        }


def _count_tokens(messages: list[dict]) -> int:
    return sum(len(_text(m.get("content")).split()) for m in messages)


# --- parent side ------------------------------------------------------------


@dataclass(frozen=True)
class ScriptedModelControl:
    """A client for a running scripted model's control API."""

    url: str

    def requests(self) -> list[dict]:
        """Every ``/api/*`` request the server has answered, oldest first."""
        return call(f"{self.url}/_scripted/requests")[1]["requests"]

    def chat_requests(self, script: str | None = None) -> list[dict]:
        """The ``/api/chat`` requests, optionally only those answered by ``script``."""
        return [
            r for r in self.requests()
            if r["path"] == "/api/chat" and script in (None, r["script"])
        ]

    def scripts(self) -> list[dict]:
        """The loaded scripts' names and descriptions."""
        return call(f"{self.url}/_scripted/scripts")[1]["scripts"]

    def arm(self, pause: str) -> None:
        """Make the next stream reaching pause point ``pause`` stop half-way."""
        call(f"{self.url}/_scripted/arm", {"pause": pause})

    def wait_paused(self, timeout: float = 60.0) -> str:
        """Block until a stream is held at a pause point; return that point's name."""
        return long_poll(
            f"{self.url}/_scripted/wait_paused", "paused", timeout,
            "no stream reached an armed pause point (was the pause armed, and does the script's "
            "turn name it?)",
        )

    def release(self) -> int:
        """Let every held stream finish; return how many were held."""
        return call(f"{self.url}/_scripted/release", {})[1]["released"]

    def fail_next(self, n: int = 1, status: int = 500, message: str | None = None) -> None:
        """Answer the next `n` chat requests with HTTP `status` (a 5xx is what a retry is for)
        and `{"error": message}`, whatever their script says; logged with `fault: "error"`."""
        call(f"{self.url}/_scripted/fail_next", {"n": n, "status": status, "message": message})

    def hang_next(self, n: int = 1) -> None:
        """Never answer the next `n` chat requests: no headers, no tokens, until `release()` or
        the client hangs up (a time limit's work); logged with `fault: "hang"`, status 0.
        `wait_paused()` returns `"(hang)"` once one is held."""
        call(f"{self.url}/_scripted/hang_next", {"n": n})

    def hold_request(self, n: int = 1, at: str = RECEIVED) -> None:
        """Hold the `n`-th chat request from now (1: the next) that is answered normally, `at`
        `"received"` (before any answer) or `"first-chunk"` (right after its first chunk), until
        `release()` or its client hangs up: a kill point at a model request, for any script.
        `wait_paused()` returns `"(request received)"` or `"(request first-chunk)"` once it is held."""
        call(f"{self.url}/_scripted/hold_request", {"n": n, "at": at})


def start_scripted_model(
    scripts_dir: str | Path,
    log_file: str | Path | None = None,
    model: str = "scripted",
    port: int = 0,
    thinking: bool = True,
) -> tuple[subprocess.Popen, str]:
    """Start the server in a child process; return it and its base URL."""
    args = ["--scripts", str(scripts_dir), "--model", model, "--port", str(port)]
    if not thinking:
        args.append("--no-thinking")
    if log_file is not None:
        args += ["--log", str(log_file)]
    proc, ready = spawn_module("sophos_lab.standins.scripted_model", args)
    return proc, ready["url"]


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(
        prog="python -m sophos_lab.standins.scripted_model", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--scripts", required=True, type=Path, help="directory of *.json scripts")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--model", default="scripted", help="model name to answer to")
    parser.add_argument("--log", type=Path, help="append a JSON line per request here")
    parser.add_argument("--no-thinking", action="store_true",
                        help="answer like a model that cannot think: refuse requests with think: true")
    args = parser.parse_args(argv)
    if not args.scripts.is_dir():
        parser.error(f"--scripts {args.scripts} is not a directory")
    server = ScriptedModelServer(
        (args.host, args.port), load_scripts(args.scripts), args.model, RequestLog(args.log),
        thinking=not args.no_thinking,
    )
    serve(server, model=args.model)


if __name__ == "__main__":
    main()

"""A recording proxy in front of any Ollama-protocol server, with the scripted model's controls.

When the lab is pointed at a real Ollama (or anything that speaks its protocol), it starts this
proxy on loopback and points the agent at it. The proxy forwards every request to the upstream
server unchanged and streams NDJSON answers through line by line, flushing each one, so the
client sees the model's bytes as they arrive. On the way it

- logs every ``/api/*`` request, with the fields of the scripted model's log that make sense
  for a real model (``n_messages``, ``last_role``, ``turn``, ``tools``, ``tool_args``, ...), and
- can hold a model stream at a named pause point until a notebook or test releases it, so a
  kill lands at an exact point whatever the model is.

Run it with::

    python -m sophos_lab.standins.model_proxy --upstream URL [--port 0] [--log-file FILE]

Pause points (arm one with ``ModelProxyControl.arm(name, after_chunks=3)``; each arming holds
one stream):

``summary``
    the first answer that follows a tool result (the request's last message is a ``tool``
    message), held after ``after_chunks`` content chunks — or, if that stream ends sooner or
    turns out to be another tool call, just before its tool-call or final chunk. This is the
    point the scripted ``fetch-and-summarise`` script names ``summary``.
``first-chunk``
    the next ``/api/chat`` answer, held before its first chunk (the response headers are sent).
``mid-stream``
    the next ``/api/chat`` answer of any kind, held like ``summary``.

A held stream is let go by ``release()``, or ends when its client disconnects (a killed agent);
the proxy then drops its upstream connection too. The bytes of the model's answer are never
changed; a held stream is only delayed.

Faults, as the scripted model has them (``fail_next(n, status)``, ``hang_next(n)``): the proxy
answers the next ``n`` chat requests itself, with an HTTP error, or not at all until released
or the client hangs up, as a gateway in front of a model server can. Those requests never
reach the model; they are logged with ``fault: "error"`` (their status) or ``fault: "hang"``
(status 0).

``hold_request(n, at)``, as the scripted model's: the ``n``-th chat request from now is held
when the proxy receives it (before it is forwarded: logged with ``fault: "held"``, status 0, if
its client hangs up meanwhile) or right after its first chunk was passed on (the grader's model
kill points, for any model).
"""

from __future__ import annotations

import argparse
import http.client
import json
import subprocess
import sys
import threading
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from sophos_lab.standins._httpkit import (FIRST_CHUNK, HANG, RECEIVED, Faults, Holds, JsonHandler, RequestLog, call,
                                          long_poll, now_iso, prompt_digest, serve)
from sophos_lab.standins._proc import spawn_module, stop_server

__all__ = [
    "DEFAULT_AFTER_CHUNKS",
    "PAUSE_POINTS",
    "ModelProxyControl",
    "normalize_upstream",
    "start_model_proxy",
    "stop_server",
]

PAUSE_POINTS = ("summary", "first-chunk", "mid-stream")
DEFAULT_AFTER_CHUNKS = 3
"""Content chunks a held stream has sent before it stops (``summary`` and ``mid-stream``)."""

CONTROL_PREFIXES = ("/_proxy/", "/_scripted/")
"""The control API; ``/_scripted/`` is an alias, so the scripted model's client works too."""

LOG_FIELDS = (
    "model", "script", "turn", "n_messages", "last_role", "status", "tools", "tool_args",
    "stream", "think", "fault", "prompt",
)
# Hop-by-hop headers (RFC 9110 §7.6.1) and those the proxy sets itself.
_REQUEST_DROP = {"host", "connection", "keep-alive", "proxy-connection", "te", "trailer",
                 "transfer-encoding", "upgrade", "content-length", "accept-encoding"}
_RESPONSE_DROP = {"connection", "keep-alive", "transfer-encoding", "content-length", "trailer",
                  "upgrade", "date", "server"}


def normalize_upstream(host: str) -> str:
    """``OLLAMA_HOST`` as a base URL; as with Ollama, ``localhost`` alone means port 11434."""
    host = host.strip().rstrip("/")
    bare = "://" not in host
    if bare:
        host = "http://" + host
    parts = urlsplit(host)
    if parts.port is None:
        port = 11434 if bare else 443 if parts.scheme == "https" else 80
        host = f"{parts.scheme}://{parts.hostname}:{port}{parts.path}"
    return host


# --- the server -------------------------------------------------------------


class ModelProxyServer(ThreadingHTTPServer):
    """The proxy: the upstream's address, the request log and the pause points."""

    daemon_threads = True
    request_queue_size = 128  # see ScriptedModelServer: many runs may start at once

    def __init__(self, address: tuple[str, int], upstream: str, log: RequestLog | None = None) -> None:
        super().__init__(address, _Handler)
        self.upstream = normalize_upstream(upstream)
        parts = urlsplit(self.upstream)
        self.upstream_https = parts.scheme == "https"
        self.upstream_host = parts.hostname or "127.0.0.1"
        self.upstream_port = parts.port or (443 if self.upstream_https else 80)
        self.upstream_path = parts.path.rstrip("/")
        self.log = log or RequestLog()
        self.pauses = Holds()
        self.faults = Faults()
        self._lock = threading.Lock()
        self._after: dict[str, int] = {}

    def arm(self, pause: str, after_chunks: int) -> None:
        with self._lock:
            self._after[pause] = after_chunks
        self.pauses.arm(pause)

    def after_chunks(self, pause: str) -> int:
        with self._lock:
            return self._after.get(pause, DEFAULT_AFTER_CHUNKS)

    def connect(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.upstream_https else http.client.HTTPConnection
        return cls(self.upstream_host, self.upstream_port, timeout=None)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            super().handle_error(request, client_address)  # a killed agent hangs up: no error

    def server_close(self) -> None:
        self.pauses.close()
        super().server_close()


class _Handler(JsonHandler):
    server: ModelProxyServer

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        for prefix in CONTROL_PREFIXES:
            if url.path.startswith(prefix):
                self._control(method, url.path[len(prefix):], parse_qs(url.query))
                return
        self._forward(method)

    # --- control API ----------------------------------------------------

    def _control(self, method: str, name: str, query: dict[str, list[str]]) -> None:
        if method == "GET" and name == "requests":
            self.send_json(200, {"requests": self.server.log.entries()})
        elif method == "GET" and name == "scripts":
            self.send_json(200, {"scripts": []})
        elif method == "GET" and name == "upstream":
            self.send_json(200, {"upstream": self.server.upstream})
        elif method == "GET" and name == "wait_paused":
            self.answer_wait(self.server.pauses, query, "paused")
        elif method == "POST" and name == "arm":
            body = self.read_json()
            pause, after = body.get("pause"), body.get("after_chunks", DEFAULT_AFTER_CHUNKS)
            if pause not in PAUSE_POINTS or not isinstance(after, int) or after < 1:
                self.send_json(400, {"error": f"expected {{\"pause\": one of {list(PAUSE_POINTS)}, "
                                              f"\"after_chunks\": a positive int}}, got {body}"})
                return
            self.server.arm(pause, after)
            self.send_json(200, {"armed": pause, "after_chunks": after})
        elif method == "POST" and name == "release":
            self.read_json()
            self.send_json(200, {"released": self.server.pauses.release()})
        elif method == "POST" and name in ("fail_next", "hang_next", "hold_request"):
            self.send_json(*self.server.faults.control(name, self.read_json(), "model proxy: injected failure"))
        else:
            self.send_json(404, {"error": f"no control endpoint {method} {name}"})

    # --- forwarding -----------------------------------------------------

    def _forward(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        path = urlsplit(self.path).path
        entry = _describe(path, raw)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _REQUEST_DROP}
        headers["Content-Length"] = str(len(raw))
        headers["Accept-Encoding"] = "identity"  # keep NDJSON lines readable on the way through
        if path.endswith("/api/chat") and self._fault(path, entry):
            return
        held = self.server.faults.counted() if path.endswith("/api/chat") else None
        if held == RECEIVED and not self.hold_request(self.server.pauses, RECEIVED):
            self._record(path, 0, {**entry, "fault": "held"})
            return
        upstream = self.server.connect()
        try:
            try:
                upstream.request(method, self.server.upstream_path + self.path, body=raw or None,
                                 headers=headers)
                response = upstream.getresponse()
            except OSError as err:
                self._record(path, 502, entry)
                self.send_json(502, {"error": f"model proxy: upstream {self.server.upstream} "
                                              f"did not answer: {err}"})
                return
            self._record(path, response.status, entry)
            streamed = response.chunked or (response.length is None and method != "HEAD")
            chat = path.endswith("/api/chat")
            if streamed:
                self._relay_stream(response, chat, entry, held)
            else:
                self._relay_whole(response, method, chat, entry, held)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        finally:
            upstream.close()

    def _fault(self, path: str, entry: dict) -> bool:
        """Answer this chat request with the next injected fault, if there is one (the model
        never sees it); whether there was."""
        fault = self.server.faults.take()
        if fault is None:
            return False
        if fault == HANG:
            self._record(path, 0, {**entry, "fault": "hang"})  # status 0: never answered
            self.server.pauses.arm(HANG)
            self.server.pauses.hold_if_armed(HANG, self.connection)
            self.close_connection = True  # released or abandoned: either way, no answer
            return True
        status, message = fault
        self._record(path, status, {**entry, "fault": "error"})
        self.send_json(status, {"error": message})
        return True

    def _send_head(self, response: http.client.HTTPResponse, **extra: str) -> None:
        self.send_response(response.status, response.reason)
        for key, value in response.getheaders():
            if key.lower() not in _RESPONSE_DROP:
                self.send_header(key, value)
        for key, value in extra.items():
            self.send_header(key, value)
        self.end_headers()

    def _relay_whole(self, response: http.client.HTTPResponse, method: str, chat: bool,
                     entry: dict, held: str | None = None) -> None:
        data = response.read()
        if chat and response.status == 200:
            # One answer object: every pause point that applies holds it before it is sent.
            for pause in _points(entry):
                if not self._hold(pause):
                    return
            if held == FIRST_CHUNK and not self.hold_request(self.server.pauses, FIRST_CHUNK):
                return
        self._send_head(response, **{"Content-Length": str(len(data))})
        if method != "HEAD":
            self.wfile.write(data)

    def _relay_stream(self, response: http.client.HTTPResponse, chat: bool, entry: dict,
                      held: str | None = None) -> None:
        self._send_head(response, **{"Transfer-Encoding": "chunked"})
        mid = [p for p in _points(entry) if p != "first-chunk"] if chat and response.status == 200 else []
        first = chat and response.status == 200
        contents = 0
        while True:
            line = response.readline()
            if not line:
                break
            if first:
                first = False
                if not self._hold("first-chunk"):
                    return
            if mid and _ends_turn(line):
                if not self._hold_all(mid):
                    return
                mid = []
            self.send_chunk(line)
            if held == FIRST_CHUNK and response.status == 200:
                held = None
                if not self.hold_request(self.server.pauses, FIRST_CHUNK):
                    return
            if mid and _has_content(line):
                contents += 1
                due = [p for p in mid if contents >= self.server.after_chunks(p)]
                if due:
                    if not self._hold_all(due):
                        return
                    mid = [p for p in mid if p not in due]
        self.send_chunk(b"")

    def _hold_all(self, pauses: list[str]) -> bool:
        return all(self._hold(pause) for pause in pauses)

    def _hold(self, pause: str) -> bool:
        """Wait if ``pause`` is armed; False (and close) if the client hung up meanwhile."""
        if self.server.pauses.hold_if_armed(pause, self.connection):
            return True
        self.close_connection = True
        return False

    def _record(self, path: str, status: int, entry: dict) -> None:
        if not path.startswith("/api/"):
            return
        values = {**entry, "status": status}
        self.server.log.add({
            "time": now_iso(),
            "path": path,
            **{key: values.get(key) for key in LOG_FIELDS},
        })


def _describe(path: str, raw: bytes) -> dict[str, Any]:
    """The log fields of one request, read from its body (which is forwarded as it came)."""
    try:
        body = json.loads(raw) if raw else {}
    except ValueError:
        body = {}
    if not isinstance(body, dict):
        body = {}
    entry: dict[str, Any] = {"model": body.get("model")}
    if not path.endswith("/api/chat"):
        return entry
    messages = [m for m in body.get("messages") or [] if isinstance(m, dict)]
    functions = [t.get("function", {}) for t in body.get("tools") or [] if isinstance(t, dict)]
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
    entry.update(
        n_messages=len(messages),
        last_role=messages[-1].get("role") if messages else None,
        # As the scripted model counts it: assistant messages since the last user message.
        turn=sum(1 for m in messages[last_user + 1:] if m.get("role") == "assistant"),
        tools=[f.get("name") for f in functions],
        tool_args={f.get("name"): list((f.get("parameters") or {}).get("properties", {}))
                   for f in functions},
        stream=body.get("stream", True) is not False,
        think=body.get("think"),
        prompt=prompt_digest(messages),
    )
    return entry


def _points(entry: dict) -> list[str]:
    """The pause points a chat answer can be held at."""
    points = ["first-chunk", "mid-stream"]
    if entry.get("last_role") == "tool":
        points.insert(1, "summary")
    return points


def _parse(line: bytes) -> dict:
    try:
        value = json.loads(line)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _has_content(line: bytes) -> bool:
    message = _parse(line).get("message")
    return isinstance(message, dict) and bool(message.get("content"))


def _ends_turn(line: bytes) -> bool:
    """Whether this chunk is the final one, or carries tool calls (the turn's outcome)."""
    chunk = _parse(line)
    message = chunk.get("message")
    return bool(chunk.get("done")) or (isinstance(message, dict) and bool(message.get("tool_calls")))


# --- parent side ------------------------------------------------------------


@dataclass(frozen=True)
class ModelProxyControl:
    """A client for a running model proxy: the scripted model's control methods, for any model."""

    url: str
    upstream: str = ""

    def requests(self) -> list[dict]:
        """Every ``/api/*`` request the proxy has forwarded, oldest first."""
        return call(f"{self.url}/_proxy/requests")[1]["requests"]

    def chat_requests(self, script: str | None = None) -> list[dict]:
        """The ``/api/chat`` requests. A real model has no scripts: their ``script`` is None,
        so asking for a named script gives an empty list."""
        return [
            r for r in self.requests()
            if r["path"] == "/api/chat" and script in (None, r["script"])
        ]

    def scripts(self) -> list[dict]:
        """A real model runs no scripts."""
        return []

    def arm(self, pause: str, after_chunks: int = DEFAULT_AFTER_CHUNKS) -> None:
        """Hold the next stream that reaches ``pause`` (one of ``PAUSE_POINTS``)."""
        status, body = call(f"{self.url}/_proxy/arm", {"pause": pause, "after_chunks": after_chunks})
        if status != 200:
            raise ValueError(body.get("error", body))

    def wait_paused(self, timeout: float = 60.0) -> str:
        """Block until a stream is held at a pause point; return that point's name."""
        return long_poll(
            f"{self.url}/_proxy/wait_paused", "paused", timeout,
            "no model stream reached an armed pause point (was the pause armed, and did the "
            "model answer after a tool result?)",
        )

    def release(self) -> int:
        """Let every held stream go on; return how many were held."""
        return call(f"{self.url}/_proxy/release", {})[1]["released"]

    def fail_next(self, n: int = 1, status: int = 500, message: str | None = None) -> None:
        """Answer the next `n` chat requests with HTTP `status` and `{"error": message}` from the
        proxy itself, without forwarding them (a gateway's failure; the model never sees them);
        logged with `fault: "error"`. As `ScriptedModelControl.fail_next`."""
        status_code, body = call(f"{self.url}/_proxy/fail_next", {"n": n, "status": status, "message": message})
        if status_code != 200:
            raise ValueError(body.get("error", body))

    def hang_next(self, n: int = 1) -> None:
        """Never answer the next `n` chat requests (not forwarded: no headers, until `release()`
        or the client hangs up); logged with `fault: "hang"`, status 0. As the scripted model's."""
        status_code, body = call(f"{self.url}/_proxy/hang_next", {"n": n})
        if status_code != 200:
            raise ValueError(body.get("error", body))

    def hold_request(self, n: int = 1, at: str = RECEIVED) -> None:
        """Hold the `n`-th chat request from now (1: the next) `at` `"received"` (before it is
        forwarded) or `"first-chunk"` (right after its first chunk), until `release()` or its
        client hangs up. As `ScriptedModelControl.hold_request`."""
        status_code, body = call(f"{self.url}/_proxy/hold_request", {"n": n, "at": at})
        if status_code != 200:
            raise ValueError(body.get("error", body))


def start_model_proxy(
    upstream: str, log_file: str | Path | None = None, port: int = 0
) -> tuple[subprocess.Popen, str]:
    """Start the proxy in a child process (it exits with its parent); return it and its URL."""
    args = ["--upstream", upstream, "--port", str(port)]
    if log_file is not None:
        args += ["--log-file", str(log_file)]
    proc, ready = spawn_module("sophos_lab.standins.model_proxy", args)
    return proc, ready["url"]


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(
        prog="python -m sophos_lab.standins.model_proxy", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--upstream", required=True, help="the Ollama-protocol server, e.g. http://127.0.0.1:11434")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--log-file", type=Path, help="append a JSON line per /api request here")
    args = parser.parse_args(argv)
    server = ModelProxyServer((args.host, args.port), args.upstream, RequestLog(args.log_file))
    serve(server, upstream=server.upstream)


if __name__ == "__main__":
    main()

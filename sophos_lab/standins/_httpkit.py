"""Pieces shared by the kit's loopback HTTP servers and their control clients.

- ``Holds``: named one-shot hold points that make a request wait until a
  test or notebook releases it (armed, waited for and released over HTTP).
- ``RequestLog``: a thread-safe in-memory log, mirrored to a JSON-lines file.
- ``Faults``: the next chat requests' injected failures (the scripted model's and the model
  proxy's ``fail_next`` / ``hang_next``), and ``hold_request``: the n-th chat request from now
  held when it is received or right after its first chunk (the grader's model kill points).
- ``prompt_digest``: which user message a chat request answers, for the request logs.
- ``JsonHandler``: a quiet HTTP/1.1 request handler with JSON helpers.
- ``serve``: print the ready line and serve until interrupted.
- ``call`` and ``long_poll``: the urllib side used by the control clients.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import socket
import sys
import threading
import urllib.error
import urllib.request
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

EXIT_WITH_PARENT = "SOPHOS_LAB_EXIT_WITH_PARENT"
"""Set by the launcher: serve until stdin closes, so a server never outlives its lab."""

MAX_WAIT = 300.0
"""Upper bound, in seconds, for a long-poll on the server side."""


def now_iso() -> str:
    """The current UTC time as an ISO 8601 string ending in Z."""
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


class Holds:
    """Named hold points: arm a name, and the next request reaching it waits.

    Each arming is used once. A held request waits until ``release`` or
    ``close`` is called, or until its client disconnects.
    """

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._armed: set[str] = set()
        # Each held request waits on its own socket pair, so one select()
        # wakes it on either a release or its client hanging up.
        self._held: list[tuple[str, socket.socket]] = []
        self._closed = False

    def arm(self, name: str) -> None:
        """Make the next request that reaches ``name`` wait."""
        with self._changed:
            self._armed.add(name)

    def hold_if_armed(self, name: str, client: socket.socket) -> bool:
        """Wait here if ``name`` is armed; False if the client went away meanwhile."""
        with self._changed:
            if self._closed or name not in self._armed:
                return True
            self._armed.discard(name)
            wake, waker = socket.socketpair()
            self._held.append((name, waker))
            self._changed.notify_all()
        try:
            readable, _, _ = select.select([client, wake], [], [])
        finally:
            with self._changed:
                if (name, waker) in self._held:
                    self._held.remove((name, waker))
            wake.close()
            waker.close()
        # The client sends nothing while it waits for our answer, so a
        # readable client socket means it has closed the connection.
        return wake in readable

    def wait_held(self, timeout: float) -> str | None:
        """The name some request is held at, waiting up to ``timeout`` seconds."""
        with self._changed:
            self._changed.wait_for(lambda: self._held, min(timeout, MAX_WAIT))
            return self._held[0][0] if self._held else None

    def release(self) -> int:
        """Let every held request continue; return how many there were."""
        with self._changed:
            for _, waker in self._held:
                waker.send(b"!")
            released = len(self._held)
            self._held.clear()
            return released

    def close(self) -> None:
        """Release everything and stop holding from now on."""
        with self._changed:
            self._closed = True
        self.release()


HANG = "(hang)"
"""The hold point of a chat request that `hang_next` makes wait before any answer."""

RECEIVED, FIRST_CHUNK = "received", "first-chunk"
"""Where `hold_request` holds its request: before any answer, or right after the first chunk."""


def held_name(at: str) -> str:
    """The hold point's name of a request `hold_request` holds `at` (what `wait_paused` returns)."""
    return f"(request {at})"


def prompt_digest(messages: list[dict]) -> str | None:
    """A short digest of the last user message's text: with `turn` (assistant messages since
    that message), which step of which turn of a conversation a chat request asks for."""
    users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    if not users:
        return None
    content = users[-1].get("content")
    text = content if isinstance(content, str) else json.dumps(content, sort_keys=True)
    return hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()[:12]


class Faults:
    """The next chat requests' failures, each used once, in order: HTTP errors, then hangs; and
    one request to hold (`hold_request`), counted among the requests answered normally."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._errors: list[tuple[int, str]] = []
        self._hangs = 0
        self._hold: tuple[int, str] | None = None

    def hold_request(self, n: int, at: str) -> None:
        """Hold the `n`-th chat request from now (1: the next) that is answered normally, `at`
        `RECEIVED` (before any answer) or `FIRST_CHUNK` (right after its first chunk), until
        released or its client hangs up. A new call replaces the one before."""
        with self._lock:
            self._hold = (n, at)

    def counted(self) -> str | None:
        """Count one chat request about to be answered normally; where to hold it (`RECEIVED`,
        `FIRST_CHUNK`) if it is the one `hold_request` named, else None."""
        with self._lock:
            if self._hold is None:
                return None
            n, at = self._hold
            self._hold = (n - 1, at) if n > 1 else None
            return at if n == 1 else None

    def fail(self, n: int, status: int, message: str) -> None:
        with self._lock:
            self._errors += [(status, message)] * n

    def hang(self, n: int) -> None:
        with self._lock:
            self._hangs += n

    def take(self) -> tuple[int, str] | str | None:
        """The next request's fault: `(status, message)`, `HANG`, or None."""
        with self._lock:
            if self._errors:
                return self._errors.pop(0)
            if self._hangs:
                self._hangs -= 1
                return HANG
            return None

    def control(self, name: str, body: dict, failure: str) -> tuple[int, dict]:
        """Answer the control request `name` (`fail_next`, `hang_next`, `hold_request`) with `body`: the HTTP
        status and JSON of the answer. A failure's default message is `failure (HTTP <status>)`."""
        n = body.get("n")
        if name == "hold_request":
            at = body.get("at", RECEIVED)
            if type(n) is int and n > 0 and at in (RECEIVED, FIRST_CHUNK):
                self.hold_request(n, at)
                return 200, {"holding": n, "at": at}
            return 400, {"error": f'expected a body like {{"n": 2, "at": "{RECEIVED}" or "{FIRST_CHUNK}"}}'}
        if name == "fail_next":
            status = body.get("status", 500)
            if type(n) is int and n > 0 and type(status) is int and 400 <= status <= 599:
                self.fail(n, status, str(body.get("message") or f"{failure} (HTTP {status})"))
                return 200, {"failing": n, "status": status}
            return 400, {"error": 'expected a body like {"n": 2, "status": 500}'}
        if type(n) is int and n > 0:
            self.hang(n)
            return 200, {"hanging": n}
        return 400, {"error": 'expected a body like {"n": 1}'}


class RequestLog:
    """A list of dicts kept in memory and appended to a JSON-lines file."""

    def __init__(self, path: Path | None = None) -> None:
        self._lock = threading.Condition()
        self._entries: list[dict] = []
        self.path = path

    def add(self, entry: dict) -> None:
        """Record one entry."""
        with self._lock:
            self._entries.append(entry)
            if self.path is not None:
                with self.path.open("a", encoding="utf-8") as f:
                    f.write(json.dumps(entry) + "\n")
            self._lock.notify_all()

    def wait_count(self, match: Any, count: int, timeout: float) -> int:
        """Wait up to ``timeout`` seconds until ``count`` entries ``match`` (a predicate); how many do."""
        def found() -> int:
            return sum(1 for entry in self._entries if match(entry))

        with self._lock:
            self._lock.wait_for(lambda: found() >= count, min(timeout, MAX_WAIT))
            return found()

    def entries(self) -> list[dict]:
        """A copy of every entry so far, oldest first."""
        with self._lock:
            return list(self._entries)


class JsonHandler(BaseHTTPRequestHandler):
    """A request handler that speaks HTTP/1.1 and keeps stderr quiet."""

    protocol_version = "HTTP/1.1"
    # Headers, body and each streamed token go out as separate small writes;
    # with Nagle's algorithm on, each would wait for the client's delayed ACK.
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the servers keep their own structured logs

    def read_json(self) -> dict:
        """The request body as a JSON object ({} if empty or not an object)."""
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            return {}
        return body if isinstance(body, dict) else {}

    def send_json(self, status: int, body: Any) -> None:
        """Send ``body`` as a complete JSON response."""
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def start_chunked(self, status: int, content_type: str) -> None:
        """Send headers for a streamed body; follow with ``send_chunk`` calls."""
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def send_chunk(self, data: bytes) -> None:
        """Send one chunk of a streamed body and flush it; b"" ends the body."""
        self.wfile.write(b"%X\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def hold_request(self, holds: Holds, at: str) -> bool:
        """Hold this chat request `at` a point (`Faults.hold_request`) until released; False (and
        the connection closed) if its client hung up meanwhile."""
        holds.arm(held_name(at))
        if holds.hold_if_armed(held_name(at), self.connection):
            return True
        self.close_connection = True
        return False

    def answer_wait(self, holds: Holds, query: dict[str, list[str]], key: str) -> None:
        """Answer a long-poll: ``{key: name}`` once a request is held, else 408."""
        try:
            timeout = float(query.get("timeout", ["10"])[0])
        except ValueError:
            timeout = 10.0
        name = holds.wait_held(timeout)
        self.send_json(200 if name else 408, {key: name})


def serve(server: ThreadingHTTPServer, **ready: Any) -> None:
    """Print the ready line (with the server's URL and ``ready``) and serve forever."""
    host, port = server.server_address[:2]
    line = {"ready": True, "url": f"http://{host}:{port}", **ready}
    print(json.dumps(line), flush=True)
    if os.environ.get(EXIT_WITH_PARENT) == "1":
        # The parent holds our stdin open; end of input means it is gone, whatever killed it.
        threading.Thread(target=lambda: (sys.stdin.buffer.read(), server.shutdown()), daemon=True).start()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def call(url: str, body: dict | None = None, timeout: float = 10.0) -> tuple[int, Any]:
    """GET ``url`` (or POST ``body`` as JSON); return the status and decoded JSON."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as err:
        with err:
            return err.code, json.load(err)


def long_poll(url: str, key: str, timeout: float, nothing: str) -> str:
    """Ask a wait endpoint for up to ``timeout`` seconds; the held name.

    Raises TimeoutError, with ``nothing`` saying what did not happen, when nothing was held.
    """
    _, body = call(f"{url}?timeout={timeout}", timeout=timeout + 10)
    if body[key] is None:
        raise TimeoutError(f"{nothing} within {timeout} s")
    return body[key]

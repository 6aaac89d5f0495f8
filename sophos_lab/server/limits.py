"""The HTTP server's limits, in one place, and the uvicorn protocol that enforces those uvicorn
has no option for.

    limits = HttpLimits.from_env()
    uvicorn.Config(app, ..., **limits.uvicorn_options())

| limit | default | variable | enforced by |
|---|---|---|---|
| a request (head and body) must arrive within | 10 s | `SOPHOS_LAB_REQUEST_TIMEOUT_SECONDS` | `LimitedH11Protocol` (408) |
| an idle kept-alive connection is closed after | 5 s | `SOPHOS_LAB_KEEP_ALIVE_SECONDS` | uvicorn's `timeout_keep_alive` |
| open connections served at once | 512 | `SOPHOS_LAB_MAX_CONNECTIONS` | uvicorn's `limit_concurrency` (503) |
| request line and headers | 16 KiB | (fixed) | h11's incomplete-event limit and `StrictH11Connection` (400) |
| a JSON request body | 1 MiB | `SOPHOS_LAB_MAX_BODY_BYTES` | `routes.json_object` (413), see `app.ServerOptions` |

The request timeout runs from the connection's opening (its first request) or from the first
byte of a later request on a kept-alive connection, and stops once the whole request is in: a
response, however long it streams (an SSE stream follows a run for minutes), is never timed.

Why a protocol of our own: uvicorn has no timeout on receiving a request (its keep-alive timer
stops at the first byte, so a client that sends one byte at a time is held forever), answers
what h11 refuses with a plain-text 400, and h11 accepts a request with both `Content-Length` and
`Transfer-Encoding` (it frames it by the latter and keeps the connection open: the request-
smuggling pattern of RFC 9112 §6.3, which lets a server reject it and says it must then close).
`LimitedH11Protocol` is uvicorn's own h11 protocol with those three things added; the server
uses it whatever parsers are installed (`http=`: never httptools, whose refusals differ).
It leans on uvicorn's `H11Protocol` internals (`conn`, `cycle`, `handle_events`,
`send_400_response`); `tests/test_server_limits.py` is what says it still works after an upgrade.
"""

from __future__ import annotations

import asyncio
import functools
import http
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..runtime import errors
from ..runtime.settings import positive
from .wire import error_response

DEFAULT_REQUEST_TIMEOUT_SECONDS = 10.0
"""Long enough for any client that sends its request at once over a slow link (a chat body is a
few KiB; the largest allowed, 1 MiB, needs 100 KiB/s), short enough that a slow client's hold
on a connection is brief."""
DEFAULT_KEEP_ALIVE_SECONDS = 5.0
"""uvicorn's default: a browser reuses its connection between the page's requests."""
DEFAULT_MAX_CONNECTIONS = 512
"""Far above what one person's lab opens (a page holds a stream and a few requests), and below
the common soft limit of 1024 open files, which the database, the MCP servers' pipes and the
logs share: past it the server answers 503 instead of failing to accept or to open files."""
MAX_HEAD_BYTES = 16 * 1024
"""h11's default; a request line and headers (a token, a `Last-Event-ID`) are far smaller."""
MAX_DETAIL_CHARS = 200
"""How much of the parser's reason a 400 repeats (it may quote the client's bytes)."""

REQUEST_TIMEOUT = "REQUEST_TIMEOUT"
"""The error code of a 408: the request did not arrive in time."""


@dataclass(frozen=True)
class HttpLimits:
    """What the server bounds, and how (see the module's table)."""

    request_timeout: float = DEFAULT_REQUEST_TIMEOUT_SECONDS
    keep_alive: float = DEFAULT_KEEP_ALIVE_SECONDS
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_head_bytes: int = MAX_HEAD_BYTES

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> HttpLimits:
        """Unset, empty, unparsable or <= 0 all mean the default, as for every kit setting."""
        env = os.environ if environ is None else environ
        return cls(
            request_timeout=positive(env.get("SOPHOS_LAB_REQUEST_TIMEOUT_SECONDS"), DEFAULT_REQUEST_TIMEOUT_SECONDS, float),
            keep_alive=positive(env.get("SOPHOS_LAB_KEEP_ALIVE_SECONDS"), DEFAULT_KEEP_ALIVE_SECONDS, float),
            max_connections=positive(env.get("SOPHOS_LAB_MAX_CONNECTIONS"), DEFAULT_MAX_CONNECTIONS, int),
        )

    def uvicorn_options(self) -> dict[str, Any]:
        """The keyword arguments of `uvicorn.Config` that carry these limits."""
        return {
            "http": functools.partial(LimitedH11Protocol, limits=self),
            "ws": "none",  # the API has no WebSocket route: an upgrade is an ordinary request
            "timeout_keep_alive": self.keep_alive,
            # uvicorn refuses a request when the open connections, this one included, reach
            # its limit: one more, so that exactly `max_connections` are served at once.
            "limit_concurrency": self.max_connections + 1,
            "h11_max_incomplete_event_size": self.max_head_bytes,
        }


class StrictH11Connection(h11.Connection):
    """h11's server connection that also refuses, as h11 refuses a malformed request:

    - a request with both `Content-Length` and `Transfer-Encoding`;
    - a request line and headers over `max_head_bytes` that arrived in one read (h11 bounds only
      what it is still waiting for).

    `refused` is the last refusal (h11's or ours): uvicorn drops it before it answers.
    """

    def __init__(self, max_head_bytes: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_head_bytes)
        self.max_head_bytes = max_head_bytes
        self.refused: h11.RemoteProtocolError | None = None

    def next_event(self) -> Any:
        try:
            event = super().next_event()
            if isinstance(event, h11.Request):
                self._check(event)
        except h11.RemoteProtocolError as error:
            self.refused = error
            raise
        return event

    def _check(self, request: h11.Request) -> None:
        names = {name for name, _ in request.headers}
        if b"content-length" in names and b"transfer-encoding" in names:
            raise h11.RemoteProtocolError("both Content-Length and Transfer-Encoding")
        # The head as it came, near enough: "METHOD target HTTP/1.1", "name: value" lines, a blank line.
        size = len(request.method) + len(request.target) + 12 + 2 + sum(
            len(name) + len(value) + 4 for name, value in request.headers)
        if size > self.max_head_bytes:
            raise h11.RemoteProtocolError("request head too large", error_status_hint=431)


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on receiving each request (408
    `REQUEST_TIMEOUT`), the kit's error envelope on what the parser refuses (400
    `BAD_REQUEST`) and `StrictH11Connection`'s refusals; each closes the connection."""

    def __init__(self, *args: Any, limits: HttpLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.conn = StrictH11Connection(limits.max_head_bytes)
        self.request_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_deadline()  # a connection that sends nothing is closed too

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_deadline()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        # Time a request while it is being received: from its first byte (or the connection's
        # opening) until its head and body are in. Not while idle between requests (the
        # keep-alive timeout's part), not while the response is written.
        if self.transport.is_closing() or self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            self._stop_deadline()
        elif self.conn.their_state is h11.SEND_BODY or self.conn.trailing_data[0]:
            self._start_deadline()

    def send_400_response(self, msg: str) -> None:
        """What the parser refused (`msg` is uvicorn's fixed text), in the envelope."""
        error = self.conn.refused
        if error is not None and error.error_status_hint == 431:
            message = f"The request head is larger than {self.limits.max_head_bytes} bytes"
        else:
            detail = str(error) if error is not None else msg
            message = f"Malformed HTTP request: {detail[:MAX_DETAIL_CHARS]}"
        self.logger.info("Refused a request from %s: %s", _client(self), message)
        self.refuse(400, errors.BAD_REQUEST, message + "; the connection is closed.")

    def _start_deadline(self) -> None:
        if self.request_deadline is None:
            self.request_deadline = self.loop.call_later(self.limits.request_timeout, self._request_timed_out)

    def _stop_deadline(self) -> None:
        if self.request_deadline is not None:
            self.request_deadline.cancel()
            self.request_deadline = None

    def _request_timed_out(self) -> None:
        self.request_deadline = None
        if self.transport.is_closing():
            return
        message = f"The request did not arrive within {self.limits.request_timeout:g} s"
        self.logger.warning("Closed a connection from %s: %s", _client(self), message)
        if self.conn.their_state is h11.IDLE and not self.conn.trailing_data[0]:
            self.conn.send(h11.ConnectionClosed())  # nothing was asked: nothing to answer
            self.transport.close()
        else:
            self.refuse(408, REQUEST_TIMEOUT, message + "; the connection is closed.")

    def refuse(self, status: int, code: str, message: str) -> None:
        """Answer `{"error": {code, message}}` with `status` if no response has begun, then close."""
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            envelope = error_response(code, message)  # the app's own envelope, byte for byte
            headers = [*self.server_state.default_headers, *envelope.raw_headers, (b"connection", b"close")]
            self.transport.write(self.conn.send(h11.Response(
                status_code=status, headers=headers, reason=http.HTTPStatus(status).phrase.encode())))
            try:
                self.transport.write(self.conn.send(h11.Data(data=envelope.body)))
                self.transport.write(self.conn.send(h11.EndOfMessage()))
            except h11.LocalProtocolError:
                pass  # the answer to a HEAD request has no body
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # the app, if it answers after all, answers nobody
        self.transport.close()


def _client(protocol: H11Protocol) -> str:
    return "%s:%d" % protocol.client if protocol.client else "a client"

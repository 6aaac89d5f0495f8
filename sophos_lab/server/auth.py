"""The token rule: a server bound to anything but loopback needs `SOPHOS_LAB_TOKEN`, and with a
token set every API request must carry `Authorization: Bearer <token>`.

Two exceptions, both for the web page. The page's own files (`/` and `/static/...`) are served
without the token: they are the package's files, the same for everyone, and hold no data; every
request for data goes to `/api/`. And the SSE stream (`GET /api/chat`) may carry the token as
`?token=` instead, because a browser's `EventSource` cannot send headers. The access log never
shows that query value (`redact_token`).
"""

from __future__ import annotations

import ipaddress
import logging
import re
import secrets
from urllib.parse import parse_qs

from starlette.types import ASGIApp, Receive, Scope, Send

from .wire import UNAUTHORIZED, error_response

PAGE_PATHS = re.compile(r"/(static/.*)?")
"""The web page's files: public, with no data in them."""
STREAM_PATH = "/api/chat"
_TOKEN_IN_QUERY = re.compile(r"(?<=[?&])token=[^&]*")


def is_loopback(host: str) -> bool:
    """Whether binding `host` listens on this machine only (`localhost`, 127.0.0.0/8, `::1`)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve to anything


class BearerToken:
    """ASGI middleware: refuse (401, the error envelope) any HTTP request without the token."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.token = token.encode("utf-8")
        self.expected = b"Bearer " + self.token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self._public(scope):
            given = dict(scope["headers"]).get(b"authorization", b"")
            in_query = self._query_token(scope)
            if in_query is not None and not given:
                allowed, message = secrets.compare_digest(in_query, self.token), "The token in ?token= is not this server's."
            else:
                allowed = secrets.compare_digest(given, self.expected)
                message = ("This server needs its token: send Authorization: Bearer <SOPHOS_LAB_TOKEN>."
                           if not given else "The token in Authorization is not this server's.")
            if not allowed:
                response = error_response(UNAUTHORIZED, message, {"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    @staticmethod
    def _public(scope: Scope) -> bool:
        return scope["method"] in ("GET", "HEAD") and PAGE_PATHS.fullmatch(scope["path"]) is not None

    @staticmethod
    def _query_token(scope: Scope) -> bytes | None:
        """`?token=` of an SSE request (`GET /api/chat`); None on any other request."""
        if scope["method"] != "GET" or scope["path"] != STREAM_PATH:
            return None
        values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token")
        return values[-1].encode("utf-8") if values else None


class RedactToken(logging.Filter):
    """Shows `?token=` as `token=REDACTED` in uvicorn's access log lines (path is their third argument)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            record.args = (*args[:2], redact_token(args[2]), *args[3:])
        return True


def redact_token(path: str) -> str:
    return _TOKEN_IN_QUERY.sub("token=REDACTED", path)

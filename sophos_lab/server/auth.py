"""The token rule: a server bound to anything but loopback needs `SOPHOS_LAB_TOKEN` or users
(`sophos-lab user add`), and with either every API request must carry `Authorization: Bearer
<token>`, which says who it is (see `BearerToken`).

Two exceptions, both for the web page. The page's own files (`/` and `/static/...`) and the kit's
pages for the agent to fetch (`/pages/...`, `/robots.txt`) are served without the token: they are
the kit's files, the same for everyone, and hold no data; every
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

from ..runtime import errors, users
from .wire import UNAUTHORIZED, error_response, unavailable

PAGE_PATHS = re.compile(r"/((static|pages)/.*|pages|robots\.txt)?")
"""The web page's files: public, with no data in them."""
STREAM_PATH = "/api/chat"
PROBE_PATHS = ("/api/healthz", "/api/readyz")
"""Without a server token, public even with users: they read no data, and open no database."""
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
    """ASGI middleware: who a request is, or a refusal (401, the error envelope) before the app
    sees it.

    - With the server's token (`SOPHOS_LAB_TOKEN`): the instructor, who acts for no user and so
      sees every conversation.
    - With a user's token (`sophos-lab user add`): that user (`users.acting_user`, for the
      request's whole task and the runs it starts); a revoked token is refused.
    - With no token: allowed only while the server has neither a token nor users (a learner's
      own laptop, the default).
    """

    def __init__(self, app: ASGIApp, token: str | None = None) -> None:
        self.app = app
        self.token = token.encode("utf-8") if token else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._public(scope):
            await self.app(scope, receive, send)
            return
        try:
            user, refusal = await self._who(scope)
        except Exception as error:  # the users table cannot be read: who this is is not known
            if not errors.database_unavailable(error):
                raise
            await unavailable(error)(scope, receive, send)
            return
        if refusal is not None:
            response = error_response(UNAUTHORIZED, refusal, {"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        acting = users.acting_user.set(user)
        try:
            await self.app(scope, receive, send)
        finally:
            users.acting_user.reset(acting)

    async def _who(self, scope: Scope) -> tuple[str | None, str | None]:
        """`(user id or None, None)` for a request allowed in, `(None, why not)` otherwise."""
        header = dict(scope["headers"]).get(b"authorization")
        in_query = self._query_token(scope)
        if header is not None:
            scheme, _, given = header.partition(b" ")
            if scheme != b"Bearer":
                return None, "The token in Authorization is not this server's."
            where = "Authorization"
        elif in_query is not None:
            given, where = in_query, "?token="
        else:
            given, where = None, ""
        store = scope["app"].state.service.store
        if given is None:
            if self.token is None and scope["path"] in PROBE_PATHS:
                return None, None  # the probes touch nothing, the database included
            if await users.has_users(store):
                return None, ("This server has users: send Authorization: Bearer <your token> (the one "
                              "`sophos-lab user add NAME` printed).")
            if self.token is None:
                return None, None  # one user, on loopback: the default
            return None, "This server needs its token: send Authorization: Bearer <SOPHOS_LAB_TOKEN>."
        if self.token is not None and secrets.compare_digest(given, self.token):
            return None, None
        user = await users.user_for_token(store, given.decode("latin-1"))
        if user is None:
            return None, f"The token in {where} is not this server's."
        if user.revoked:
            return None, f"The token in {where} was revoked (user {user.name!r})."
        return user.id, None

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

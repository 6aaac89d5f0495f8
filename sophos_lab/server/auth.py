"""The token rule: a server bound to anything but loopback needs `SOPHOS_LAB_TOKEN`, and with a
token set every request must carry `Authorization: Bearer <token>`."""

from __future__ import annotations

import ipaddress
import secrets

from starlette.types import ASGIApp, Receive, Scope, Send

from .wire import UNAUTHORIZED, error_response


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
        self.expected = f"Bearer {token}".encode("utf-8")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                message = ("This server needs its token: send Authorization: Bearer <SOPHOS_LAB_TOKEN>."
                           if not given else "The token in Authorization is not this server's.")
                response = error_response(UNAUTHORIZED, message, {"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

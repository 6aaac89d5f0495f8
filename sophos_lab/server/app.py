"""The ASGI app: the API routes over one `AgentService`, the token check, the error envelope.

    app = create_app(Settings.from_env(), ServerOptions.from_env())

Nothing is opened when the app starts, as in the original: the database (and its crash
recovery) on the first request that needs it, the MCP servers on the first run that needs
tools; `healthz` and `readyz` touch neither. The lifespan's end drains and closes the service.
Under plain uvicorn that end comes only after every connection has closed, so a stream
following a run would hold the shutdown until the run ended on its own; `sophos-lab serve`
(`process.DrainingServer`) drains first, then lets uvicorn close.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import psycopg
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ..runtime import errors
from ..runtime.errors import SophosError
from ..runtime.service import AgentService
from ..runtime.settings import Settings, positive
from .auth import BearerToken
from .routes import API, ExactRoute
from .wire import INTERNAL_ERROR, METHOD_NOT_ALLOWED, error_response, refusal, unavailable

log = logging.getLogger(__name__)

STATIC = Path(__file__).resolve().parent / "static"
"""The web page: `index.html`, its script and its style sheet (package data, no build step)."""
PAGES = Path(__file__).resolve().parents[2] / "data" / "web"
"""The kit's own web pages, served at `/pages/` for the agent to fetch on a machine without
internet (`Fetch http://127.0.0.1:5174/pages/ and tell me what it says.`)."""
PAGE_HEADERS = {
    # Defence in depth: the page writes every model and tool text with textContent; even if
    # some did end up as markup, no inline script or handler would run.
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; base-uri 'none'; "
                               "form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}
DEFAULT_PING_SECONDS = 15.0
DEFAULT_MAX_BODY_BYTES = 1 << 20


@dataclass(frozen=True)
class ServerOptions:
    """What the HTTP layer needs beyond the runtime's `Settings`."""

    token: str | None = None
    """`SOPHOS_LAB_TOKEN`: when set, every request needs `Authorization: Bearer <token>`."""
    ping_seconds: float = DEFAULT_PING_SECONDS
    """`SOPHOS_LAB_SSE_PING_SECONDS`: how often an open stream gets a `ping` (the original's 15 s)."""
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    """`SOPHOS_LAB_MAX_BODY_BYTES`: a larger request body is refused with 413."""
    log_dir: Path | None = None
    """`SOPHOS_LAB_LOG_DIR`: where the MCP servers' stderr goes."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ServerOptions:
        env = os.environ if environ is None else environ
        log_dir = env.get("SOPHOS_LAB_LOG_DIR")
        return cls(
            token=env.get("SOPHOS_LAB_TOKEN") or None,
            ping_seconds=positive(env.get("SOPHOS_LAB_SSE_PING_SECONDS"), DEFAULT_PING_SECONDS, float),
            max_body_bytes=positive(env.get("SOPHOS_LAB_MAX_BODY_BYTES"), DEFAULT_MAX_BODY_BYTES, int),
            log_dir=Path(log_dir) if log_dir else None,
        )


def create_app(settings: Settings, options: ServerOptions | None = None) -> Starlette:
    """The app over one new `AgentService` with these settings (`app.state.service`)."""
    options = options or ServerOptions()
    service = AgentService(settings, log_dir=options.log_dir)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        try:
            yield
        finally:
            await service.shutdown()

    app = Starlette(
        routes=[*API, ExactRoute("/", web_page, methods=["GET"]), Mount("/static", StaticFiles(directory=STATIC)),
                ExactRoute("/robots.txt", robots, methods=["GET"]),
                Mount("/pages", StaticFiles(directory=PAGES, html=True, check_dir=False))],
        middleware=[Middleware(BearerToken, token=options.token)],
        # psycopg's errors are answered here (Starlette re-raises what reaches `Exception`'s handler,
        # and the server logs it as a crash): an unreachable database is a 503, not a 500.
        exception_handlers={SophosError: _refused, HTTPException: _http_error, psycopg.OperationalError: _failed,
                            Exception: _failed},
        lifespan=lifespan,
    )
    app.state.service = service
    app.state.options = options
    return app


async def web_page(request: Request) -> Response:
    """The page at `/` (the original's UI contract; `static/app.js` says how)."""
    return FileResponse(STATIC / "index.html", headers=PAGE_HEADERS)


async def robots(request: Request) -> Response:
    """Everyone may fetch `/pages/` (the fetch tool reads `robots.txt` before a page)."""
    return FileResponse(PAGES / "robots.txt", media_type="text/plain")


async def _refused(request: Request, error: Exception) -> Response:
    assert isinstance(error, SophosError)
    return refusal(error)


async def _http_error(request: Request, error: Exception) -> Response:
    """Starlette's own 404 and 405, in the error envelope."""
    assert isinstance(error, HTTPException)
    path = request.scope["path"]  # as routed: `request.url` drops tabs and newlines (urllib's urlsplit)
    if error.status_code == 405:
        allowed = sorted({
            method for route in request.app.routes if isinstance(route, Route)
            and route.path_regex.fullmatch(path) for method in route.methods or ()
        })
        return error_response(METHOD_NOT_ALLOWED, f"{request.method} is not allowed on {path}",
                              {"Allow": ", ".join(allowed)})
    if error.status_code == 404:
        return error_response(errors.NOT_FOUND, f"No such endpoint: {path}")
    response = error_response(f"HTTP_{error.status_code}", error.detail)
    response.status_code = error.status_code
    return response


async def _failed(request: Request, error: Exception) -> Response:
    if errors.database_unavailable(error):  # a route's or the token check's: ask again, not a 500
        log.warning("%s %s: the database is unavailable: %s", request.method, request.url.path, error)
        return unavailable(error)
    log.error("%s %s failed", request.method, request.url.path, exc_info=error)
    # The details (SQL, paths) go to the server's log, not to a client that may be off loopback.
    return error_response(INTERNAL_ERROR, f"The server failed on {request.method} {request.url.path}; its log says why.")

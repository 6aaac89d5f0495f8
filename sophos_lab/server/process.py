"""The server process: uvicorn with the kit's honest shutdown in front of its own.

On SIGTERM (or SIGINT) uvicorn's signal handler asks its main loop to exit; `DrainingServer`
then stops accepting connections, drains the service (each active run stops at its next step
boundary, or is cancelled after `SHUTDOWN_TIMEOUT`, and is recorded `interrupted` / `SHUTDOWN`
before its final event goes to every open stream), and only then runs uvicorn's shutdown:
close idle connections, wait for the rest (each stream has ended with its run), and the
lifespan's end closes MCP and the database. The caller turns the signal into exit code 0.

What one client may hold or send (the request and keep-alive timeouts, the head size, the open
connections) is `limits.HttpLimits`, passed to uvicorn with the protocol that enforces it.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import uvicorn

from ..runtime.service import AgentService
from ..runtime.settings import Settings
from .app import ServerOptions, create_app
from .auth import RedactToken
from .limits import HttpLimits
from .sse import DRAIN_MARGIN

Announce = Callable[..., None]
"""`announce(event, **data)`: tell whoever started the server what it is doing."""


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, service: AgentService, announce: Announce) -> None:
        super().__init__(config)
        self.service = service
        self.announce = announce

    @property
    def url(self) -> str:
        port = self.servers[0].sockets[0].getsockname()[1]
        host = self.config.host
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started:
            self.announce("ready", url=self.url, pid=os.getpid())

    async def shutdown(self, sockets: Any = None) -> None:
        for server in self.servers:
            server.close()  # no new connections while the runs drain
        self.announce("shutdown-requested", active_runs=[run.id for run in self.service.active.values()],
                      timeout=self.service.settings.shutdown_timeout)
        await self.service.drain()
        self.announce("drained")
        await super().shutdown(sockets)


def human_announce(event: str, **data: Any) -> None:
    if event == "ready":
        print(f"sophos-lab serve: the HTTP API listens at {data['url']} (pid {data['pid']}); "
              f"try curl {data['url']}/api/healthz", flush=True)
    elif event == "shutdown-requested":
        runs = len(data["active_runs"])
        print("sophos-lab serve: shutting down: " + (
            f"{runs} active run(s) stop at their next step (cancelled after {data['timeout']:g} s) and are "
            "recorded interrupted / SHUTDOWN" if runs else "no active runs"), flush=True)


def run_server(
    settings: Settings, options: ServerOptions, host: str, port: int,
    announce: Announce = human_announce, exit_with_stdin: bool = False, limits: HttpLimits | None = None,
) -> None:
    """Serve until a signal (or the end of stdin, with `exit_with_stdin`) and a graceful shutdown.

    `announce` hears `ready` (`url`, `pid`), `shutdown-requested` (`active_runs`, `timeout`)
    and `drained`. A lab's child sets `exit_with_stdin`, so it does not outlive the lab.
    `limits` (default: from the environment) bounds what a client may hold (`server.limits`).
    """
    app = create_app(settings, options)
    limits = HttpLimits.from_env() if limits is None else limits
    config = uvicorn.Config(
        app, host=host, port=port, lifespan="on", log_level="info",
        timeout_graceful_shutdown=int(settings.shutdown_timeout + DRAIN_MARGIN),
        **limits.uvicorn_options(),  # request and keep-alive timeouts, head size, connections
    )
    logging.getLogger("uvicorn.access").addFilter(RedactToken())  # the page's ?token= on the SSE stream
    server = DrainingServer(config, app.state.service, announce)
    if exit_with_stdin:
        def exit_with_parent() -> None:
            sys.stdin.read()
            server.should_exit = True  # the main loop looks every 0.1 s, then drains as for SIGTERM

        threading.Thread(target=exit_with_parent, daemon=True).start()
    server.run()

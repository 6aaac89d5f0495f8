"""The HTTP API: the original's endpoints and SSE stream over one `AgentService`.

A layer above `runtime/` (it imports the runtime; the runtime never imports it), built from
Starlette, sse-starlette and uvicorn. `create_app(settings)` is the ASGI app;
`sophos-lab serve` runs it in a process that drains honestly on SIGTERM (`process`).
"""

from .app import ServerOptions, create_app

__all__ = ["ServerOptions", "create_app"]

"""Server-sent events as the original frames them, on sse-starlette's `EventSourceResponse`.

A frame is `id: N` (only for a run's own events), `event: <name>`, `data: <JSON>`, then a blank
line, with `\\n` line ends. `ping` (data `""`, no id) goes out every `ping_seconds` and never
moves a client's `Last-Event-ID`.

A stream that follows a run keeps going through a graceful shutdown until the run's final
event: the drain records the run and publishes that event, then the stream ends by itself.
sse-starlette would otherwise cancel every stream as soon as uvicorn is told to exit, so each
response is given a grace period longer than the drain can take.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Any

from sse_starlette import EventSourceResponse, ServerSentEvent

from ..runtime import errors
from ..runtime.errors import SophosError
from ..runtime.active import ActiveRun
from .wire import event_json

HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache, no-transform",
    "Connection": "keep-alive",
}
DRAIN_MARGIN = 10.0
"""Seconds a stream may outlast `SHUTDOWN_TIMEOUT` while its run is recorded after a cancel."""


def frame(event: str, data: Any, id: int | None = None) -> bytes:
    """One SSE frame, byte for byte as the original writes it."""
    head = f"id: {id}\n" if id is not None else ""
    return f"{head}event: {event}\ndata: {event_json(data)}\n\n".encode("utf-8")


def ping() -> ServerSentEvent:
    return ServerSentEvent(data='""', event="ping", sep="\n")


def last_event_id(value: str | None) -> int:
    """The `Last-Event-ID` header as the original reads it: missing or non-numeric is 0."""
    try:
        number = float(value or 0)
    except ValueError:
        return 0
    return max(0, math.floor(number)) if math.isfinite(number) else 0


def event_stream(frames: AsyncIterator[bytes], ping_seconds: float, shutdown_timeout: float) -> EventSourceResponse:
    return EventSourceResponse(
        frames, headers=HEADERS, ping=ping_seconds, ping_message_factory=ping, sep="\n",
        shutdown_grace_period=shutdown_timeout + DRAIN_MARGIN,
    )


async def single(event: str, data: Any) -> AsyncIterator[bytes]:
    """A stream of one event without an id (an invalid, unknown or idle conversation)."""
    yield frame(event, data)


async def follow(run: ActiveRun, after: int) -> AsyncIterator[bytes]:
    """The run's events with an id above `after`, then live ones, up to its final event.

    `after` = 0 (no `Last-Event-ID`) starts at the oldest event the bounded buffer still keeps.
    An id older than that, or one the run never gave (an id of another run: ids count per run),
    gets one `chat-error` `REPLAY_GONE` without an id, saying how to recover.
    """
    if after == 0:
        after = run.dropped
    try:
        if after > run.last_id:
            raise SophosError(errors.REPLAY_GONE, (
                f"Event {after} is not one of run {run.id}, which has sent {run.last_id} so far (ids "
                "count per run and per server process). Reload the conversation, then follow the "
                "run again without Last-Event-ID."))
        async for event in run.events(after):
            yield frame(event.event, event.data, event.id)
    except SophosError as gone:
        yield frame("chat-error", {
            **gone.to_dict(), "conversation": run.conversation, "run": run.id, "oldest": run.dropped + 1,
        })

"""A run in progress in this process, with the buffer of its events that its followers read."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from langgraph.runtime import RunControl

from . import errors
from .errors import SophosError
from .events import Event


@dataclass
class ActiveRun:
    """A run in progress in this process, with its event buffer (replayable from any id it keeps).

    The buffer keeps the latest `keep` events (all of them when `keep` is None); ids go on
    counting, so the buffer holds ids `dropped + 1` to `last_id`.
    """

    id: str
    conversation: str
    resume: bool
    control: RunControl = field(default_factory=RunControl)
    buffer: list[Event] = field(default_factory=list)
    task: asyncio.Task | None = None
    lost: bool = False
    """Another process took the run over (this process's lease ran out)."""
    recorded: bool = False
    """Its outcome has been written (or refused, when it was lost): no lease to keep for it."""
    keep: int | None = None
    """How many of the latest events the buffer keeps for replay (None: every event)."""
    dropped: int = 0
    """How many of the oldest events the buffer has let go (ids 1 to `dropped`)."""
    cancel_requested: bool = False
    """`cancel()` was accepted: written to the run's row before anything was stopped."""
    in_graph: bool = False
    """The graph is streaming (a cancel then stops it mid-step); False once it has stopped."""
    replayed: bool = False
    """Not started by this call: the run a repeated request (idempotency key, approval) started
    first; it may have finished long ago, and then holds its `started` and final events only."""
    sink: Callable[[str, str, Event], None] | None = None
    """A worker's: given each event as it is published, to write it where every server reads it."""
    began: float = field(default_factory=time.monotonic)
    """When this process took the run on."""
    overdue: bool = False
    """Stopped for running longer than its steps can take (`AgentService.overdue_seconds`)."""
    before: str | None = None
    """The status of the conversation's run before this one, if its starter read it (None: not read)."""
    owner: tuple[str | None] | None = None
    """`(user id,)` of the conversation's owner (`users`), if its starter read it with the
    conversation (None: not read; the run reads it as it begins)."""
    input_ids: str | None = None
    """`runs.input` once the thread holds the run's messages (`models.carried_ids`); None: a resume."""
    input_saved: bool = False
    """A `loop` checkpoint of this run is committed, so its messages are in the thread (its input
    checkpoint holds them only in `__start__`, and a fold's checkpoint is another run's)."""
    _signal: asyncio.Event = field(default_factory=asyncio.Event)

    def checkpoint_listener(self, saved: Callable[[int], None]) -> Callable[[dict[str, Any]], None]:
        """What the saver calls with each committed checkpoint of the thread: notes whether this
        run's messages are in it, then `saved(step)`."""
        def listener(metadata: dict[str, Any]) -> None:
            if metadata.get("run_id") == self.id and metadata.get("source") == "loop":
                self.input_saved = True
            saved(metadata.get("step", -1))
        return listener

    def publish(self, name: str, data: Any) -> Event:
        event = Event(self.last_id + 1, name, data)
        if self.sink is not None:
            self.sink(self.id, self.conversation, event)
        self.buffer.append(event)
        if self.keep is not None and len(self.buffer) > self.keep:
            excess = len(self.buffer) - self.keep
            del self.buffer[:excess]
            self.dropped += excess
        self._signal.set()
        self._signal = asyncio.Event()
        return event

    @property
    def last_id(self) -> int:
        """The id of the latest event (0 before the first)."""
        return self.dropped + len(self.buffer)

    @property
    def finished(self) -> bool:
        return bool(self.buffer) and self.buffer[-1].is_terminal

    async def events(self, after: int = 0) -> AsyncIterator[Event]:
        """Every event with an id above `after`, then live ones, up to the final event.

        Raises `REPLAY_GONE` when the next event to give is no longer kept: `after` is older
        than the buffer, or a slow reader fell more than `keep` events behind.
        """
        last = after
        while True:
            signal = self._signal
            while last < self.last_id:
                index = last - self.dropped
                if index < 0:
                    raise SophosError(errors.REPLAY_GONE, (
                        f"Events {last + 1} to {self.dropped} of run {self.id} are no longer kept (the "
                        f"buffer keeps the latest {self.keep}). Reload the conversation, then follow "
                        "the run again without Last-Event-ID: it starts from the oldest event kept."))
                event = self.buffer[index]
                last = event.id
                yield event
                if event.is_terminal:
                    return
            await signal.wait()

    async def wait(self) -> Event:
        """The final event (`end` or `chat-error`)."""
        async for event in self.events(max(self.last_id - 1, 0)):
            pass
        return event  # events() stops right after the final event

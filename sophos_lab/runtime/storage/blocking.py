"""A `Storage` for code that is not async: the CLI, the lab's helpers in a notebook cell, tests.

The storage lives on an event loop of its own, in a thread of its own, and each call waits for
its answer there (as procrastinate builds its sync verbs from the async ones). Never for a
service's own loop: there a call must be awaited, or it would stop every other run while it waits.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
from collections.abc import Awaitable, Callable
from typing import Any


class Blocking:
    """`Blocking(make)`: the storage `make()` returns (called on the thread's loop), with each of
    its coroutine methods as a plain call that returns the answer. `call(f, *args)` runs
    `f(storage, *args)` there (a rule of `users`, say); `close()` closes it and stops the thread."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sophos-storage", daemon=True)
        self._thread.start()
        self.storage = self._run(self._make(make))

    @staticmethod
    async def _make(make: Callable[[], Any]) -> Any:
        return make()

    def _run(self, coroutine: Awaitable[Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.storage, name)
        if not inspect.iscoroutinefunction(value):
            return value

        @functools.wraps(value)
        def blocking(*args: Any, **kwargs: Any) -> Any:
            return self._run(value(*args, **kwargs))

        return blocking

    def call(self, function: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
        return self._run(function(self.storage, *args, **kwargs))

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._run(self.storage.aclose())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def __enter__(self) -> Blocking:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""Lesson 12, retries and time limits: the child it starts, and the views of its retries, its model
requests and the backoff policy.

Read any of them in the lesson with `??`, e.g. `lesson.retries??`.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from ...runtime.settings import Settings
from ..children import LabKernel, LabWorker
from ..harness import Lab


def start_child(lab: Lab, kind: str, **env: str) -> LabKernel | LabWorker:
    """A fresh agent process with these settings (environment variables): a child Jupyter kernel
    when `kind` is `"kernel"`, else a plain subprocess (`"worker"`)."""
    return lab.kernel(**env) if kind == "kernel" else lab.worker(**env)


def retries(events: list[dict[str, Any]]) -> pd.DataFrame:
    """The `retry` trace events among `events` (a child's `events()`), one row each: attempt
    `attempt` of `of` follows after `wait` s, because the one before failed with `error`; `code` is
    what the run would have recorded, had that attempt been the last."""
    rows = [{"step": e["data"]["step"], "node": e["data"]["node"], **e["data"]["data"]}
            for e in events if e["event"] == "trace" and e["data"]["event"] == "retry"]
    return pd.DataFrame(rows, columns=["step", "node", "attempt", "of", "wait", "code", "error"])


def requests_since(lab: Lab, start: int) -> pd.DataFrame:
    """The model's chat requests from number `start` on (`len(lab.model.chat_requests())` taken
    before): each one's HTTP status, the fault the lab injected (`fail_next`), and the seconds since
    the request before it (the wait, plus the time the failed request itself took)."""
    frame = pd.DataFrame(lab.model.chat_requests()[start:], columns=["time", "status", "fault"])
    times = pd.to_datetime(frame["time"])
    return frame.assign(after_previous=times.diff().dt.total_seconds().round(2))[["status", "fault", "after_previous"]]


def entered(events: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """`(step, node)` of every step that a run entered, in order (its `enter` trace events)."""
    return [(e["data"]["step"], e["data"]["node"]) for e in events
            if e["event"] == "trace" and e["data"]["event"] == "enter"]


def tool_results(events: list[dict[str, Any]]) -> list[str]:
    """The status (`success`, `error`) of every tool result among `events`, in order."""
    return [e["data"]["data"]["status"] for e in events
            if e["event"] == "trace" and e["data"]["event"] == "result"]


def policy(settings: Settings, count: int = 8) -> pd.DataFrame:
    """The backoff of `settings` for its first `count` retries: the wait before each attempt
    (`Settings.backoff(n)`, `min(base · 2^(n-1), max)`) and the waiting so far."""
    numbers = range(1, count + 1)
    waits = pd.Series([settings.backoff(n) for n in numbers])
    return pd.DataFrame({"retry": numbers, "before attempt": [n + 1 for n in numbers],
                         "wait (s)": waits, "waited in all (s)": waits.cumsum()})


def limits(settings: Settings) -> str:
    """The attempts and time limits of `settings` in one line."""
    return (f"{settings.model_attempts} attempts per model step, {settings.tool_attempts} per tools step; "
            f"time limits {settings.model_timeout_seconds:g} s (model step), "
            f"{settings.tool_timeout_seconds:g} s (tools step); jitter {'on' if settings.retry_jitter else 'off'}")


def wait_before(retries: pd.DataFrame, attempt: int) -> float | None:
    """The wait (s) before attempt number `attempt`, as the `retries(...)` table has it (None: that
    attempt was never made)."""
    waits = retries.loc[retries["attempt"] == attempt, "wait"].tolist()
    return float(waits[0]) if waits else None

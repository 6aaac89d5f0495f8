"""Lesson 17, the separate worker: the web servers and workers it starts, the run it holds half-way,
and its views of the runs table, the events and the picture of who owns what.

Read any of them in the lesson with `??`, e.g. `lesson.hold_a_run??`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from ..children import LabPoolWorker, LabServer
from ..harness import Lab
from ..pictures import Picture
from ..pictures.topology import observe, topology_picture


@dataclass
class Fleet:
    """The web servers and pool workers this lesson starts, with the names it gives them: "server A",
    "server B", ... (a server started again under a letter already used is "server A again"), and
    "worker 1", "worker 2", ... in the order they start."""

    lab: Lab
    web: dict[str, str]
    """The web servers' settings (environment variables), e.g. `SOPHOS_LAB_RUNS=workers`."""
    worker_env: dict[str, str]
    """The workers' settings."""
    servers: dict[str, LabServer] = field(default_factory=dict)
    workers: dict[str, LabPoolWorker] = field(default_factory=dict)

    def server(self, letter: str) -> LabServer:
        """Start a web server (`sophos-lab serve` with the `web` settings) named "server <letter>"."""
        name = f"server {letter}"
        while name in self.servers:
            name += " again"
        self.servers[name] = server = self.lab.server(**self.web)
        return server

    def worker(self) -> LabPoolWorker:
        """Start a pool worker (`sophos-lab worker`), the next "worker <n>"; it claims queued runs at once."""
        worker = self.lab.pool_worker(**self.worker_env)
        self.workers[f"worker {len(self.workers) + 1}"] = worker
        return worker

    def name_of(self, process: Any) -> str:
        """The lesson's name of a server or worker it started."""
        return next(name for name, known in {**self.servers, **self.workers}.items() if known is process)

    def close(self) -> None:
        """Stop every server and worker still running."""
        for process in [*self.servers.values(), *self.workers.values()]:
            process.close()


def hold_a_run(lab: Lab, server: LabServer, message: str) -> str:
    """Send `message` (a fetch and a long summary) through `server`, and hold the model half-way
    through the summary, after the fetch (`lab.model.arm("summary")`, a barrier): a live run on a
    worker. Returns the conversation's id."""
    lab.model.arm("summary")
    conversation = server.chat_until_tool_call(message, tool="fetch__fetch")
    lab.model.wait_paused()
    return conversation


def outcome(final: dict[str, Any]) -> str:
    """A final event in one word: an `end`'s status, or the code of a `chat-error` or `rejected`."""
    return final["data"]["status"] if final["event"] == "end" else final["data"]["code"]


def runs(fleet: Fleet, conversation: str) -> pd.DataFrame:
    """The conversation's runs, oldest first, with the worker that claimed each (its `owner_id`, and
    the lesson's name and the pid of the worker with that owner id)."""
    frame = fleet.lab.sql("SELECT status, error_code, owner_id, started_at, claimed_at FROM runs"
                          " WHERE conversation_id = ? ORDER BY seq", conversation)
    names = {worker.owner: name for name, worker in fleet.workers.items()}
    pids = {worker.owner: worker.pid for worker in fleet.workers.values()}
    return frame.assign(worker=frame["owner_id"].map(names), worker_pid=frame["owner_id"].map(pids))


def holder(fleet: Fleet, conversation: str) -> LabPoolWorker:
    """The worker that claimed the conversation's latest run."""
    [[owner]] = fleet.lab.sql("SELECT owner_id FROM runs WHERE conversation_id = ? ORDER BY seq DESC LIMIT 1",
                              conversation).values.tolist()
    return next(worker for worker in fleet.workers.values() if worker.owner == owner)


def with_ids(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events that carry an id (those a client can name in `Last-Event-ID`)."""
    return [event for event in events if event.get("id") is not None]


def in_order(ids: list[int]) -> bool:
    """Whether `ids` are 1, 2, 3, ... each once: every event, none twice, none missed."""
    return ids == list(range(1, len(ids) + 1))


def written(lab: Lab, conversation: str) -> dict[str, list]:
    """What the database holds of the conversation's runs: its events `(run_id, id, event)` and its
    checkpoint ids, to compare before and after a process tried to write."""
    events = lab.sql("SELECT run_id, id, event FROM run_events WHERE conversation_id = ? ORDER BY run_id, id",
                     conversation)
    checkpoints = lab.sql("SELECT checkpoint_id FROM checkpoints WHERE thread_id = ? ORDER BY 1", conversation)
    return {"events": events.values.tolist(), "checkpoints": checkpoints["checkpoint_id"].tolist()}


def who_owns_what(fleet: Fleet) -> Picture:
    """The picture of the lesson: every web server and worker it started (running, or how it ended),
    PostgreSQL with the runs table in the middle, and which runs each worker owns and each web
    server streamed (`sophos_lab.lab.pictures.topology`)."""
    table = fleet.lab.sql("SELECT id, conversation_id, seq, status, error_code, owner_id FROM runs")
    return topology_picture(observe(table, fleet.servers, fleet.workers))

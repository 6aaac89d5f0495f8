"""The topology picture (`sophos_lab.lab.pictures.topology`), drawn from constructed records: which
process owns or streamed which run follows the runs table's owners and the servers' events, named
without pids or ids."""

from __future__ import annotations

from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")

import pandas as pd  # noqa: E402

from sophos_lab.lab.pictures import Picture  # noqa: E402
from sophos_lab.lab.pictures.topology import (  # noqa: E402
    TITLE, Link, Process, RunRow, Topology, observe, process_state, topology_picture,
)


class FakeProc:
    def __init__(self, returncode: int | None) -> None:
        self.returncode = returncode

    def poll(self) -> int | None:
        return self.returncode


def server(pid: int, returncode: int | None, *runs: tuple[str, str]) -> SimpleNamespace:
    """A stand-in `LabServer`: its client's events name `(conversation, run)` pairs."""
    events = [{"event": "ready", "data": {"url": "http://127.0.0.1:1", "pid": pid}}]
    for conversation, run in runs:
        events += [{"id": 1, "event": "started", "data": {"conversation": conversation, "run": run}},
                   {"id": 2, "event": "token", "data": "Hello"},
                   {"id": 3, "event": "end", "data": {"conversation": conversation, "run": run, "status": "completed"}}]
    return SimpleNamespace(pid=pid, proc=FakeProc(returncode), log=SimpleNamespace(events=events),
                           is_alive=lambda: returncode is None)


def worker(pid: int, owner: str, returncode: int | None) -> SimpleNamespace:
    return SimpleNamespace(pid=pid, owner=owner, proc=FakeProc(returncode), is_alive=lambda: returncode is None)


RUNS = pd.DataFrame([
    # id, conversation_id, seq, status, error_code, owner_id (out of order: seq decides)
    ("r3", "conv-y", 3, "completed", None, "w2"),
    ("r1", "conv-x", 1, "completed", None, "w1"),
    ("r2", "conv-y", 2, "interrupted", None, "w1"),
    ("r4", "conv-z", 4, "interrupted", "SHUTDOWN", "w2"),
], columns=["id", "conversation_id", "seq", "status", "error_code", "owner_id"])


def test_the_records_say_who_owns_and_who_streamed_each_run() -> None:
    servers = {"server A": server(101, -9, ("conv-x", "r1"), ("conv-y", "r2")),
               "server B": server(102, None, ("conv-y", "r2"), ("conv-y", "r3"), ("conv-z", "r4"))}
    workers = {"worker 1": worker(201, "w1", -9), "worker 2": worker(202, "w2", 0)}
    topology = observe(RUNS, servers, workers)

    assert [(r.conversation, r.run, r.status) for r in topology.runs] == [
        (1, 1, "completed"), (2, 1, "interrupted"), (2, 2, "completed"), (3, 1, "interrupted")]
    shown = topology_picture(topology)

    assert isinstance(shown, Picture)
    assert shown.title == TITLE
    assert shown.elements == [
        "PostgreSQL: the runs table, 4 runs of 3 conversations",
        "server A: killed (SIGKILL)",
        "server A streamed run 1 of conversation 1",
        "server A streamed run 1 of conversation 2",
        "server B: running",
        "server B streamed run 1 of conversation 2",
        "server B streamed run 2 of conversation 2",
        "server B streamed run 1 of conversation 3",
        "worker 1: killed (SIGKILL)",
        "worker 1 owns run 1 of conversation 1 (completed)",
        "worker 1 owns run 1 of conversation 2 (interrupted)",
        "worker 2: stopped (exit 0)",
        "worker 2 owns run 2 of conversation 2 (completed)",
        "worker 2 owns run 1 of conversation 3 (interrupted, SHUTDOWN)",
    ]
    assert not any(str(pid) in element for element in shown.elements for pid in (101, 102, 201, 202))
    svg = shown.svg()
    for label in ("PostgreSQL", "server A", "worker 2", "pid 201", "run 1 of conv. 3 (interrupted, SHUTDOWN)",
                  "run 2 of conv. 2", "conv. 2 · run 1 · interrupted · worker 1"):
        assert label in svg, label  # labels stay text in the SVG
    assert str(shown).splitlines()[0] == f"🖼  {TITLE}"


def test_a_run_nobody_claimed_is_in_the_table_with_no_edge() -> None:
    queued = Topology(processes=[Process("server A", "server"), Process("worker 1", "worker", "running")],
                      runs=[RunRow(1, 1, "queued")], links=[])
    shown = topology_picture(queued)

    assert shown.elements == ["PostgreSQL: the runs table, 1 run of 1 conversation",
                              "server A: running", "worker 1: running"]
    assert "conv. 1 · run 1 · queued" in shown.svg()


def test_a_link_names_its_run_and_only_an_owner_its_outcome() -> None:
    run = RunRow(2, 1, "interrupted")
    topology = Topology([Process("server B", "server"), Process("worker 3", "worker", "stopped (exit 0)")],
                        [run], [Link("server B", "streams", run), Link("worker 3", "owns", run)])

    assert topology_picture(topology).elements[1:] == [
        "server B: running", "server B streamed run 1 of conversation 2",
        "worker 3: stopped (exit 0)", "worker 3 owns run 1 of conversation 2 (interrupted)"]


def test_a_process_state_in_words() -> None:
    assert process_state(None, True) == "running"
    assert process_state(-9, False) == "killed (SIGKILL)"
    assert process_state(0, False) == "stopped (exit 0)"
    assert process_state(-15, False) == "ended by signal 15"

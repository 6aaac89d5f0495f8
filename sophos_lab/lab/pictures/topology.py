"""Who owns what: the web servers, the workers and PostgreSQL between them, with the runs each holds.

Drawn from what a lesson recorded (lesson 17): the runs table (each run's conversation, status and
`owner_id`), the processes the lab started (each web server and pool worker, its pid, whether it is
still running or how it ended) and what each web server streamed to its client (the runs named by
the `started`, `end` and `chat-error` events its client received). One box per process, PostgreSQL
in the middle with the runs table, and an edge from each process to PostgreSQL labelled with the
runs it owns (a worker: `runs.owner_id`) or streamed (a web server: nothing of a run is in it, it
reads the run's events from the database).

`observe(runs, servers, workers)` reads those records into a `Topology`; `topology_picture(topology)`
draws it as a `Picture` whose elements name what it shows in words that do not depend on timing or
pids ("worker 1 owns run 1 of conversation 3 (interrupted)"). Conversations are numbered in the order
of their first run, a conversation's runs in their order, processes by the names the lesson gives.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import Picture, picture

if TYPE_CHECKING:
    import pandas as pd

TITLE = "who owns what"

STATUS_COLOURS = {"completed": "tab:green", "failed": "tab:red", "interrupted": "tab:orange",
                  "running": "tab:blue", "queued": "tab:grey"}


@dataclass
class Process:
    """A web server or a pool worker that the lab started."""

    name: str
    """As the lesson names it: "server A", "worker 1"."""
    role: str
    """`"server"` or `"worker"`."""
    state: str = "running"
    """"running", or how it ended: "killed (SIGKILL)", "stopped (exit 0)"."""
    pid: int | None = None
    """Drawn in its box (not among the elements: a pid differs from run to run)."""


@dataclass
class RunRow:
    """A row of the runs table."""

    conversation: int
    """The conversation's number, in the order of the conversations' first runs (1 for the first)."""
    run: int
    """The run's number within its conversation (1 for its first run)."""
    status: str
    error_code: str | None = None

    @property
    def name(self) -> str:
        """"run 1 of conversation 3"."""
        return f"run {self.run} of conversation {self.conversation}"

    @property
    def outcome(self) -> str:
        """Its status, with its error code if it has one: "interrupted, SHUTDOWN"."""
        return f"{self.status}, {self.error_code}" if self.error_code else self.status


@dataclass
class Link:
    """A process's hold on a run: a worker `owns` it (`runs.owner_id`), a web server `streams` it to its
    client (the kind; the elements say "streamed": what its client received)."""

    process: str
    kind: str
    run: RunRow


@dataclass
class Topology:
    """The processes, the runs table and who holds which run: what the picture draws."""

    processes: list[Process] = field(default_factory=list)
    runs: list[RunRow] = field(default_factory=list)
    links: list[Link] = field(default_factory=list)


def process_state(returncode: int | None, alive: bool) -> str:
    """A process's state in words, from its exit code (None: not exited)."""
    if alive or returncode is None:
        return "running"
    if returncode == -9:
        return "killed (SIGKILL)"
    if returncode < 0:
        return f"ended by signal {-returncode}"
    return f"stopped (exit {returncode})"


def _state(child: Any) -> str:
    proc = getattr(child, "proc", None)
    returncode = proc.poll() if proc is not None else getattr(child, "returncode", None)
    return process_state(returncode, child.is_alive())


def _pid(child: Any) -> int | None:
    try:
        return child.pid
    except (AssertionError, AttributeError):
        return None


def observe(runs: pd.DataFrame, servers: Mapping[str, Any], workers: Mapping[str, Any]) -> Topology:
    """The topology the records show.

    `runs`: the runs table (a DataFrame with `id`, `conversation_id`, `seq`, `status`, `error_code`,
    `owner_id`); `servers`: name → a `LabServer` (its client's events say which runs it streamed);
    `workers`: name → a `LabPoolWorker` (its `owner` is the `owner_id` of the runs it claimed)."""
    ordered = runs.sort_values("seq")
    numbers: dict[str, int] = {}
    counts: dict[str, int] = {}
    rows: dict[str, RunRow] = {}
    for run in ordered.itertuples():
        numbers.setdefault(run.conversation_id, len(numbers) + 1)
        counts[run.conversation_id] = counts.get(run.conversation_id, 0) + 1
        error = run.error_code if isinstance(run.error_code, str) else None
        rows[run.id] = RunRow(numbers[run.conversation_id], counts[run.conversation_id], run.status, error)
    topology = Topology(runs=list(rows.values()))
    for name, server in servers.items():
        topology.processes.append(Process(name, "server", _state(server), _pid(server)))
        streamed: list[str] = []
        for event in server.log.events:
            data = event.get("data")
            run = data.get("run") if isinstance(data, dict) and "conversation" in data else None
            if run in rows and run not in streamed:
                streamed.append(run)
        topology.links += [Link(name, "streams", rows[run]) for run in streamed]
    owners = {worker.owner: name for name, worker in workers.items() if worker.owner is not None}
    for name, worker in workers.items():
        topology.processes.append(Process(name, "worker", _state(worker), _pid(worker)))
    for run in ordered.itertuples():
        if run.owner_id in owners:
            topology.links.append(Link(owners[run.owner_id], "owns", rows[run.id]))
    return topology


def elements(topology: Topology) -> list[str]:
    """What the picture shows, named: PostgreSQL and its runs, each process and its state, each
    link ("server B streamed run 1 of conversation 2", "worker 1 owns run 1 of conversation 3
    (interrupted)")."""
    conversations = len({run.conversation for run in topology.runs})
    found = [f"PostgreSQL: the runs table, {_count(len(topology.runs), 'run')} of {_count(conversations, 'conversation')}"]
    for process in topology.processes:
        found.append(f"{process.name}: {process.state}")
        found += [_said(link) for link in topology.links if link.process == process.name]
    return found


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "s")


def _said(link: Link) -> str:
    if link.kind == "owns":
        return f"{link.process} owns {link.run.name} ({link.run.outcome})"
    return f"{link.process} streamed {link.run.name}"


def _owner(topology: Topology, run: RunRow) -> str | None:
    return next((link.process for link in topology.links if link.kind == "owns" and link.run is run), None)


def topology_picture(topology: Topology) -> Picture:
    """The servers on the left, PostgreSQL with its runs table in the middle, the workers on the
    right, and an edge from each process to PostgreSQL labelled with the runs it streamed or owns."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    servers = [p for p in topology.processes if p.role == "server"]
    workers = [p for p in topology.processes if p.role == "worker"]
    spacing = 1.5
    height = max(len(servers), len(workers), (len(topology.runs) + 3) * 0.3 / spacing, 1) * spacing + 0.6
    figure, axes = plt.subplots(figsize=(14.0, 0.62 * height + 0.6))
    axes.set_xlim(0, 14)
    axes.set_ylim(0, height)
    axes.axis("off")
    pg_left, pg_right = 5.2, 8.8
    axes.add_patch(FancyBboxPatch((pg_left, 0.25), pg_right - pg_left, height - 0.5, boxstyle="round,pad=0.05",
                                  facecolor="#eef3fb", edgecolor="tab:blue", linewidth=1.4))
    axes.text((pg_left + pg_right) / 2, height - 0.45, "PostgreSQL", ha="center", va="top", fontsize=11,
              fontweight="bold", color="tab:blue")
    axes.text((pg_left + pg_right) / 2, height - 0.85, "runs (and their owners) · checkpoints · run_events", ha="center",
              va="top", fontsize=7, color="tab:blue")
    for index, run in enumerate(topology.runs):
        owner = _owner(topology, run)
        axes.text(pg_left + 0.12, height - 1.3 - 0.3 * index,
                  f"conv. {run.conversation} · run {run.run} · {run.outcome}" + (f" · {owner}" if owner else ""),
                  ha="left", va="top", fontsize=7, color=STATUS_COLOURS.get(run.status, "black"))

    def place(processes: list[Process], left: float, right: float, side: str) -> None:
        step = (height - 0.5) / max(len(processes), 1)
        for index, process in enumerate(processes):
            y = height - 0.25 - step * (index + 0.5)
            ended = process.state != "running"
            killed = process.state.startswith("killed")
            axes.add_patch(FancyBboxPatch((left, y - 0.42), right - left, 0.84, boxstyle="round,pad=0.04",
                                          facecolor="#f4f4f4" if ended else "white",
                                          edgecolor="tab:red" if killed else ("grey" if ended else "black"),
                                          linestyle="--" if ended else "-", linewidth=1.2))
            pid = f" · pid {process.pid}" if process.pid is not None else ""
            axes.text((left + right) / 2, y + 0.12, process.name, ha="center", va="center", fontsize=10,
                      fontweight="bold", color="grey" if ended else "black")
            axes.text((left + right) / 2, y - 0.2, f"{process.state}{pid}", ha="center", va="center", fontsize=7,
                      color="tab:red" if killed else "dimgrey")
            mine = [link for link in topology.links if link.process == process.name]
            if not mine:
                continue
            start, end = (right, pg_left) if side == "left" else (left, pg_right)
            kind = mine[0].kind
            colour = "tab:blue" if kind == "streams" else "black"
            axes.annotate("", (end, y), xytext=(start, y),
                          arrowprops={"arrowstyle": "<-" if kind == "streams" else "-", "color": colour,
                                      "linewidth": 1.0, "linestyle": "--" if kind == "streams" else "-"})
            lines = ["owns" if kind == "owns" else "streamed"] + [
                f"run {link.run.run} of conv. {link.run.conversation}" + (f" ({link.run.outcome})" if kind == "owns" else "")
                for link in mine]
            axes.text((start + end) / 2, y + 0.05, "\n".join(lines), ha="center", va="bottom", fontsize=6.5,
                      color=colour, linespacing=1.15)

    place(servers, 0.2, 2.3, "left")
    place(workers, 11.7, 13.8, "right")
    axes.set_title(f"{TITLE}: workers own the runs, web servers stream them from PostgreSQL", fontsize=10)
    return picture(figure, TITLE, elements(topology))

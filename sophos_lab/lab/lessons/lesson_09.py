"""Lesson 09, the life of one run: the views its cells call (read any of them with `lesson.name??`).

`stream_log` puts a run's events in order with its commits (the lab's `write` events); the stage
functions give each row of that log one of the original walkthrough's 15 stages; `stages_table`
builds the walkthrough's table from what the stores hold; `every_write_picture` draws the run with
one lane per store; `check_commits` states the order of the commits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from ..inspect import TextFrame
from ..pictures import Picture, picture

if TYPE_CHECKING:
    from ..harness import Lab

MEMORY_WRITERS = {f"memory__{name}" for name in ("create_entities", "create_relations", "add_observations",
                                                 "delete_entities", "delete_observations", "delete_relations")}
"""The memory server's tools that rewrite its file."""

STAGES = {
    1: "request (here: the child's `chat` command)",
    2: "validation",
    3: "conversation row",
    4: "run row `running`, then `started`",
    5: "the graph streams the new message",
    6: "checkpoints before any node",
    7: "agent step 1: tools, prompt, model call",
    8: "step 1 checkpoint: the tool call",
    9: "tools step 2: the tool runs",
    10: "step 2 checkpoint: the tool result",
    11: "steps 3 to 6 (the original's)",
    12: "the last step: the answer",
    13: "finishRun: the outcome",
    14: "`end` published",
    15: "reload: read the latest checkpoint",
}
"""The original walkthrough's 15 stages of one request."""


def start_child(lab: Lab, child: str) -> Any:
    """A fresh agent process of the kind `child` names (`"kernel"` or `"worker"`): a 'restart'.
    With the model's thinking on (`OLLAMA_THINK=true`) and every commit traced (`SOPHOS_LAB_TRACE_WRITES=1`)."""
    env = {"OLLAMA_THINK": "true", "SOPHOS_LAB_TRACE_WRITES": "1"}
    return lab.kernel(**env) if child == "kernel" else lab.worker(**env)


def stream_log(events: list[dict[str, Any]]) -> pd.DataFrame:
    """The run's events in order, one row each, with the graph step each belongs to. A run of
    `reasoning` or `token` events becomes one row (`count`). A `write` row is a commit: the
    run's row, a task's pending writes (they belong to the step of the checkpoint that follows
    them), a checkpoint, or the outcome."""
    rows: list[dict[str, Any]] = []
    step = None
    for e in events:
        data = e["data"]
        if e["event"] in ("reasoning", "token"):
            if rows and rows[-1]["event"] == e["event"]:
                rows[-1]["count"] += 1
                continue
            rows.append({"event": e["event"], "step": step, "what": "", "count": 1})
            continue
        what = ""
        if e["event"] == "trace":
            step = data["step"]
            what = f"{data['event']} {data['node']}"
            if data["event"] in ("call", "result"):
                detail = data["data"]
                what += f" {detail['name']}" + (f" ({detail['status']})" if "status" in detail else "")
        elif e["event"] == "write":
            what = data["write"]
            if what.startswith("checkpoint step"):
                step = int(what.rsplit(" ", 1)[1])
        elif e["event"] == "started":
            what = "started (resume)" if data.get("resume") else "started"
        elif e["event"] == "end":
            what = f"end {data.get('status')}"
        rows.append({"event": e["event"], "step": step, "what": what, "count": 1})
    # A task's writes come before its step's checkpoint: give them that checkpoint's step.
    following = None
    for row in reversed(rows):
        if row["event"] == "write" and row["what"].startswith("checkpoint step"):
            following = row["step"]
        elif row["event"] == "write" and row["what"].startswith("writes "):
            row["step"] = following
        elif row["event"] == "write" or row["event"] in ("started", "end"):
            row["step"] = None
    return pd.DataFrame(rows, columns=["event", "step", "what", "count"], dtype=object)


def steps_entered(events: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """(step, node) of every step the run entered."""
    return [(e["data"]["step"], e["data"]["node"]) for e in events
            if e["event"] == "trace" and e["data"]["event"] == "enter"]


def memory_graph(path: Path) -> list[dict[str, Any]]:
    """The memory server's knowledge graph: one record per line of its file (none without a file)."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def memory_steps(events: list[dict[str, Any]]) -> list[int]:
    """The steps where one of the memory server's writing tools succeeded (from the `result` events)."""
    return [e["data"]["step"] for e in events if e["event"] == "trace" and e["data"]["event"] == "result"
            and e["data"]["data"]["name"] in MEMORY_WRITERS and e["data"]["data"]["status"] == "success"]


def model_calls_of(lab: Lab, run: pd.Series) -> list[dict[str, Any]]:
    """The model's request log, the requests made between the run's start and its end."""
    start, end = pd.Timestamp(run["started_at"]), pd.Timestamp(run["finished_at"])
    return [r for r in lab.model.chat_requests() if start <= pd.Timestamp(r["time"]) <= end]


def tools_table(requests: list[dict[str, Any]]) -> pd.DataFrame:
    """One row per model call: the messages sent (the system prompt included), the last one's role,
    the number of tools offered, and whether they are the first call's tools."""
    tools = requests[0]["tools"] if requests else []
    return pd.DataFrame([{"model call": i, "messages sent": r["n_messages"], "last role": r["last_role"],
                          "tools offered": len(r["tools"]), "same tools": r["tools"] == tools}
                         for i, r in enumerate(requests, 1)])


def stage_of_step(step: int, closing: bool, last_step: int) -> int:
    """The stage of what happens in graph `step` of a run whose last step is `last_step`.
    `closing`: from the step's first commit on (its writes, its checkpoint, the facts published
    after them); before it, the step's work."""
    if step <= 0:
        return 6
    if step == last_step:
        return 12
    if step >= 3:
        return 11
    return {1: 7, 2: 9}[step] + int(closing)


def stage_of_row(row: pd.Series, committed: set[int], last_step: int) -> int:
    """The stage of one row of `stream_log`, given the steps whose first commit came before it."""
    if row["event"] == "started" or row["what"] == "run":
        return 4
    if row["what"].startswith("outcome"):
        return 13
    if row["event"] == "end":
        return 14
    return stage_of_step(row["step"], row["step"] in committed, last_step)


def stage_column(log: pd.DataFrame, last_step: int) -> list[int]:
    """The stage of each row of `stream_log`, in order: a step's work (`enter`, what it streams)
    is one stage, its commits and what is published after them the next, for steps 1 and 2;
    steps 3 to the one before last are stage 11, the last step stage 12; the commits of the run
    row and of the outcome are stages 4 and 13, `end` stage 14."""
    committed: set[int] = set()
    stages = []
    for _, row in log.iterrows():
        if row["event"] == "write" and row["step"] is not None:
            committed.add(row["step"])
        stages.append(stage_of_row(row, committed, last_step))
    return stages


@dataclass
class Observed:
    """What section 1 and 2 read of the first run, for the stages' table and its checks."""

    c: str
    run: pd.Series
    """The run's row."""
    conversation: pd.Series
    """The conversation's row."""
    cps: pd.DataFrame
    writes: pd.DataFrame
    """`lab.writes(c)` with `task_step` (the step its task ran in) and `node`."""
    log: pd.DataFrame
    """`stream_log(events)` with its `stage` column."""
    events: list[dict[str, Any]]
    in_run: list[dict[str, Any]]
    """The model requests of the run."""
    memory_steps: list[int]
    graph: list[dict[str, Any]]
    refusals: list[dict[str, Any]]
    rows: tuple[tuple[int, int], tuple[int, int]]
    """(conversations, runs) before and after the bad requests."""
    reloaded: pd.DataFrame
    reload_calls: int

    @property
    def last_step(self) -> int:
        return int(self.cps["step"].max())

    @property
    def t0(self) -> pd.Timestamp:
        return pd.Timestamp(self.run["started_at"])


def _at(first: Observed, value: Any) -> str:
    return f"+{(pd.Timestamp(value) - first.t0).total_seconds():.3f} s"


def _joined(items: list[str]) -> str:
    return "\n".join(items) or "—"


def _rows_written(first: Observed, stage: int) -> list[str]:
    run, conversation = first.run, first.conversation
    if stage == 2:
        codes = ", ".join(sorted({r["data"]["code"] for r in first.refusals}))
        return [f"none: {len(first.refusals)} bad requests refused ({codes}); (conversations, runs) "
                f"{first.rows[0]} → {first.rows[1]}"]
    if stage == 3:
        return [f"conversations +1 at {_at(first, conversation['created_at'])}"]
    if stage == 4:
        return [f"runs +1 `running` at {_at(first, run['started_at'])}; started_at = the conversation's created_at: "
                f"{conversation['created_at'] == run['started_at']}"]
    if stage == 5:
        return [f"runs.input: {len(json.loads(run['input']))} message, the new one"]
    if stage == 13:
        return [f"runs `{run['status']}` at {_at(first, run['finished_at'])}; conversations.message_count = "
                f"{conversation['message_count']}, updated_at = finished_at: "
                f"{conversation['updated_at'] == run['finished_at']}"]
    if stage == 15:
        return [f"none: {len(first.reloaded)} messages read from the latest checkpoint"]
    return []


def _memory_written(first: Observed, stage: int) -> list[str]:
    steps = [step for step in first.memory_steps if stage_of_step(step, False, first.last_step) == stage]
    if not steps:
        return []
    entities = [f"{e['name']} ({e['entityType']}, {len(e['observations'])} observation)"
                for e in first.graph if e.get("type") == "entity"]
    return [f"rewritten in step {', '.join(map(str, steps))}; now: {', '.join(entities)}"]


def _tools_offered(first: Observed, stage: int) -> list[str]:
    agent_steps = [step for step, node in steps_entered(first.events) if node == "agent"]
    model_call_of = dict(zip(agent_steps, first.in_run))  # the k-th model call is the k-th agent step's
    offered = [f"step {step}: the model call offers {len(call['tools'])} tools"
               + (f": {', '.join(call['tools'])}" if step == agent_steps[0] else ", the same")
               for step, call in model_call_of.items() if stage_of_step(step, False, first.last_step) == stage]
    if stage == 15:
        offered.append(f"model calls made by the reload: {first.reload_calls}")
    return offered


def stages_table(first: Observed) -> TextFrame:
    """The walkthrough's 15 stages, one row each, with what the kit wrote for each, read from the
    stores: rows, checkpoints, pending writes, the memory file, the events streamed and the tools
    offered. Times are seconds since the run started."""
    last_step = first.last_step
    table = []
    for stage, name in STAGES.items():
        mine = first.log[first.log["stage"] == stage]
        table.append({
            "stage": stage,
            "what happens": name,
            "rows": _joined(_rows_written(first, stage)),
            "checkpoints": _joined([
                f"step {p.step} ({p.source}) at {_at(first, p.created_at)}: next {list(p.next)}, "
                f"messages {p.message_count}"
                for p in first.cps.itertuples() if stage_of_step(p.step, True, last_step) == stage]),
            "pending writes": _joined([f"step {step} {'/'.join(g['node'].unique())}: {', '.join(g['channel'])}"
                                       for step, g in first.writes.groupby("task_step")
                                       if stage_of_step(step, True, last_step) == stage]),
            "memory.jsonl": _joined(_memory_written(first, stage)),
            "events": _joined([(r.what or r.event) + (f" ×{r.count}" if r.count > 1 else "")
                               for r in mine.itertuples() if r.event != "write"]),
            "tools": _joined(_tools_offered(first, stage)),
        })
    return TextFrame(table).set_index("stage")


def commits(log: pd.DataFrame) -> list[str]:
    """The commits of the run, in order (the `write` rows of `stream_log`)."""
    return log.loc[log["event"] == "write", "what"].tolist()


def check_commits(lab: Lab, first: Observed) -> None:
    """The claims about the order of the commits: every task's writes kept, each step's just before
    its checkpoint; the run row first, before `started`; the outcome last, before `end`; and each
    step's `leave` after its checkpoint (persist, then notify)."""
    log, writes, last_step = first.log, first.writes, first.last_step
    done = commits(log)
    steps = list(range(0, last_step + 1))
    lab.check("every task's writes are kept, steps 0 to the last", sorted(writes["task_step"].unique()) == steps,
              sorted(writes["task_step"].unique()))
    lab.check("each task wrote its message",
              all("messages" in set(g["channel"]) for _, g in writes.groupby("task_step")),
              writes[["task_step", "channel"]].values.tolist())
    lab.check("each step's writes are committed just before its checkpoint",
              lambda: all(done[done.index(f"checkpoint step {s}") - 1].startswith("writes ") for s in steps), done)
    order = list(zip(log["event"], log["what"]))
    lab.check("the run row is the first commit, before `started`",
              lambda: done[0] == "run" and order.index(("write", "run")) < order.index(("started", "started")),
              order[:3])
    lab.check("the outcome is the last commit, before `end`",
              lambda: done[-1] == "outcome completed"
              and order.index(("write", "outcome completed")) < order.index(("end", "end completed")), order[-3:])

    def left_after_checkpoint(s: int) -> bool:
        checkpoint_at = order.index(("write", f"checkpoint step {s}"))
        leave_at = next(i for i, (_, what) in enumerate(order) if what.startswith("leave") and log["step"][i] == s)
        return checkpoint_at < leave_at

    lab.check("each step's `leave` comes after its checkpoint",
              lambda: all(left_after_checkpoint(s) for s in range(1, last_step + 1)), done)


LANES = ["run row", "conversation row", "model calls", "checkpoints", "pending writes", "web page", "memory.jsonl"]
NODE_COLOUR = {"__start__": "grey", "agent": "tab:purple", "tools": "tab:orange"}


def every_write_picture(first: Observed, web_log: list[dict[str, Any]], memory_mtime: float | None) -> Picture:
    """The first run on a time axis, one lane per store: the run and conversation rows, the model
    calls, the checkpoints, the pending writes (drawn at their step's checkpoint: the `writes`
    table keeps no time, and the commit trace says each step's writes are committed right before
    its checkpoint), the web server's requests (`web_log`: its access log) and the memory file's
    modification time. The lower panel zooms in on the steps after the first."""
    import matplotlib.pyplot as plt

    t0, run, conversation, cps = first.t0, first.run, first.conversation, first.cps

    def secs(value: Any) -> float:
        return (pd.Timestamp(value) - t0).total_seconds()

    web_hits = [w for w in web_log if t0 <= pd.Timestamp(w["time"]) <= pd.Timestamp(run["finished_at"])]
    step_time = {p.step: secs(p.created_at) for p in cps.itertuples()}
    end = secs(run["finished_at"])
    zoom = (step_time.get(1, 0) - 0.01, end + 0.01)
    figure, panels = plt.subplots(2, 1, figsize=(10, 7.5))
    for axes, (left, right) in zip(panels, [(-0.02 * end, 1.02 * end), zoom]):
        y = {lane: i for i, lane in enumerate(LANES)}
        axes.barh(y["run row"], end, left=0, height=0.35, color="tab:green", alpha=0.6)
        axes.scatter([0, end], [y["run row"]] * 2, marker="D", color="black", zorder=3)
        axes.scatter([secs(conversation["created_at"]), secs(conversation["updated_at"])], [y["conversation row"]] * 2,
                     marker="D", color="black", zorder=3)
        axes.scatter([secs(r["time"]) for r in first.in_run], [y["model calls"]] * len(first.in_run), marker="v",
                     s=40, color="tab:purple")
        axes.scatter(list(step_time.values()), [y["checkpoints"]] * len(step_time), marker="|", s=300, color="black")
        for step, group in first.writes.groupby("task_step"):
            axes.scatter(step_time[step], y["pending writes"], marker="s", s=40,
                         color=NODE_COLOUR.get(group["node"].iloc[0], "black"), zorder=3)
        axes.scatter([secs(w["time"]) for w in web_hits], [y["web page"]] * len(web_hits), marker="o", color="tab:blue")
        if memory_mtime is not None:
            axes.scatter([memory_mtime - t0.timestamp()], [y["memory.jsonl"]], marker="*", s=150, color="tab:red",
                         zorder=3)
        visible = [s for s, t in step_time.items() if left <= t <= right]
        for n, step in enumerate(sorted(visible)):
            axes.annotate(str(step), (step_time[step], y["checkpoints"]), xytext=(0, 12 + 9 * (n % 2)),
                          textcoords="offset points", ha="center", fontsize=8)
        for n, w in enumerate(web_hits):
            axes.annotate(w["path"].lstrip("/"), (secs(w["time"]), y["web page"]), xytext=(0, -11 - 9 * (n % 2)),
                          textcoords="offset points", ha="center", fontsize=7)
        axes.set_yticks(range(len(LANES)), LANES, fontsize=8)
        axes.set_ylim(len(LANES) - 0.5, -0.7)
        axes.set_xlim(left, right)
        axes.grid(axis="x", alpha=0.3)
    if first.in_run and 0 in step_time:
        waited = secs(first.in_run[0]["time"]) - step_time[0]  # step 1, from its start to its model call
        panels[0].annotate(f"step 1 before its model call: {waited:.2f} s\n"
                           "(a process's first run starts the MCP servers here)",
                           (step_time[0] + waited / 2, LANES.index("model calls")), ha="center", va="center",
                           fontsize=8)
    title = f"one run, every write: conversation {first.c[:8]}…"
    panels[0].set_title(title)
    panels[1].set_title("zoom: from the step 1 checkpoint to the end", fontsize=9)
    panels[1].set_xlabel("seconds since the run started\n◆ a row written · ▼ a model request · | a checkpoint (its "
                         "step above) · ■ a step's pending writes (grey input, purple agent, orange tools) · "
                         "● a web request · ★ memory.jsonl rewritten", fontsize=8)
    figure.tight_layout()
    steps = sorted(step_time)
    shown = [
        "run row: written at the start (`running`) and with the outcome",
        "conversation row: created with the run row, updated with the outcome",
        f"model calls: {len(first.in_run)}",
        f"checkpoints: steps {steps[0]} to {steps[-1]}" if steps else "checkpoints: none",
        f"pending writes: of steps {', '.join(str(int(s)) for s in sorted(first.writes['task_step'].unique()))}",
        f"web page: {', '.join(w['path'].lstrip('/') for w in web_hits) or 'no request'}",
        "memory.jsonl: rewritten" if memory_mtime is not None else "memory.jsonl: not written",
    ]
    return picture(figure, title.split(":")[0], shown)

"""Lesson 08b, runtime ownership: the set-ups and views the lesson uses, out of its way.

Two agent processes, A and B, share the lab's SQLite file. `hold_a_run` keeps a run of A's
`running` in a live process for as long as the lesson likes (the scripted model's `summary`
pause). The other functions read the file read-only, with plain SQL where the lab has no view,
like the original's `sqlite3` one-liners; reading never runs recovery. `lease_picture` draws a
takeover on a time axis from what the lesson recorded (see `sophos_lab.lab.pictures.lease`).
"""

from __future__ import annotations

import sqlite3
import time
from typing import TYPE_CHECKING, Any

import pandas as pd

from ...runtime.ownership import process_alive
from ..pictures import Picture, lease
from ..pictures.lease import seconds  # noqa: F401 - the lesson reads the runs' times with it

if TYPE_CHECKING:
    from ..harness import Lab


def message(lab: Lab) -> str:
    """The lesson's long run: fetch a page and summarize it (the summary is where the model pauses)."""
    return f"Fetch {lab.page('wal.html')} and summarize it in 12 detailed bullet points."


def start_child(lab: Lab, kind: str, **env: str) -> Any:
    """A fresh agent process of the kind `kind` names (`CHILD`: "kernel" or "worker"), with
    optional setting overrides (e.g. `SOPHOS_LAB_LEASE_SECONDS="1.5"`)."""
    return lab.kernel(**env) if kind == "kernel" else lab.worker(**env)


def hold_a_run(lab: Lab, child: Any) -> str:
    """Start the summary in `child` and hold its model half-way: a live `running` run.
    Returns the conversation."""
    lab.model.arm("summary")
    conversation = child.chat_until_tool_call(message(lab), tool="fetch__fetch")
    lab.model.wait_paused()
    return conversation


def run_id(child: Any) -> str:
    """The run that the child's latest command started."""
    return child.wait_for("started")["data"]["run"]


def outcome(final: dict[str, Any]) -> str:
    """A final event in one word: an `end`'s status, or the code of a `chat-error` or `rejected`."""
    return final["data"]["status"] if final["event"] == "end" else final["data"]["code"]


def rows(lab: Lab, sql: str, *params: Any) -> list[tuple]:
    """A query on a read-only connection to the lab's database file."""
    conn = sqlite3.connect(f"{lab.db_path.as_uri()}?mode=ro", uri=True)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def owners(lab: Lab, **pids: int) -> pd.DataFrame:
    """The owners table: which child each owner is (`A=pid, ...`), its pid, whether that process
    is alive (the test the runtime uses: the pid exists and started when the row says), and the
    seconds left on its lease."""
    names = {pid: name for name, pid in pids.items()}
    now = time.time()
    records = [
        {"child": names.get(pid, "?"), "owner_id": owner_id, "pid": pid,
         "alive": process_alive(pid, started), "lease_left_s": round(expires - now, 1)}
        for owner_id, pid, started, expires in rows(
            lab, "SELECT id, pid, pid_started, lease_expires_at FROM owners ORDER BY opened_at")
    ]
    return pd.DataFrame(records, columns=["child", "owner_id", "pid", "alive", "lease_left_s"])


def lease_deadline(lab: Lab, owner_id: str) -> float:
    """The owner's lease deadline as `owners.lease_expires_at` records it (seconds since the epoch)."""
    [(expires,)] = rows(lab, "SELECT lease_expires_at FROM owners WHERE id = ?", owner_id)
    return expires


def transcript(lab: Lab, conversation: str) -> pd.DataFrame:
    """The messages of the conversation's latest checkpoint, each cut to a short line."""
    frame = lab.messages(conversation)[["role", "content"]]
    return frame.assign(content=frame["content"].str.replace("\n", " ").str.slice(0, 70))


def user_messages(lab: Lab, conversation: str) -> list[str]:
    """The text of every user message in the conversation's current state."""
    messages = lab.messages(conversation)
    return messages.loc[messages["role"] == "user", "content"].tolist()


def history(lab: Lab, conversation: str, who: dict[str, str]) -> pd.DataFrame:
    """Every checkpoint of the thread, oldest first: the run that wrote it (`who` names run ids)
    and the step of its parent. Two checkpoints with one parent are two branches of history."""
    parent = dict(rows(lab, "SELECT checkpoint_id, parent_checkpoint_id FROM checkpoints WHERE thread_id = ?",
                       conversation))
    points = lab.checkpoints(conversation)
    step = dict(zip(points["checkpoint_id"], points["step"]))
    points["written_by"] = points["run_id"].map(who)
    points["parent_step"] = pd.array([step.get(parent[c]) for c in points["checkpoint_id"]], dtype="Int64")
    return points[["step", "source", "message_count", "last_role", "written_by", "parent_step"]]


def forks(lab: Lab, conversation: str) -> int:
    """How many checkpoints of the thread are the parent of more than one: 0 means one branch."""
    return rows(
        lab, "SELECT COUNT(*) FROM (SELECT parent_checkpoint_id FROM checkpoints WHERE thread_id = ?"
        " GROUP BY parent_checkpoint_id HAVING COUNT(*) > 1)", conversation)[0][0]


def saved(lab: Lab) -> dict[str, list[tuple]]:
    """Every row of the runs, checkpoints and writes tables: to compare before and after."""
    return {table: rows(lab, f"SELECT * FROM {table}") for table in ("runs", "checkpoints", "writes")}


def lease_picture(lab: Lab, conversation: str, deadline: float, lease_seconds: float, *, scenario: str,
                  killed: float | None = None, frozen: tuple[float, float | None] | None = None,
                  woke: tuple[float, str] | None = None) -> Picture:
    """The lease on a time axis, from the records: the conversation's runs (A's first, B's last),
    A's lease (`deadline` as the owners table recorded it, and its length) and the moments the
    lesson took: the kill, or the freeze (SIGSTOP to SIGCONT) and the wake with its outcome.
    One lane per process, the lease as a bar, the kill ✕ or the freeze, the expiry and the takeover."""
    return lease.lease_picture(lease.takeover(lab.peek_runs(conversation), deadline, lease_seconds,
                                              scenario=scenario, killed=killed, frozen=frozen, woke=woke))

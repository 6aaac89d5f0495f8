"""Lesson 07 · Side effects and idempotency: the kill inside a payment, the lesson's views, its picture.

    from sophos_lab.lab.lessons import lesson_07 as lesson
    child = lesson.start_child(lab, CHILD)
    crash = lesson.pay_and_kill(lab, child, "Pay 30 to bob, exactly once.", "ledger__record_payment_once")
    lesson.payments(lab, "bob")

The ledger server (`sophos_lab/standins/ledger_server.py`) reports each payment to the lab's web
fixture server once its insert has gone through (`GET /ledger-committed`), and waits for the
answer before it answers the agent: holding that report (`lab.web.hold(REPORT)`) stops the tool
call between the ledger's insert and the agent's receipt, the window this lesson kills in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import pandas as pd

from ..pictures import Picture
from ..pictures.replay import Checkpoint, Payment, Replay, replay_picture

REPORT = "/ledger-committed"
"""Where the ledger server reports a payment after its insert, and waits for the lab's answer."""


def start_child(lab: Any, kind: str) -> Any:
    """A fresh agent process (a 'restart'): a child kernel (`kind == "kernel"`) or a plain worker."""
    return lab.kernel() if kind == "kernel" else lab.worker()


def entered(child: Any) -> list[tuple[int, str]]:
    """(step, node) of every step the child's latest run entered."""
    return [(e["data"]["step"], e["data"]["node"]) for e in child.events()
            if e["event"] == "trace" and e["data"]["event"] == "enter"]


def tool_result(child: Any) -> dict[str, Any]:
    """The tool result of the child's latest run (name, tool_call_id, result, status); {} if none."""
    results = [e["data"]["data"] for e in child.events() if e["event"] == "trace" and e["data"]["event"] == "result"]
    return results[-1] if results else {}


def runs_summary(lab: Any, conversation: str) -> str:
    """Each run's status and error code ("-" for none), one per line, numbered in start order."""
    runs = lab.state(conversation)["runs"]
    return "\n".join(f"run {n}: {status} {code or '-'}" for n, (status, code) in enumerate(runs, 1))


def payments(lab: Any, to: str) -> pd.DataFrame:
    """The ledger's payments to account `to`, oldest first."""
    ledger = lab.ledger()
    return ledger[ledger["to_account"] == to][["id", "to_account", "amount", "idempotency_key"]]


def receipt(payment: Any) -> str:
    """The receipt the ledger answers for a payment (a row of `lab.ledger()`): "payment 3: 30 to bob"."""
    return f"payment {payment['id']}: {payment['amount']} to {payment['to_account']}"


@dataclass
class Crash:
    """What `pay_and_kill` saw: a payment's tool call cut short after the ledger's insert."""

    conversation: str
    call: dict[str, Any]
    """The model's tool call, as the agent step recorded it (name, arguments, tool_call_id)."""
    shown: list[str]
    """The arguments the model was shown for the tool (the runtime hides `idempotency_key`)."""
    exit_code: int
    """The agent's exit code: -9, SIGKILL."""


def pay_and_kill(lab: Any, child: Any, message: str, tool: str) -> Crash:
    """Section 1's steps in one call: hold the ledger's report, ask `message` until the model calls
    `tool`, wait until the ledger has made its insert and waits at the report, SIGKILL the agent,
    then let the report go (the ledger answers into a pipe nobody reads)."""
    lab.web.hold(REPORT)
    conversation = child.chat_until_tool_call(message, tool=tool)
    call = child.wait_for("trace", event="call")["data"]["data"]
    lab.web.wait_held()
    shown = lab.model.chat_requests()[-1]["tool_args"][tool]  # the request that asked for the payment
    exit_code = child.kill()
    lab.web.release()
    return Crash(conversation, call, shown, exit_code)


def observed(lab: Any, conversation: str, label: str, exit_code: int, steps: list[tuple[int, str]],
             result: dict[str, Any]) -> Replay:
    """What the lab recorded of one experiment, for the picture: the thread's checkpoints (by run),
    the ledger's payments made while its runs ran (each given to the run during which it was
    committed), the kill's exit code, the steps the resume entered, and the key each call carried.

    The first call's key is the one stored with its payment. The replay's key is read off its
    receipt: the ledger answers a keyed call with the payment that holds that key."""
    runs = lab.peek_runs(conversation).reset_index(drop=True)
    number = {run_id: n for n, run_id in enumerate(runs["id"], 1)}
    marks = lab.checkpoints(conversation)
    marks = marks[marks["checkpoint_id"].notna()]
    checkpoints = [Checkpoint(int(m.step), tuple(m.next), number.get(m.run_id, 0)) for m in marks.itertuples()]
    began = [pd.Timestamp(t) for t in runs["started_at"]]
    last = runs["finished_at"].iloc[-1]
    ended = pd.Timestamp(last) if isinstance(last, str) else pd.Timestamp.now(tz="UTC")
    ledger = lab.ledger()
    made = [row for _, row in ledger.iterrows() if began[0] <= pd.Timestamp(row["created_at"]) <= ended]
    paid = [Payment(f"payment {row['id']}", row["idempotency_key"],
                    sum(1 for start in began if start <= pd.Timestamp(row["created_at"])))
            for row in made]
    first_key = next((p.key for p in paid if p.run == 1), None)
    named = re.match(r"payment (\d+):", str(result.get("result", "")))
    again = ledger[ledger["id"] == int(named.group(1))] if named else ledger.iloc[0:0]
    replay_key = again["idempotency_key"].iloc[0] if len(again) else None
    keys = [first_key, replay_key] if named else [first_key]
    return Replay(label, "ledger", checkpoints, paid, exit_code, steps, keys=keys, replay_result=result.get("result"))


def picture(replays: list[Replay]) -> Picture:
    """The experiments side by side: commit, kill, replay (`sophos_lab.lab.pictures.replay`)."""
    return replay_picture(replays)

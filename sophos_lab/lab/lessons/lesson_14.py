"""Lesson 14 · Challenge 2 · Durable human-in-the-loop: what the lesson uses besides the lesson itself.

The agent's processes (`start_child`, `wait_frozen`), the requests that stop at a gate
(`ask_to_pay`, which also writes down the `mcp.json` each gate was made under, read back by
`config_when_made`), views of the lab's records (`paid`, `last_status`, `overview`, the picture
`gate_picture`), and the tests of the two exercises (`test_decide`, `test_is_stale`). Read any of
them with `??`, e.g. `lesson.ask_to_pay??`.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from ..children import AnotherPath, ChildFailed
from ..forkserver import wait_stopped
from ..harness import lab_home
from ..inspect import ledger as read_ledger
from ..pictures.gates import gate_lives

if TYPE_CHECKING:
    from ..children import LabKernel, LabWorker
    from ..harness import Lab
    from ..pictures import Picture

LESSON = "14_challenge_durable_approval"
TOOL = "ledger__record_payment"
"""The gated tool: the ledger's plain payment, as the agent names it (`<server>__<tool>`)."""
MAX_AGE = timedelta(days=7)
"""How long an approval may wait before it is stale (the exercise `is_stale`, section 9)."""


def start_child(lab: Lab, kind: str, **env: str) -> LabKernel | LabWorker:
    """A fresh agent process (a "restart"): a child Jupyter kernel when `kind` is `"kernel"`, else
    a plain subprocess (`"worker"`), with `env` added to its environment."""
    return lab.kernel(**env) if kind == "kernel" else lab.worker(**env)


def wait_frozen(child: LabKernel | LabWorker, kind: str) -> None:
    """Block until `child` has stopped itself (SIGSTOP, as `SOPHOS_LAB_STOP_AFTER_WRITE=1` makes
    it do after its first commit for a run): a barrier on the process's state, not a timer."""
    if kind == "kernel":
        wait_stopped(child.km.provisioner.process)   # the kernel is the notebook's own subprocess
    else:
        child.wait_stopped()


def mcp_config(lab: Lab) -> dict[str, Any]:
    """The lab's `mcp.json` as it is now, as a dict."""
    return json.loads((lab.config_dir / "mcp.json").read_text())


def gate_configs(root: Path | None = None) -> Path:
    """The folder where `ask_to_pay` writes down each gate's `mcp.json`: `gate-configs/` in the
    lesson's lab folder (`root`, else `.lab/14_challenge_durable_approval/`)."""
    return (root or lab_home() / LESSON) / "gate-configs"


def ask_to_pay(lab: Lab, child: LabKernel | LabWorker, who: str, conversation: str | None = None,
               attempts: int = 3) -> str:
    """Ask `child` for a payment of 30 to `who` (in `conversation`, else in a new one), wait until
    the run stops at its gate, and write down the lab's `mcp.json` as it is then, in a file named
    after the gate (`config_when_made` reads it back). Returns the conversation.

    A real model may answer in words instead of calling the tool: then it asks again (in a new
    conversation, or in the same one), and after `attempts` tries raises `AnotherPath`."""
    message = f"Please pay 30 to {who}."
    if conversation is None:
        conversation = child.chat_until_tool_call(message, tool=TOOL)
    else:
        for attempt in range(1, attempts + 1):
            child.chat(message, conversation)
            if child.wait_for_tool_call() is not None:
                break
            child.wait_final()
            print(f"Attempt {attempt} of {attempts}: the model answered without calling {TOOL}.")
            if attempt == attempts:
                raise AnotherPath(f"The model did not call {TOOL}: try a model that supports tools.")
            print("A real model may do that. Asking again, in the same conversation.")
    final = child.wait_final()
    if (final["event"], final["data"].get("status")) != ("end", "waiting"):
        raise ChildFailed(f"the request to pay {who} did not stop at its gate: {final}")
    folder = gate_configs(lab.root)
    folder.mkdir(exist_ok=True)
    (folder / f"{final['data']['approval']['gate']}.json").write_text(json.dumps(mcp_config(lab)))
    return conversation


def config_when_made(gate: Mapping[str, Any]) -> dict[str, Any]:
    """The lab's `mcp.json` as `ask_to_pay` wrote it down when `gate` (a row of `lab.gates()`) was
    made: the lesson's own record, taken a moment after the gate appeared (the kit keeps none)."""
    return json.loads((gate_configs() / f"{gate['gate']}.json").read_text())


def paid(lab: Lab, who: str, book: str | Path | None = None) -> int:
    """How many payments to `who` a ledger book holds: the lab's own, or the database file `book`."""
    payments = lab.ledger() if book is None else read_ledger(book)
    return int((payments["to_account"] == who).sum())


def last_status(lab: Lab, conversation: str) -> str:
    """The status of the conversation's latest run."""
    return lab.runs(conversation)["status"].iloc[-1]


def overview(lab: Lab, conversations: Mapping[str, str]) -> str:
    """A table, one line per conversation of `conversations` (id -> what it asked for): its runs'
    statuses in start order, and each of its gates' payee and decision."""
    rows = []
    for conversation, asked in conversations.items():
        gates = lab.gates(conversation)
        rows.append({
            "asked for": asked,
            "runs": " → ".join(lab.runs(conversation)["status"]),
            "gates": ", ".join(f"{args['to']}: {decision or 'undecided'}"
                               for args, decision in zip(gates["args"], gates["decision"])),
        })
    return pd.DataFrame(rows).to_string(index=False)


def refused(answer: dict[str, Any], code: str) -> bool:
    """Whether a command's final event is a refusal (`rejected`) with the error code `code`."""
    return (answer["event"], answer["data"].get("code")) == ("rejected", code)


def now() -> str:
    """The time now, as the runtime writes its times (ISO 8601, UTC): for a moment the lesson
    itself sees, such as a kill, which no table records."""
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def gate_picture(lab: Lab, names: Mapping[str, str] | None = None, marks: Mapping[str, str] | None = None) -> Picture:
    """Every gate of the lab (`lab.gates()`) from the moment it was made to its decision, and the
    payments of the lab's ledger, in the order they happened. `names` gives a conversation (by id)
    a name shown beside its gates' payee; `marks` adds moments the lesson saw itself (label -> ISO
    time), such as the kills."""
    return gate_lives(lab.gates(), {"ledger": lab.ledger()}, names=names, marks=marks)


def test_decide(lab: Lab, child: LabKernel | LabWorker, decide: Callable[..., Any], c_alice: str, c_carol: str,
                untouched: tuple[str, ...]) -> None:
    """The check of the exercise `decide`: it brings bob's conversation (`c_alice`, stopped at an
    undecided gate after a decided one) and carol's (decided, cut off by a kill) past their gates,
    each paid exactly once, touches no gate of the conversations `untouched`, and a second call
    (a retry) changes nothing. Raises AssertionError with what is wrong."""
    for conversation, who in ((c_alice, "bob"), (c_carol, "carol")):
        gate = lab.gates(conversation).iloc[-1]
        returned = decide(lab, child, conversation)
        assert returned == gate["gate"], (
            f"for {who}'s conversation decide returned {returned!r}, not the id of the gate it stopped at "
            "(the `gate` column of the conversation's last row in lab.gates)")
    bob, carol = lab.gates(c_alice).iloc[-1], lab.gates(c_carol).iloc[-1]
    assert bob["decision"] == "approve", (
        "bob's gate is still undecided: decide didn't approve the gate his conversation stopped at. (The "
        "first row of lab.gates is alice's gate, decided long ago: approving a decided gate only answers "
        "with the run it started, and pays nothing.)")
    assert paid(lab, "bob") == 1, f"bob should be paid exactly once, not {paid(lab, 'bob')} times"
    assert paid(lab, "carol") == 1 or last_status(lab, c_carol) != "interrupted", (
        "carol is still unpaid, and her conversation's last run is `interrupted`. Her approval was written "
        "before the kill, so approving again only answers with the run it started (replayed: `interrupted`) "
        "and runs nothing. The decision is on disk: carry it on, as the refusal in section 4 says.")
    assert paid(lab, "carol") == 1, f"carol should be paid exactly once, not {paid(lab, 'carol')} times"
    for conversation, who in ((c_alice, "bob"), (c_carol, "carol")):
        assert last_status(lab, conversation) == "completed", (
            f"{who}'s conversation should end with a completed run, not {last_status(lab, conversation)!r}: "
            "wait for the run you start to end")
    assert paid(lab, "alice") == 1 and paid(lab, "dave") == 0, "decide paid someone else: only bob and carol were asked for"
    assert all(lab.gates(other)["decision"].tolist() == [None] for other in untouched), (
        "decide decided a gate of another conversation: only the one it was given may be touched")
    runs, payments = len(lab.runs()), len(lab.ledger())
    for conversation in (c_alice, c_carol):
        decide(lab, child, conversation)    # a retry
    assert len(lab.ledger()) == payments, "called a second time, decide paid again: a retry must change nothing"
    assert len(lab.runs()) == runs, (
        f"called a second time, decide started {len(lab.runs()) - runs} new run(s): there was nothing left "
        "to do, so a retry must start nothing")
    child.approve(c_alice, gate=bob["gate"])
    again = child.wait_final()
    assert again["event"] == "end" and again["data"]["run"] == bob["decided_run_id"], (
        f"bob's approval sent once more should return the run the first one started, not {again}")
    assert len(lab.ledger()) == payments and len(lab.runs()) == runs, "the same approval again changed something"


def test_is_stale(lab: Lab, is_stale: Callable[..., Any], c_dave: str, c_erin: str, moved: dict[str, Any]) -> None:
    """The check of the exercise `is_stale`, on real gates: dave's (made before the ledger server
    was moved to another book) and erin's (made after), under `moved` (the config since then), the
    config dave's gate was made under and variants of it, today and more than `MAX_AGE` later.
    Raises AssertionError with what is wrong."""
    dave, erin = lab.gates(c_dave).iloc[-1], lab.gates(c_erin).iloc[-1]
    now = datetime.now(timezone.utc)

    def stale(gate: pd.Series, config: dict[str, Any], when: datetime = now) -> bool:
        answer = is_stale(gate, copy.deepcopy(config), when)
        assert isinstance(answer, (bool, np.bool_)), f"is_stale should return True or False, not {answer!r}"
        return bool(answer)

    assert stale(dave, moved), (
        "dave's gate was made before the ledger server was pointed at another book, so the ledger's entry "
        "in mcp.json is not the one it was made under, and your rule calls it fresh. An approval now would "
        "pay into a book the person was never shown. (A rule that only looks at the gate's age can't see this.)")
    assert not stale(dave, config_when_made(dave)), (
        "under the config dave's gate was made in, nothing changed for it, and it is minutes old: your rule "
        "calls it stale. Compare the server's entry then and now, not times.")
    assert not stale(erin, moved), "erin's gate was made a moment ago, under the config as it is: your rule calls it stale"
    later = now + MAX_AGE + timedelta(days=1)
    assert stale(erin, moved, later), (
        f"a week and a day later ({later:%Y-%m-%d}) erin's gate is older than MAX_AGE: your rule calls it fresh")
    fetch_changed = copy.deepcopy(moved)
    fetch_changed["fetch"]["args"] = [*fetch_changed["fetch"]["args"], "--ignore-robots-txt"]
    assert not stale(erin, fetch_changed), (
        "only the fetch server's entry changed, and erin's payment doesn't run on it: your rule calls it "
        "stale. That is a false alarm: every edit of mcp.json would send every waiting person back.")
    without_ledger = {name: entry for name, entry in moved.items() if name != "ledger"}
    assert stale(erin, without_ledger), (
        "with the ledger server gone from mcp.json, erin's call can't run as she was shown it: your rule "
        "calls it fresh")

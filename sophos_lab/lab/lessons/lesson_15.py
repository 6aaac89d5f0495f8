"""Lesson 15 · Challenge 3 · A replay-safe mutating tool: the checks of your `pay_once`, a design
the quick check passes and the crash does not, and the lesson's picture.

    from sophos_lab.lab.lessons import lesson_15 as lesson
    lesson.test_pay_once_directly(bank_lab, pay_once)    # section 2: two calls in this process
    experiment = lesson.crash_and_resume(bank_lab, pay_once)   # sections 3 to 5 in one call
    lesson.test_crash(bank_lab, pay_once, experiment)    # the crash test

The bank, its server and the crash itself are the kit's (`sophos_lab/lab/bank.py`); this module
holds what the lesson checks and shows with them.
"""

from __future__ import annotations

import importlib.util
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..bank import BankLab, Crash, Resumed, new_bank
from ..pictures import Picture
from ..pictures.replay import Checkpoint, Payment, Replay, replay_picture

KEY_LATER = '''\
"""A pay_once that section 2's quick check passes: it pays in one transaction, and records the key
in a second one (each `with conn:` block commits when it ends)."""
import sqlite3
from contextlib import closing


def pay_once(db_path, key, to, amount):
    with closing(sqlite3.connect(db_path, timeout=10)) as conn:
        seen = conn.execute(
            "SELECT to_account, amount, result FROM idempotency_keys WHERE key = ?", (key,)
        ).fetchone()
        if seen is not None:
            if (seen[0], seen[1]) != (to, amount):
                raise ValueError(f"idempotency key {key!r} was used for another payment: {seen[2]}")
            return seen[2]      # a repeat: the first call's receipt
        with conn:              # first the payment ...
            payment = conn.execute(
                "INSERT INTO payments (to_account, amount) VALUES (?, ?)", (to, amount)
            ).lastrowid
        receipt = f"payment {payment}: {amount} to {to}"
        with conn:              # ... then, once it has gone through, its key
            conn.execute(
                "INSERT INTO idempotency_keys (key, to_account, amount, result) VALUES (?, ?, ?, ?)",
                (key, to, amount, receipt),
            )
        return receipt
'''
"""The source of `key_later`: a design the quick check can't tell from a right one."""


@dataclass
class Experiment:
    """Sections 3 to 5 with one `pay_once`: the crash, the new agent process, the thread after
    the restart, and the resume."""

    crash: Crash | None = None
    child: Any = None
    state: dict[str, Any] | None = None
    resumed: Resumed | None = None


def crash_and_resume(bank_lab: BankLab, function: Callable) -> Experiment:
    """Serve `function`, crash the machine at the bank server's first commit, restart the agent
    and resume the conversation (the kit's `crash_after_first_commit`, `restart` and `resume`)."""
    crash = bank_lab.crash_after_first_commit(function)
    child = bank_lab.restart()
    state = bank_lab.lab.state(crash.conversation)
    return Experiment(crash, child, state, bank_lab.resume(child, crash))


def calls_per_server(calls: list[dict[str, Any]]) -> list[int]:
    """How many calls each bank server process got, smallest first."""
    return sorted(Counter(c["pid"] for c in calls if c["event"] == "call").values())


def key_later(lab: Any) -> Callable:
    """The `pay_once` of `KEY_LATER`, saved in the lab folder as a module of its own (the bank server
    runs a function's whole file, as it runs your cell)."""
    path = lab.root / "key_later.py"
    path.write_text(KEY_LATER, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("key_later", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.pay_once


def test_pay_once_directly(bank_lab: BankLab, pay_once: Callable) -> None:
    """Section 2's quick check: call `pay_once` in this process, on a scratch bank of its own
    (`direct-check.db`), with the same key twice, then a new key, then the first key with another
    amount, and read the tables after each call. Raises AssertionError with what is wrong."""
    db = bank_lab.lab.root / "direct-check.db"
    new_bank(db)
    bank = bank_lab.tables
    first = pay_once(str(db), "thread-1:call-1", "carol", 45)
    tables = bank(db)
    assert len(tables["payments"]) == 1, f"a first call should make one payment, not {len(tables['payments'])}"
    receipt = f"payment {tables['payments']['id'].iloc[0]}: 45 to carol"
    assert first == receipt, f"the receipt should read {receipt!r}, not {first!r}"
    keys = tables["idempotency_keys"][["key", "result"]].values.tolist()
    assert keys == [["thread-1:call-1", receipt]], \
        f"idempotency_keys should hold the key with its receipt, [['thread-1:call-1', {receipt!r}]], not {keys}"
    again = pay_once(str(db), "thread-1:call-1", "carol", 45)
    assert len(bank(db)["payments"]) == 1, "the same key twice made two payments: a repeat must pay nothing"
    assert again == first, f"a repeat should return the first call's receipt {first!r}, not {again!r}"
    other = pay_once(str(db), "thread-1:call-2", "carol", 45)
    assert len(bank(db)["payments"]) == 2, "a new key is a new payment: it should make a second one"
    assert other != first, f"a new payment needs a receipt of its own, not the first one's {first!r}"
    try:
        pay_once(str(db), "thread-1:call-1", "carol", 50)
    except Exception:
        pass
    else:
        raise AssertionError("the first key with another amount was accepted: it is not a repeat of the "
                             "first payment, so it must be refused (raise an error)")
    assert len(bank(db)["payments"]) == 2, "the refused call must not pay"


def quick_check_failure(bank_lab: BankLab, function: Callable) -> str | None:
    """Why section 2's quick check fails `function`, or None when it passes."""
    try:
        test_pay_once_directly(bank_lab, function)
    except AssertionError as error:
        return str(error)
    return None


def test_crash(bank_lab: BankLab, pay_once: Callable, experiment: Experiment) -> None:
    """The crash test: after the crash and the resume, the bank's payments and keys are what the
    contract asks for, with the runtime's key, and the resumed call got the first call's receipt.
    If `pay_once` is not the function `experiment` ran (you changed the cell since), the whole
    experiment runs again with it first (about ten seconds), and `experiment` holds the new run."""
    if experiment.crash is None or experiment.crash.function is not pay_once:
        if experiment.child is not None:
            experiment.child.close()
        fresh = crash_and_resume(bank_lab, pay_once)
        experiment.crash, experiment.child, experiment.state, experiment.resumed = (
            fresh.crash, fresh.child, fresh.state, fresh.resumed)
    crash, resumed = experiment.crash, experiment.resumed
    errors = [(c["pid"], c["error"]) for c in resumed.calls if c["event"] == "error"]
    if any(error.startswith("NotImplementedError") for _, error in errors):
        raise NotImplementedError
    if errors:
        pid, error = errors[0]
        which = "the first call" if pid == resumed.calls[0]["pid"] else "the replayed call, in the new bank server"
        raise AssertionError(f"pay_once raised on {which}: {error}")
    key = f"{crash.conversation}:{crash.call['tool_call_id']}"
    paid, at_kill = resumed.after["payments"], crash.at_kill
    if len(paid) > 1:
        if len(at_kill["payments"]) and not len(at_kill["idempotency_keys"]):
            why = ("the first payment was on disk when the machine went down and its key was not, so the "
                   "new bank server found no key for the replayed call. Record the key in the same "
                   "transaction as the payment: then a crash leaves both on disk, or neither")
        else:
            why = ("the new bank server did not find the key the first call had stored: look the key up "
                   "in idempotency_keys before paying")
        count = "two" if len(paid) == 2 else str(len(paid))
        raise AssertionError(f"{count} payments: the replayed tools step paid again because {why}.")
    if len(paid) == 0:
        if len(at_kill["idempotency_keys"]):
            raise AssertionError("no payment at all: the key was on disk when the machine went down and its "
                                 "payment was not, so the replay found the key and paid nothing. Write the "
                                 "payment and its key in one transaction.")
        raise AssertionError("no payment at all after the resume: pay_once should insert the payment into payments")
    receipt = f"payment {paid['id'].iloc[0]}: {paid['amount'].iloc[0]} to {paid['to_account'].iloc[0]}"
    assert resumed.result.get("result") == receipt, (
        f"the resumed call got {resumed.result.get('result')!r}, not the receipt of the one payment, "
        f"{receipt!r}: a repeat must return the first call's result")
    assert resumed.after["idempotency_keys"]["key"].tolist() == [key], (
        f"idempotency_keys should hold the runtime's key once, {key!r}: "
        f"{resumed.after['idempotency_keys']['key'].tolist()}")


def observed(lab: Any, label: str, experiment: Experiment) -> Replay:
    """What the lab recorded of one experiment, for the picture: the thread's checkpoints (by run),
    the bank's payments after the resume (those already on disk at the kill are the first call's)
    with the key each one has in `idempotency_keys` (the key whose stored receipt names it), the
    kill, the steps the resume entered and the key each call carried (the bank servers' log)."""
    crash, resumed = experiment.crash, experiment.resumed
    runs = lab.peek_runs(crash.conversation).reset_index(drop=True)
    number = {run_id: n for n, run_id in enumerate(runs["id"], 1)}
    marks = lab.checkpoints(crash.conversation)
    marks = marks[marks["checkpoint_id"].notna()]
    checkpoints = [Checkpoint(int(m.step), tuple(m.next), number.get(m.run_id, 0)) for m in marks.itertuples()]
    first = set(crash.at_kill["payments"]["id"])
    keys = resumed.after["idempotency_keys"]
    paid = []
    for row in resumed.after["payments"].itertuples():
        receipt = f"payment {row.id}: {row.amount} to {row.to_account}"
        stored = keys[keys["result"] == receipt]["key"].tolist()
        paid.append(Payment(f"payment {row.id}", stored[0] if stored else None, 1 if row.id in first else 2))
    sent = [c["key"] for c in resumed.calls if c["event"] == "call"]
    answer = resumed.result.get("result") if resumed.result.get("status") == "success" else None
    return Replay(label, "bank", checkpoints, paid, crash.agent_exit, resumed.steps, keys=sent, replay_result=answer)


def picture(lab: Any, experiments: list[tuple[str, Experiment]]) -> Picture:
    """The experiments side by side, each under its label: commit, kill, replay
    (`sophos_lab.lab.pictures.replay`)."""
    return replay_picture([observed(lab, label, experiment) for label, experiment in experiments])

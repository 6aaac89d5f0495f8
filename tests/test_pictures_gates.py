"""The life of each gate (`sophos_lab.lab.pictures.gates`), drawn from a constructed gates table and ledger."""

from __future__ import annotations

import pandas as pd

from sophos_lab.lab.pictures import Picture
from sophos_lab.lab.pictures.gates import TITLE, events, gate_lives, gate_rows

T = "2025-03-01T10:00:{:02d}.000000+00:00"


def gate(gate_id: str, conversation: str, to: str, made: int, decided: int | None = None,
         decision: str | None = None) -> dict:
    return {"gate": gate_id, "conversation_id": conversation, "run_id": f"run-{gate_id}", "call_id": f"call-{gate_id}",
            "tool": "ledger__record_payment", "args": {"to": to, "amount": 30}, "decision": decision,
            "reason": None, "created_at": T.format(made), "decided_at": None if decided is None else T.format(decided),
            "decided_run_id": None if decided is None else f"run-{gate_id}-2"}


def payments(*paid: tuple[str, int]) -> pd.DataFrame:
    return pd.DataFrame([{"id": n, "to_account": to, "amount": 30, "idempotency_key": None,
                          "created_at": f"2025-03-01T10:00:{second:02d}.000Z"} for n, (to, second) in enumerate(paid, 1)])


GATES = pd.DataFrame([
    gate("g1", "c1", "alice", made=1, decided=3, decision="approve"),
    gate("g2", "c2", "alice", made=2, decided=20, decision="approve"),   # waited across alice's first payment
    gate("g3", "c3", "dave", made=5),
])
LEDGER = payments(("alice", 3), ("alice", 21))   # the first in the same millisecond as its decision


def test_the_events_are_in_the_order_they_happened_and_a_decision_precedes_its_payment() -> None:
    happened = [e.text for e in events(GATES, {"ledger": LEDGER}, names={"c2": "second tab"}, marks={"kill -9": T.format(10)})]
    assert happened == ["made: alice", "made: alice (second tab)", "approve: alice", "paid: alice", "made: dave",
                        "kill -9", "approve: alice (second tab)", "paid: alice"]


def test_the_picture_shows_each_gate_its_payments_and_what_still_waits() -> None:
    shown = gate_lives(GATES, {"ledger": LEDGER}, names={"c2": "second tab"}, marks={"kill -9": T.format(10)})

    assert isinstance(shown, Picture) and shown.title == TITLE
    assert shown.elements[-1] == "waiting: dave" and "kill -9" in shown.elements
    assert str(shown).splitlines()[0] == f"🖼  {TITLE}"
    svg = shown.svg()
    for label in ("gate: alice (second tab)", "gate: dave", ">ledger<", "approve", "waiting", "kill -9"):
        assert label in svg, label   # the labels stay text in the SVG


def test_two_books_are_two_rows_and_name_their_payments() -> None:
    shown = gate_lives(GATES.iloc[:1], {"old book": payments(("alice", 3)), "new book": payments()
                                        .reindex(columns=LEDGER.columns)})
    assert shown.elements == ["made: alice", "approve: alice", "paid: alice (old book)"]
    assert "new book" in shown.svg()


def test_a_gate_of_several_calls_is_one_row_named_by_its_payees() -> None:
    both = pd.DataFrame([gate("g1", "c1", "alice", 1, 2, "approve"), gate("g1", "c1", "bob", 1, 2, "reject")])
    (row,) = gate_rows(both)
    assert (row["label"], row["decision"]) == ("alice, bob", "mixed")

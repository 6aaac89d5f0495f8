"""The replay picture (`sophos_lab.lab.pictures.replay`), drawn from constructed records: what it
names follows what the ledger and the thread recorded (a key or none, one payment or two), never
the keys' values or the times."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

from sophos_lab.lab.pictures import Picture  # noqa: E402
from sophos_lab.lab.pictures.replay import TITLE, Checkpoint, Payment, Replay, replay_picture  # noqa: E402

THREAD = [Checkpoint(-1, ("__start__",), 1), Checkpoint(0, ("agent",), 1), Checkpoint(1, ("tools",), 1),
          Checkpoint(2, ("agent",), 2), Checkpoint(3, (), 2)]


def without_key() -> Replay:
    return Replay("record_payment, no key", "ledger", THREAD,
                  [Payment("payment 1", None, 1), Payment("payment 2", None, 2)], -9,
                  [(2, "tools"), (3, "agent")], keys=[None, None], replay_result="payment 2: 30 to alice")


def with_key(key: str = "c0ffee:call-1") -> Replay:
    return Replay("record_payment_once, the runtime's key", "ledger", THREAD,
                  [Payment("payment 3", key, 1)], -9, [(2, "tools"), (3, "agent")], keys=[key, key],
                  replay_result="payment 3: 30 to bob")


def test_the_same_crash_with_and_without_a_key() -> None:
    shown = replay_picture([without_key(), with_key()])

    assert isinstance(shown, Picture)
    assert shown.title == TITLE
    assert shown.elements == [
        "lanes: the agent process, the ledger (tool server), the checkpoint store",
        "record_payment, no key: checkpoint: run 1 saved step 1, next = ['tools']",
        "record_payment, no key: commit: the first call's payment, without a key",
        "record_payment, no key: kill: SIGKILL of the agent process before the receipt came back",
        "record_payment, no key: missing checkpoint: step 2 (tools) of the killed run",
        "record_payment, no key: replay: run 2 ran the tools step again, then agent",
        "record_payment, no key: key: none was sent, so the replay paid again: two payments",
        "record_payment_once, the runtime's key: checkpoint: run 1 saved step 1, next = ['tools']",
        "record_payment_once, the runtime's key: commit: the first call's payment, with its key",
        "record_payment_once, the runtime's key: kill: SIGKILL of the agent process before the receipt came back",
        "record_payment_once, the runtime's key: missing checkpoint: step 2 (tools) of the killed run",
        "record_payment_once, the runtime's key: replay: run 2 ran the tools step again, then agent",
        "record_payment_once, the runtime's key: key: the replay sent the same key: one payment",
    ]
    svg = shown.svg()
    for label in ("kill (SIGKILL)", "receipt lost", "no checkpoint of step 2", "commit payment 1 (no key)",
                  "commit payment 3 (key K1)", "key found: no new payment", "(tool server)"):
        assert label in svg, label  # labels stay text in the SVG
    assert str(shown).splitlines()[0] == f"🖼  {TITLE}"
    assert set(shown._repr_mimebundle_()) == {"image/svg+xml", "text/plain"}


def test_a_key_written_after_its_payment_does_not_stop_the_replay() -> None:
    key = "c0ffee:call-1"
    late = Replay("payment, then its key", "bank", THREAD, [Payment("payment 1", None, 1), Payment("payment 2", key, 2)],
                  -9, [(2, "tools"), (3, "agent")], keys=[key, key], replay_result="payment 2: 45 to carol")

    (*_, outcome) = replay_picture([late]).elements
    assert outcome == "key: the replay sent the same key, yet paid again (the first payment was on disk without its key): two payments"


def test_a_function_that_raised_commits_nothing() -> None:
    key = "c0ffee:call-1"
    stub = Replay("pay_once", "bank", THREAD, [], -9, [(2, "tools"), (3, "agent")], keys=[key, key])

    shown = replay_picture([stub])
    assert "commit: none by the first call" in shown.elements
    assert shown.elements[-1] == "key: the replay sent the same key: no payment at all"
    assert "nothing committed" in shown.svg()


def test_the_elements_do_not_depend_on_the_keys_values() -> None:
    assert replay_picture([with_key("a:b")]).elements == replay_picture([with_key("x:y")]).elements

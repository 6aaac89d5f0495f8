"""The picture of event ids across a disconnect (`sophos_lab.lab.pictures.event_ids`), drawn from
constructed frames: what each connection got, the catch-up after `Last-Event-ID`, and a client that
reconnected with an id too old (frames twice) or too new (frames missed)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

from sophos_lab.lab.pictures import event_ids  # noqa: E402


def stream(last: int) -> list[dict]:
    """A run's events 1..last: started, a trace, reasoning, then tokens, then end."""
    kinds = {1: "started", 2: "trace", 3: "reasoning", 4: "reasoning", last: "end"}
    return [{"id": n, "event": kinds.get(n, "token"), "data": ""} for n in range(1, last + 1)]


def test_a_reconnect_with_the_last_id_seen_catches_up_without_a_gap_or_a_repeat() -> None:
    run = stream(30)
    result = event_ids.draw(run[:8], run[8:], 17, run)

    assert result.title == "event ids across a disconnect"
    assert result.elements == [
        "connection 1: ids 1..8, then disconnect",
        "the server kept ids 9..17 with no client connected",
        "connection 2: reconnect with Last-Event-ID: 8",
        "catch-up: ids 9..17 replayed from the server's buffer",
        "live: ids 18..30, up to `end`",
        "missed: 0, received twice: 0",
    ]
    svg = result.svg()
    for words in ("disconnect after id 8", "reconnect with Last-Event-ID: 8", "catch-up: 9..17", "live: 18..30"):
        assert words in svg  # the labels stay text in the SVG
    assert str(result).splitlines()[0] == "🖼  event ids across a disconnect"


def test_an_id_too_old_gives_frames_twice_and_one_too_new_misses_some() -> None:
    run = stream(20)
    again = event_ids.draw(run[:10], run[6:], 12, run, last_event_id=6)  # not 10: the last id seen
    assert again.elements[2] == "connection 2: reconnect with Last-Event-ID: 6"
    assert again.elements[-1] == "missed: 0, received twice: 4"
    gap = event_ids.draw(run[:10], run[13:], 15, run)  # the second connection began at 14
    assert gap.elements[-1] == "missed: 3, received twice: 0"
    assert gap.elements[3] == "catch-up: ids 14..15 replayed from the server's buffer"

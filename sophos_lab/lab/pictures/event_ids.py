"""Event ids across a disconnect: what a client received on each of its two connections to one
run's SSE stream, what the server kept for it meanwhile, and the `Last-Event-ID` catch-up.

Drawn from the events a lesson observed (lesson 04): the frames the first connection read before
it hung up, the frames the second one read after it reconnected with `Last-Event-ID: n`, where
the second one's catch-up ended (the frames the server had already sent to nobody, replayed from
its buffer), and the run's whole stream as the lab's own follower received it. The x axis is the
event id: one column per event of the run, coloured by its kind.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import Picture, picture

KINDS = {"reasoning": "tab:purple", "token": "tab:blue", "trace": "tab:orange"}
"""The colour of each kind of event; any other kind (`started`, `end`, ...) is black."""
TITLE = "event ids across a disconnect"


def _span(ids: Sequence[int]) -> str:
    return "none" if not ids else f"{ids[0]}" if len(ids) == 1 else f"{ids[0]}..{ids[-1]}"


def elements(first: Sequence[dict[str, Any]], second: Sequence[dict[str, Any]], caught_up: int,
             run: Sequence[dict[str, Any]], last_event_id: int | None = None) -> list[str]:
    """What the picture shows, named: the ids of each connection, the disconnect, what the server
    kept meanwhile, the `Last-Event-ID` of the reconnect, the catch-up and the live rest, and how
    many of the run's events the client missed or received twice."""
    last = first[-1]["id"] if first else 0
    asked = last if last_event_id is None else last_event_id
    received = [e["id"] for e in [*first, *second] if e.get("id") is not None]
    replayed = [e["id"] for e in second if e.get("id") is not None and e["id"] <= caught_up]
    live = [e["id"] for e in second if e.get("id") is not None and e["id"] > caught_up]
    kept = [e["id"] for e in run if e.get("id") is not None and last < e["id"] <= caught_up]
    everything = {e["id"] for e in run if e.get("id") is not None}
    final = second[-1]["event"] if second else "nothing"
    return [
        f"connection 1: ids {_span([e['id'] for e in first])}, then disconnect",
        f"the server kept ids {_span(kept)} with no client connected",
        f"connection 2: reconnect with Last-Event-ID: {asked}",
        f"catch-up: ids {_span(replayed)} replayed from the server's buffer",
        f"live: ids {_span(live)}, up to `{final}`",
        f"missed: {len(everything - set(received))}, received twice: {len(received) - len(set(received))}",
    ]


def draw(first: Sequence[dict[str, Any]], second: Sequence[dict[str, Any]], caught_up: int,
         run: Sequence[dict[str, Any]], last_event_id: int | None = None) -> Picture:
    """The picture, from the frames of the first connection (`first`, up to the hang-up), those of
    the second (`second`, opened with `Last-Event-ID` = the last id of `first`), the id the second
    one's catch-up ended at (`caught_up`: the last event the server had sent before the model went
    on), and the run's whole stream (`run`: every event with an id, as a follower from id 1 got it).
    `last_event_id`: the header the second connection sent, when not the last id of `first`."""
    import matplotlib.pyplot as plt

    last = first[-1]["id"] if first else 0
    asked = last if last_event_id is None else last_event_id
    stream = [e for e in run if e.get("id") is not None]
    top = max([1, *(e["id"] for e in stream), *(e["id"] for e in second if e.get("id") is not None)])
    lanes = ["connection 1", "the server's run", "connection 2"]
    y = {lane: n for n, lane in enumerate(lanes)}
    figure, axes = plt.subplots(figsize=(9.0, 3.4))
    axes.set_xlim(0, top + 1)
    axes.set_ylim(len(lanes) - 0.3, -0.9)

    def columns(events: Sequence[dict[str, Any]], lane: str, alpha: float = 1.0) -> None:
        for event in events:
            if event.get("id") is not None:
                axes.bar(event["id"], 0.36, bottom=y[lane] - 0.18, width=0.9, alpha=alpha, linewidth=0,
                         color=KINDS.get(event["event"], "black"))

    columns(first, "connection 1")
    columns(stream, "the server's run")
    columns([e for e in second if e.get("id") is not None and e["id"] <= caught_up], "connection 2")
    columns([e for e in second if e.get("id") is not None and e["id"] > caught_up], "connection 2", alpha=0.45)

    # The disconnect, on connection 1 after its last id; the stretch the server sent to nobody.
    axes.axvline(last + 0.5, color="tab:red", linestyle="--", linewidth=1)
    axes.annotate(f"disconnect after id {last}", (last + 0.5, y["connection 1"] - 0.25), xytext=(-4, 0),
                  textcoords="offset points", ha="right", va="bottom", fontsize=8, color="tab:red")
    if caught_up > last:
        axes.axvspan(last + 0.5, caught_up + 0.5, ymin=0.0, ymax=1.0, color="tab:red", alpha=0.07, linewidth=0)
        axes.annotate(f"kept, sent to no client: ids {last + 1}..{caught_up}",
                      ((last + caught_up + 1) / 2, y["the server's run"] - 0.25),
                      ha="center", va="bottom", fontsize=8)
    # The reconnect: from connection 1's last id down to connection 2's first.
    axes.annotate(f"reconnect with Last-Event-ID: {asked}", (asked + 1, y["connection 2"] - 0.2),
                  xytext=(asked + 1 + 0.03 * top, y["connection 2"] - 0.5), fontsize=8, ha="left", va="center",
                  arrowprops={"arrowstyle": "->", "color": "black", "linewidth": 0.8})
    if second:
        axes.annotate(f"catch-up: {asked + 1}..{caught_up}", ((asked + caught_up + 1) / 2, y["connection 2"] + 0.22),
                      ha="center", va="top", fontsize=8)
        live_ids = [e["id"] for e in second if e.get("id") is not None and e["id"] > caught_up]
        if live_ids:
            axes.annotate(f"live: {live_ids[0]}..{live_ids[-1]}",
                          ((live_ids[0] + live_ids[-1]) / 2, y["connection 2"] + 0.22),
                          ha="center", va="top", fontsize=8)
    names = [lanes[0], "the server's run\n(every event)", f"connection 2\n(Last-Event-ID: {asked})"]
    axes.set_yticks(range(len(lanes)), names, fontsize=8)
    axes.tick_params(axis="y", length=0)
    for side in ("top", "right", "left"):
        axes.spines[side].set_visible(False)
    from matplotlib.patches import Patch

    handles = [Patch(color=colour, label=kind) for kind, colour in KINDS.items()]
    handles.append(Patch(color="black", label="other (started, end)"))
    axes.legend(handles=handles, loc="upper right", ncol=len(handles), fontsize=7, frameon=False)
    axes.set_xlabel("event id (one column per event of the run; pale: live, after the catch-up)", fontsize=8)
    axes.set_title(TITLE)
    figure.tight_layout()
    return picture(figure, TITLE, elements(first, second, caught_up, run, last_event_id))

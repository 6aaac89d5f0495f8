"""Lesson 04, streaming is not persistence: the SSE client, the hang-up and the reconnect its
cells call, its picture and the exercise's test (read any of them with `lesson.name??`).

`sse()` is a client as `curl -N` is one: the events of `GET /api/chat?conversation=` as they
arrive, with a hang-up when the loop stops. The lab's own follower (`server.chat(...)` follows the
stream it starts, `server.follow(c, 0)` a running one from its first event, and neither hangs up)
is the reference: it sees every event (`reference(server)`).
"""

from __future__ import annotations

import difflib
import queue
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..children import AnotherPath, sse_events
from ..pictures import Picture
from ..pictures import event_ids

if TYPE_CHECKING:
    from ..children import LabServer
    from ..harness import Lab

CAUGHT_UP_AFTER = 1.0
"""Seconds with no new frame, while the model is held, after which a reconnect's catch-up is over."""


def sse(server: LabServer, conversation: str, last_event_id: int | None = None) -> Iterator[dict[str, Any]]:
    """The events (`id`, `event`, `data`) of the conversation's stream as they arrive, pings left
    out, from `last_event_id` on when given. Leaving the loop (or closing it) hangs up."""
    import httpx

    headers = {} if last_event_id is None else {"Last-Event-ID": str(last_event_id)}
    with httpx.stream("GET", f"{server.url}/api/chat", params={"conversation": conversation},
                      headers={**server.headers, **headers}, timeout=httpx.Timeout(60, read=None)) as response:
        for event in sse_events(response.iter_lines()):
            if event["event"] != "ping":
                yield event


def hold_half_way(lab: Lab) -> None:
    """Hold the next answer after a tool result half-way (the scripted model's `summary` pause;
    with another model, the recording proxy's, after 20 chunks)."""
    if lab.scripted:
        lab.model.arm("summary")
    else:
        lab.model.arm("summary", after_chunks=20)


def text(events: Sequence[dict[str, Any]], name: str = "token") -> str:
    """The data of the events named `name` (the answer's `token`s by default), joined."""
    return "".join(e["data"] for e in events if e["event"] == name)


def reference(server: LabServer) -> list[dict[str, Any]]:
    """What the lab's follower saw of the latest chat it followed: every event with an id."""
    return [e for e in server.events() if e.get("id") is not None]


def detail(server: LabServer, conversation: str) -> dict[str, Any]:
    """`GET /api/conversations/<conversation>`: the conversation as a reload shows it."""
    return server.request("GET", f"/api/conversations/{conversation}").json()


def _fetched(event: dict[str, Any]) -> bool:
    return event["event"] == "trace" and isinstance(event["data"], dict) and event["data"].get("event") == "result"


@dataclass
class HungUp:
    conversation: str
    first: list[dict[str, Any]]
    """The frames the first connection read, up to the hang-up."""
    answer_tokens: int
    """How many tokens of the answer (after the fetch's result) it read."""

    @property
    def last(self) -> int:
        """The id of the last frame it read: what it reconnects with."""
        return self.first[-1]["id"]


def hang_up_mid_answer(lab: Lab, server: LabServer, message: str, tokens: int, attempts: int = 3) -> HungUp:
    """POST `message` in a new conversation (a bare POST: no follower, so this client is the run's
    only one), follow its stream and hang up after `tokens` tokens of the answer that comes after
    the fetch. A real model may answer in words without the fetch: then it says so and asks again,
    in a new conversation."""
    for attempt in range(1, attempts + 1):
        conversation = server.request("POST", "/api/chat", json={"message": message}).json()["conversation"]
        first: list[dict[str, Any]] = []
        answer_tokens = 0
        with closing(sse(server, conversation)) as events:
            for event in events:
                first.append(event)
                answer_tokens += event["event"] == "token" and any(_fetched(e) for e in first)
                if answer_tokens == tokens or event["event"] in ("end", "chat-error"):
                    break  # hang up, mid-answer (or the run ended without the fetch)
        if answer_tokens == tokens:
            return HungUp(conversation, first, answer_tokens)
        print(f"Attempt {attempt} of {attempts}: the model answered without fetching the page. "
              "Asking again, in a new conversation.")
    raise AnotherPath(f"The model answered without fetching the page {attempts} times: run the cell again.")


@dataclass
class Reconnected:
    second: list[dict[str, Any]]
    """The frames the second connection read, from its first to the run's final event."""
    caught_up: int
    """The id of the last frame the server had already sent (to nobody) when the client came back:
    the end of the catch-up; the frames after it are live."""


def reconnect(lab: Lab, server: LabServer, conversation: str, last: int) -> Reconnected:
    """Reconnect to the conversation's stream with `Last-Event-ID: last` while the model is held,
    read the catch-up (what the server replays from its buffer: every frame after `last` it had
    sent meanwhile), then let the model finish and read the live frames to the end.

    The lab's follower joins first, from id 1, as the reference. The catch-up is over when, the
    model being held, no frame has come for `CAUGHT_UP_AFTER` seconds (the server sends it at once)."""
    server.follow(conversation, 0)  # the reference: every event of the run, from id 1
    server.log.wait_until(lambda e: (e.get("id") or 0) >= last, "the follower has caught up", 30)
    arrived: queue.Queue = queue.Queue()

    def read() -> None:
        try:
            with closing(sse(server, conversation, last_event_id=last)) as events:
                for event in events:
                    arrived.put(event)
        finally:
            arrived.put(None)

    threading.Thread(target=read, daemon=True).start()
    second: list[dict[str, Any]] = []
    ended = False
    timeout = 60.0  # for the first frame; then the model is still held: what comes now is the catch-up
    while not ended:
        try:
            event = arrived.get(timeout=timeout)
        except queue.Empty:
            break
        ended = event is None
        second += [] if ended else [event]
        timeout = CAUGHT_UP_AFTER
    caught_up = max([last, *(e["id"] for e in second if e.get("id") is not None)])
    lab.model.release()  # the catch-up is over; let the answer finish
    while not ended and (event := arrived.get(timeout=120)) is not None:
        second.append(event)
    server.wait_final()
    return Reconnected(second, caught_up)


def event_ids_picture(hung_up: HungUp, reconnected: Reconnected, server: LabServer) -> Picture:
    """The picture of section 2: the ids each connection received, the disconnect, what the
    server kept meanwhile, the reconnect with `Last-Event-ID` and its catch-up, from what the
    two connections and the lab's follower received."""
    return event_ids.draw(hung_up.first, reconnected.second, reconnected.caught_up, reference(server))


@dataclass
class CutPair:
    conversation: str
    frames: list[dict[str, Any]]
    """The frames of both connections, in the order they arrived."""
    cut: int
    """How many of them the first connection read."""
    noted: int
    """The `Last-Event-ID` the second connection opened with."""


def record_cut_pair(lab: Lab, server: LabServer, message: str, read: int = 6, back: int = 3) -> CutPair:
    """The exercise's pair of connections: a new long answer, held half-way; the first connection
    reads `read` tokens and is cut; the second opens with `Last-Event-ID` set to the id just before
    the first connection's last `back` tokens (a client that noted its place a little late).
    Prints each connection's ids and the frames around the cut."""
    if lab.scripted:
        lab.model.arm("long-answer")                  # the scripted model's pause, half-way
    else:
        lab.model.arm("mid-stream", after_chunks=8)   # the recording proxy's, after 8 chunks
    server.chat(message)
    conversation = server.conversation()
    frames: list[dict[str, Any]] = []
    with closing(sse(server, conversation)) as events:
        for event in events:
            frames.append(event)
            if sum(e["event"] == "token" for e in frames) == read:
                break  # cut, mid-answer
    cut = len(frames)
    noted = [e["id"] for e in frames if e["event"] == "token"][-back] - 1  # the id the client reconnects with
    lab.model.wait_paused()
    with closing(sse(server, conversation, last_event_id=noted)) as events:
        for event in events:
            frames.append(event)
            if len(frames) == cut + 1:
                lab.model.release()  # the replay has begun; let the answer finish
    server.wait_final()
    print(f"connection 1: ids {frames[0]['id']}..{frames[cut - 1]['id']}, cut after {read} tokens")
    print(f"connection 2, Last-Event-ID: {noted}: ids {frames[cut]['id']}..{frames[-1]['id']} ({frames[-1]['event']})")
    for n, e in [(1, e) for e in frames[cut - back - 1:cut]] + [(2, e) for e in frames[cut:cut + back + 2]]:
        print(f"  connection {n}  id {e['id']:>3}  {e['event']:<9} {e['data']!r}")
    return CutPair(conversation, frames, cut, noted)


def where_it_differs(got: str, saved: str) -> str:
    """Where `got` has a piece of `saved` twice, lacks one, or has something else (word by word)."""
    a, b = re.findall(r"\s+|\S+", saved), re.findall(r"\s+|\S+", got)
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        extra, lacking, at = "".join(b[j1:j2]), "".join(a[i1:i2]), len("".join(a[:i1]))
        if op == "insert" and got.count(extra) > saved.count(extra):
            return (f"{extra[:60]!r} is there twice (after character {at}): the second connection replayed "
                    "events the first had delivered, and a frame whose id you have seen is the same event again")
        if op == "delete":
            return (f"{lacking[:60]!r} is missing (after character {at}): every frame with an id you had not "
                    "seen yet holds a piece of the answer, on either connection")
        if op != "equal":
            return f"after character {at}, your text has {extra[:60]!r} where the answer has {lacking[:60]!r}"
    return "it differs from the answer"


def test_reassemble(reassemble: Callable[[list[dict[str, Any]]], str], lab: Lab,
                    pairs: Sequence[tuple[str, Sequence[dict[str, Any]], str]]) -> None:
    """The exercise's test: for each (name, frames, conversation), `reassemble(frames)` must be the
    answer as the conversation's last checkpoint holds it; when it is not, the message says where
    the text has a piece twice or lacks one."""
    for pair, frames_of, conversation in pairs:
        saved = lab.messages(conversation)["content"].iloc[-1]  # the answer, as the last checkpoint holds it
        got = reassemble([dict(frame) for frame in frames_of])
        assert isinstance(got, str), f"reassemble must return a str, not {type(got).__name__}"
        assert got == saved, f"With {pair} frames, {where_it_differs(got, saved)}."

"""`GET /api/chat?conversation=`: the SSE stream byte for byte, replay after `Last-Event-ID`, the
single-event answers, `ping`, and the bounded buffer's answer to an id it no longer keeps.

The frames are read raw (`iter_bytes`) and compared as bytes: `id: N` (a run's own events
only), `event: <name>`, `data: <compact JSON>`, a blank line. The server of this module pings
every 0.2 s and keeps the latest 60 events of a run, so both can be seen without waiting long.
Runs are held (a web page, a model pause) while a test connects, never timed.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator

import httpx
import pytest

from conftest import BACKENDS, database_env

from sophos_lab.runtime.errors import REPLAY_GONE, SophosError
from sophos_lab.runtime.active import ActiveRun

BUFFER = 60
PING = b'event: ping\ndata: ""\n\n'
FRAME = re.compile(rb"id: (\d+)\nevent: ([a-z-]+)\ndata: ([^\n]*)\n\n")
UNKNOWN = "0d4a3f0e-1b2c-4d5e-8f60-718293a4b5c6"


@pytest.fixture(scope="module", params=BACKENDS)
def server(request, lab, tmp_path_factory):
    """One server for the module's tests, on a SQLite file and then on a PostgreSQL database."""
    database = database_env(request, request.param, tmp_path_factory.mktemp("server-sse") / "sophos.db")
    with lab.server(**database, SOPHOS_LAB_SSE_PING_SECONDS="0.2",
                    SOPHOS_LAB_EVENT_BUFFER=str(BUFFER)) as server:
        yield server


def start(server, message: str) -> dict:
    answer = server.request("POST", "/api/chat", json={"message": message})
    assert answer.status_code == 200, answer.text
    return answer.json()


@contextlib.contextmanager
def stream(server, conversation: str, last_event_id: str | None = None) -> Iterator[Frames]:
    """`GET /api/chat?conversation=` (with `Last-Event-ID` when given), read as raw frames."""
    headers = {} if last_event_id is None else {"Last-Event-ID": last_event_id}
    with httpx.stream("GET", f"{server.url}/api/chat", params={"conversation": conversation},
                      headers=headers, timeout=httpx.Timeout(30)) as response:
        yield Frames(response)


class Frames:
    """The raw frames of one stream, pings included, read once and in order."""

    def __init__(self, response: httpx.Response) -> None:
        self.headers = response.headers
        self._frames = self._read(response)

    def __iter__(self) -> Iterator[bytes]:
        return self._frames

    def events(self, count: int | None = None) -> list[bytes]:
        """The next frames that are not pings: `count` of them, or all until the stream ends."""
        out = []
        for frame in self._frames:
            if frame != PING:
                out.append(frame)
                if len(out) == count:
                    break
        return out

    def body(self) -> bytes:
        return b"".join(self._frames)

    @staticmethod
    def _read(response: httpx.Response) -> Iterator[bytes]:
        pending = b""
        for chunk in response.iter_bytes():
            pending += chunk
            while b"\n\n" in pending:
                frame, pending = pending.split(b"\n\n", 1)
                yield frame + b"\n\n"
        assert pending == b"", f"the stream ended inside a frame: {pending!r}"


def parsed(frame: bytes) -> tuple[int, str, object]:
    found = FRAME.fullmatch(frame)
    assert found, frame
    return int(found[1]), found[2].decode(), json.loads(found[3])


# --- framing -----------------------------------------------------------------------------


def test_a_run_streams_as_the_original_frames_it(server, lab):
    lab.web.hold("/index.html")
    try:
        started = start(server, f"Fetch {lab.page('index.html')}")
        with stream(server, started["conversation"]) as response:
            lab.web.wait_held()
            lab.web.release()
            received = response.events()
            headers = response.headers
    finally:
        lab.web.release()

    assert (headers["content-type"], headers["cache-control"], headers["connection"]) == (
        "text/event-stream", "no-cache, no-transform", "keep-alive")
    conversation, run = started["conversation"], started["run"]
    assert received[0] == (f'id: 1\nevent: started\ndata: {{"conversation":"{conversation}",'
                           f'"run":"{run}","resume":false}}\n\n').encode()
    assert received[-1] == (f'id: {len(received)}\nevent: end\ndata: {{"conversation":"{conversation}",'
                            f'"run":"{run}","status":"completed"}}\n\n').encode()
    ids, names, data = zip(*map(parsed, received))
    assert list(ids) == list(range(1, len(received) + 1))
    assert set(names) == {"started", "trace", "token", "end"}
    for frame in received:  # data is compact JSON, as JSON.stringify writes it
        raw = FRAME.fullmatch(frame)[3].decode()
        assert raw == json.dumps(json.loads(raw), ensure_ascii=False, separators=(",", ":"))
    notes = [(d["node"], d["event"]) for name, d in zip(names, data) if name == "trace"]
    assert notes == [("agent", "enter"), ("tools", "call"), ("agent", "leave"), ("tools", "enter"),
                     ("tools", "result"), ("tools", "leave"), ("agent", "enter"), ("agent", "leave")]


def test_an_open_stream_is_pinged_without_an_id(server, lab):
    lab.web.hold("/index.html")
    try:
        started = start(server, f"Fetch {lab.page('index.html')}")
        with stream(server, started["conversation"]) as response:
            lab.web.wait_held()  # nothing more happens in the run until the page is released
            seen = []
            for frame in response:
                seen.append(frame)
                if frame == PING:
                    break
            lab.web.release()
            rest = response.events()
    finally:
        lab.web.release()

    assert seen[-1] == b'event: ping\ndata: ""\n\n'
    assert parsed(rest[-1])[1] == "end"
    ids = [parsed(frame)[0] for frame in seen[:-1] + rest if frame != PING]
    assert ids == list(range(1, len(ids) + 1))  # pings never take an id


# --- replay ------------------------------------------------------------------------------


def test_last_event_id_replays_exactly_the_events_a_client_missed(server, lab):
    lab.web.hold("/index.html")
    try:
        started = start(server, f"Fetch {lab.page('index.html')}")
        with stream(server, started["conversation"]) as everything:
            with stream(server, started["conversation"]) as first:
                seen = first.events(3)  # then the client goes away; the run goes on
            last = parsed(seen[-1])[0]
            with stream(server, started["conversation"], last_event_id=str(last)) as again:
                lab.web.wait_held()
                lab.web.release()
                rest = again.events()
            whole = everything.events()
    finally:
        lab.web.release()

    assert last == 3
    assert seen + rest == whole  # nothing lost, nothing twice, byte for byte
    assert parsed(rest[0])[0] == last + 1


@pytest.mark.parametrize("header", [None, "", "abc", "-4"])
def test_a_missing_or_non_numeric_last_event_id_replays_from_the_first_event(server, lab, header):
    lab.web.hold("/index.html")
    try:
        started = start(server, f"Fetch {lab.page('index.html')}")
        with stream(server, started["conversation"], last_event_id=header) as response:
            lab.web.wait_held()
            lab.web.release()
            received = response.events()
    finally:
        lab.web.release()

    assert parsed(received[0])[:2] == (1, "started")
    assert parsed(received[-1])[1] == "end"


# --- single-event answers ----------------------------------------------------------------


def test_an_invalid_id_gets_one_chat_error_without_an_id(server):
    for query in ({"conversation": "not-a-uuid"}, {}):
        response = httpx.get(f"{server.url}/api/chat", params=query)
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/event-stream"
        assert response.content == b'event: chat-error\ndata: {"code":"BAD_REQUEST","message":"Invalid Conversation ID"}\n\n'


def test_an_unknown_conversation_gets_one_chat_error_without_an_id(server):
    response = httpx.get(f"{server.url}/api/chat", params={"conversation": UNKNOWN})

    assert response.content == (b'event: chat-error\ndata: {"code":"NOT_FOUND","message":"Conversation Not Found",'
                                b'"conversation":"' + UNKNOWN.encode() + b'"}\n\n')


def test_a_conversation_without_an_active_run_gets_one_end_with_its_latest_status(server):
    started = start(server, "hello")
    with stream(server, started["conversation"]) as response:
        response.events()  # the run has ended

    with stream(server, started["conversation"], last_event_id="3") as response:
        after = response.body()

    assert after == (f'event: end\ndata: {{"conversation":"{started["conversation"]}","run":"{started["run"]}",'
                     '"status":"completed"}\n\n').encode()


# --- the bounded buffer ------------------------------------------------------------------


def test_an_id_older_than_the_buffer_gets_replay_gone_and_a_fresh_follower_the_events_kept(server, lab):
    lab.model.arm("essay")
    try:
        started = start(server, "Write an essay on durable execution.")
        lab.model.wait_paused()  # half the essay's tokens are out, more than the buffer keeps
        with stream(server, started["conversation"]) as fresh:
            [oldest] = fresh.events(1)
            oldest_id = parsed(oldest)[0]
            with stream(server, started["conversation"], last_event_id=str(oldest_id - 2)) as late:
                gone = late.body()
            lab.model.release()
            kept = [oldest] + fresh.events()
    finally:
        lab.model.release()

    assert oldest_id > BUFFER
    name, data = re.fullmatch(rb"event: (chat-error)\ndata: ([^\n]*)\n\n", gone).groups()
    error = json.loads(data)
    assert (error["code"], error["conversation"], error["run"]) == (REPLAY_GONE, started["conversation"], started["run"])
    assert error["oldest"] >= oldest_id and "Reload the conversation" in error["message"]
    ids = [parsed(frame)[0] for frame in kept]
    assert ids == list(range(oldest_id, oldest_id + len(ids)))
    assert parsed(kept[-1])[1:] == ("end", {**started, "status": "completed"})


def test_an_id_the_run_never_sent_gets_replay_gone(server, lab):
    lab.web.hold("/index.html")
    try:
        started = start(server, f"Fetch {lab.page('index.html')}")
        with stream(server, started["conversation"], last_event_id="500") as response:
            gone = response.body()
        lab.web.wait_held()
    finally:
        lab.web.release()

    assert gone.startswith(b'event: chat-error\ndata: {"code":"REPLAY_GONE","message":"Event 500 is not one of run ')


async def test_the_buffer_keeps_the_latest_events_and_refuses_older_ids():
    run = ActiveRun(id="run-1", conversation="c", resume=False, keep=3)
    for n in range(10):
        run.publish("token", str(n))
    run.publish("end", {"status": "completed"})

    assert [event.id for event in run.buffer] == [9, 10, 11]
    assert (run.dropped, run.last_id) == (8, 11)
    assert [event.id async for event in run.events(8)] == [9, 10, 11]
    assert (await run.wait()).event == "end"
    with pytest.raises(SophosError) as gone:
        [event async for event in run.events(7)]
    assert gone.value.code == REPLAY_GONE
    assert "Events 8 to 8 of run run-1 are no longer kept" in gone.value.message


async def test_a_reader_that_falls_behind_the_buffer_is_told_so():
    run = ActiveRun(id="run-1", conversation="c", resume=False, keep=3)
    run.publish("started", {})
    reader = run.events()
    assert (await anext(reader)).id == 1
    for n in range(5):  # the reader is slow: ids 2 and 3 go before it reads them
        run.publish("token", str(n))

    with pytest.raises(SophosError) as gone:
        await anext(reader)
    assert gone.value.code == REPLAY_GONE

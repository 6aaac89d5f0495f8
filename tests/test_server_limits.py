"""The HTTP server's own limits, as a hostile or broken client meets them: a real `sophos-lab
serve` process (`lab.server()`) and raw sockets, since httpx would not send what these send.

- a request must arrive (head and body) within `SOPHOS_LAB_REQUEST_TIMEOUT_SECONDS` of its
  connection opening: slow clients get 408 `REQUEST_TIMEOUT` and are closed, a connection that
  sends nothing is closed, others are served meanwhile, and a stream (whose request arrived at
  once) stays open as long as its run;
- a request the HTTP parser refuses (a malformed chunked body, a bad header line, a head over
  16 KiB, both `Content-Length` and `Transfer-Encoding`) gets 400 `BAD_REQUEST` in the kit's
  envelope, and the connection is closed, so nothing after it is read as a request;
- an idle kept-alive connection is closed after `SOPHOS_LAB_KEEP_ALIVE_SECONDS`; more open
  connections than `SOPHOS_LAB_MAX_CONNECTIONS` get 503.

No sleeps: every wait ends at a barrier (the server answering or closing a connection, an event
on a stream); `BOUND` is only how long a test waits before it fails.
"""

from __future__ import annotations

import json
import select
import socket
import time

import pytest

from sophos_lab.lab.inspect import peek_runs

REQUEST_TIMEOUT = 1.0
KEEP_ALIVE = 1.0
BOUND = 20.0
"""How long a test waits for the server to answer or close before it fails."""
SUMMARISE = "Fetch {url} and summarize it in 12 detailed bullet points."


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    return tmp_path_factory.mktemp("limits") / "sophos.db"


@pytest.fixture(scope="module")
def server(lab, db):
    with lab.server(DATABASE_PATH=str(db), SOPHOS_LAB_REQUEST_TIMEOUT_SECONDS=str(REQUEST_TIMEOUT),
                    SOPHOS_LAB_KEEP_ALIVE_SECONDS=str(KEEP_ALIVE)) as server:
        yield server


def connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=BOUND)


def until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a timeout fails the test)."""
    received = bytearray()
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass  # closed, with our last bytes unread: what it sent before is in `received`
    finally:
        sock.close()
    return bytes(received)


def exchange(server, data: bytes) -> bytes:
    """Send `data` on a new connection and read until the server closes it."""
    sock = connect(server)
    sock.sendall(data)
    return until_closed(sock)


def responses(data: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """The responses in `data`: (status, lower-cased headers, body), framed by Content-Length."""
    found = []
    while data:
        head, separator, data = data.partition(b"\r\n\r\n")
        assert separator, f"not an HTTP response: {head!r}"
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
        length = int(headers.get("content-length", len(data)))
        found.append((int(status_line.split()[1]), headers, data[:length]))
        data = data[length:]
    return found


def the_envelope(data: bytes, status: int, code: str) -> str:
    """The one response in `data` is the kit's error envelope with `status` and `code`, and
    says the connection closes; its message."""
    [(got_status, headers, body)] = responses(data)
    assert (got_status, headers.get("content-type")) == (status, "application/json"), (got_status, headers, body)
    assert headers["connection"] == "close"
    error = json.loads(body)["error"]
    assert set(json.loads(body)) == {"error"} and set(error) == {"code", "message"}
    assert error["code"] == code
    return error["message"]


def chat_request(body: bytes, *headers: str) -> bytes:
    lines = ["POST /api/chat HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def conversation_ids(server) -> list[str]:
    return [c["id"] for c in server.request("GET", "/api/conversations").json()["conversations"]]


# --- slow clients: the request timeout -----------------------------------------------------


SLOW_HEAD = b"GET /api/healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "


def dribble(socks: list[socket.socket], data: bytes) -> dict[socket.socket, bytes]:
    """Send every socket the next byte of `data` (then `x`s: a header that never ends) about
    four times a second, until the server has closed each; what each received."""
    received = {sock: bytearray() for sock in socks}
    sent = dict.fromkeys(socks, 0)
    open_ = set(socks)
    deadline = time.monotonic() + BOUND
    while open_:
        assert time.monotonic() < deadline, f"{len(open_)} of {len(socks)} slow connections still open after {BOUND} s"
        readable, _, _ = select.select(list(open_), [], [], 0.25)  # the pace of the drip; a close ends it
        for sock in readable:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                chunk = b""
            if chunk:
                received[sock] += chunk
            else:
                open_.discard(sock)
                sock.close()
        for sock in open_.difference(readable):
            if select.select([sock], [], [], 0)[0]:
                continue  # the server answered meanwhile: read it first (a byte sent now would be reset)
            try:
                sock.send(data[sent[sock]:sent[sock] + 1] or b"x")
            except (BrokenPipeError, ConnectionResetError):
                pass  # closed between the two calls; the next select reads what came
            sent[sock] += 1
    return {sock: bytes(got) for sock, got in received.items()}


def test_two_hundred_slow_clients_get_408_after_the_timeout_while_others_are_served(server):
    slow = [connect(server) for _ in range(200)]
    opened = time.monotonic()
    for sock in slow:
        sock.send(SLOW_HEAD[:1])
    meanwhile = server.request("GET", "/api/healthz")  # a client that sends its request at once
    answers = dribble(slow, SLOW_HEAD)
    closed_after = time.monotonic() - opened

    assert (meanwhile.status_code, meanwhile.json()) == (200, {"status": "ok"})
    messages = {the_envelope(answer, 408, "REQUEST_TIMEOUT") for answer in answers.values()}
    assert messages == {f"The request did not arrive within {REQUEST_TIMEOUT:g} s; the connection is closed."}
    assert closed_after >= REQUEST_TIMEOUT
    after = server.request("GET", "/api/healthz")
    assert after.status_code == 200


def test_a_body_that_never_arrives_is_cut_by_the_timeout_and_nothing_is_written(server):
    before = conversation_ids(server)
    sock = connect(server)
    sock.sendall(chat_request(b'{"message": "hel', "Content-Length: 100"))  # 84 bytes never come

    message = the_envelope(until_closed(sock), 408, "REQUEST_TIMEOUT")

    assert message == f"The request did not arrive within {REQUEST_TIMEOUT:g} s; the connection is closed."
    assert conversation_ids(server) == before
    # The handler that was reading the body heard the hang-up as a refusal, not as a failure.
    assert "Traceback" not in server.log_path.read_text(errors="replace")


def test_a_slow_second_request_on_a_kept_alive_connection_is_timed_from_its_first_byte(server):
    # uvicorn's keep-alive timer stops at the first byte of the next request: from there on,
    # only the request timeout bounds it.
    sock = connect(server)
    sock.sendall(b"GET /api/healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    first = b""
    while not first.endswith(b'{"status":"ok"}'):
        first += sock.recv(65536)

    answer = dribble([sock], SLOW_HEAD)[sock]

    assert responses(first)[0][0] == 200
    the_envelope(answer, 408, "REQUEST_TIMEOUT")


def test_a_connection_that_sends_nothing_is_closed_without_an_answer(server):
    assert until_closed(connect(server)) == b""


def test_a_stream_open_far_longer_than_the_timeout_is_not_cut(server, lab, db):
    lab.model.arm("summary")
    try:
        server.chat(SUMMARISE.format(url=lab.page("wal.html")))
        conversation = server.conversation()
        server.wait_for("trace", event="result")
        lab.model.wait_paused()  # the stream is open, the answer half-way, nothing is sent now
        # A slow client that connects now is closed after the timeout: by then the stream's
        # connection has been open longer than that, with no request bytes to wait for.
        the_envelope(dribble([connect(server)], SLOW_HEAD).popitem()[1], 408, "REQUEST_TIMEOUT")
        tokens_before = sum(event["event"] == "token" for event in server.events())
    finally:
        lab.model.release()
    final = server.wait_final()

    assert (final["event"], final["data"]["status"]) == ("end", "completed")
    assert sum(event["event"] == "token" for event in server.events()) > tokens_before  # the rest came
    assert list(peek_runs(db, conversation)["status"]) == ["completed"]


# --- requests the parser refuses: 400 in the envelope ----------------------------------------


MALFORMED = [
    ("a malformed chunk size", chat_request(b"zz\r\n{}\r\n0\r\n\r\n", "Transfer-Encoding: chunked")),
    ("a chunk longer than it said", chat_request(b"2\r\n{\"message\": 1}\r\n0\r\n\r\n", "Transfer-Encoding: chunked")),
    ("a header line without a colon", b"GET /api/healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nnot a header\r\n\r\n"),
    ("a garbled request line", b"GET /api/healthz\r\nHost: 127.0.0.1\r\n\r\n"),
    ("an unknown transfer coding", chat_request(b"{}", "Transfer-Encoding: gzip")),
    ("two different Content-Lengths", chat_request(b"{}", "Content-Length: 2", "Content-Length: 3")),
]


@pytest.mark.parametrize("request_bytes", [case[1] for case in MALFORMED], ids=[case[0] for case in MALFORMED])
def test_a_malformed_request_gets_400_in_the_envelope_and_the_connection_closes(server, request_bytes):
    before = conversation_ids(server)

    message = the_envelope(exchange(server, request_bytes), 400, "BAD_REQUEST")

    assert message.startswith("Malformed HTTP request: ")
    assert conversation_ids(server) == before


def test_a_request_head_over_16_KiB_gets_400_in_the_envelope(server):
    head = b"GET /api/healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * (16 * 1024) + b"\r\n\r\n"

    message = the_envelope(exchange(server, head), 400, "BAD_REQUEST")

    assert message == "The request head is larger than 16384 bytes; the connection is closed."


def test_a_request_with_both_content_length_and_chunked_is_refused_and_nothing_after_it_is_read(server):
    # A front end that frames by Content-Length sees one request; a back end that frames by
    # Transfer-Encoding (as the parser does) would see a second one smuggled inside the body.
    smuggled = b"GET /api/healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    body = b'11\r\n{"message": "hi"}\r\n0\r\n\r\n' + smuggled
    before = conversation_ids(server)

    answer = exchange(server, chat_request(body, f"Content-Length: {len(body)}", "Transfer-Encoding: chunked"))

    message = the_envelope(answer, 400, "BAD_REQUEST")  # one response, not two
    assert message == ("Malformed HTTP request: both Content-Length and Transfer-Encoding; "
                       "the connection is closed.")
    assert conversation_ids(server) == before  # no run started


def test_a_well_formed_chunked_body_is_still_accepted(server):
    body = b'11\r\n{"message": "hi"}\r\n0\r\n\r\n'
    sock = connect(server)
    sock.sendall(chat_request(body, "Transfer-Encoding: chunked", "Connection: close"))

    [(status, _, answer)] = responses(until_closed(sock))

    assert status == 200 and set(json.loads(answer)) == {"conversation", "run"}
    server.follow(json.loads(answer)["conversation"])
    assert server.wait_final()["event"] == "end"


# --- keep-alive and the connection cap -------------------------------------------------------


def test_an_idle_kept_alive_connection_is_closed_after_the_keep_alive_timeout(server):
    sock = connect(server)
    sock.settimeout(KEEP_ALIVE + 3)  # uvicorn's own default is 5 s
    sock.sendall(b"GET /api/healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")

    [(status, headers, _)] = responses(until_closed(sock))

    assert status == 200 and headers.get("connection") != "close"  # it was kept alive, then closed


def test_more_connections_than_the_cap_get_503(lab, tmp_path):
    with lab.server(DATABASE_PATH=str(tmp_path / "sophos.db"), SOPHOS_LAB_MAX_CONNECTIONS="3") as server:
        held = [connect(server) for _ in range(3)]
        for sock in held:  # three kept-alive connections, each served once
            sock.sendall(b"GET /api/healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        refused = exchange(server, b"GET /api/healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        for sock in held:
            sock.close()

    [(status, _, _)] = responses(refused)
    assert status == 503

"""The web page's side of the server, without a browser (`test_server_browser.py` drives the
page itself): `/` and its files, the token rule's two exceptions for the page, the access log,
and a server that takes a killed one's port.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import httpx
import pytest

from sophos_lab.server.auth import RedactToken

STATIC = Path(__file__).resolve().parent.parent / "sophos_lab" / "server" / "static"
UNKNOWN = "0d4a3f0e-1b2c-4d5e-8f60-718293a4b5c6"
TOKEN = "a-long-random-secret"


@pytest.fixture(scope="module")
def server(lab, tmp_path_factory):
    root = tmp_path_factory.mktemp("server-page")
    with lab.server(DATABASE_PATH=str(root / "sophos.db")) as server:
        yield server


@pytest.fixture(scope="module")
def server_with_token(lab, tmp_path_factory):
    root = tmp_path_factory.mktemp("server-page-token")
    with lab.server(DATABASE_PATH=str(root / "sophos.db"), SOPHOS_LAB_TOKEN=TOKEN) as server:
        yield server


def error_of(response: httpx.Response) -> tuple[int, str, str]:
    error = response.json()["error"]
    return response.status_code, error["code"], error["message"]


def test_the_page_is_served_at_the_root_with_its_script_and_style(server):
    page = httpx.get(f"{server.url}/")
    script = httpx.get(f"{server.url}/static/app.js")
    style = httpx.get(f"{server.url}/static/style.css")

    assert (page.status_code, page.headers["content-type"]) == (200, "text/html; charset=utf-8")
    assert '<script src="static/app.js"></script>' in page.text
    assert '<link rel="stylesheet" href="static/style.css">' in page.text
    # no inline script or event handler would run, should markup ever reach the page
    assert page.headers["content-security-policy"].startswith("default-src 'self'")
    assert (script.status_code, script.headers["content-type"]) == (200, "text/javascript; charset=utf-8")
    assert (style.status_code, style.headers["content-type"]) == (200, "text/css; charset=utf-8")
    missing = httpx.get(f"{server.url}/static/nothing.js")
    assert error_of(missing) == (404, "NOT_FOUND", "No such endpoint: /static/nothing.js")


def test_the_page_writes_text_never_markup():
    script = (STATIC / "app.js").read_text()
    assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write", script)


def test_with_a_token_the_page_is_served_without_it(server_with_token):
    page = httpx.get(f"{server_with_token.url}/")
    script = httpx.get(f"{server_with_token.url}/static/app.js")

    assert (page.status_code, script.status_code) == (200, 200)


def test_with_a_token_only_the_stream_takes_it_as_a_query_parameter(server_with_token):
    url = server_with_token.url
    right = httpx.get(f"{url}/api/chat", params={"conversation": UNKNOWN, "token": TOKEN})
    wrong = httpx.get(f"{url}/api/chat", params={"conversation": UNKNOWN, "token": "guess"})
    others = [
        httpx.request(method, f"{url}{path}", params={"token": TOKEN}, json={"message": "hi"})
        for method, path in [("GET", "/api/conversations"), ("GET", f"/api/conversations/{UNKNOWN}/export"),
                             ("POST", "/api/chat"), ("POST", "/")]
    ]

    assert right.status_code == 200
    assert right.content == (b'event: chat-error\ndata: {"code":"NOT_FOUND","message":"Conversation Not Found",'
                             b'"conversation":"' + UNKNOWN.encode() + b'"}\n\n')
    assert error_of(wrong) == (401, "UNAUTHORIZED", "The token in ?token= is not this server's.")
    for response in others:
        assert error_of(response) == (
            401, "UNAUTHORIZED", "This server needs its token: send Authorization: Bearer <SOPHOS_LAB_TOKEN>.")


def test_the_access_log_shows_no_token():
    # a line as uvicorn's access logger writes it
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 0, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:50000", "GET", f"/api/chat?conversation={UNKNOWN}&token={TOKEN}", "1.1", 200),
                               None)

    assert RedactToken().filter(record)
    assert record.getMessage() == (
        f'127.0.0.1:50000 - "GET /api/chat?conversation={UNKNOWN}&token=REDACTED HTTP/1.1" 200')


def test_a_server_started_on_a_killed_servers_port_takes_its_place(lab, db_path):
    first = lab.server(DATABASE_PATH=str(db_path))
    assert first.kill() == -9
    with lab.server(port=first.port, DATABASE_PATH=str(db_path)) as second:
        healthy = httpx.get(f"{first.url}/api/healthz")

    assert second.url == first.url
    assert (healthy.status_code, healthy.json()) == (200, {"status": "ok"})

"""The web fixtures server, its control API, and the real MCP fetch server."""

import asyncio
import http.client
import json
import shutil
import sys
import threading
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

from sophos_lab.standins.webfixtures import WebFixturesControl, start_web_fixtures, stop_server

WEB = Path(__file__).resolve().parent.parent / "data" / "web"


@contextmanager
def running(root, log_file=None):
    proc, url = start_web_fixtures(root, log_file=log_file)
    try:
        yield WebFixturesControl(url)
    finally:
        stop_server(proc)


@pytest.fixture
def site(tmp_path):
    """The shipped pages under tmp/www, next to a file that must stay private."""
    root = tmp_path / "www"
    shutil.copytree(WEB, root)
    (root / "notes").mkdir()
    (root / "notes" / "draft.html").write_text("<p>draft</p>")
    (tmp_path / "secret.txt").write_text("private")
    with running(root, log_file=tmp_path / "access.jsonl") as control:
        yield control


def get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.status, response.read().decode()


def raw_status(control, path):
    """Status for a request target sent exactly as given (urllib would tidy it)."""
    address = urlsplit(control.url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=5)
    try:
        connection.request("GET", path)
        with connection.getresponse() as response:
            return response.status
    finally:
        connection.close()


def test_counts_gets_per_path_but_not_control_requests(site, tmp_path):
    for _ in range(2):
        assert get(site.page_url("wal.html"))[0] == 200
    status, body = get(site.page_url("/"))
    assert "<title>Example Domain</title>" in body
    assert site.hits("/wal.html") == 2
    assert site.hits("/wal.html") == 2
    assert site.hits("/index.html") == 0
    entries = site.entries()
    assert [(e["method"], e["path"], e["status"]) for e in entries] == [
        ("GET", "/wal.html", 200), ("GET", "/wal.html", 200), ("GET", "/", 200)
    ]
    assert entries[0]["user_agent"].startswith("Python-urllib")
    logged = (tmp_path / "access.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in logged] == entries


def test_robots_txt_allows_everyone(site, tmp_path):
    assert get(site.page_url("robots.txt"))[1] == (WEB / "robots.txt").read_text()
    empty = tmp_path / "empty"
    empty.mkdir()
    with running(empty) as bare:
        assert get(bare.page_url("robots.txt")) == (200, "User-agent: *\nAllow: /\n")


@pytest.mark.parametrize("path", [
    "/../secret.txt",
    "/%2e%2e/secret.txt",
    "/notes/../../secret.txt",
    "/notes/",
    "/notes",
    "/missing.html",
    "/%00",
])
def test_no_traversal_listing_or_missing_pages(site, path):
    assert raw_status(site, path) == 404


def test_held_request_waits_for_release(site):
    site.hold("/wal.html")
    finished = threading.Event()
    replies = []

    def fetch():
        try:
            replies.append(get(site.page_url("wal.html")))
        finally:
            finished.set()

    threading.Thread(target=fetch, daemon=True).start()
    try:
        assert site.wait_held(timeout=10) == "/wal.html"
        assert not finished.is_set()
        assert site.hits("/wal.html") == 0  # logged once answered
        assert site.release() == 1
    finally:
        site.release()
    assert finished.wait(timeout=10)
    status, body = replies[0]
    assert status == 200 and "Write-Ahead Logging" in body
    # A hold is one-shot: the next request is answered at once.
    assert get(site.page_url("wal.html"), timeout=5)[0] == 200
    assert site.hits("/wal.html") == 2


def test_wait_held_times_out_when_nothing_is_held(site):
    with pytest.raises(TimeoutError, match="no request reached a held path"):
        site.wait_held(timeout=0.1)


async def fetch_with_mcp(url):
    server = StdioServerParameters(
        command=sys.executable,
        args=["-m", "mcp_server_fetch", "--allow-private-ips"],
        # Without node on PATH, readabilipy uses its Python extractor instead
        # of installing its JavaScript one on first use.
        env={"PATH": str(Path(sys.executable).parent)},
    )
    async with stdio_client(server) as (read, write):
        async with ClientSession(read, write) as session:
            await session.initialize()
            return await session.call_tool("fetch", {"url": url, "max_length": 50000})


def test_fetch_server_reads_fixture_page(site):
    result = asyncio.run(fetch_with_mcp(site.page_url("wal.html")))
    assert not result.isError, result.content
    text = result.content[0].text
    assert "Write-Ahead Logging" in text
    assert "SQLite's WAL mode" in text and "point-in-time recovery" in text
    assert site.hits("/wal.html") == 1
    assert site.hits("/robots.txt") == 1
    assert {e["user_agent"] for e in site.entries()} == {
        "ModelContextProtocol/1.0 (Autonomous; +https://github.com/modelcontextprotocol/servers)"
    }

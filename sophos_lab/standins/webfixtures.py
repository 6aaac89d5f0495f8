"""Static web pages on loopback, for agents that fetch URLs in the lab.

Run it with::

    python -m sophos_lab.standins.webfixtures --root DIR [--port 0] [--log FILE]

It serves the files under ``--root`` (``/`` and paths ending in ``/`` serve
that directory's ``index.html``; no listings; nothing outside the root),
answers ``/robots.txt`` with "allow everyone" unless the root has its own,
and logs every request. A control API under ``/_fixtures/`` counts hits,
can hold the next request for a page until released, and waits until a
page's requests are logged (see ``WebFixturesControl``).
"""

from __future__ import annotations

import argparse
import mimetypes
import subprocess
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

from sophos_lab.standins._httpkit import Holds, JsonHandler, RequestLog, call, long_poll, now_iso, serve
from sophos_lab.standins._proc import spawn_module, stop_server

__all__ = ["WebFixturesControl", "start_web_fixtures", "stop_server"]

ALLOW_ALL = b"User-agent: *\nAllow: /\n"
CLIENT_GONE = 499  # the request was held and its client hung up (nginx's code)


class WebFixturesServer(ThreadingHTTPServer):
    """The HTTP server, holding the root, the access log and the hold points."""

    daemon_threads = True

    def __init__(
        self, address: tuple[str, int], root: str | Path, log: RequestLog | None = None
    ) -> None:
        super().__init__(address, _Handler)
        self.root = Path(root).resolve()
        self.log = log or RequestLog()
        self.holds = Holds()

    def server_close(self) -> None:
        self.holds.close()
        super().server_close()

    def page(self, url_path: str) -> bytes | None:
        """The file served at ``url_path``, or None if there is none."""
        relative = unquote(url_path).lstrip("/")
        if relative == "" or relative.endswith("/"):
            relative += "index.html"
        try:
            path = (self.root / relative).resolve()
        except (OSError, ValueError):  # e.g. an encoded NUL byte
            return None
        if path.is_relative_to(self.root) and path.is_file():
            return path.read_bytes()
        return ALLOW_ALL if url_path == "/robots.txt" else None

    def hits(self, path: str) -> int:
        """How many GET requests for ``path`` have been answered (or abandoned)."""
        return sum(
            1 for e in self.log.entries()
            if e["method"] == "GET" and urlsplit(e["path"]).path == path
        )


class _Handler(JsonHandler):
    server: WebFixturesServer

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        if url.path == "/_fixtures/hits":
            if "path" in query:
                path = query["path"][0]
                self.send_json(200, {"path": path, "count": self.server.hits(path)})
            else:
                self.send_json(200, {"entries": self.server.log.entries()})
        elif url.path == "/_fixtures/wait_held":
            self.answer_wait(self.server.holds, query, "held")
        elif url.path == "/_fixtures/wait_logged" and "path" in query:
            self._wait_logged(query["path"][0], int(query.get("count", ["1"])[0]),
                              float(query.get("timeout", ["10"])[0]))
        elif url.path.startswith("/_fixtures/"):
            self.send_json(404, {"error": f"no control endpoint {url.path}"})
        else:
            self._serve_page(url.path)

    def do_HEAD(self) -> None:
        self._serve_page(urlsplit(self.path).path, with_body=False)

    def do_POST(self) -> None:
        path = urlsplit(self.path).path
        body = self.read_json()
        if path == "/_fixtures/hold":
            if isinstance(body.get("path"), str):
                self.server.holds.arm(body["path"])
                self.send_json(200, {"holding": body["path"]})
            else:
                self.send_json(400, {"error": 'expected a body like {"path": "/wal.html"}'})
        elif path == "/_fixtures/release":
            self.send_json(200, {"released": self.server.holds.release()})
        else:
            self.send_json(404, {"error": f"no control endpoint {path}"})

    def _wait_logged(self, path: str, count: int, timeout: float) -> None:
        """Answer once ``count`` GET requests for ``path`` are logged (answered or abandoned), else 408."""
        logged = self.server.log.wait_count(
            lambda e: e["method"] == "GET" and urlsplit(e["path"]).path == path, count, timeout)
        self.send_json(200 if logged >= count else 408, {"path": path, "count": logged})

    def _serve_page(self, path: str, with_body: bool = True) -> None:
        if not self.server.holds.hold_if_armed(path, self.connection):
            self._record(CLIENT_GONE)
            self.close_connection = True
            return
        content = self.server.page(path)
        status = 404 if content is None else 200
        if content is None:
            content, content_type = b"Not found\n", "text/plain; charset=utf-8"
        else:
            content_type = _content_type(path)
        self._record(status)
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(content)))
        self.end_headers()
        if with_body:
            self.wfile.write(content)

    def _record(self, status: int) -> None:
        self.server.log.add({
            "time": now_iso(),
            "method": self.command,
            "path": self.path,
            "status": status,
            "user_agent": self.headers.get("User-Agent"),
        })


def _content_type(path: str) -> str:
    if path.endswith("/"):
        path += "index.html"
    guessed = mimetypes.guess_type(path)[0] or "application/octet-stream"
    return f"{guessed}; charset=utf-8" if guessed.startswith("text/") else guessed


# --- parent side ------------------------------------------------------------


@dataclass(frozen=True)
class WebFixturesControl:
    """A client for a running web fixtures server's control API."""

    url: str

    def page_url(self, name: str) -> str:
        """The full URL of page ``name`` (e.g. ``"wal.html"``)."""
        return f"{self.url}/{name.lstrip('/')}"

    def hits(self, path: str) -> int:
        """How many times ``path`` (e.g. ``"/wal.html"``) was fetched with GET."""
        return call(f"{self.url}/_fixtures/hits?path={quote(path)}")[1]["count"]

    def entries(self) -> list[dict]:
        """The whole access log, oldest first."""
        return call(f"{self.url}/_fixtures/hits")[1]["entries"]

    def hold(self, path: str) -> None:
        """Hold the next request for ``path`` before it is answered."""
        call(f"{self.url}/_fixtures/hold", {"path": path})

    def wait_held(self, timeout: float = 60.0) -> str:
        """Block until a request is being held; return its path."""
        return long_poll(
            f"{self.url}/_fixtures/wait_held", "held", timeout,
            "no request reached a held path (was hold() called with the exact path, e.g. '/wal.html'?)",
        )

    def release(self) -> int:
        """Answer every held request; return how many there were."""
        return call(f"{self.url}/_fixtures/release", {})[1]["released"]

    def wait_logged(self, path: str, count: int, timeout: float = 60.0) -> int:
        """Block until ``count`` GET requests for ``path`` are in the log (a released request is
        logged once it is answered, or abandoned by its client); how many are."""
        status, body = call(f"{self.url}/_fixtures/wait_logged?path={quote(path)}&count={count}&timeout={timeout}",
                            timeout=timeout + 10)
        if status != 200:
            raise TimeoutError(f"{body['count']} requests for {path} logged within {timeout} s, not {count}")
        return body["count"]


def start_web_fixtures(
    root: str | Path, log_file: str | Path | None = None, port: int = 0
) -> tuple[subprocess.Popen, str]:
    """Start the server in a child process; return it and its base URL."""
    args = ["--root", str(root), "--port", str(port)]
    if log_file is not None:
        args += ["--log", str(log_file)]
    proc, ready = spawn_module("sophos_lab.standins.webfixtures", args)
    return proc, ready["url"]


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(
        prog="python -m sophos_lab.standins.webfixtures", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--root", required=True, type=Path, help="directory of pages")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--log", type=Path, help="append a JSON line per request here")
    args = parser.parse_args(argv)
    if not args.root.is_dir():
        parser.error(f"--root {args.root} is not a directory")
    serve(WebFixturesServer((args.host, args.port), args.root, RequestLog(args.log)))


if __name__ == "__main__":
    main()

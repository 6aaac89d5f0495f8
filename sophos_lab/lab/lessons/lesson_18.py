"""Lesson 18, many learners on one server: the learners' HTTP clients, the routes Bob tries Alice's id
on, the memory files per user, and the deletion of a user.

Read any of them in the lesson with `??`, e.g. `lesson.attempt??`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pandas as pd

from ...runtime import users
from ...runtime.storage import open_storage
from ...runtime.storage.blocking import Blocking
from ...runtime.tools import user_memory_path
from ..children import LabServer, child_environment, sse_events
from ..harness import Lab

ROUTES: list[tuple[str, str, dict[str, Any] | None]] = [
    ("GET", "/api/conversations/{c}", None),
    ("GET", "/api/conversations/{c}/runs", None),
    ("GET", "/api/conversations/{c}/export", None),
    ("GET", "/api/conversations/{c}/export?format=jsonl", None),
    ("POST", "/api/chat", {"message": "What did Alice teach it?", "conversation": "{c}"}),
    ("POST", "/api/chat", {"resume": True, "conversation": "{c}"}),
    ("POST", "/api/conversations/{c}/cancel", {}),
    ("POST", "/api/conversations/{c}/approve", {}),
    ("POST", "/api/conversations/{c}/reject", {}),
]
"""The 9 HTTP routes that take a conversation's id (`{c}`): method, path and JSON body (None: no body)."""


def client(server: LabServer, token: str | None = None) -> httpx.Client:
    """An HTTP client of `server`, sending `token` on every request (None: no token), as one
    learner's browser would."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=server.url, headers=headers, timeout=60)


def follow(who: httpx.Client, conversation: str) -> dict[str, Any] | None:
    """Follow the conversation's run as `who` (its SSE stream, `GET /api/chat`) to its final event
    (`end` or `chat-error`), and return that event."""
    with who.stream("GET", "/api/chat", params={"conversation": conversation},
                    timeout=httpx.Timeout(60, read=None)) as response:
        for event in sse_events(response.iter_lines()):
            if event["event"] in ("end", "chat-error"):
                return event
    return None


def ask(who: httpx.Client, message: str, conversation: str | None = None) -> tuple[str, dict[str, Any] | None]:
    """`who` sends `message` (a new conversation, or the next turn of `conversation`) and follows the
    run to its end: the conversation's id and the run's final event."""
    started = who.post("/api/chat", json={"message": message, "conversation": conversation})
    started.raise_for_status()
    conversation = started.json()["conversation"]
    return conversation, follow(who, conversation)


def outcome(final: dict[str, Any]) -> str:
    """A final event in one word: an `end`'s status, or a `chat-error`'s code."""
    return final["data"]["status"] if final["event"] == "end" else final["data"]["code"]


def last_answer(who: httpx.Client, conversation: str) -> str:
    """The text of the conversation's last message, as `who` reads it."""
    return who.get(f"/api/conversations/{conversation}").json()["messages"][-1]["content"]


def titles(who: httpx.Client) -> list[str]:
    """The titles of the conversations in `who`'s list (`GET /api/conversations`)."""
    return [c["title"] for c in who.get("/api/conversations").json()["conversations"]]


def attempt(who: httpx.Client, conversation: str) -> pd.DataFrame:
    """Every route of `ROUTES` with `conversation`'s id, as `who`: one row per route, its HTTP
    status and its body with the id blanked (`<id>`), so that two ids' answers compare."""
    rows = []
    for method, path, body in ROUTES:
        payload = None if body is None else json.loads(json.dumps(body).replace("{c}", conversation))
        response = who.request(method, path.format(c=conversation), json=payload)
        route = f"{method} {path.split('?')[0]}" + ("?format=jsonl" if "jsonl" in path else "")
        rows.append({"route": route + (" (resume)" if payload and payload.get("resume") else ""),
                     "status": response.status_code, "body": response.text.replace(conversation, "<id>")})
    return pd.DataFrame(rows)


def snapshot(instructor: httpx.Client, conversation: str) -> tuple[Any, Any]:
    """The conversation and its runs, as the instructor's token reads them (it sees every user's)."""
    return (instructor.get(f"/api/conversations/{conversation}").json(),
            instructor.get(f"/api/conversations/{conversation}/runs").json())


def memory_files(lab: Lab, names: list[str], **env: str) -> dict[str, Path]:
    """Each user's memory file (by user name), on the database that `env` names: the file the
    memory server of a run on that user's conversation reads and writes."""
    settings = lab.settings(**env)
    with Blocking(lambda: open_storage(settings)) as store:
        ids = {name: store.call(users.find_user, name).id for name in names}
    return {name: user_memory_path(settings, user) for name, user in ids.items()}


def holds(path: Path, text: str) -> bool:
    """Whether the file at `path` exists and contains `text`."""
    return path.exists() and text in path.read_text()


def delete_user(lab: Lab, name: str, database: Path, dry_run: bool = False, **env: str) -> subprocess.CompletedProcess:
    """Run `sophos-lab user delete NAME --database DATABASE` (with `--dry-run`: say what would go,
    change nothing), as the instructor would in a shell; its exit code and output."""
    command = [sys.executable, "-m", "sophos_lab.cli", "user", "delete", name, "--database", str(database)]
    return subprocess.run([*command, *(["--dry-run"] if dry_run else [])], capture_output=True, text=True,
                          env=child_environment(lab.env(**env)))

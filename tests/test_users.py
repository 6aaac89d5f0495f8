"""Many users on one server: every route answers a conversation only for its owner.

A real `sophos-lab serve` (`lab.server()`) on a SQLite file and then on PostgreSQL, with users
added as `sophos-lab user add` adds them. Alice owns a conversation; every route and method
that names it is asked by Alice, by Bob (another user), with no token, with Carol's revoked
token and with a token nobody has. Only Alice gets an answer. Bob gets exactly the answer of an
id that does not exist; the others get a 401; and for none of them is anything written (every
table of the database, rows and all, is the same before and after; `owners` aside, whose lease
the server renews on its own).
"""

from __future__ import annotations

import json
import sqlite3
from urllib.parse import quote

import httpx
import pytest
from conftest import BACKENDS, database_env, sophos_lab_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sophos_lab.lab.children import child_environment
from sophos_lab.runtime import users
from conftest import open_store
from sophos_lab.runtime.storage.models import utc_now
from sophos_lab.runtime.tools import user_memory_path

INSTRUCTOR = "the-instructor-s-long-random-secret"
UNKNOWN = "0d4a3f0e-1b2c-4d5e-8f60-718293a4b5c6"
EXAMPLES = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


class Classroom:
    """The module's server, its users' tokens and Alice's conversation."""

    def __init__(self, lab, server, database: dict[str, str]) -> None:
        self.lab, self.server, self.database = lab, server, database
        self.tokens = {name: lab.add_user(name, **database) for name in ("alice", "bob", "carol")}
        store = open_store(lab.settings(**database))
        try:
            store.call(users.revoke_user, "carol", utc_now())
        finally:
            store.close()
        self.tokens["nobody"] = "a-token-nobody-was-given"
        started = self.request("alice", "POST", "/api/chat", json={"message": "hello"},
                               headers={"Idempotency-Key": "alice-first"})
        assert started.status_code == 200, started.text
        self.conversation = started.json()["conversation"]
        self.wait_ended(self.conversation)

    def user_id(self, name: str) -> str:
        store = open_store(self.lab.settings(**self.database))
        try:
            return store.call(users.find_user, name).id
        finally:
            store.close()

    def ask_to_the_end(self, who: str, message: str, conversation: str | None = None) -> dict:
        """`who` sends `message` and the run ends: the conversation's detail, as `who` reads it."""
        started = self.request(who, "POST", "/api/chat", json={"message": message, "conversation": conversation})
        assert started.status_code == 200, started.text
        conversation = started.json()["conversation"]
        self.wait_ended(conversation)
        return self.request(who, "GET", f"/api/conversations/{conversation}").json()

    def request(self, who: str | None, method: str, path: str, **kwargs) -> httpx.Response:
        headers = {} if who is None else {"Authorization": f"Bearer {self.tokens[who]}"}
        headers.update(kwargs.pop("headers", {}))
        return httpx.request(method, self.server.url + path, headers=headers, timeout=60, **kwargs)

    def wait_ended(self, conversation: str) -> dict:
        """The instructor follows the run to its end (the instructor's token sees every run)."""
        self.server.follow(conversation)
        final = self.server.wait_final()
        assert (final["event"], final["data"].get("status")) == ("end", "completed"), final
        return final

    def snapshot(self) -> dict[str, list]:
        """Every row of every table but `owners`, in a stable order."""
        url = self.database.get("DATABASE_URL")
        if url:
            import psycopg

            with psycopg.connect(url) as conn:
                names = [row[0] for row in conn.execute(
                    "SELECT tablename FROM pg_tables WHERE schemaname = 'public' AND tablename <> 'owners'")]
                return {name: sorted(map(repr, conn.execute(f'SELECT * FROM "{name}"'))) for name in sorted(names)}
        conn = sqlite3.connect(f"file:{self.database['DATABASE_PATH']}?mode=ro", uri=True)
        try:
            names = [row[0] for row in conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name <> 'owners'")]
            return {name: sorted(map(repr, conn.execute(f'SELECT * FROM "{name}"'))) for name in sorted(names)}
        finally:
            conn.close()


@pytest.fixture(scope="module", params=BACKENDS)
def classroom(request, lab, tmp_path_factory):
    database = database_env(request, request.param, tmp_path_factory.mktemp("users") / "sophos.db")
    with lab.server(**database, SOPHOS_LAB_TOKEN=INSTRUCTOR) as server:
        yield Classroom(lab, server, database)


# Every route and method that names a conversation: (name, method, path, JSON body).
ROUTES = [
    ("detail", "GET", "/api/conversations/{id}", None),
    ("runs", "GET", "/api/conversations/{id}/runs", None),
    ("markdown export", "GET", "/api/conversations/{id}/export", None),
    ("jsonl export", "GET", "/api/conversations/{id}/export?format=jsonl", None),
    ("stream", "GET", "/api/chat?conversation={id}", None),
    ("next turn", "POST", "/api/chat", {"message": "What did I say?", "conversation": "{id}"}),
    ("resume", "POST", "/api/chat", {"resume": True, "conversation": "{id}"}),
    ("cancel", "POST", "/api/conversations/{id}/cancel", None),
    ("approve", "POST", "/api/conversations/{id}/approve", {}),
    ("reject", "POST", "/api/conversations/{id}/reject", {"reason": "no"}),
]
# What Alice, the owner, gets: an answer about her conversation (a 409 is one: nothing to resume).
OWNER_STATUS = {"detail": 200, "runs": 200, "markdown export": 200, "jsonl export": 200, "stream": 200,
                "next turn": 200, "resume": 409, "cancel": 409, "approve": 409, "reject": 409}


def ask(classroom: Classroom, who: str | None, route: tuple, conversation: str) -> httpx.Response:
    _, method, path, body = route
    if body is not None:
        body = json.loads(json.dumps(body).replace("{id}", conversation))
    return classroom.request(who, method, path.replace("{id}", conversation),
                             **({} if body is None else {"json": body}))


def answer(response: httpx.Response, conversation: str) -> tuple[int, str]:
    """The response as the client reads it, with the id it asked about written as <id>."""
    return response.status_code, response.text.replace(conversation, "<id>")


@pytest.mark.parametrize("route", ROUTES, ids=[route[0] for route in ROUTES])
def test_another_user_gets_the_answer_of_an_id_that_does_not_exist_and_writes_nothing(classroom, route):
    before = classroom.snapshot()
    theirs = ask(classroom, "bob", route, classroom.conversation)
    after = classroom.snapshot()
    unknown = ask(classroom, "bob", route, UNKNOWN)

    assert answer(theirs, classroom.conversation) == answer(unknown, UNKNOWN)
    assert theirs.status_code in (200, 404)  # 200: the stream, whose refusal is its one event
    assert "NOT_FOUND" in theirs.text
    assert after == before


@pytest.mark.parametrize("who", ["no token", "carol", "nobody"])
@pytest.mark.parametrize("route", ROUTES, ids=[route[0] for route in ROUTES])
def test_without_a_valid_token_every_route_is_a_401_and_writes_nothing(classroom, route, who):
    before = classroom.snapshot()
    refused = ask(classroom, None if who == "no token" else who, route, classroom.conversation)

    assert refused.status_code == 401
    assert refused.headers["www-authenticate"] == "Bearer"
    assert refused.json()["error"]["code"] == "UNAUTHORIZED"
    assert classroom.conversation not in refused.text
    assert classroom.snapshot() == before


def test_the_revoked_and_the_unknown_token_are_told_apart_and_no_token_is_told_what_to_send(classroom):
    assert classroom.request("carol", "GET", "/api/conversations").json()["error"]["message"] == (
        "The token in Authorization was revoked (user 'carol').")
    assert classroom.request("nobody", "GET", "/api/conversations").json()["error"]["message"] == (
        "The token in Authorization is not this server's.")
    assert classroom.request(None, "GET", "/api/conversations").json()["error"]["message"] == (
        "This server has users: send Authorization: Bearer <your token> (the one "
        "`sophos-lab user add NAME` printed).")


@pytest.mark.parametrize("route", ROUTES, ids=[route[0] for route in ROUTES])
def test_the_owner_gets_an_answer_on_every_route(classroom, route):
    mine = ask(classroom, "alice", route, classroom.conversation)

    assert mine.status_code == OWNER_STATUS[route[0]], mine.text
    assert "NOT_FOUND" not in mine.text
    if route[0] == "next turn":
        classroom.wait_ended(classroom.conversation)


def test_each_user_lists_their_own_conversations_and_the_instructor_every_one(classroom):
    bobs = classroom.request("bob", "POST", "/api/chat", json={"message": "hello from bob"}).json()["conversation"]
    classroom.wait_ended(bobs)

    def listed(who, **params):
        response = classroom.request(who, "GET", "/api/conversations", params=params)
        return [c["id"] for c in response.json()["conversations"]]

    instructor = {c["id"] for c in classroom.server.request("GET", "/api/conversations").json()["conversations"]}
    assert listed("bob") == listed("bob", limit=1) == [bobs]
    assert classroom.conversation in listed("alice") and bobs not in listed("alice")
    assert listed("alice", limit=1)[0] in listed("alice")
    assert {classroom.conversation, bobs} <= instructor


def test_idempotency_keys_are_each_user_s_own(classroom):
    """Bob sending Alice's key gets no replay of Alice's run: his request is his own."""
    first = classroom.request("alice", "POST", "/api/chat", json={"message": "hello"},
                              headers={"Idempotency-Key": "alice-first"})
    bobs = classroom.request("bob", "POST", "/api/chat", json={"message": "hello"},
                             headers={"Idempotency-Key": "alice-first"})

    assert (first.status_code, first.headers.get("idempotent-replayed")) == (200, "true")
    assert first.json()["conversation"] == classroom.conversation
    assert bobs.status_code == 200 and "idempotent-replayed" not in bobs.headers
    assert bobs.json()["conversation"] != classroom.conversation
    classroom.wait_ended(bobs.json()["conversation"])
    again = classroom.request("bob", "POST", "/api/chat", json={"message": "hello"},
                              headers={"Idempotency-Key": "alice-first"})
    assert again.json() == bobs.json() and again.headers["idempotent-replayed"] == "true"


def test_the_stream_of_another_user_s_live_run_sends_not_a_byte_of_it(classroom):
    lab = classroom.lab
    lab.web.hold("/index.html")
    try:
        started = classroom.request("alice", "POST", "/api/chat", json={
            "message": f"Fetch {lab.page('index.html')}", "conversation": classroom.conversation})
        assert started.status_code == 200, started.text
        lab.web.wait_held()  # the run is in its tools step: it has events to send
        bobs = classroom.request("bob", "GET", f"/api/chat?conversation={classroom.conversation}")
        unknown = classroom.request("bob", "GET", f"/api/chat?conversation={UNKNOWN}")
        cancel = classroom.request("bob", "POST", f"/api/conversations/{classroom.conversation}/cancel")
    finally:
        lab.web.release()

    assert answer(bobs, classroom.conversation) == answer(unknown, UNKNOWN)
    assert "run-start" not in bobs.text and "tool" not in bobs.text
    assert cancel.status_code == 404
    classroom.wait_ended(classroom.conversation)  # Bob's cancel stopped nothing


# Bytes a header value may hold (HTTP's field-content: visible, obs-text, inner spaces and tabs).
FIELD_BYTES = {*range(0x21, 0x7f), *range(0x80, 0x100), 0x20, 0x09}
header_tokens = st.binary(min_size=1, max_size=80).map(lambda b: bytes(c for c in b if c in FIELD_BYTES).strip(b" \t")).filter(bool)


@EXAMPLES
@given(token=header_tokens)
def test_any_other_token_is_a_401_that_writes_nothing(classroom, token):
    before = classroom.snapshot()
    header = httpx.get(classroom.server.url + "/api/conversations",
                       headers=[(b"Authorization", b"Bearer " + token)], timeout=30)
    query = httpx.get(classroom.server.url + "/api/chat",
                      params={"conversation": classroom.conversation, "token": token.decode("latin-1")}, timeout=30)

    assert header.status_code == query.status_code == 401
    assert classroom.conversation not in header.text + query.text
    assert classroom.snapshot() == before


ids = st.one_of(
    st.uuids().map(str),
    st.sampled_from([str.upper, str.lower, str.title, lambda s: s]).map(lambda case: ("case", case)),
    st.text(min_size=1, max_size=40).filter(lambda text: text.strip(".") != ""),  # not a dot segment
)


@EXAMPLES
@given(asked=ids)
def test_bob_never_reads_alice_s_conversation_by_any_spelling_of_its_id(classroom, asked):
    if isinstance(asked, tuple):
        asked = asked[1](classroom.conversation)
    path = "/api/conversations/" + quote(asked, safe="")
    bobs = classroom.request("bob", "GET", path)

    assert bobs.status_code in (400, 404)
    assert "hello" not in bobs.text
    if bobs.status_code == 404:
        assert bobs.json()["error"]["code"] == "NOT_FOUND"
    if asked.lower() == classroom.conversation:
        assert classroom.request("alice", "GET", path).status_code == 200


def test_a_taken_or_malformed_user_name_is_refused_with_nothing_changed(lab, tmp_path):
    token = lab.add_user("ada", DATABASE_PATH=str(tmp_path / "users.db"))
    assert len(token) >= 40

    with pytest.raises(Exception, match="There is a user 'ada' already; nothing was changed."):
        lab.add_user("ada", DATABASE_PATH=str(tmp_path / "users.db"))
    with pytest.raises(Exception, match="Invalid user name"):
        lab.add_user("ada lovelace", DATABASE_PATH=str(tmp_path / "users.db"))
    store = open_store(lab.settings(DATABASE_PATH=str(tmp_path / "users.db")))
    try:
        assert [user.name for user, _ in store.call(users.list_users)] == ["ada"]
    finally:
        store.close()



REMEMBER = "Remember this: the Sophos lab codename is BLUE-HERON."
RECALL = "Read your whole knowledge graph: what is the Sophos lab codename?"


def last_answer(detail: dict) -> str:
    return detail["messages"][-1]["content"]


def test_a_fact_one_learner_teaches_is_never_read_by_another(classroom):
    """Each user's memory server reads and writes that user's file only (the real memory server)."""
    classroom.ask_to_the_end("alice", REMEMBER)
    bobs = classroom.ask_to_the_end("bob", RECALL)
    alices = classroom.ask_to_the_end("alice", RECALL)

    assert last_answer(bobs) == "My knowledge graph holds no codename for the Sophos lab, so I do not know it."
    assert "BLUE-HERON" not in json.dumps(bobs)
    assert last_answer(alices) == "Your knowledge graph says that the Sophos lab codename is BLUE-HERON."
    settings = classroom.lab.settings(**classroom.database)
    assert "BLUE-HERON" in user_memory_path(settings, classroom.user_id("alice")).read_text()
    bob_file = user_memory_path(settings, classroom.user_id("bob"))
    assert not bob_file.exists() or "BLUE-HERON" not in bob_file.read_text()
    shared = settings.memory_file_path
    assert not shared.exists() or "BLUE-HERON" not in shared.read_text()


def test_deleting_a_user_removes_their_conversations_memory_and_token_and_nobody_else_s(classroom):
    classroom.tokens["dave"] = classroom.lab.add_user("dave", **classroom.database)
    daves = classroom.ask_to_the_end("dave", REMEMBER)["conversation"]["id"]
    dave = classroom.user_id("dave")
    settings = classroom.lab.settings(**classroom.database)
    alices = {c["id"] for c in classroom.request("alice", "GET", "/api/conversations").json()["conversations"]}
    cli = ["user", "delete", "dave"]
    env = child_environment(classroom.lab.env(**classroom.database))

    dry = sophos_lab_cli(*cli, "--dry-run", env=env)
    still = classroom.request("dave", "GET", f"/api/conversations/{daves}")
    deleted = sophos_lab_cli(*cli, env=env)
    gone = classroom.request("dave", "GET", "/api/conversations")
    everyone = classroom.server.request("GET", f"/api/conversations/{daves}")

    assert dry.returncode == 0, dry.stderr
    assert "user dave would be deleted, with 1 conversation(s); nothing was changed" in dry.stdout
    assert still.status_code == 200
    assert deleted.returncode == 0, deleted.stderr
    assert daves in deleted.stdout and "user dave deleted, with 1 conversation(s)" in deleted.stdout
    assert gone.status_code == 401 and gone.json()["error"]["message"] == "The token in Authorization is not this server's."
    assert everyone.status_code == 404  # the instructor finds nothing either: the rows are gone
    assert not user_memory_path(settings, dave).parent.exists()
    assert {c["id"] for c in classroom.request("alice", "GET", "/api/conversations").json()["conversations"]} == alices
    again = sophos_lab_cli(*cli, env=env)
    assert again.returncode == 1 and "No user 'dave'" in again.stderr

"""The HTTP API as a client meets it: a real `sophos-lab serve` process (`lab.server()`) with the
scripted model, driven with httpx.

Status codes, the error envelope and the order of checks of `POST /api/chat` are the original's
(`{"error": {"code", "message"}}`); the conversation, export, health and readiness endpoints
too. Beyond the original: the runs of a conversation, an `Idempotency-Key` kept in the database,
the token rule, and an honest SIGTERM. A server killed with SIGKILL leaves a conversation a new
server resumes.

The module's server has a database of its own; the lab (model, web pages) is the session's, so
counts of model calls and fetches are differences.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from conftest import BACKENDS, database_env

from sophos_lab.lab.children import child_environment
from sophos_lab.lab.harness import dead_port_url
from sophos_lab.lab.inspect import peek_runs

SUMMARISE = "Fetch {url} and summarize it in 12 detailed bullet points."
UNKNOWN = "0d4a3f0e-1b2c-4d5e-8f60-718293a4b5c6"
MAX_BODY = 4096


@pytest.fixture(scope="module", params=BACKENDS)
def server(request, lab, tmp_path_factory):
    """One server for the module's tests, on a SQLite file and then on a PostgreSQL database."""
    database = database_env(request, request.param, tmp_path_factory.mktemp("server") / "sophos.db")
    with lab.server(**database, SOPHOS_LAB_MAX_BODY_BYTES=str(MAX_BODY)) as server:
        yield server


def post_chat(server, body=None, content: bytes | None = None, headers=None) -> httpx.Response:
    if content is not None:
        return server.request("POST", "/api/chat", content=content, headers=headers or {})
    return server.request("POST", "/api/chat", json=body, headers=headers or {})


def refusal(response: httpx.Response) -> tuple[int, str, str]:
    error = response.json()["error"]
    assert set(error) == {"code", "message"}
    return response.status_code, error["code"], error["message"]


def conversation_ids(server) -> list[str]:
    return [c["id"] for c in server.request("GET", "/api/conversations").json()["conversations"]]


def finished(server, message: str, conversation: str | None = None) -> str:
    """Send `message` and follow the run to its end; the conversation."""
    server.chat(message, conversation)
    final = server.wait_final()
    assert (final["event"], final["data"].get("status")) == ("end", "completed"), final
    return final["data"]["conversation"]


def roles(detail: dict) -> list[str]:
    return [message["role"] for message in detail["messages"]]


# --- POST /api/chat: the order of checks ---------------------------------------------------


ORDER_OF_CHECKS = [
    # what is wrong, the body, and the answer: each check in the original's order, so a body
    # that breaks two rules gets the earlier one's answer.
    ("not JSON", b"message=hello", 400, "BAD_REQUEST", "Request body must be JSON"),
    ("not UTF-8", b'{"message": "\xff"}', 400, "BAD_REQUEST", "Request body must be JSON"),
    ("JSON but not an object", b'["hello"]', 400, "BAD_REQUEST", "Request body must be a JSON object"),
    ("no message", {}, 400, "BAD_REQUEST", "Message is required"),
    ("a blank message", {"message": "  \n "}, 400, "BAD_REQUEST", "Message is required"),
    ("a blank message, before a bad id", {"message": "", "conversation": "not-a-uuid"},
     400, "BAD_REQUEST", "Message is required"),
    ("resume is only the literal true", {"resume": "true", "conversation": UNKNOWN},
     400, "BAD_REQUEST", "Message is required"),
    ("a resume without a conversation", {"resume": True}, 400, "BAD_REQUEST", "A conversation is required to resume"),
    ("a malformed id", {"message": "hello", "conversation": "not-a-uuid"}, 400, "BAD_REQUEST", "Invalid Conversation ID"),
    ("a path for an id", {"message": "hello", "conversation": "../../etc/passwd"},
     400, "BAD_REQUEST", "Invalid Conversation ID"),
    ("an id that is not a string", {"message": "hello", "conversation": 42}, 400, "BAD_REQUEST", "Invalid Conversation ID"),
    ("a message UTF-8 cannot store", b'{"message": "\\ud800"}', 400, "BAD_REQUEST",
     "The message is not valid Unicode: a lone surrogate '\\ud800' at position 0. Nothing was stored."),
    ("an unknown id", {"message": "hello", "conversation": UNKNOWN}, 404, "NOT_FOUND", "Conversation Not Found"),
    ("a resume of an unknown id", {"resume": True, "conversation": UNKNOWN}, 404, "NOT_FOUND", "Conversation Not Found"),
]


@pytest.mark.parametrize("body, status, code, message", [case[1:] for case in ORDER_OF_CHECKS],
                         ids=[case[0] for case in ORDER_OF_CHECKS])
def test_a_refused_chat_answers_with_the_original_envelope_and_writes_nothing(server, body, status, code, message):
    before = conversation_ids(server)
    if isinstance(body, bytes):
        response = post_chat(server, content=body, headers={"Content-Type": "application/json"})
    else:
        response = post_chat(server, body)

    assert refusal(response) == (status, code, message)
    assert conversation_ids(server) == before


def test_a_body_over_the_limit_is_refused_with_413_and_nothing_is_written(server):
    before = conversation_ids(server)
    response = post_chat(server, {"message": "x" * MAX_BODY})

    assert refusal(response) == (413, "PAYLOAD_TOO_LARGE",
                                 f"Request body is larger than {MAX_BODY} bytes; nothing was stored.")
    assert conversation_ids(server) == before


def test_an_accepted_chat_answers_conversation_and_run_at_once(server):
    started = post_chat(server, {"message": "hello"})

    assert started.status_code == 200
    assert set(started.json()) == {"conversation", "run"}
    conversation, run = started.json()["conversation"], started.json()["run"]
    assert str(uuid.UUID(conversation)) == conversation and str(uuid.UUID(run)) == run
    server.follow(conversation)
    assert server.wait_final()["data"] == {"conversation": conversation, "run": run, "status": "completed"}


def test_a_next_turn_names_its_conversation_in_any_case(server):
    conversation = finished(server, "hello")
    again = post_chat(server, {"message": "hi again", "conversation": conversation.upper()})

    assert again.json()["conversation"] == conversation
    server.follow(conversation)
    assert server.wait_final()["data"]["status"] == "completed"


def test_a_busy_conversation_is_refused_with_409(server, lab):
    lab.web.hold("/index.html")
    try:
        server.chat(f"Fetch {lab.page('index.html')}")
        conversation = server.conversation()
        lab.web.wait_held()  # the run is in its tools step

        second = post_chat(server, {"message": "hello", "conversation": conversation})
        resume = post_chat(server, {"resume": True, "conversation": conversation})
    finally:
        lab.web.release()

    assert refusal(second) == refusal(resume) == (409, "SESSION_IN_PROGRESS", "Previous request still in progress")
    assert server.wait_final()["data"]["status"] == "completed"


def test_a_finished_conversation_is_not_resumable(server):
    conversation = finished(server, "hello")

    refused = post_chat(server, {"resume": True, "conversation": conversation})

    assert refusal(refused) == (409, "RUN_NOT_RESUMABLE", "Nothing to resume: the last run finished")


# --- conversations, runs and exports -----------------------------------------------------


def test_conversations_are_listed_most_recently_updated_first(server):
    older = finished(server, "hello")
    newer = finished(server, "hi there")

    listed = server.request("GET", "/api/conversations").json()["conversations"]

    assert [c["id"] for c in listed][:2] == [newer, older]
    assert listed[0] == {
        "id": newer, "title": "hi there", "createdAt": listed[0]["createdAt"],
        "updatedAt": listed[0]["updatedAt"], "messageCount": 2, "status": "completed",
    }


def test_conversations_come_in_pages_with_a_cursor_for_the_next(server):
    for text in ("one", "two", "three"):
        finished(server, text)
    everything = [c["id"] for c in server.request("GET", "/api/conversations").json()["conversations"]]

    walked, cursor = [], None
    while True:
        params = {"limit": 2} | ({"cursor": cursor} if cursor else {})
        page = server.request("GET", "/api/conversations", params=params).json()
        assert len(page["conversations"]) <= 2
        walked += [c["id"] for c in page["conversations"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break

    assert walked == everything


@pytest.mark.parametrize("params", [{"limit": "0"}, {"limit": "many"}, {"limit": "²"}, {"limit": "1001"},
                                    {"cursor": "not-a-cursor"}])
def test_a_bad_page_request_is_a_400(server, params):
    status, code, _ = refusal(server.request("GET", "/api/conversations", params=params))
    assert (status, code) == (400, "BAD_REQUEST")


def test_a_conversation_has_its_messages_from_the_checkpoint(server, lab):
    conversation = finished(server, f"Fetch {lab.page('index.html')}")

    detail = server.request("GET", f"/api/conversations/{conversation}").json()

    assert roles(detail) == ["user", "assistant", "tool", "assistant"]
    assert detail["messages"][1]["toolCalls"][0]["name"] == "fetch__fetch"
    assert (detail["messages"][2]["name"], detail["messages"][2]["status"]) == ("fetch__fetch", "success")
    assert (detail["resumable"], detail["next"]) == (False, [])
    assert detail["conversation"]["messageCount"] == len(detail["messages"])


BAD_ID_PATHS = [
    *(f"/api/conversations/{bad}{endpoint}" for bad in ("not-a-uuid", "..%2F..%2Fetc%2Fpasswd")
      for endpoint in ("", "/export", "/runs")),
    "/api/conversations/",  # the empty id
    f"/api/conversations/{UNKNOWN}/no-such-thing",
]


@pytest.mark.parametrize("path", BAD_ID_PATHS)
def test_a_bad_conversation_id_is_a_400(server, path):
    assert refusal(server.request("GET", path)) == (400, "BAD_REQUEST", "Invalid Conversation ID")


@pytest.mark.parametrize("path", ["/api/conversations/{}", "/api/conversations/{}/export",
                                  "/api/conversations/{}/runs"])
def test_an_unknown_conversation_is_a_404(server, path):
    assert refusal(server.request("GET", path.format(UNKNOWN))) == (404, "NOT_FOUND", "Conversation Not Found")


def test_the_markdown_export_is_an_attachment_named_after_the_conversation(server, lab):
    conversation = finished(server, f"Fetch {lab.page('index.html')}")

    export = server.request("GET", f"/api/conversations/{conversation}/export")
    other_format = server.request("GET", f"/api/conversations/{conversation}/export?format=pdf")

    assert export.headers["content-type"] == "text/markdown; charset=utf-8"
    assert export.headers["content-disposition"] == f'attachment; filename="{conversation}.md"'
    assert export.text.startswith(f"# Fetch {lab.page('index.html')}\n")
    assert "> **Tool call** `fetch__fetch`" in export.text
    assert other_format.text == export.text  # any format but jsonl is Markdown, as in the original


def test_the_jsonl_export_is_the_checkpoint_history_oldest_first(server, lab):
    conversation = finished(server, f"Fetch {lab.page('index.html')}")

    export = server.request("GET", f"/api/conversations/{conversation}/export?format=jsonl")

    assert export.headers["content-type"] == "application/x-ndjson; charset=utf-8"
    assert export.headers["content-disposition"] == f'attachment; filename="{conversation}.checkpoints.jsonl"'
    assert export.text.endswith("\n")
    lines = [httpx.Response(200, content=line).json() for line in export.text.splitlines()]
    assert [line["step"] for line in lines] == sorted(line["step"] for line in lines)
    assert (lines[-1]["next"], lines[-1]["message_count"], lines[-1]["last_message"]["role"]) == ([], 4, "assistant")


def test_the_runs_of_a_conversation_are_listed_in_start_order(server):
    conversation = finished(server, "hello")
    finished(server, "hi again", conversation)

    runs = server.request("GET", f"/api/conversations/{conversation}/runs").json()["runs"]

    assert [run["status"] for run in runs] == ["completed", "completed"]
    assert [run["input"][0]["content"] for run in runs] == ["hello", "hi again"]
    assert [run["steps"] for run in runs] == [1, 1]  # each ran the model once: one graph step
    assert set(runs[0]) == {"id", "conversation", "status", "startedAt", "finishedAt", "steps", "input"}


def test_unknown_paths_and_methods_answer_in_the_envelope(server):
    assert refusal(server.request("GET", "/api/nothing-here")) == (404, "NOT_FOUND", "No such endpoint: /api/nothing-here")
    wrong_method = server.request("DELETE", "/api/chat")
    assert refusal(wrong_method) == (405, "METHOD_NOT_ALLOWED", "DELETE is not allowed on /api/chat")
    assert wrong_method.headers["allow"] == "GET, HEAD, POST"


# --- Idempotency-Key ---------------------------------------------------------------------


def test_a_repeated_idempotency_key_returns_the_first_run_and_starts_nothing(server, lab):
    key = {"Idempotency-Key": f"order-{uuid.uuid4()}"}
    calls = lab.model_calls()
    first = post_chat(server, {"message": "hello"}, headers=key)
    server.follow(first.json()["conversation"])
    server.wait_final()

    again = post_chat(server, {"message": "hello"}, headers=key)

    assert again.status_code == 200
    assert again.json() == first.json()
    assert again.headers["idempotent-replayed"] == "true"
    runs = server.request("GET", f"/api/conversations/{first.json()['conversation']}/runs").json()["runs"]
    assert [run["id"] for run in runs] == [first.json()["run"]]
    assert lab.model_calls() - calls == 1


def test_an_idempotency_key_used_for_another_request_is_refused(server):
    key = {"Idempotency-Key": f"order-{uuid.uuid4()}"}
    first = post_chat(server, {"message": "hello"}, headers=key)
    server.follow(first.json()["conversation"])
    server.wait_final()

    other = post_chat(server, {"message": "hello, but otherwise"}, headers=key)

    status, code, message = refusal(other)
    assert (status, code) == (422, "IDEMPOTENCY_KEY_REUSED")
    assert first.json()["run"] in message


def test_requests_racing_with_one_key_start_one_run(server):
    key = {"Idempotency-Key": f"race-{uuid.uuid4()}"}
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda _: post_chat(server, {"message": "hello"}, headers=key), range(6)))

    assert {answer.status_code for answer in answers} == {200}
    [started] = {(a.json()["conversation"], a.json()["run"]) for a in answers}
    assert sum("idempotent-replayed" not in a.headers for a in answers) == 1
    runs = server.request("GET", f"/api/conversations/{started[0]}/runs").json()["runs"]
    assert [run["id"] for run in runs] == [started[1]]


@pytest.mark.parametrize("key", ["", "x" * 256, "two words"])
def test_a_malformed_idempotency_key_is_a_400(server, key):
    response = post_chat(server, {"message": "hello"}, headers={"Idempotency-Key": key})
    assert refusal(response) == (400, "BAD_REQUEST", "Idempotency-Key must be 1 to 255 visible ASCII characters")


# --- health, readiness, the token --------------------------------------------------------


def test_healthz_and_readyz_of_a_ready_server(server):
    assert server.request("GET", "/api/healthz").json() == {"status": "ok"}
    assert server.request("GET", "/api/readyz").json() == {"status": "ok"}


def test_probes_open_nothing_and_readyz_says_why_the_model_is_not_ready(lab, tmp_path):
    db = tmp_path / "sophos.db"
    with lab.server(OLLAMA_HOST=dead_port_url(), DATABASE_PATH=str(db)) as server:
        health = server.request("GET", "/api/healthz")
        ready = server.request("GET", "/api/readyz")
        assert not db.exists()  # neither probe opened the database

        # readyz is advisory: a run is still accepted, and fails on its stream
        server.chat("hello")
        final = server.wait_final()

    assert (health.status_code, health.json()) == (200, {"status": "ok"})
    assert (ready.status_code, ready.json()) == (503, {"status": "error", "message": "Failed to connect to Ollama"})
    assert (final["event"], final["data"]["code"]) == ("chat-error", "AGENT_FAILURE")


def test_a_server_off_loopback_without_a_token_refuses_to_start(tmp_path):
    env = child_environment({"SOPHOS_LAB_HOME": str(tmp_path)})
    env.pop("SOPHOS_LAB_TOKEN", None)
    refused = subprocess.run([sys.executable, "-m", "sophos_lab.cli", "serve", "--host", "0.0.0.0", "--port", "0"],
                             env=env, capture_output=True, text=True, timeout=60)

    assert refused.returncode == 2
    assert "refusing to listen on 0.0.0.0 without a token" in refused.stderr
    assert "SOPHOS_LAB_TOKEN" in refused.stderr
    assert not (tmp_path / "default").exists()  # it opened nothing


def test_a_server_with_users_listens_beyond_loopback_and_answers_only_a_user_s_token(lab, db_path):
    token = lab.add_user("ada", DATABASE_PATH=str(db_path))
    with lab.server(host="0.0.0.0", DATABASE_PATH=str(db_path)) as server:
        listening = [c.laddr for c in psutil.Process(server.pid).net_connections(kind="tcp")
                     if c.status == psutil.CONN_LISTEN]
        port = server.port
        anonymous = httpx.get(f"http://127.0.0.1:{port}/api/conversations")
        ada = httpx.get(f"http://127.0.0.1:{port}/api/conversations", headers={"Authorization": f"Bearer {token}"})

    assert [(address.ip, address.port) for address in listening] == [("0.0.0.0", port)]
    assert anonymous.status_code == 401
    assert (ada.status_code, ada.json()) == (200, {"conversations": []})


def test_with_a_token_every_request_must_carry_it(lab, db_path):
    with lab.server(SOPHOS_LAB_TOKEN="a-long-random-secret", DATABASE_PATH=str(db_path)) as server:
        anonymous = httpx.get(f"{server.url}/api/healthz")
        wrong = httpx.get(f"{server.url}/api/conversations", headers={"Authorization": "Bearer guess"})
        stream = httpx.get(f"{server.url}/api/chat", params={"conversation": UNKNOWN})
        right = server.request("GET", "/api/healthz")

    assert refusal(anonymous) == (401, "UNAUTHORIZED",
                                  "This server needs its token: send Authorization: Bearer <SOPHOS_LAB_TOKEN>.")
    assert anonymous.headers["www-authenticate"] == "Bearer"
    assert refusal(wrong) == (401, "UNAUTHORIZED", "The token in Authorization is not this server's.")
    assert refusal(stream)[:2] == (401, "UNAUTHORIZED")
    assert (right.status_code, right.json()) == (200, {"status": "ok"})


# --- the process: SIGTERM drains, SIGKILL leaves a conversation to resume -----------------


def test_sigterm_mid_run_ends_the_open_stream_with_shutdown_and_exits_0(lab, db_path):
    server = lab.server(DATABASE_PATH=str(db_path))
    lab.web.hold("/wal.html")
    try:
        server.chat(SUMMARISE.format(url=lab.page("wal.html")))
        conversation = server.conversation()
        lab.web.wait_held()  # the tools step is under way
        with ThreadPoolExecutor(1) as pool:
            exit_code = pool.submit(server.shutdown)
            requested = server.wait_for("shutdown-requested")
            lab.web.release()  # the tools step ends; the drain stops the run before the next one
            final = server.wait_final()
            assert exit_code.result() == 0
    finally:
        lab.web.release()

    assert requested["data"]["active_runs"] == [final["data"]["run"]]
    assert final["event"] == "chat-error"
    assert (final["data"]["code"], final["data"]["conversation"]) == ("SHUTDOWN", conversation)
    ids = [event["id"] for event in server.log.events if event.get("id")]
    assert ids == list(range(1, len(ids) + 1)) and final["id"] == ids[-1]  # the final event is the run's own
    [run] = peek_runs(db_path, conversation).itertuples()
    assert (run.status, run.error_code) == ("interrupted", "SHUTDOWN")
    steps = [e["data"] for e in server.log.events if e["event"] == "trace" and e["data"]["event"] == "leave"]
    assert [(s["node"], s.get("saved", True)) for s in steps] == [("agent", True), ("tools", True)]


def test_a_server_killed_mid_answer_leaves_a_conversation_a_new_server_resumes(lab, db_path):
    fetches = lab.fetches("wal.html")
    key = {"Idempotency-Key": f"summary-{uuid.uuid4()}"}
    lab.model.arm("summary")
    first = lab.server(DATABASE_PATH=str(db_path))
    started = first.request("POST", "/api/chat", json={"message": SUMMARISE.format(url=lab.page("wal.html"))},
                            headers=key).json()
    conversation = started["conversation"]
    first.follow(conversation)
    first.wait_for("trace", event="result")
    lab.model.wait_paused()  # the answer is half-way through its tokens
    shown = "".join(e["data"] for e in first.events() if e["event"] == "token")
    assert first.kill() == -9
    assert list(peek_runs(db_path, conversation)["status"]) == ["running"]  # nobody could record it

    second = lab.server(DATABASE_PATH=str(db_path))
    second.follow(conversation)
    answered = second.wait_for("end")
    detail = second.request("GET", f"/api/conversations/{conversation}").json()
    listed = second.request("GET", "/api/conversations").json()["conversations"]
    repeat = second.request("POST", "/api/chat", json={"message": SUMMARISE.format(url=lab.page("wal.html"))},
                            headers=key)
    second.resume(conversation)
    final = second.wait_final()
    after = second.request("GET", f"/api/conversations/{conversation}").json()
    listed_after = second.request("GET", "/api/conversations?limit=10").json()["conversations"]

    assert answered == {"id": None, "event": "end",
                        "data": {"conversation": conversation, "run": started["run"], "status": "interrupted"}}
    assert (detail["resumable"], detail["next"], roles(detail)) == (True, ["agent"], ["user", "assistant", "tool"])
    # The listing counts what the conversation shows: the recovery that relabelled the run counted it.
    assert [(c["status"], c["messageCount"]) for c in listed] == [("interrupted", 3)]
    assert detail["conversation"]["messageCount"] == len(detail["messages"]) == 3
    # the tokens a client saw were never saved
    assert shown and all(shown not in m["content"] for m in detail["messages"] if m["role"] == "assistant")
    assert repeat.json() == started  # the key outlived the process: no second run
    assert (final["event"], final["data"]["status"]) == ("end", "completed")
    assert roles(after) == ["user", "assistant", "tool", "assistant"]
    assert [(c["status"], c["messageCount"]) for c in listed_after] == [("completed", 4)]
    assert after["messages"][-1]["content"].count("\n- ") == 11
    assert lab.fetches("wal.html") - fetches == 1  # the resume did not fetch again
    runs = second.request("GET", f"/api/conversations/{conversation}/runs").json()["runs"]
    assert [run["status"] for run in runs] == ["interrupted", "completed"]


def test_the_prompt_the_readme_suggests_fetches_the_kit_s_own_page_with_no_internet(server, lab):
    """The README's first prompt fetches the server's own `/pages/` (public, like the web page's
    files, with a `robots.txt` that allows it): the fetch tool reads it over loopback."""
    page = server.request("GET", "/pages/")
    assert page.status_code == 200 and "<title>Example Domain</title>" in page.text
    assert server.request("GET", "/robots.txt").text.startswith("User-agent: *")
    conversation = finished(server, f"Fetch {server.url}/pages/ and tell me what it says.")
    detail = server.request("GET", f"/api/conversations/{conversation}").json()
    assert roles(detail) == ["user", "assistant", "tool", "assistant"]
    assert "Example Domain" in detail["messages"][2]["content"]
    assert "loaded fine" in detail["messages"][3]["content"]

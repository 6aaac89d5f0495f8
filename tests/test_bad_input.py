"""Bad input is refused with a clear error, and the database is intact afterwards."""

import asyncio
import base64
import json
import shutil
import sqlite3
import uuid
from pathlib import Path

import matplotlib.pyplot as plt
import pytest
from conftest import integrity, statuses

from sophos_lab.lab import inspect as views
from sophos_lab.runtime.agent import check_config, read_system_prompt
from sophos_lab.runtime.errors import (
    AGENT_FAILURE, BAD_REQUEST, CONFIG_ERROR, NOT_FOUND, RUN_NOT_RESUMABLE, SCHEMA_TOO_NEW, SophosError,
)
from sophos_lab.runtime.requests import parse_conversation_id
from sophos_lab.runtime.storage.models import ListingPosition, encode_cursor
from sophos_lab.runtime.tools import load_mcp_config
from test_server import refusal as envelope

VIEWS = [
    views.peek_runs, views.checkpoints, views.pending_writes, views.messages, views.thread_view,
    views.state, views.timeline,
]


@pytest.fixture
def copied(fetched, db_path):
    """A copy of a database holding one finished conversation; returns its id."""
    source, target = sqlite3.connect(fetched.db_path), sqlite3.connect(db_path)
    source.backup(target)
    source.close()
    target.close()
    return fetched.conversation


async def refusal(call) -> SophosError:
    with pytest.raises(SophosError) as refused:
        await call()
    return refused.value


def row_counts(path) -> dict[str, int]:
    """How many rows each table of the database holds (read-only): what a refusal must not change."""
    conn = sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True)
    try:
        tables = [name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return {table: conn.execute(f'SELECT count(*) FROM "{table}"').fetchone()[0] for table in tables}
    finally:
        conn.close()


def fetch_needs_approval(config: Path) -> Path:
    """`config` with every fetch tool behind an approval gate: a run that fetches waits there."""
    path = config / "mcp.json"
    servers = json.loads(path.read_text())
    servers["fetch"]["approval"] = True
    path.write_text(json.dumps(servers, indent=2))
    return config


# --- conversation ids ----------------------------------------------------------------------


@pytest.mark.parametrize("bad_id", ["not-a-uuid", "../../etc/passwd", "", "a" * 36])
async def test_a_malformed_conversation_id_is_a_bad_request(open_service, copied, db_path, bad_id):
    async with open_service() as agent:
        refusals = [
            await refusal(lambda: agent.chat("hello", bad_id)),
            await refusal(lambda: agent.resume(bad_id)),
            await refusal(lambda: agent.get_conversation(bad_id)),
            await refusal(lambda: agent.export_jsonl(bad_id)),
        ]
        [conversation] = await agent.list_conversations()

    assert {error.code for error in refusals} == {BAD_REQUEST}
    assert "Invalid Conversation ID" in refusals[0].message
    assert conversation.id == copied
    assert integrity(db_path) == "ok"


def test_a_conversation_id_with_a_trailing_newline_is_a_bad_request():
    with pytest.raises(SophosError) as refused:
        parse_conversation_id(str(uuid.uuid4()) + "\n")
    assert refused.value.code == BAD_REQUEST


@pytest.mark.parametrize(
    "bad_id", ["\ud800", [""], [], 42, "", "not-a-uuid", "' OR 1=1 --"],
    ids=["lone-surrogate", "list-of-empty", "empty-list", "int", "empty", "not-a-uuid", "sql"],
)
@pytest.mark.parametrize("view", VIEWS, ids=lambda view: view.__name__)
def test_the_inspect_views_refuse_a_malformed_conversation_id(fetched, view, bad_id):
    with pytest.raises(SophosError) as refused:
        view(fetched.db_path, bad_id)

    assert refused.value.code == BAD_REQUEST
    assert refused.value.message == f"Invalid Conversation ID: {bad_id!r}"
    assert integrity(fetched.db_path) == "ok"


def test_the_inspect_views_read_a_conversation_by_its_id_in_any_case(fetched):
    db, upper = fetched.db_path, fetched.conversation.upper()
    assert views.peek_runs(db, None)["id"].tolist() == [fetched.run]  # None: every run
    assert views.peek_runs(db, upper)["id"].tolist() == [fetched.run]
    assert views.state(db, upper) == views.state(db, fetched.conversation)
    plt.close(views.timeline(db, upper))
    assert integrity(db) == "ok"


async def test_an_upper_case_id_names_the_same_conversation(open_service, copied):
    async with open_service() as agent:
        detail = await agent.get_conversation(copied.upper())
    assert detail.conversation.id == copied


async def test_an_unknown_conversation_is_not_found(open_service, copied, db_path):
    unknown = str(uuid.uuid4())
    async with open_service() as agent:
        refusals = [
            await refusal(lambda: agent.chat("hello", unknown)),
            await refusal(lambda: agent.resume(unknown)),
            await refusal(lambda: agent.get_conversation(unknown)),
        ]
        assert [c.id for c in (await agent.list_conversations())] == [copied]

    assert {error.code for error in refusals} == {NOT_FOUND}
    assert unknown in refusals[0].message
    assert integrity(db_path) == "ok"


# --- page cursors --------------------------------------------------------------------------

BAD_CURSORS = {
    "rowid-too-large-for-sqlite": "WyJhIiwgOTk5OTk5OTk5OTk5OTk5OTk5OTk5OTld",  # ["a", 99999999999999999999999]
    "lone-surrogate": "WyJcdWQ4MDAiLCAxXQ",  # ["\ud800", 1]
}


@pytest.mark.parametrize("cursor", BAD_CURSORS.values(), ids=BAD_CURSORS.keys())
async def test_a_cursor_naming_no_possible_position_is_a_bad_request(open_service, copied, db_path, cursor):
    async with open_service() as agent:
        before = row_counts(db_path)
        with pytest.raises(SophosError) as refused:
            await agent.conversation_page(2, cursor)
        assert row_counts(db_path) == before

    assert refused.value.code == BAD_REQUEST
    assert refused.value.message.startswith(f"Invalid cursor: {cursor!r}.")


async def test_a_cursor_is_only_ever_taken_exactly_as_the_kit_wrote_it(open_service, copied):
    """Base64 and JSON have other spellings of the same position (padding, spare bits in the
    last character, spaces): each is a cursor the kit never gave, refused, not read as its own."""
    updated_at, rowid = "2026-01-01T00:00:00.000000+00:00", 3
    given = encode_cursor(ListingPosition(updated_at, rowid))
    respelled = {
        "padded": given + "=",
        "spare bits set": given[:-1] + chr(ord(given[-1]) + 1),
        "JSON with a space": base64.urlsafe_b64encode(json.dumps([updated_at, rowid]).encode()).decode().rstrip("="),
    }
    async with open_service() as agent:
        refusals = {}
        for label, cursor in respelled.items():
            with pytest.raises(SophosError) as refused:
                await agent.conversation_page(2, cursor)
            refusals[label] = refused.value.code
        assert (await agent.conversation_page(2, given)).next_cursor is None  # the kit's own spelling is read

    assert refusals == dict.fromkeys(respelled, BAD_REQUEST)


# --- approvals -----------------------------------------------------------------------------


async def test_a_gate_or_tool_call_id_utf8_cannot_store_is_a_bad_request_and_decides_nothing(
    lab, open_service, config_dir, db_path,
):
    fetch_needs_approval(config_dir)
    async with open_service() as agent:
        run = await agent.chat(f"Fetch {lab.page('index.html')}")
        assert (await run.wait()).data["status"] == "waiting"
        before = row_counts(db_path)
        refusals = {}
        for label, decide in {
            "approve the gate": lambda: agent.approve(run.conversation, None, gate="\ud800"),
            "reject the gate": lambda: agent.reject(run.conversation, "no", gate="\ud800"),
            "a decision's tool call id": lambda: agent.approve(run.conversation, {"\ud800": "approve"}),
        }.items():
            refused = await refusal(decide)
            refusals[label] = (refused.code, refused.message)
        assert row_counts(db_path) == before
        assert (await agent.pending_approval(run.conversation)) is not None  # the gate still waits

    assert refusals == {
        "approve the gate": (BAD_REQUEST, "The gate id is not valid Unicode: a lone surrogate '\\ud800' at "
                                          "position 0. Nothing was decided."),
        "reject the gate": (BAD_REQUEST, "The gate id is not valid Unicode: a lone surrogate '\\ud800' at "
                                         "position 0. Nothing was decided."),
        "a decision's tool call id": (BAD_REQUEST, "The tool call id is not valid Unicode: a lone surrogate "
                                                   "'\\ud800' at position 0. Nothing was decided."),
    }


# --- messages ------------------------------------------------------------------------------


@pytest.mark.parametrize("message", ["", "   \n\t ", None])
async def test_an_empty_message_is_a_bad_request(open_service, copied, db_path, message):
    async with open_service() as agent:
        new = await refusal(lambda: agent.chat(message))
        follow_up = await refusal(lambda: agent.chat(message, copied))
        assert (await statuses(agent, copied)) == ["completed"]
        assert len((await agent.list_conversations())) == 1

    assert new.code == follow_up.code == BAD_REQUEST
    assert "message is required" in new.message
    assert integrity(db_path) == "ok"


# --- configuration -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mcp_json", "reason"),
    [
        ('{"fetch": {"command": "python",', "not valid JSON"),
        ('["fetch", "memory"]', "must map server names to objects"),
        ('{"fetch": "python -m mcp_server_fetch"}', "must map server names to objects"),
        ('{"fetch": {"command": "${NO_SUCH_VARIABLE_42}"}}', "${NO_SUCH_VARIABLE_42}, which is not set"),
    ],
    ids=["invalid-json", "a-list", "not-objects", "unknown-variable"],
)
async def test_a_malformed_mcp_json_is_refused_naming_the_file(open_service, config_dir, db_path, mcp_json, reason):
    (config_dir / "mcp.json").write_text(mcp_json)
    async with open_service() as agent:
        refused = await refusal(lambda: agent.chat("hello"))
        assert (await agent.list_conversations()) == []

    assert refused.code == CONFIG_ERROR
    assert str(config_dir / "mcp.json") in refused.message
    assert reason in refused.message
    assert integrity(db_path) == "ok"


BAD_MCP_JSON = [
    (b"\xff\xfe\x00", "not UTF-8 text ('utf-8' codec can't decode byte 0xff in position 0: invalid start byte)"),
    (b"[" * 100_000, "not valid JSON (nested too deeply)"),
    (b'{"a": {"command": ""}}', "server 'a': command may not be empty"),
    (b'{"a": {"url": ""}}', "server 'a': url may not be empty"),
    (b'{"fetch\\n": {"command": "python"}}', "server 'fetch\\n': names may use letters, digits and '-' only"),
    (b'{"a": {"command": "python\\u0000"}}', "server 'a': command may not contain NUL"),
    (b'{"a": {"command": "\\ud800"}}', "server 'a': command is not valid Unicode"),
    (b'{"a": {"command": "python", "env": {"": "x"}}}', "server 'a': env names may not be empty"),
    (b'{"a": {"command": "python", "env": {"A=B": "x"}}}', "server 'a': env names may not contain '='"),
    (b'{"a": {"command": "x"}, "a": {"command": "y"}}', "the key 'a' appears twice"),
    (b'{"a": ' + b"1" * 5000 + b"}", "not valid JSON (Exceeds the limit (4300 digits)"),
]
BAD_MCP_JSON_IDS = [
    "not-utf-8", "deeply-nested", "empty-command", "empty-url", "name-with-newline", "nul",
    "lone-surrogate", "empty-env-name", "env-name-with-equals", "duplicate-server", "huge-integer",
]


@pytest.mark.parametrize(("mcp_json", "reason"), BAD_MCP_JSON, ids=BAD_MCP_JSON_IDS)
def test_a_malformed_mcp_json_is_a_config_error_naming_the_file(lab, config_dir, mcp_json, reason):
    path = config_dir / "mcp.json"
    path.write_bytes(mcp_json)
    with pytest.raises(SophosError) as loading:
        load_mcp_config(path, {})
    with pytest.raises(SophosError) as checking:
        check_config(lab.settings(CONFIG_DIR=str(config_dir)))

    assert loading.value.code == CONFIG_ERROR
    assert loading.value.message.startswith(f"{path}: ")
    assert reason in loading.value.message
    assert checking.value == loading.value


def test_a_directory_in_place_of_mcp_json_is_a_config_error(lab, config_dir):
    path = config_dir / "mcp.json"
    path.unlink()
    path.mkdir()
    with pytest.raises(SophosError) as checking:
        check_config(lab.settings(CONFIG_DIR=str(config_dir)))

    assert checking.value.code == CONFIG_ERROR
    assert checking.value.message == f"{path}: cannot read the file (Is a directory)"


def test_a_missing_mcp_json_is_a_config_error(lab, config_dir):
    (config_dir / "mcp.json").unlink()
    with pytest.raises(SophosError) as checking:
        check_config(lab.settings(CONFIG_DIR=str(config_dir)))

    assert checking.value == SophosError(CONFIG_ERROR, f"MCP configuration not found: {config_dir / 'mcp.json'}")


def _not_utf8(path):
    path.write_bytes(b"\xff\xfe\x00")


def _directory(path):
    path.unlink()
    path.mkdir()


@pytest.mark.parametrize(
    ("spoil", "reason"),
    [(_not_utf8, "not UTF-8 text ('utf-8' codec can't decode byte 0xff in position 0: invalid start byte)"),
     (_directory, "cannot read the file (Is a directory)")],
    ids=["not-utf-8", "a-directory"],
)
def test_a_bad_system_prompt_is_a_config_error_naming_the_file(lab, config_dir, spoil, reason):
    settings = lab.settings(CONFIG_DIR=str(config_dir))
    spoil(settings.system_prompt_path)
    with pytest.raises(SophosError) as reading:
        read_system_prompt(settings)
    with pytest.raises(SophosError) as checking:
        check_config(settings)

    assert reading.value.code == CONFIG_ERROR
    assert reading.value.message.startswith(f"{settings.system_prompt_path}: ")
    assert reason in reading.value.message
    assert checking.value == reading.value


def test_a_missing_system_prompt_is_a_config_error(lab, config_dir):
    settings = lab.settings(CONFIG_DIR=str(config_dir))
    settings.system_prompt_path.unlink()
    with pytest.raises(SophosError) as checking:
        check_config(settings)

    assert checking.value == SophosError(CONFIG_ERROR, f"System prompt not found: {settings.system_prompt_path}")


def test_the_lab_configuration_passes_the_check(lab, config_dir):
    assert check_config(lab.settings(CONFIG_DIR=str(config_dir))) is None


@pytest.mark.parametrize("spoil", [
    lambda config: (config / "mcp.json").write_bytes(b"\xff\xfe\x00"),
    lambda config: (config / "mcp.json").write_text('{"a": {"command": ""}}'),
    lambda config: _not_utf8(config / "system.md"),
], ids=["mcp-json-not-utf-8", "empty-command", "system-md-not-utf-8"])
async def test_a_bad_configuration_is_refused_before_anything_is_written(
    open_service, copied, config_dir, db_path, spoil,
):
    spoil(config_dir)
    async with open_service() as agent:
        new = await refusal(lambda: agent.chat("hello"))
        follow_up = await refusal(lambda: agent.chat("hello", copied))
        resumed = await refusal(lambda: agent.resume(copied))
        assert [c.id for c in (await agent.list_conversations())] == [copied]
        assert (await statuses(agent, copied)) == ["completed"]

    assert new.code == follow_up.code == CONFIG_ERROR
    assert resumed.code in (CONFIG_ERROR, RUN_NOT_RESUMABLE)  # `copied` has nothing to resume
    assert integrity(db_path) == "ok"


async def test_a_fixed_mcp_json_is_read_again_without_a_restart(lab, open_service, config_dir):
    good = (config_dir / "mcp.json").read_text()
    (config_dir / "mcp.json").write_text("{")
    async with open_service() as agent:
        assert (await refusal(lambda: agent.chat("hello"))).code == CONFIG_ERROR
        (config_dir / "mcp.json").write_text(good)
        end = await agent.ask("hello")
        assert (await statuses(agent, end.data["conversation"])) == ["completed"]

    assert end.data["status"] == "completed"


async def test_a_system_prompt_removed_during_a_run_fails_it_with_a_config_error(
    lab, open_service, config_dir, db_path
):
    """Checked before the run, gone by the time the model is called again (read on every call)."""
    lab.web.hold("/wal.html")
    async with open_service() as agent:
        run = await agent.chat(f"Fetch {lab.page('wal.html')}")
        await asyncio.to_thread(lab.web.wait_held)  # the tools step is under way
        (config_dir / "system.md").unlink()
        lab.web.release()
        error = await run.wait()
        [recorded] = await agent.list_runs(run.conversation)

    assert (error.event, error.data["code"]) == ("chat-error", CONFIG_ERROR)
    assert str(config_dir / "system.md") in error.data["message"]
    assert (recorded.status, recorded.error_code) == ("failed", CONFIG_ERROR)
    assert integrity(db_path) == "ok"


# --- the database --------------------------------------------------------------------------


@pytest.fixture
def newer_schema(db_path):
    """A database written by a future sophos_lab (schema version 99)."""
    conn = sqlite3.connect(db_path)
    conn.execute("PRAGMA user_version = 99")
    conn.close()
    return db_path


async def test_a_database_with_a_newer_schema_is_refused_and_left_unchanged(open_service, newer_schema):
    before = newer_schema.read_bytes()
    async with open_service() as agent:
        with pytest.raises(SophosError) as listing:
            await agent.list_conversations()
        chatting = await refusal(lambda: agent.chat("hello"))

    assert listing.value.code == chatting.code == SCHEMA_TOO_NEW
    assert str(newer_schema) in chatting.message
    assert "version 99" in chatting.message
    assert newer_schema.read_bytes() == before
    conn = sqlite3.connect(newer_schema)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 99
    conn.close()
    assert integrity(newer_schema) == "ok"


# --- over HTTP ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(lab, tmp_path_factory):
    """`sophos-lab serve` on a database of its own, its fetch tool behind an approval gate, and
    the default body limit (1 MiB), so that a deeply nested body reaches the JSON parser."""
    root = tmp_path_factory.mktemp("bad-input-server")
    config = fetch_needs_approval(shutil.copytree(lab.config_dir, root / "config"))
    with lab.server(DATABASE_PATH=str(root / "sophos.db"), CONFIG_DIR=str(config),
                    MEMORY_FILE_PATH=str(root / "memory.jsonl")) as server:
        yield server


@pytest.fixture(scope="module")
def waiting(server, lab) -> str:
    """A conversation of the module's server whose run waits at its gate."""
    server.chat(f"Fetch {lab.page('index.html')}")
    final = server.wait_final()
    assert final["data"]["status"] == "waiting", final
    return final["data"]["conversation"]


def server_rows(server) -> dict[str, int]:
    return row_counts(Path(server.env["DATABASE_PATH"]))


@pytest.mark.parametrize("cursor", BAD_CURSORS.values(), ids=BAD_CURSORS.keys())
def test_a_cursor_naming_no_possible_position_is_a_400(server, waiting, cursor):
    before = server_rows(server)
    response = server.request("GET", "/api/conversations", params={"cursor": cursor})

    assert envelope(response)[:2] == (400, BAD_REQUEST)
    assert server_rows(server) == before


@pytest.mark.parametrize("depth", [2_000, 100_000])
@pytest.mark.parametrize("endpoint", ["/api/chat", "/api/conversations/{}/approve", "/api/conversations/{}/reject"])
def test_a_json_body_nested_too_deeply_is_a_400_and_writes_nothing(server, waiting, endpoint, depth):
    body = b'{"message": "hello", "nested": ' + b"[" * depth + b"]" * depth + b"}"
    before = server_rows(server)
    response = server.request("POST", endpoint.format(waiting), content=body,
                              headers={"Content-Type": "application/json"})

    assert envelope(response) == (400, BAD_REQUEST, "Request body is JSON nested too deeply to read; nothing was stored.")
    assert server_rows(server) == before


@pytest.mark.parametrize("endpoint, body", [
    ("approve", b'{"gate": "\\ud800"}'),
    ("reject", b'{"gate": "\\ud800"}'),
    ("approve", b'{"decisions": {"\\ud800": "approve"}}'),
], ids=["approve-gate", "reject-gate", "decision-key"])
def test_a_gate_or_tool_call_id_utf8_cannot_store_is_a_400_and_decides_nothing(server, waiting, endpoint, body):
    before = server_rows(server)
    response = server.request("POST", f"/api/conversations/{waiting}/{endpoint}", content=body,
                              headers={"Content-Type": "application/json"})
    shown = server.request("GET", f"/api/conversations/{waiting}").json()

    status, code, message = envelope(response)
    assert (status, code) == (400, BAD_REQUEST)
    assert "lone surrogate '\\ud800'" in message
    assert shown["approval"] is not None  # the gate still waits
    assert server_rows(server) == before


AROUND_AN_ID = {"trailing newline": "{}%0a", "trailing CRLF": "{}%0d%0a", "leading newline": "%0a{}",
                "trailing space": "{}%20", "leading tab": "%09{}"}
ID_ROUTES = [("GET", ""), ("GET", "/export"), ("GET", "/runs"),
             ("POST", "/cancel"), ("POST", "/approve"), ("POST", "/reject")]


def test_an_id_with_whitespace_around_it_is_a_400_on_every_route(server, waiting):
    """The id is of a conversation that exists: were the whitespace dropped, the route would
    answer for it."""
    before = server_rows(server)
    answers = {
        (around, method, endpoint): envelope(server.request(
            method, f"/api/conversations/{spelling.format(waiting)}{endpoint}",
            **({"json": {}} if method == "POST" else {})))
        for around, spelling in AROUND_AN_ID.items() for method, endpoint in ID_ROUTES
    }

    assert answers == dict.fromkeys(answers, (400, BAD_REQUEST, "Invalid Conversation ID"))
    assert server_rows(server) == before


def test_a_path_with_a_trailing_newline_names_no_endpoint(server, waiting):
    before = server_rows(server)
    chat = server.request("POST", "/api/chat%0a", json={"message": "hello"})
    listing = server.request("GET", "/api/conversations%0a")

    assert envelope(chat) == (404, NOT_FOUND, "No such endpoint: /api/chat\n")
    assert envelope(listing) == (404, NOT_FOUND, "No such endpoint: /api/conversations\n")
    assert server_rows(server) == before

"""Bad input is refused with a clear error, and the database is intact afterwards."""

import sqlite3
import uuid

import pytest
from conftest import integrity, statuses

from sophos_lab.errors import AGENT_FAILURE, BAD_REQUEST, NOT_FOUND, SCHEMA_TOO_NEW, SophosError


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
        [conversation] = agent.list_conversations()

    assert {error.code for error in refusals} == {BAD_REQUEST}
    assert "Invalid Conversation ID" in refusals[0].message
    assert conversation.id == copied
    assert integrity(db_path) == "ok"


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
        assert [c.id for c in agent.list_conversations()] == [copied]

    assert {error.code for error in refusals} == {NOT_FOUND}
    assert unknown in refusals[0].message
    assert integrity(db_path) == "ok"


# --- messages ------------------------------------------------------------------------------


@pytest.mark.parametrize("message", ["", "   \n\t ", None])
async def test_an_empty_message_is_a_bad_request(open_service, copied, db_path, message):
    async with open_service() as agent:
        new = await refusal(lambda: agent.chat(message))
        follow_up = await refusal(lambda: agent.chat(message, copied))
        assert statuses(agent, copied) == ["completed"]
        assert len(agent.list_conversations()) == 1

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
async def test_a_malformed_mcp_json_fails_the_run_naming_the_file(open_service, config_dir, db_path, mcp_json, reason):
    (config_dir / "mcp.json").write_text(mcp_json)
    async with open_service() as agent:
        error = await agent.ask("hello")
        detail = await agent.get_conversation(error.data["conversation"])
        [run] = agent.list_runs(error.data["conversation"])

    assert (error.event, error.data["code"]) == ("chat-error", AGENT_FAILURE)
    assert str(config_dir / "mcp.json") in error.data["message"]
    assert reason in error.data["message"]
    assert (run.status, run.error_code, run.error_message) == ("failed", AGENT_FAILURE, error.data["message"])
    assert (detail.next, detail.resumable) == (("agent",), True)
    assert integrity(db_path) == "ok"


async def test_a_fixed_mcp_json_is_read_again_without_a_restart(lab, open_service, config_dir):
    good = (config_dir / "mcp.json").read_text()
    (config_dir / "mcp.json").write_text("{")
    async with open_service() as agent:
        error = await agent.ask("hello")
        (config_dir / "mcp.json").write_text(good)
        end = await (await agent.resume(error.data["conversation"])).wait()
        assert statuses(agent, error.data["conversation"]) == ["failed", "completed"]

    assert end.data["status"] == "completed"


async def test_a_missing_system_prompt_fails_the_run_naming_the_path(open_service, config_dir, db_path):
    (config_dir / "system.md").unlink()
    async with open_service() as agent:
        error = await agent.ask("hello")

    assert error.data["code"] == AGENT_FAILURE
    assert str(config_dir / "system.md") in error.data["message"]
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
            agent.list_conversations()
        chatting = await refusal(lambda: agent.chat("hello"))

    assert listing.value.code == chatting.code == SCHEMA_TOO_NEW
    assert str(newer_schema) in chatting.message
    assert "version 99" in chatting.message
    assert newer_schema.read_bytes() == before
    conn = sqlite3.connect(newer_schema)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 99
    conn.close()
    assert integrity(newer_schema) == "ok"


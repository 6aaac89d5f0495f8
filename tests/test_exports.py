"""Exports: a Markdown transcript and the JSONL checkpoint history, generated on request."""

import json

import pytest

from sophos_lab.lab.inspect import peek_runs

CHECKPOINT_FIELDS = {
    "checkpoint_id", "created_at", "step", "source", "next", "message_count", "last_message", "run_id",
}


@pytest.fixture
def exported(fetched, open_service):
    """The Markdown and JSONL exports of the finished fetch conversation, read by a fresh service."""

    async def export():
        async with open_service(DATABASE_PATH=str(fetched.db_path)) as fresh:
            return await fresh.export_markdown(fetched.conversation), await fresh.export_jsonl(fetched.conversation)

    return export


async def test_the_transcript_shows_the_title_messages_tool_calls_and_results(fetched, exported):
    markdown, _ = await exported()

    assert markdown.startswith(f"# Fetch {fetched.page}\n")
    assert f"- Conversation (thread_id): `{fetched.conversation}`" in markdown
    assert markdown.count("## User") == 1
    assert markdown.count("## Assistant") == 2
    assert "> **Tool call** `fetch__fetch`" in markdown
    assert f'"url": "{fetched.page}"' in markdown
    assert "### Tool result: `fetch__fetch` (success)" in markdown
    assert "This domain is for use in illustrative examples" in markdown
    assert "loaded fine" in markdown


async def test_the_jsonl_has_one_line_per_checkpoint_oldest_first(exported):
    _, jsonl = await exported()
    records = [json.loads(line) for line in jsonl.splitlines()]

    assert jsonl.endswith("}\n")
    assert all(set(record) == CHECKPOINT_FIELDS for record in records)
    assert [r["step"] for r in records] == [-1, 0, 1, 2, 3]
    assert [r["created_at"] for r in records] == sorted(r["created_at"] for r in records)
    assert [r["source"] for r in records] == ["input", "loop", "loop", "loop", "loop"]
    assert [r["next"] for r in records] == [["__start__"], ["agent"], ["tools"], ["agent"], []]
    assert [r["message_count"] for r in records] == [0, 1, 2, 3, 4]
    assert [r["last_message"] and r["last_message"]["role"] for r in records] == [
        None, "user", "assistant", "tool", "assistant",
    ]


async def test_each_checkpoint_names_the_run_that_wrote_it(fetched, exported):
    _, jsonl = await exported()
    [run] = peek_runs(fetched.db_path, fetched.conversation).itertuples()
    assert {json.loads(line)["run_id"] for line in jsonl.splitlines()} == {run.id} == {fetched.run}


async def test_checkpoints_of_a_resumed_thread_belong_to_each_run_in_turn(open_service):
    async with open_service(OLLAMA_MODEL="does-not-exist") as agent:
        conversation = (await agent.ask("hello")).data["conversation"]
    async with open_service() as agent:
        await (await agent.resume(conversation)).wait()
        failed, completed = [run.id for run in (await agent.list_runs(conversation))]
        records = [json.loads(line) for line in (await agent.export_jsonl(conversation)).splitlines()]

    assert [(r["step"], r["run_id"]) for r in records] == [
        (-1, failed), (0, failed),  # the failed run wrote its input; its agent step never finished
        (1, completed),  # the resume ran the agent step again
    ]

"""Listing conversations a page at a time: limit, opaque cursor, the listing's own order.

`conversation_page` pages the order `list_conversations` has always had (most recently updated
first, the later-inserted first among equals) by keyset: the cursor names where a page ended,
so conversations created while a client walks the pages never shift it.
"""

import base64
import json
import sqlite3
import uuid

import pytest

from sophos_lab.runtime.errors import BAD_REQUEST, SophosError
from sophos_lab.runtime.storage import sqlite_storage
from sophos_lab.runtime.storage.models import MAX_PAGE_SIZE, PAGE_SIZE, decode_cursor
from sophos_lab.runtime.storage.sqlite_schema import MIGRATIONS

pytestmark = pytest.mark.both_backends


async def add_conversations(agent, count: int) -> list[str]:
    """`count` conversations, each with one completed run, oldest first; their ids."""
    ids = []
    for number in range(count):
        conversation, run = str(uuid.uuid4()), str(uuid.uuid4())
        await agent.store.start_run(run, conversation, [{"id": run, "content": f"question {number}"}],
                                    title=f"question {number}")
        await agent.store.finish_run(run, "completed", 2)
        ids.append(conversation)
    return ids


async def nothing(page_number: int) -> None:
    return None


async def walk(agent, limit: int, between_pages=nothing) -> list[list[str]]:
    """Every page from the first to the last, as lists of ids; `between_pages(n)` runs after page n."""
    pages, cursor = [], None
    while True:
        page = await agent.conversation_page(limit, cursor)
        pages.append([c.id for c in page.conversations])
        if page.next_cursor is None:
            return pages
        await between_pages(len(pages))
        cursor = page.next_cursor


def flat(pages: list[list[str]]) -> list[str]:
    return [conversation for page in pages for conversation in page]


async def test_pages_cover_every_conversation_once_in_the_listing_order(open_service):
    async with open_service() as agent:
        oldest_first = await add_conversations(agent, 23)

        pages = await walk(agent, limit=5)

        assert [len(page) for page in pages] == [5, 5, 5, 5, 3]
        assert flat(pages) == oldest_first[::-1] == [c.id for c in (await agent.list_conversations())]
        assert agent._graph is None  # listing reads the app tables only: no checkpoint, no graph


async def test_the_first_page_has_the_default_size_and_the_latest_outcome(open_service):
    async with open_service() as agent:
        ids = await add_conversations(agent, PAGE_SIZE + 1)
        run = str(uuid.uuid4())
        await agent.store.start_run(run, ids[0])
        await agent.store.finish_run(run, "failed", None, "MODEL_UNAVAILABLE", "no model")

        page = await agent.conversation_page()

        assert len(page.conversations) == PAGE_SIZE
        assert page.next_cursor is not None
        top = page.conversations[0]
        assert (top.id, top.status, top.error_code) == (ids[0], "failed", "MODEL_UNAVAILABLE")
        [last] = (await agent.conversation_page(cursor=page.next_cursor)).conversations
        assert last.id == ids[1]


async def test_an_empty_database_has_one_empty_last_page(open_service):
    async with open_service() as agent:
        page = await agent.conversation_page()
        assert (page.conversations, page.next_cursor) == ([], None)


async def test_conversations_created_during_a_walk_do_not_shift_it(open_service):
    async with open_service() as agent:
        before = await add_conversations(agent, 12)
        created = []

        async def create(_):
            created.extend(await add_conversations(agent, 3))

        pages = await walk(agent, limit=4, between_pages=create)

        assert flat(pages) == before[::-1]  # each once, none skipped, none of the new ones
        assert len(created) == 6
        assert [c.id for c in (await agent.conversation_page(6)).conversations] == created[::-1]


async def test_a_conversation_updated_during_a_walk_moves_to_the_top_and_is_not_shown_twice(open_service):
    async with open_service() as agent:
        newest_first = (await add_conversations(agent, 9))[::-1]
        seen_already, not_yet_seen = newest_first[1], newest_first[7]

        async def new_runs(page_number):
            if page_number == 1:
                for conversation in (seen_already, not_yet_seen):
                    run = str(uuid.uuid4())
                    await agent.store.start_run(run, conversation)
                    await agent.store.finish_run(run, "completed", 4)

        walked = flat(await walk(agent, limit=3, between_pages=new_runs))

        assert walked == [c for c in newest_first if c != not_yet_seen]
        assert [c.id for c in (await agent.conversation_page(2)).conversations] == [not_yet_seen, seen_already]


async def test_conversations_updated_at_the_same_instant_are_paged_in_the_listing_order(open_service, db_path):
    """Ties of updated_at (a clock that stood still, a bulk import) are broken as the listing
    breaks them, later-inserted first: a cursor on updated_at alone would skip or repeat them."""
    async with open_service() as agent:
        await add_conversations(agent, 7)
        conn = sqlite3.connect(db_path)
        with conn:
            conn.execute("UPDATE conversations SET updated_at = '2026-01-01T00:00:00.000000+00:00'")
        conn.close()

        pages = await walk(agent, limit=2)

        assert [len(page) for page in pages] == [2, 2, 2, 1]
        assert flat(pages) == [c.id for c in (await agent.list_conversations())]
        assert len(set(flat(pages))) == 7


def b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


@pytest.mark.parametrize("cursor", [
    "",
    "not a cursor",
    "%%%%",
    b64(b"not json"),
    b64(b"\xff\xfe"),
    b64(json.dumps(["2026-01-01T00:00:00+00:00"]).encode()),
    b64(json.dumps({"updated_at": "2026-01-01", "rowid": 3}).encode()),
    b64(json.dumps([3, "2026-01-01"]).encode()),
    b64(json.dumps(["2026-01-01", 0]).encode()),
    b64(json.dumps(["2026-01-01", True]).encode()),
    b64(json.dumps(["2026-01-01", 2.5]).encode()),
    "A" * 10_000,
    42,
    ["2026-01-01", 3],
])
async def test_a_malformed_cursor_is_refused_never_taken_for_the_first_page(open_service, cursor):
    async with open_service() as agent:
        await add_conversations(agent, 3)

        with pytest.raises(SophosError) as refused:
            await agent.conversation_page(2, cursor)

        assert refused.value.code == BAD_REQUEST
        assert "cursor" in refused.value.message
        assert len((await agent.list_conversations())) == 3  # nothing lost


@pytest.mark.parametrize("limit", [0, -1, MAX_PAGE_SIZE + 1, "10", 2.5, True, None])
async def test_a_page_size_out_of_bounds_is_refused(open_service, limit):
    async with open_service() as agent:
        with pytest.raises(SophosError) as refused:
            await agent.conversation_page(limit)
        assert refused.value.code == BAD_REQUEST
        assert f"1 to {MAX_PAGE_SIZE}" in refused.value.message


async def test_the_smallest_and_largest_page_sizes_are_accepted(open_service):
    async with open_service() as agent:
        ids = await add_conversations(agent, 3)
        assert [c.id for c in (await agent.conversation_page(1)).conversations] == [ids[-1]]
        assert [c.id for c in (await agent.conversation_page(MAX_PAGE_SIZE)).conversations] == ids[::-1]


async def test_a_version_2_file_gains_the_listing_indexes_and_pages_its_rows(db_path):
    conn = sqlite3.connect(db_path)
    conn.executescript(f"BEGIN; {MIGRATIONS[0]}; {MIGRATIONS[1]}; PRAGMA user_version = 2; COMMIT;")
    for number in range(3):
        conn.execute(
            "INSERT INTO conversations VALUES (?, ?, 't0', ?, 2)",
            (str(uuid.uuid4()), f"old {number}", f"t{number + 1}"),
        )
    conn.commit()
    conn.close()

    store = sqlite_storage(db_path)
    try:
        first = await store.conversation_page(2)
        second = await store.conversation_page(2, decode_cursor(first.next_cursor))
        assert [c.title for c in first.conversations + second.conversations] == ["old 2", "old 1", "old 0"]
    finally:
        await store.aclose()
    conn = sqlite3.connect(db_path)
    try:
        indexes = {
            name: [column for _, _, column in conn.execute(f"PRAGMA index_info({name})")]
            for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL")
        }
    finally:
        conn.close()
    assert indexes["conversations_by_recency"] == ["updated_at"]
    assert indexes["runs_by_conversation"] == ["conversation_id"]


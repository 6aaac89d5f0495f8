"""Listing conversations at scale: 10,000 conversations with 3 runs each.

The anchor is the original's own listing (`SUMMARY_SELECT` and `listConversations` in its
persistence/conversations.ts): each conversation joined with its latest run, found by
`ORDER BY started_at DESC, rowid DESC LIMIT 1` off its one index `runs_by_conversation
(conversation_id, started_at)`, joined by the run's id, sorted by `updated_at DESC`; on a copy of
the same file (the same rows, written through the kit's schema) with the original's index in
place of the kit's, and rows in the original's own shape: one object per row keyed by column
name (better-sqlite3's default row; here a dict per row, built from the cursor's tuples), no
class of its own. The original had no pages: a page is its query with `LIMIT 50 OFFSET n`, the
only way that query pages.

- the pages: the kit's `AgentService.conversation_page` (keyset pagination off its indexes)
  against the original's query with LIMIT / OFFSET: the first page and page 100;
- the whole list: the kit's `AgentService.list_conversations()` against the original's query.

Both sides return the same conversations with the same fields in the same order (checked before
anything is timed): the kit's as `Conversation` objects, the anchor's as dicts. The kit's
figures include what the service does before it reads (the recovery check). The calls
alternate, kit and anchor, so drift on the machine hits both alike; each figure is the median
of REPEAT calls on a warm cache, and the spread is printed with it.

    python benchmarks/listing.py [--quick]    # the rows, and where the whole list's time goes
"""

from __future__ import annotations

import asyncio
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import astuple
from datetime import datetime, timedelta, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sophos_lab.runtime.service import AgentService  # noqa: E402
from sophos_lab.runtime.settings import Settings  # noqa: E402
from sophos_lab.runtime.storage import sqlite_storage  # noqa: E402
from sophos_lab.runtime.storage.blocking import Blocking  # noqa: E402

CONVERSATIONS = 10_000
RUNS_EACH = 3
PAGE = 50
REPEAT = 21
BARE = (
    "the original's own summary query (each conversation's latest run by started_at DESC, rowid DESC off its "
    "index (conversation_id, started_at), joined by the run's id, sorted by updated_at DESC), paged the only way "
    "it can be (LIMIT / OFFSET); on a copy of the same file with the original's index; its rows in the original's "
    "shape, a dict per row keyed by column; both sides return the same conversations in the same order"
)
LATER_PAGE = 100
"""The page number of the "later page" figure (rows 4,951 to 5,000 of 10,000)."""

# The original's summary query (`SUMMARY_SELECT` and `listConversations` in its
# persistence/conversations.ts): the latest run by start time, off its index of
# (conversation_id, started_at), joined by the run's id; the list sorted by updated_at.
ORIGINAL_LISTING = """
SELECT c.id, c.title, c.created_at, c.updated_at, c.message_count,
       r.status, r.error_code, r.error_message
FROM conversations c
LEFT JOIN runs r ON r.id = (
    SELECT id FROM runs WHERE conversation_id = c.id ORDER BY started_at DESC, rowid DESC LIMIT 1
)
ORDER BY c.updated_at DESC"""
# The original's index, in place of the kit's.
OLD_INDEXES = """
DROP INDEX conversations_by_recency;
DROP INDEX runs_by_conversation;
CREATE INDEX runs_by_conversation ON runs (conversation_id, started_at);
"""


def fill(path: Path, conversations: int) -> None:
    """A file as a long-used lab leaves it: `conversations` conversations of RUNS_EACH runs,
    written through the kit's schema (the store creates it), in one transaction."""
    with Blocking(lambda: sqlite_storage(path)) as store:
        store.open()  # creates the file at the current schema version
    start = datetime(2026, 1, 1, tzinfo=timezone.utc)
    conversation_rows, run_rows = [], []
    for number in range(conversations):
        conversation = str(uuid.uuid4())
        created = start + timedelta(minutes=number)
        times = [(created + timedelta(seconds=10 * run)).isoformat(timespec="microseconds") for run in range(RUNS_EACH)]
        conversation_rows.append((conversation, f"Conversation {number}", times[0], times[-1], 2 * RUNS_EACH))
        for run, at in enumerate(times):
            status = "failed" if run == RUNS_EACH - 1 and number % 7 == 0 else "completed"
            run_rows.append((str(uuid.uuid4()), conversation, status, at, at))
    conn = sqlite3.connect(path)
    with conn:
        conn.executemany(
            "INSERT INTO conversations (id, title, created_at, updated_at, message_count) VALUES (?, ?, ?, ?, ?)",
            conversation_rows,
        )
        conn.executemany(
            "INSERT INTO runs (id, conversation_id, status, started_at, finished_at) VALUES (?, ?, ?, ?, ?)",
            run_rows,
        )
    conn.close()


def paired_ms(kit, bare, repeat: int) -> tuple[list[float], list[float]]:
    """Milliseconds of `repeat` calls of each, alternating which goes first; after one warm-up
    call of each (the page cache and the statement cache, as a server that keeps running has)."""
    kit(), bare()
    times: dict[object, list[float]] = {kit: [], bare: []}
    for number in range(repeat):
        for call in (kit, bare) if number % 2 == 0 else (bare, kit):
            start = time.perf_counter()
            call()
            times[call].append((time.perf_counter() - start) * 1000)
    return times[kit], times[bare]


def dict_rows(cursor) -> list[dict]:
    """The original's row shape: one dict per row, keyed by column name."""
    names = [column[0] for column in cursor.description]
    return [dict(zip(names, row)) for row in cursor]


def anchor(conn: sqlite3.Connection, sql: str):
    """The anchor's call: the original's query, its rows as dicts."""
    return lambda: dict_rows(conn.execute(sql))


def same(conversations, rows: list[dict]) -> bool:
    """The kit's `Conversation`s and the anchor's dicts hold the same fields, in the same order."""
    return [astuple(c) for c in conversations] == [tuple(row.values()) for row in rows]


class Files:
    """The kit's file and the anchors' copy, filled once."""

    def __init__(self, folder: Path, conversations: int) -> None:
        kit_db, old_db = folder / "kit.db", folder / "old.db"
        fill(kit_db, conversations)
        shutil.copy(kit_db, old_db)
        self.old = sqlite3.connect(old_db)  # tuple rows, made dicts by `dict_rows`
        self.old.executescript(OLD_INDEXES)
        self.loop = asyncio.new_event_loop()  # the kit's calls are awaited, as a server awaits them
        self.service = self.loop.run_until_complete(_service(kit_db))

    def kit(self, call):
        """`call()` (a coroutine function) as a plain call, run to its end on this loop."""
        return lambda: self.loop.run_until_complete(call())

    def close(self) -> None:
        self.loop.run_until_complete(self.service.store.aclose())
        self.loop.close()
        self.old.close()


async def _service(path: Path) -> AgentService:
    return AgentService(Settings.from_env({"DATABASE_PATH": str(path)}))


def rows(quick: bool = False) -> list[dict]:
    conversations = 1_000 if quick else CONVERSATIONS
    repeat = 3 if quick else REPEAT
    later = min(LATER_PAGE, conversations // PAGE // 2)
    scale = f"{conversations:,} conversations x {RUNS_EACH} runs"
    with tempfile.TemporaryDirectory() as tmp:
        files = Files(Path(tmp), conversations)
        service, old, kit = files.service, files.old, files.kit
        try:
            cursor = None
            for _ in range(later - 1):
                cursor = kit(lambda: service.conversation_page(PAGE, cursor))().next_cursor

            def old_page(offset: int):
                return anchor(old, f"{ORIGINAL_LISTING} LIMIT {PAGE} OFFSET {offset}")

            # Like with like: the same conversations, the same fields, the same order.
            if not same(kit(service.list_conversations)(), anchor(old, ORIGINAL_LISTING)()):
                raise RuntimeError("the kit's list_conversations() and the original's query disagree")
            if not same(kit(lambda: service.conversation_page(PAGE))().conversations, old_page(0)()):
                raise RuntimeError("the kit's first page and the original's first page disagree")
            if not same(kit(lambda: service.conversation_page(PAGE, cursor))().conversations,
                        old_page((later - 1) * PAGE)()):
                raise RuntimeError(f"the kit's page {later} and the OFFSET page disagree")

            measured = [
                (f"first page of {PAGE}, {scale}",
                 *paired_ms(kit(lambda: service.conversation_page(PAGE)), old_page(0), repeat)),
                (f"page {later} of {PAGE} (kit: its cursor; bare: OFFSET), {scale}",
                 *paired_ms(kit(lambda: service.conversation_page(PAGE, cursor)), old_page((later - 1) * PAGE), repeat)),
                (f"all conversations, list_conversations(), {scale}",
                 *paired_ms(kit(service.list_conversations), anchor(old, ORIGINAL_LISTING), repeat)),
            ]
        finally:
            files.close()
    return [
        {"benchmark": "listing", "measure": measure, "kit_runs": kit, "bare_runs": bare, "unit": "ms"}
        for measure, kit, bare in measured
    ]


def breakdown(quick: bool = False) -> list[tuple[str, list[float]]]:
    """Where the whole list's time goes, each side: the query alone (tuple rows, no objects),
    and the query with its rows built (milliseconds of REPEAT calls)."""
    conversations = 1_000 if quick else CONVERSATIONS
    repeat = 3 if quick else REPEAT
    with tempfile.TemporaryDirectory() as tmp:
        files = Files(Path(tmp), conversations)
        store, old = files.service.store, files.old
        try:
            from sophos_lab.runtime.storage.rules import _LISTING, _LISTING_ORDER
            from sophos_lab.runtime.storage.sqlite import DIALECT

            kit_conn = sqlite3.connect(store.db.path)  # tuple rows, the kit's file and query
            kit_query = DIALECT.prepare(_LISTING + _LISTING_ORDER)
            sql_kit, sql_bare = paired_ms(lambda: kit_conn.execute(kit_query).fetchall(),
                                          lambda: old.execute(ORIGINAL_LISTING).fetchall(), repeat)
            store_kit, built_bare = paired_ms(files.kit(store.list_conversations), anchor(old, ORIGINAL_LISTING), repeat)
            kit_conn.close()
        finally:
            files.close()
    return [
        ("kit: the query alone (tuples)", sql_kit),
        ("kit: Storage.list_conversations() (no recovery check)", store_kit),
        ("original: the query alone (tuples)", sql_bare),
        ("original: the query, a dict per row", built_bare),
    ]


if __name__ == "__main__":
    from bench import format_table, machine

    quick = "--quick" in sys.argv
    print(f"Machine: {machine()}")
    print(f"bare: {BARE}")
    print(format_table(rows(quick=quick)))
    print()
    print(f"The whole list, min / median / max of {3 if quick else REPEAT} calls:")
    for label, times in breakdown(quick=quick):
        print(f"  {label:<52} {min(times):6.1f} / {statistics.median(times):6.1f} / {max(times):6.1f} ms")

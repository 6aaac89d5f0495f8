"""Listing conversations at scale: 10,000 conversations with 3 runs each.

Two anchors, each on a copy of the same file (the same rows, written through the kit's schema)
with the indexes it had: `runs_by_conversation (conversation_id, started_at)` and no index on
`updated_at` (the original's one index, which schema version 2 still had):

- the pages: the kit's `AgentService.conversation_page` (keyset pagination, schema version 4's
  indexes) against schema version 2's listing query (a correlated subquery per row, a sort of
  every conversation), paged the only way that query can be (LIMIT / OFFSET);
- the whole list: the kit's `AgentService.list_conversations()` against the original's own
  summary query: each conversation joined with its latest run, found by `ORDER BY started_at
  DESC, rowid DESC LIMIT 1` off its index, joined by the run's id, sorted by `updated_at DESC`.

Both sides return the same thing: a list of `Conversation` dataclasses, in the same order (checked
before anything is timed). The anchors build each one with the dataclass's own constructor,
`Conversation(*row)` from a tuple row (as the original built one object per row, `toSummary`);
the kit's `list_conversations()` includes what the service does before it reads (the recovery
check). The calls alternate, kit and anchor, so drift on the machine hits both alike; each
figure is the median of REPEAT calls on a warm cache, and the spread is printed with it.

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
from datetime import datetime, timedelta, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sophos_lab.runtime.service import AgentService  # noqa: E402
from sophos_lab.runtime.settings import Settings  # noqa: E402
from sophos_lab.runtime.storage import sqlite_storage  # noqa: E402
from sophos_lab.runtime.storage.blocking import Blocking  # noqa: E402
from sophos_lab.runtime.storage.models import Conversation  # noqa: E402

CONVERSATIONS = 10_000
RUNS_EACH = 3
PAGE = 50
REPEAT = 21
BARE = (
    "schema version 2's listing query (a subquery per row, a full sort; paged with LIMIT / OFFSET) "
    "for the pages; for all conversations, the original's own summary query (the latest run by "
    "started_at DESC, rowid DESC off its index (conversation_id, started_at), sorted by updated_at); "
    "both on a copy of the same file with those indexes, each row a Conversation built by its "
    "constructor from a tuple; both sides return the same list of Conversation objects"
)
LATER_PAGE = 100
"""The page number of the "later page" figure (rows 4,951 to 5,000 of 10,000)."""

# Schema version 2's listing, as it was: the latest run found by a subquery per conversation,
# on an index of (conversation_id, started_at), and every conversation sorted by updated_at.
OLD_LISTING = """
SELECT c.id, c.title, c.created_at, c.updated_at, c.message_count,
       r.status, r.error_code, r.error_message
FROM conversations c
LEFT JOIN runs r ON r.rowid = (
    SELECT rowid FROM runs WHERE conversation_id = c.id ORDER BY rowid DESC LIMIT 1
)
ORDER BY c.updated_at DESC, c.rowid DESC"""
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
# The original's index (and schema version 2's), in place of schema version 4's.
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


def anchor(conn: sqlite3.Connection, sql: str):
    """The anchor's call: the query's tuple rows, each a Conversation by its constructor."""
    return lambda: [Conversation(*row) for row in conn.execute(sql)]


class Files:
    """The kit's file and the anchors' copy, filled once."""

    def __init__(self, folder: Path, conversations: int) -> None:
        kit_db, old_db = folder / "kit.db", folder / "old.db"
        fill(kit_db, conversations)
        shutil.copy(kit_db, old_db)
        self.old = sqlite3.connect(old_db)  # tuple rows
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
                return anchor(old, f"{OLD_LISTING} LIMIT {PAGE} OFFSET {offset}")

            # Like with like: the same conversations, the same fields, the same order.
            if kit(service.list_conversations)() != anchor(old, ORIGINAL_LISTING)():
                raise RuntimeError("the kit's list_conversations() and the original's query disagree")
            if kit(lambda: service.conversation_page(PAGE, cursor))().conversations != old_page((later - 1) * PAGE)():
                raise RuntimeError(f"the kit's page {later} and the OFFSET page disagree")

            measured = [
                (f"first page of {PAGE}, {scale}",
                 *paired_ms(kit(lambda: service.conversation_page(PAGE)), old_page(0), repeat)),
                (f"page {later} of {PAGE} (cursor; bare: OFFSET), {scale}",
                 *paired_ms(kit(lambda: service.conversation_page(PAGE, cursor)), old_page((later - 1) * PAGE), repeat)),
                (f"all conversations, list_conversations() (bare: the original's summary query), {scale}",
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
    and the query with the objects built (milliseconds of REPEAT calls)."""
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
        ("original: the query, Conversation(*row) per row", built_bare),
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

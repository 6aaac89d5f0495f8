"""Listing conversations at scale: 10,000 conversations with 3 runs each.

The kit's `AgentService.conversation_page` (keyset pagination, schema version 3's indexes)
against the listing query of schema version 2 — a correlated subquery per row, a sort of every
conversation — on a copy of the same file with version 2's indexes, paged the only way that
query can be (LIMIT / OFFSET). Each figure is the median of several calls on a warm cache.

    python benchmarks/listing.py [--quick]
"""

from __future__ import annotations

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
from sophos_lab.runtime.store import Conversation, Store  # noqa: E402

CONVERSATIONS = 10_000
RUNS_EACH = 3
PAGE = 50
BARE = "schema version 2's listing query (a subquery per row, a full sort) on the same rows with its indexes"
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
OLD_INDEXES = """
DROP INDEX conversations_by_recency;
DROP INDEX runs_by_conversation;
CREATE INDEX runs_by_conversation ON runs (conversation_id, started_at);
"""


def fill(path: Path, conversations: int) -> None:
    """A file as a long-used lab leaves it: `conversations` conversations of RUNS_EACH runs,
    written through the kit's schema (the store creates it), in one transaction."""
    store = Store(path)
    store.conn  # noqa: B018 - creates the file at the current schema version
    store.close()
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


def median_ms(call, repeat: int) -> float:
    call()  # warm the page cache and the statement cache, as a server that keeps running would
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def rows(quick: bool = False) -> list[dict]:
    conversations = 1_000 if quick else CONVERSATIONS
    repeat = 3 if quick else 15
    later = min(LATER_PAGE, conversations // PAGE // 2)
    scale = f"{conversations:,} conversations x {RUNS_EACH} runs"
    with tempfile.TemporaryDirectory() as tmp:
        kit_db, old_db = Path(tmp) / "kit.db", Path(tmp) / "old.db"
        fill(kit_db, conversations)
        shutil.copy(kit_db, old_db)
        old = sqlite3.connect(old_db)
        old.row_factory = sqlite3.Row
        old.executescript(OLD_INDEXES)

        service = AgentService(Settings.from_env({"DATABASE_PATH": str(kit_db)}))
        try:
            cursor = None
            for _ in range(later - 1):
                cursor = service.conversation_page(PAGE, cursor).next_cursor

            def old_page(offset: int):
                return lambda: [Conversation(**row) for row in old.execute(
                    f"{OLD_LISTING} LIMIT {PAGE} OFFSET {offset}")]

            measured = [
                (f"first page of {PAGE}, {scale}",
                 median_ms(lambda: service.conversation_page(PAGE), repeat),
                 median_ms(old_page(0), repeat)),
                (f"page {later} of {PAGE} (cursor; bare: OFFSET), {scale}",
                 median_ms(lambda: service.conversation_page(PAGE, cursor), repeat),
                 median_ms(old_page((later - 1) * PAGE), repeat)),
                (f"all conversations, list_conversations(), {scale}",
                 median_ms(service.list_conversations, max(3, repeat // 3)),
                 median_ms(lambda: [Conversation(**row) for row in old.execute(OLD_LISTING)], max(3, repeat // 3))),
            ]
        finally:
            service.store.close()
            old.close()
    return [
        {"benchmark": "listing", "measure": measure, "kit": kit, "bare": bare, "unit": "ms"}
        for measure, kit, bare in measured
    ]


if __name__ == "__main__":
    from bench import format_table

    print(f"bare: {BARE}")
    print(format_table(rows(quick="--quick" in sys.argv)))

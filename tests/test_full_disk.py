"""A full disk: SQLite answers "database or disk is full", and the kit says so, losing nothing.

Each test mounts a real small file system (a tmpfs) of its own, puts the database on it and
fills it for real: a filler file is written until the kernel answers ENOSPC. Nothing in SQLite
or Python is patched. Where this process cannot mount (not root, no permission), the tests are
skipped and say why.

What they show: a chat, an approval or a resume on a full disk is refused with `STORAGE_FULL`
and writes nothing (every row of the file is the same before and after), and the same request
goes through once there is space; a fresh process whose first open cannot write its owner row
reads on (a worker child lists, the HTTP API lists with 200) and refuses writes (a worker's
`rejected`, HTTP 507, the CLI's one line and exit 1); where SQLite cannot open the file at all,
reads say `STORAGE_FULL` too, and nothing dies; a run that the full disk stopped mid-answer stays
`running` after its process exits, and the next open with space recovers it.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import sqlite3
import subprocess
from pathlib import Path

import pytest
from conftest import integrity, sophos_lab_cli

from sophos_lab.lab.children import child_environment
from sophos_lab.lab.harness import extra_server
from sophos_lab.runtime.errors import SophosError

DISK_SIZE = "4m"
"""Room for the schema, a few runs and their WAL (SQLite checkpoints the WAL at 1000 pages)."""
FULL = "STORAGE_FULL"
"""The code of a refusal for want of space (`errors.STORAGE_FULL`; HTTP 507)."""
NOTE = "Note number {:03d} for the full-disk test: keep it."
"""A message no script matches: the scripted model answers it in a few words."""
ESSAY = "Write an essay on durable execution."
"""The scripted model streams its answer slowly, and holds it half-way when `essay` is armed."""


class Disk:
    """A tmpfs mounted for one test: fill it until ENOSPC, free it again."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.filler = path / "filler"

    @property
    def db(self) -> Path:
        return self.path / "sophos.db"

    def fill(self) -> int:
        """Write the filler until the file system has no byte left; how many were written."""
        written = 0
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            for chunk in (1 << 16, 1 << 12, 1 << 9, 1):
                while True:
                    try:
                        written += os.write(fd, b"\0" * chunk)
                    except OSError as error:
                        if error.errno != errno.ENOSPC:
                            raise
                        break
        finally:
            os.close(fd)
        assert os.statvfs(self.path).f_bavail == 0
        return written

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)


@pytest.fixture
def disk(tmp_path):
    """A fresh tmpfs of `DISK_SIZE` at `tmp_path/disk`, unmounted after the test."""
    mountpoint = tmp_path / "disk"
    mountpoint.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs (to fill it for real) needs root; this process is not root")
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_SIZE},mode=0700", "tmpfs", str(mountpoint)],
                                 capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        pytest.skip("no mount command here: cannot make a small file system to fill")
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip() or mounted.returncode}): "
                    "the full-disk tests need a small real file system")
    try:
        yield Disk(mountpoint)
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True, timeout=30)


def rows(db: Path) -> dict[str, list[tuple]]:
    """Every row of the app tables and the checkpoint tables, read-only (it never recovers)."""
    conn = sqlite3.connect(f"{db.absolute().as_uri()}?mode=ro", uri=True)
    try:
        return {
            table: sorted(map(tuple, conn.execute(f"SELECT * FROM {table}")), key=repr)
            for table in ("conversations", "runs", "idempotency_keys", "gates", "checkpoints", "writes")
        }
    finally:
        conn.close()


def refused_full(error: SophosError | dict) -> None:
    """A `STORAGE_FULL` refusal (an exception, or a `rejected` event's data) that says what it is."""
    code, message = (error.code, error.message) if isinstance(error, SophosError) else (error["code"], error["message"])
    assert code == FULL, error
    assert "is full" in message and "Nothing was accepted" in message, message


def cli(*args: str) -> subprocess.CompletedProcess:
    """`sophos-lab ARGS` in a process of its own."""
    return sophos_lab_cli(*args, env=child_environment({}))


def one_line_refusal(done: subprocess.CompletedProcess, command: str) -> None:
    """The CLI's answer to a full disk: exit 1, one line on stderr with the code, no traceback."""
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert done.stderr.startswith(f"sophos-lab {command}: {FULL}: "), done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr


# --- 1. a request on a full disk -----------------------------------------------------------


async def test_chat_on_a_full_disk_is_refused_with_storage_full_and_writes_nothing(disk, open_service):
    async with open_service(DATABASE_PATH=str(disk.db)) as agent:
        first = await agent.chat(NOTE.format(1))
        assert (await first.wait()).event == "end"
        before = rows(disk.db)
        disk.fill()

        with pytest.raises(SophosError) as new:
            await agent.chat(NOTE.format(2))  # a new conversation: it and its run, or neither
        with pytest.raises(SophosError) as more:
            await agent.chat(NOTE.format(3), first.conversation, idempotency_key="full-disk-3")
        refused_full(new.value)
        refused_full(more.value)
        assert rows(disk.db) == before  # no conversation without its run, no run without its input
        assert agent.active == {}
        with pytest.raises(SophosError) as vacuum:
            await agent.vacuum()  # it needs room for a copy of the file
        refused_full(vacuum.value)
        # Reading goes on.
        [listed] = await agent.list_conversations()
        detail = await agent.get_conversation(first.conversation)
        assert (listed.status, len(detail.messages)) == ("completed", 2)

        disk.free()
        # Space again: the same request (the same key) starts its run now; nothing was left over.
        again = await agent.chat(NOTE.format(3), first.conversation, idempotency_key="full-disk-3")
        final = await again.wait()
        assert (again.replayed, final.event, final.data["status"]) == (False, "end", "completed")
        assert [r.status for r in (await agent.list_runs())] == ["completed", "completed"]
        assert [m["content"] for m in (await agent.get_conversation(first.conversation)).messages if m["role"] == "user"] == [
            NOTE.format(1), NOTE.format(3)]
    assert integrity(disk.db) == "ok"


async def test_approve_and_reject_on_a_full_disk_are_refused_and_decide_nothing(lab, disk, open_service, config_dir, tmp_path):
    mcp = config_dir / "mcp.json"
    mcp.write_text(json.dumps({**json.loads(mcp.read_text()), **extra_server("ledger")}))
    ledger = tmp_path / "ledger.db"
    async with open_service(DATABASE_PATH=str(disk.db), LEDGER_PATH=str(ledger)) as agent:
        waiting = await agent.chat("Please pay 30 to alice.")
        assert (await waiting.wait()).data["status"] == "waiting"
        gate = await agent.pending_approval(waiting.conversation)
        before = rows(disk.db)
        disk.fill()

        with pytest.raises(SophosError) as approve:
            await agent.approve(waiting.conversation, gate=gate.id)
        with pytest.raises(SophosError) as reject:
            await agent.reject(waiting.conversation, "Not today.", gate=gate.id)
        refused_full(approve.value)
        refused_full(reject.value)
        assert rows(disk.db) == before  # the gate is undecided, no run carries a decision
        assert (await agent.pending_approval(waiting.conversation)) == gate
        assert not ledger.exists() or not sqlite3.connect(ledger).execute("SELECT * FROM payments").fetchall()

        disk.free()
        approved = await agent.approve(waiting.conversation, gate=gate.id)
        assert (await approved.wait()).data["status"] == "completed"
        assert [r.status for r in (await agent.list_runs(waiting.conversation))] == ["waiting", "completed"]


# --- 2. a fresh process whose first open meets the full disk --------------------------------


async def test_a_fresh_process_on_a_full_disk_reads_and_refuses_every_write_with_storage_full(lab, disk, open_service):
    # Another process keeps the file open (as a running server would) while the disk fills.
    async with open_service(DATABASE_PATH=str(disk.db)) as holder:
        conversation = (await holder.ask(NOTE.format(1))).data["conversation"]
        before = rows(disk.db)
        disk.fill()

        with lab.worker(DATABASE_PATH=str(disk.db)) as child:
            # Its first open cannot write its owner row: it reads instead of dying.
            [listed] = child.conversations()
            assert (listed["id"], listed["status"]) == (conversation, "completed")
            child.chat(NOTE.format(2), conversation)
            to_old = child.wait_final()
            child.chat(NOTE.format(3))
            to_new = child.wait_final()
            assert child.is_alive()
            delete = cli("delete", conversation, "--database", str(disk.db))
            with lab.server(DATABASE_PATH=str(disk.db)) as server:
                listing = server.request("GET", "/api/conversations")
                posted = server.request("POST", "/api/chat", json={"message": NOTE.format(4)})
            assert rows(disk.db) == before

            disk.free()
            # Space again: the same process writes its owner row with its first run.
            child.chat(NOTE.format(5), conversation)
            done = child.wait_final()

    for refused in (to_old, to_new):
        assert refused["event"] == "rejected"
        refused_full(refused["data"])
    one_line_refusal(delete, "delete")
    assert listing.status_code == 200 and [c["id"] for c in listing.json()["conversations"]] == [conversation]
    assert posted.status_code == 507
    refused_full(posted.json()["error"])
    assert (done["event"], done["data"]["status"]) == ("end", "completed")
    assert integrity(disk.db) == "ok"


async def test_where_not_even_reading_is_possible_every_entry_point_says_storage_full(lab, disk, open_service):
    async with open_service(DATABASE_PATH=str(disk.db)) as writer:
        conversation = (await writer.ask(NOTE.format(1))).data["conversation"]
    # Closed: SQLite folded the WAL back and removed its shared-memory file, which the next
    # open must size again; on a full disk it cannot, and not even a read-only open reads.
    assert not Path(f"{disk.db}-shm").exists()
    disk.fill()

    async with open_service(DATABASE_PATH=str(disk.db)) as fresh:
        with pytest.raises(SophosError) as listing:
            await fresh.list_conversations()
        with pytest.raises(SophosError) as chat:
            await fresh.chat(NOTE.format(2), conversation)
        with lab.worker(DATABASE_PATH=str(disk.db)) as child:
            with pytest.raises(SophosError) as in_child:
                child.conversations()
            assert child.is_alive()
        prune = cli("prune", "--all", "--database", str(disk.db))
        refused_full(listing.value)
        refused_full(chat.value)
        refused_full(in_child.value)
        one_line_refusal(prune, "prune")

        disk.free()
        [listed] = await fresh.list_conversations()
        assert (listed.id, listed.status, listed.message_count) == (conversation, "completed", 2)
    assert integrity(disk.db) == "ok"


# --- 3. a run whose outcome could not be recorded -------------------------------------------


async def test_a_run_the_full_disk_stopped_stays_running_and_the_next_open_with_space_recovers_it(lab, disk, open_service):
    lab.model.arm("essay")
    with lab.worker(DATABASE_PATH=str(disk.db)) as child:
        child.chat(ESSAY)
        conversation = child.conversation()
        lab.model.wait_paused()  # the run's row and its first checkpoints are on disk
        disk.fill()
        lab.model.release()  # the answer's checkpoint finds no space, nor does the outcome
        final = child.wait_final()
        assert child.shutdown() == 0
    assert final["event"] == "chat-error" and "could not be recorded" in final["data"]["message"]
    assert final["data"]["code"] == "STORAGE_FULL"
    assert FULL in final["data"]["message"]

    disk.free()
    [left] = rows(disk.db)["runs"]
    assert left[2] == "running"  # a process that cannot write cannot record its own end

    async with open_service(DATABASE_PATH=str(disk.db)) as fresh:
        [summary] = await fresh.list_conversations()  # the first open with space recovers it
        assert (fresh.store.recovered_runs, summary.status) == (1, "interrupted")
        detail = await fresh.get_conversation(conversation)
        assert (detail.next, detail.resumable, [m["role"] for m in detail.messages]) == (("agent",), True, ["user"])

        before = rows(disk.db)
        disk.fill()
        with pytest.raises(SophosError) as resume:
            await fresh.resume(conversation)
        refused_full(resume.value)
        assert rows(disk.db) == before and fresh.active == {}

        disk.free()
        resumed = await (await fresh.resume(conversation)).wait()
        assert resumed.event == "end"
        assert [r.status for r in (await fresh.list_runs(conversation))] == ["interrupted", "completed"]
        assert [m["role"] for m in (await fresh.get_conversation(conversation)).messages] == ["user", "assistant"]
    assert integrity(disk.db) == "ok"


async def test_the_process_whose_run_could_not_record_its_end_relabels_it_once_there_is_room(lab, disk, open_service):
    """A live process's own run is left alone by recovery (its owner is alive), so the process
    itself relabels the run it could not record: the conversation is not held `running` until a
    restart."""
    lab.model.arm("essay")
    async with open_service(DATABASE_PATH=str(disk.db)) as agent:
        run = await agent.chat(ESSAY)
        await asyncio.to_thread(lab.model.wait_paused)
        disk.fill()
        lab.model.release()
        final = await run.wait()
        still_full = await agent.get_conversation(run.conversation)  # reads; cannot relabel yet

        disk.free()
        detail = await agent.get_conversation(run.conversation)
        resumed = await (await agent.resume(run.conversation)).wait()

    assert (final.event, final.data["code"]) == ("chat-error", "STORAGE_FULL")
    assert still_full.conversation.status == "running"
    assert (detail.conversation.status, detail.resumable) == ("interrupted", True)
    assert resumed.event == "end"

"""Retention: delete a conversation, prune a thread's old checkpoints, VACUUM the file.

On both backends (a real SQLite file, a real PostgreSQL database), the real service with the scripted model, real worker processes for the
crashes, and the CLI as a child process. A prune must keep the thread exactly: the messages
`get_conversation` shows, the raw state LangGraph rebuilds, `next`, and what the model is sent
on the next turn, for threads of the kit's `DeltaChannel` and for threads written with
LangGraph's default `add_messages` channel (as the kit wrote them before).
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import integrity, roles, sophos_lab_cli, statuses

from sophos_lab.lab.children import child_environment
from sophos_lab.lab import inspect
from sophos_lab.lab.harness import Lab
from sophos_lab.lab.inspect import checkpoints
from sophos_lab.runtime.errors import BAD_REQUEST, NOT_FOUND, OWNERSHIP_LOST, SESSION_IN_PROGRESS, SophosError
from sophos_lab.runtime.storage import postgres_storage, sqlite_storage
from sophos_lab.runtime.storage.blocking import Blocking
from sophos_lab.runtime.storage.postgres import is_postgres_url

# The PostgreSQL side runs in `make test-matrix`: make test tries PostgreSQL through test_postgres,
# test_workers, test_ownership, test_users and the PostgreSQL crash matrices (see docs/testing.md).
pytestmark = pytest.mark.both_backends(postgres_full_matrix=True)

SUMMARISE = "Fetch {url} and summarize it in 12 detailed bullet points."
UNKNOWN = "00000000-0000-4000-8000-000000000000"


@pytest.fixture
def own_lab(request, lab_home, database):
    """A lab of this test's own, for a worker that is killed (its model pause is the test's)."""
    with Lab.setup(f"tests-retention-{request.node.name}", quiet=True, fork_servers=True,
                   database_url=database.get("DATABASE_URL")) as lab:
        yield lab


@pytest.fixture
def where(database) -> str:
    """This test's database as the lab's views name it: the file's path, or the URL."""
    return database.get("DATABASE_URL") or database["DATABASE_PATH"]


@contextlib.asynccontextmanager
async def service_of(lab):
    """An `AgentService` in this process on `lab`'s database, model and configuration."""
    service = lab.service()
    try:
        yield service
    finally:
        await service.aclose()


def on_postgres(database) -> bool:
    return is_postgres_url(str(database))


def rows(database, sql: str, *params) -> list[tuple]:
    """A read-only query (`?` placeholders) on either backend."""
    return list(inspect.sql(database, sql, params).itertuples(index=False, name=None))


def counts(database, conversation: str) -> dict[str, int]:
    """The conversation's rows in every table that holds any."""
    writes = "checkpoint_writes" if on_postgres(database) else "writes"
    return {
        "conversations": rows(database, "SELECT count(*) FROM conversations WHERE id = ?", conversation)[0][0],
        "runs": rows(database, "SELECT count(*) FROM runs WHERE conversation_id = ?", conversation)[0][0],
        "checkpoints": rows(database, "SELECT count(*) FROM checkpoints WHERE thread_id = ?", conversation)[0][0],
        "writes": rows(database, f"SELECT count(*) FROM {writes} WHERE thread_id = ?", conversation)[0][0],
        "prunes": rows(database, "SELECT count(*) FROM prunes WHERE conversation_id = ?", conversation)[0][0],
    }


POSTGRES_TABLES = ("conversations", "owners", "runs", "prunes", "idempotency_keys", "gates",
                   "checkpoints", "checkpoint_blobs", "checkpoint_writes")


def files(database) -> tuple:
    """Everything the database holds. SQLite: the file and its WAL, byte for byte (a missing
    WAL reads as empty; the `-shm` index is left out: a reader creates it, and it holds no
    data). PostgreSQL: every row of every table, as text."""
    if on_postgres(database):
        return tuple(sorted(rows(database, f"SELECT t::text FROM {table} t")) for table in POSTGRES_TABLES)
    wal = Path(f"{database}-wal")
    return Path(database).read_bytes(), wal.read_bytes() if wal.exists() else b""


def intact(database) -> str:
    """"ok" when the database is whole. SQLite: `PRAGMA integrity_check`. PostgreSQL (whose
    pages the server checks): no checkpoint names a parent that is gone, no write a checkpoint
    that is gone, and every blob a checkpoint names is there."""
    if not on_postgres(database):
        return integrity(Path(database))
    dangling = rows(database, """
        SELECT 'parent', count(*) FROM checkpoints c WHERE parent_checkpoint_id IS NOT NULL AND NOT EXISTS (
            SELECT 1 FROM checkpoints p WHERE p.thread_id = c.thread_id AND p.checkpoint_ns = c.checkpoint_ns
            AND p.checkpoint_id = c.parent_checkpoint_id)
        UNION ALL SELECT 'write', count(*) FROM checkpoint_writes w WHERE NOT EXISTS (
            SELECT 1 FROM checkpoints c WHERE c.thread_id = w.thread_id AND c.checkpoint_ns = w.checkpoint_ns
            AND c.checkpoint_id = w.checkpoint_id)
        UNION ALL SELECT 'blob', count(*) FROM checkpoints c, jsonb_each_text(c.checkpoint -> 'channel_versions') v
            WHERE c.checkpoint -> 'channel_values' -> v.key = 'true' AND NOT EXISTS (
            SELECT 1 FROM checkpoint_blobs b WHERE b.thread_id = c.thread_id AND b.checkpoint_ns = c.checkpoint_ns
            AND b.channel = v.key AND b.version = v.value)""")
    return "ok" if all(n == 0 for _, n in dangling) else f"dangling rows: {dangling}"


@dataclass
class Thread:
    """Everything a prune must keep: what the UI shows and the raw state LangGraph rebuilds."""

    messages: list[dict]
    next: tuple[str, ...]
    resumable: bool
    state: list
    """The message objects of the thread's latest checkpoint, as LangGraph rebuilds them."""


async def thread(agent, conversation: str) -> Thread:
    detail = await agent.get_conversation(conversation)
    state = (await agent.state_history(conversation))[-1].values["messages"]
    return Thread(detail.messages, detail.next, detail.resumable, state)


async def talk(agent, lab, turns: int, conversation: str | None = None) -> str:
    """A conversation of `turns` runs: a fetch (a tools step), then greetings."""
    for n in range(turns):
        message = f"Fetch {lab.page('index.html')}" if n == 0 and conversation is None else f"hello {n}"
        end = await agent.ask(message, conversation)
        assert end.event == "end", end.data
        conversation = end.data["conversation"]
    return conversation


# --- delete ------------------------------------------------------------------------------


async def test_delete_removes_the_conversation_and_everything_keyed_to_it(lab, open_service, where):
    async with open_service() as agent:
        doomed = await talk(agent, lab, 3)
        await agent.prune_conversation(doomed, keep=2)  # a prune record, keyed to it too
        kept = await talk(agent, lab, 2)
        kept_before = await thread(agent, kept)
        there = counts(where, doomed)

        removal = await agent.delete_conversation(doomed)

        assert (removal.runs, removal.checkpoints, removal.writes) == (there["runs"], there["checkpoints"], there["writes"])
        assert removal.bytes > 0 and not removal.dry_run
        assert counts(where, doomed) == dict.fromkeys(there, 0)
        assert [c.id for c in (await agent.list_conversations())] == [kept]
        assert await thread(agent, kept) == kept_before
        with pytest.raises(SophosError) as gone:
            await agent.get_conversation(doomed)
    assert gone.value.code == NOT_FOUND
    assert intact(where) == "ok"


async def test_delete_takes_the_idempotency_keys_of_its_runs_and_the_key_can_start_a_run_again(open_service):
    key = "order-7"
    async with open_service() as agent:
        run = await agent.chat("hello", idempotency_key=key)
        await run.wait()
        assert (await agent.store.keyed_run("order-7")).run_id == run.id

        await agent.delete_conversation(run.conversation)

        assert (await agent.store.keyed_run("order-7")) is None
        again = await agent.chat("hello", idempotency_key=key)
        assert (await again.wait()).event == "end"
        assert (await agent.store.keyed_run("order-7")).run_id == again.id


async def test_a_dry_run_of_delete_says_exactly_what_would_go_and_changes_nothing(lab, open_service, where):
    async with open_service() as writer:
        conversation = await talk(writer, lab, 2)
    before = files(where)

    async with open_service() as agent:
        planned = await agent.delete_conversation(conversation, dry_run=True)
    assert files(where) == before  # not a byte, not even an owner row or the recovery sweep

    async with open_service() as agent:
        done = await agent.delete_conversation(conversation)
    assert planned.dry_run and not done.dry_run
    assert (planned.runs, planned.checkpoints, planned.writes, planned.bytes) == (
        done.runs, done.checkpoints, done.writes, done.bytes)
    assert (done.runs, done.checkpoints > 0, done.writes > 0) == (2, True, True)
    assert "would delete" in planned.describe() and f"{planned.bytes:,} bytes" in planned.describe()


async def test_delete_and_prune_refuse_a_conversation_a_live_process_runs_and_take_it_once_crashed(own_lab):
    """The run's owner is alive: refused, nothing changed. Killed (in a process this one opened
    the file before): its run is no obstacle, and the conversation goes with it."""
    lab = own_lab
    async with service_of(lab) as agent:
        await agent.list_conversations()  # this process has the file open before the other one's run
        lab.model.arm("summary")
        with lab.worker() as child:
            child.chat(SUMMARISE.format(url=lab.page("wal.html")))
            conversation = child.conversation()
            lab.model.wait_paused()  # a live `running` run, held half-way through its answer
            there = counts(lab.database, conversation)

            refusals = []
            for attempt in (
                lambda: agent.delete_conversation(conversation),
                lambda: agent.delete_conversation(conversation, dry_run=True),
                lambda: agent.prune_conversation(conversation, keep=1),
                lambda: agent.prune_conversation(conversation, keep=1, dry_run=True),
            ):
                with pytest.raises(SophosError) as refused:
                    await attempt()
                refusals.append(refused.value.code)
            assert counts(lab.database, conversation) == there
            assert list(lab.peek_runs(conversation)["status"]) == ["running"]

            assert child.kill() == -9

        planned = await agent.delete_conversation(conversation, dry_run=True)
        done = await agent.delete_conversation(conversation)

    assert refusals == [SESSION_IN_PROGRESS] * 4
    assert (planned.runs, planned.checkpoints, planned.writes) == (done.runs, done.checkpoints, done.writes)
    assert counts(lab.database, conversation) == dict.fromkeys(there, 0)
    assert intact(lab.database) == "ok"


async def test_a_process_frozen_past_its_lease_writes_nothing_back_into_a_deleted_conversation(own_lab):
    """Delete is no way around ownership: the frozen process lost its run, and when it wakes its
    saver's fence refuses the checkpoint it was about to write, so nothing comes back."""
    lab = own_lab
    with lab.worker(SOPHOS_LAB_LEASE_SECONDS="1.5") as child:
        lab.model.arm("summary")
        child.chat(SUMMARISE.format(url=lab.page("wal.html")))
        conversation = child.conversation()
        lab.model.wait_paused()
        child.freeze()
        [owner] = lab.peek_runs(conversation)["owner_id"]
        [(expires,)] = rows(lab.database, "SELECT lease_expires_monotonic FROM owners WHERE id = ?", owner)
        # The one wait here is for a deadline the file itself records: a frozen process cannot renew.
        time.sleep(max(0.0, expires - time.monotonic()) + 0.05)

        async with service_of(lab) as agent:
            done = await agent.delete_conversation(conversation)

        lab.model.release()  # its held answer comes through when it wakes
        child.thaw()
        woke = child.wait_final()

    assert done.runs == 1 and done.checkpoints > 0
    assert (woke["event"], woke["data"]["code"]) == ("chat-error", OWNERSHIP_LOST)
    assert set(counts(lab.database, conversation).values()) == {0}  # nothing came back


async def test_an_unknown_or_malformed_conversation_is_refused_and_nothing_is_written(open_service, where, db_path):
    before = files(where) if on_postgres(where) else None
    async with open_service() as agent:
        codes = []
        attempts = [
            lambda: agent.delete_conversation(UNKNOWN),
            lambda: agent.delete_conversation(UNKNOWN, dry_run=True),
            lambda: agent.prune_conversation(UNKNOWN),
            lambda: agent.prune_conversation(UNKNOWN, dry_run=True),
            lambda: agent.delete_conversation("not-an-id"),
            lambda: agent.prune_conversation(UNKNOWN, keep=0),
        ]
        if not on_postgres(where):
            attempts.append(lambda: agent.vacuum())  # of a file that is not there
        for attempt in attempts:
            with pytest.raises(SophosError) as refused:
                await attempt()
            codes.append(refused.value.code)
    assert codes == [NOT_FOUND] * 4 + [BAD_REQUEST] * 2 + [NOT_FOUND] * (not on_postgres(where))
    if on_postgres(where):
        assert files(where) == before  # the service's owner row went when it closed
    else:
        assert not db_path.exists()  # a refusal does not create the file

    async with open_service() as agent:
        conversation = (await agent.ask("hello")).data["conversation"]
        there = counts(where, conversation)
        for keep in (0, -1, 1.5, True, "2"):
            with pytest.raises(SophosError) as refused:
                await agent.prune_conversation(conversation, keep=keep)
            assert refused.value.code == BAD_REQUEST
        with pytest.raises(SophosError) as refused:
            await agent.delete_conversation(UNKNOWN)
        assert refused.value.code == NOT_FOUND
    assert counts(where, conversation) == there


# --- prune: the kit's DeltaChannel threads -------------------------------------------------


@pytest.mark.parametrize("keep", [None, 1, 3], ids=["latest-run", "keep-1", "keep-3"])
async def test_prune_keeps_the_thread_exactly_and_the_next_turn_sends_every_message(lab, open_service, where, keep):
    async with open_service() as agent:
        conversation = await talk(agent, lab, 5)
        before = await thread(agent, conversation)
        there = counts(where, conversation)

        removal = await agent.prune_conversation(conversation, keep=keep)
        after = await thread(agent, conversation)
        left = counts(where, conversation)

        seen = len(lab.model.chat_requests())
        assert (await agent.ask("hello once more", conversation)).event == "end"
        [request] = lab.model.chat_requests()[seen:]
        continued = await agent.get_conversation(conversation)

    assert after == before
    kept = {None: 3, 1: 1, 3: 3}[keep]  # the latest run, a greeting, wrote 3 checkpoints
    assert (removal.kept_checkpoints, removal.checkpoints) == (kept, there["checkpoints"] - kept)
    assert left["checkpoints"] == kept
    assert removal.writes == there["writes"] - left["writes"] > 0
    assert (left["runs"], left["prunes"]) == (there["runs"], 1)
    assert removal.snapshot_bytes > 0  # the oldest kept checkpoint now holds the whole list
    assert request["n_messages"] == 1 + len(before.messages) + 1  # system, the whole thread, the new one
    assert roles(continued)[-2:] == ["user", "assistant"] and len(continued.messages) == len(before.messages) + 2
    assert intact(where) == "ok"


async def test_a_dry_run_of_prune_says_exactly_what_would_go_and_changes_nothing(lab, open_service, where):
    async with open_service() as writer:
        conversation = await talk(writer, lab, 3)
    before = files(where)

    async with open_service() as agent:
        planned = await agent.prune_conversation(conversation, keep=2, dry_run=True)
    assert files(where) == before

    there = counts(where, conversation)
    async with open_service() as agent:
        done = await agent.prune_conversation(conversation, keep=2)
    left = counts(where, conversation)
    assert planned.dry_run and not done.dry_run
    assert (planned.checkpoints, planned.writes, planned.bytes, planned.kept_checkpoints, planned.snapshot_bytes) == (
        done.checkpoints, done.writes, done.bytes, done.kept_checkpoints, done.snapshot_bytes)
    assert (done.checkpoints, done.writes) == (there["checkpoints"] - 2, there["writes"] - left["writes"])
    assert (left["checkpoints"], left["runs"], left["prunes"]) == (2, 3, 1)  # every run is kept


async def test_the_history_view_says_what_was_pruned_and_when(lab, open_service, where):
    async with open_service() as agent:
        conversation = await talk(agent, lab, 3)
        history = checkpoints(where, conversation)
        first = await agent.prune_conversation(conversation, keep=4)
        second = await agent.prune_conversation(conversation, keep=2)
        again = await agent.prune_conversation(conversation, keep=2)  # nothing older is left
    view = checkpoints(where, conversation)
    pruned, kept = view.iloc[:2], view.iloc[2:].reset_index(drop=True)
    [(first_at,), (second_at,)] = rows(where, "SELECT pruned_at FROM prunes WHERE conversation_id = ? ORDER BY id", conversation)

    assert kept.to_dict("records") == history.iloc[-2:].to_dict("records")  # the kept rows read as before
    steps = list(history["step"])
    assert list(pruned["source"]) == [
        f"pruned: {first.checkpoints} older checkpoints, steps {steps[0]} to {steps[-5]}",
        f"pruned: {second.checkpoints} older checkpoints, steps {steps[-4]} to {steps[-3]}",
    ]
    assert list(pruned["created_at"]) == [first_at, second_at]
    assert pruned["checkpoint_id"].isna().all() and pruned["step"].isna().all()
    assert (first.checkpoints, second.checkpoints, again.checkpoints) == (len(history) - 4, 2, 0)
    assert "nothing to prune" in again.describe()


async def test_a_crashed_run_resumes_after_its_thread_is_pruned(own_lab):
    """Killed while the answer after the tool result streamed: the pruned thread still resumes
    at the agent step, without fetching the page again, and then takes a new message."""
    lab = own_lab
    async with service_of(lab) as first:
        conversation = await talk(first, lab, 2, conversation=(await first.ask("hello")).data["conversation"])
    lab.model.arm("summary")
    with lab.worker() as child:
        child.chat(SUMMARISE.format(url=lab.page("wal.html")), conversation)
        child.wait_for("trace", event="result")
        lab.model.wait_paused()
        assert child.kill() == -9

    async with service_of(lab) as fresh:
        before = await thread(fresh, conversation)
        removal = await fresh.prune_conversation(conversation, keep=1)
        after = await thread(fresh, conversation)

        seen = len(lab.model.chat_requests())
        resumed = await fresh.resume(conversation)
        end = await resumed.wait()
        more = await fresh.ask("hello, after the resume", conversation)
        resume_request, new_request = lab.model.chat_requests()[seen:]
        final = await fresh.get_conversation(conversation)
        assert (await statuses(fresh, conversation)) == ["completed"] * 3 + ["interrupted", "completed", "completed"]

    assert (before.next, before.resumable) == (("agent",), True)
    assert after == before
    assert removal.kept_checkpoints == 1 and removal.checkpoints > 0
    assert (end.data["status"], more.event) == ("completed", "end")
    assert [e.data["node"] for e in resumed.buffer if e.event == "trace" and e.data["event"] == "enter"] == ["agent"]
    assert lab.fetches("wal.html") == 1  # the tool result survived the prune
    assert resume_request["n_messages"] == 1 + len(before.messages)
    assert new_request["n_messages"] == 1 + len(before.messages) + 2
    assert roles(final)[-5:] == ["assistant", "tool", "assistant", "user", "assistant"]


# --- prune: threads written with LangGraph's default channel ------------------------------


def write_with_the_default_channel(lab, database, turns: list[str], crash_last: bool = False) -> str:
    """A conversation as the kit wrote it before its messages channel was a DeltaChannel (and
    as `migrate-to-postgres` copies such a thread): the same graph shape with LangGraph's
    default `add_messages` channel (`MessagesState`), on the same database, with the kit's run
    rows and run ids. With `crash_last`, the last turn is left as a kill during its model call
    leaves it: the run `running` with its owner gone, `next` agent.
    """
    from langchain_core.messages import HumanMessage, SystemMessage
    from langchain_ollama import ChatOllama
    from langgraph.checkpoint.sqlite import SqliteSaver
    from langgraph.graph import END, START, MessagesState, StateGraph

    from sophos_lab.runtime.agent import DEFAULT_SYSTEM_PROMPT

    model = ChatOllama(model="scripted", base_url=lab.settings().ollama_host)

    def agent(state: MessagesState) -> dict:
        return {"messages": [model.invoke([SystemMessage(DEFAULT_SYSTEM_PROMPT), *state["messages"]])]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_node("tools", agent)  # the kit's shape; greetings never call a tool
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", lambda state: "tools" if state["messages"][-1].tool_calls else END,
                                  ["tools", END])
    builder.add_edge("tools", "agent")

    conversation = str(uuid.uuid4())
    if on_postgres(database):
        import psycopg
        from langgraph.checkpoint.postgres import PostgresSaver
        from psycopg.rows import dict_row

        store = Blocking(lambda: postgres_storage(database))
        conn = psycopg.connect(database, autocommit=True, row_factory=dict_row)  # not fenced: no owner set
        saver = PostgresSaver(conn)
    else:
        store = Blocking(lambda: sqlite_storage(database))
        conn = sqlite3.connect(database, check_same_thread=False)
        saver = SqliteSaver(conn)
    try:
        graph = builder.compile(checkpointer=saver)
        for n, text in enumerate(turns):
            run_id, message = str(uuid.uuid4()), {"id": str(uuid.uuid4()), "content": text}
            store.start_run(run_id, conversation, [message], title=text if n == 0 else None)
            config = {"configurable": {"thread_id": conversation}, "metadata": {"run_id": run_id}}
            crash = crash_last and n == len(turns) - 1
            graph.invoke({"messages": [HumanMessage(text, id=message["id"])]}, config, durability="sync",
                         interrupt_before=["agent"] if crash else None)
            if not crash:
                store.finish_run(run_id, "completed", len(graph.get_state(config).values["messages"]))
        stored = [t.checkpoint["channel_values"].get("messages") for t in saver.list({"configurable": {"thread_id": conversation}})]
        assert all(isinstance(value, list) for value in stored if value is not None), "not the default channel"
    finally:
        conn.close()
        store.close()  # its owner row goes: the crashed run's owner is gone
    return conversation


async def test_a_thread_of_the_default_channel_prunes_exactly_resumes_and_continues(lab, open_service, where):
    conversation = write_with_the_default_channel(lab, where, ["hello", "hi there", "hello, third"], crash_last=True)

    async with open_service() as agent:
        before = await thread(agent, conversation)
        removal = await agent.prune_conversation(conversation)  # keeps the crashed run's checkpoints
        after = await thread(agent, conversation)

        seen = len(lab.model.chat_requests())
        end = await (await agent.resume(conversation)).wait()
        more = await agent.ask("hi, fourth", conversation)
        resume_request, new_request = lab.model.chat_requests()[seen:]

        # The thread now mixes both kinds: old checkpoints with whole lists, new ones with deltas.
        mixed = await thread(agent, conversation)
        rewritten = await agent.prune_conversation(conversation, keep=1)
        last = await thread(agent, conversation)
        assert (await statuses(agent, conversation)) == ["completed", "completed", "interrupted", "completed", "completed"]

    assert (before.next, before.resumable) == (("agent",), True)
    assert roles(before) == ["user", "assistant", "user", "assistant", "user"]
    assert after == before
    assert removal.checkpoints > 0
    assert removal.snapshot_bytes == 0  # a default-channel checkpoint stores the whole list already
    assert (end.data["status"], more.event) == ("completed", "end")
    assert resume_request["n_messages"] == 1 + 5
    assert new_request["n_messages"] == 1 + 6 + 1
    assert rewritten.checkpoints > 0 and rewritten.snapshot_bytes > 0  # a delta checkpoint became the root
    assert last == mixed
    assert roles(last) == ["user", "assistant"] * 4
    assert intact(where) == "ok"


# --- vacuum ------------------------------------------------------------------------------


async def test_vacuum_after_a_delete_gives_the_space_back_and_keeps_everything_else(lab, open_service, where):
    """VACUUM may renumber rowids, which order runs and conversations: their order must hold."""
    async with open_service() as agent:
        doomed, kept, third = [await talk(agent, lab, 1) for _ in range(3)]
        for _ in range(4):  # runs of the three interleaved
            for conversation in (doomed, kept, third):
                await talk(agent, lab, 1, conversation)
        listed = [c.id for c in (await agent.list_conversations()) if c.id != doomed]
        runs = [run.id for run in (await agent.list_runs()) if run.conversation_id != doomed]
        kept_before = await thread(agent, kept)
        await agent.delete_conversation(doomed)

        vacuum = await agent.vacuum()
        if not on_postgres(where):
            assert vacuum.bytes_after == Path(where).stat().st_size  # the WAL is folded back in

        assert [c.id for c in (await agent.list_conversations())] == listed
        assert [run.id for run in (await agent.list_runs())] == runs
        assert await thread(agent, kept) == kept_before
        assert (await agent.ask("hello after the vacuum", kept)).event == "end"
    assert vacuum.free_bytes_before is None if on_postgres(where) else vacuum.free_bytes_before > 0
    assert vacuum.bytes_after < vacuum.bytes_before
    assert intact(where) == "ok"


async def test_vacuum_is_refused_while_a_run_is_running(lab, open_service):
    lab.web.hold("/index.html")
    try:
        async with open_service() as agent:
            run = await agent.chat(f"Fetch {lab.page('index.html')}")
            await asyncio.to_thread(lab.web.wait_held)
            with pytest.raises(SophosError) as refused:
                await agent.vacuum()
            lab.web.release()
            assert (await run.wait()).event == "end"
            after = await agent.vacuum()
    finally:
        lab.web.release()
    assert refused.value.code == SESSION_IN_PROGRESS
    assert after.bytes_after <= after.bytes_before


# --- the CLI -----------------------------------------------------------------------------


def named(where) -> tuple[list[str], dict[str, str]]:
    """How the CLI is pointed at this database: `--database PATH`, or `DATABASE_URL`."""
    return ([], {"DATABASE_URL": where}) if on_postgres(where) else (["--database", str(where)], {})


def in_env(where) -> dict[str, str]:
    return {"DATABASE_URL" if on_postgres(where) else "DATABASE_PATH": str(where)}


def sophos_lab(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """`sophos-lab ARGS` as a child process, with a lab home of its own (never the repository's)."""
    environment = {k: v for k, v in child_environment({}).items()
                   if k not in ("DATABASE_PATH", "DATABASE_URL", "MEMORY_FILE_PATH")}
    environment.update(SOPHOS_LAB_HOME=str(tmp_path / "lab-home"), **env)
    return sophos_lab_cli(*args, env=environment, cwd=tmp_path)


@pytest.mark.both_backends(postgres_full_matrix=True)
async def test_cli_dry_runs_print_exactly_what_would_go_and_change_nothing(lab, open_service, where, tmp_path):
    async with open_service() as agent:
        conversation = await talk(agent, lab, 3)
        other = await talk(agent, lab, 1)
        would_prune = await agent.prune_conversation(conversation, keep=2, dry_run=True)
        would_delete = await agent.delete_conversation(conversation, dry_run=True)
    before = files(where)

    args, env = named(where)
    prune = sophos_lab(tmp_path, "prune", conversation, "--keep", "2", "--dry-run", *args, **env)
    delete = sophos_lab(tmp_path, "delete", conversation, "--dry-run", **in_env(where))
    every = sophos_lab(tmp_path, "prune", "--all", "--dry-run", *args, **env)

    assert (prune.returncode, delete.returncode, every.returncode) == (0, 0, 0), prune.stderr + delete.stderr + every.stderr
    assert prune.stdout.strip() == would_prune.describe()
    assert delete.stdout.strip() == would_delete.describe()
    assert f"would prune {would_prune.checkpoints} checkpoints and {would_prune.writes} writes ({would_prune.bytes:,} bytes)" in prune.stdout
    assert [line.split(":")[0] for line in every.stdout.splitlines()] == [conversation, other]
    assert files(where) == before
    assert not (tmp_path / "lab-home").exists()  # the default database was never made


@pytest.mark.both_backends(postgres_full_matrix=True)
async def test_cli_delete_prune_and_vacuum_change_the_database_and_only_it(lab, open_service, where, tmp_path):
    memory = tmp_path / "memory.jsonl"
    memory.write_text('{"type": "entity", "name": "lab", "entityType": "thing", "observations": []}\n')
    remembered = memory.read_bytes()
    async with open_service() as agent:
        doomed = await talk(agent, lab, 2)
        pruned = await talk(agent, lab, 3)
        before = await thread(agent, pruned)

    args, env = named(where)
    delete = sophos_lab(tmp_path, "delete", doomed, "--vacuum", *args, MEMORY_FILE_PATH=str(memory), **env)
    prune = sophos_lab(tmp_path, "prune", pruned, "--keep", "1", *args, MEMORY_FILE_PATH=str(memory), **env)
    vacuum = sophos_lab(tmp_path, "vacuum", **in_env(where), MEMORY_FILE_PATH=str(memory))

    assert (delete.returncode, prune.returncode, vacuum.returncode) == (0, 0, 0), delete.stderr + prune.stderr + vacuum.stderr
    assert delete.stdout.startswith(f"{doomed}: deleted the conversation with 2 runs")
    assert "bytes before VACUUM" in delete.stdout.splitlines()[1]  # VACUUM FULL on PostgreSQL
    assert prune.stdout.startswith(f"{pruned}: pruned ") and "kept 1 checkpoints" in prune.stdout
    assert "bytes before VACUUM" in vacuum.stdout
    async with open_service() as agent:
        assert [c.id for c in (await agent.list_conversations())] == [pruned]
        assert await thread(agent, pruned) == before
    assert memory.read_bytes() == remembered
    assert "MEMORY_FILE_PATH" in sophos_lab(tmp_path, "prune", "--help").stdout


def test_cli_refusals_exit_1_with_the_code_and_change_nothing(tmp_path, fetched):
    before = files(fetched.db_path)
    unknown = sophos_lab(tmp_path, "delete", UNKNOWN, "--database", str(fetched.db_path))
    malformed = sophos_lab(tmp_path, "prune", "nope", "--database", str(fetched.db_path))
    keep_zero = sophos_lab(tmp_path, "prune", fetched.conversation, "--keep", "0", "--database", str(fetched.db_path))
    all_keep_zero = sophos_lab(tmp_path, "prune", "--all", "--keep", "0", "--database", str(fetched.db_path))
    assert (unknown.returncode, malformed.returncode, keep_zero.returncode, all_keep_zero.returncode) == (1, 1, 1, 1)
    assert all_keep_zero.stderr.startswith(f"sophos-lab prune: {BAD_REQUEST}: ")
    assert unknown.stderr.startswith(f"sophos-lab delete: {NOT_FOUND}: ")
    assert malformed.stderr.startswith(f"sophos-lab prune: {BAD_REQUEST}: ")
    assert keep_zero.stderr.startswith(f"sophos-lab prune: {BAD_REQUEST}: ")
    assert files(fetched.db_path) == before

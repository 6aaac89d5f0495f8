"""No conversation left stuck: a run stopped at any instant leaves it answered or resumable.

LangGraph saves a step in two commits, the task's pending writes and then the checkpoint that
folds them in; a run stopped between them leaves a latest checkpoint whose task has finished,
and LangGraph's live `next` is then empty although `astream(None)` still has work. These tests
stop runs at exactly those instants: each commit a run makes is observable
(`AgentService.on_write`), and a cancel is started right after it, before the run goes on.
"""

from __future__ import annotations

import asyncio

import pytest
from conftest import kill_points, roles, transcript as plain

from sophos_lab.lab import inspect as views
from sophos_lab.runtime.errors import RUN_NOT_ACTIVE, SophosError
from sophos_lab.server.wire import conversation_detail
from sophos_lab.ui.backends import ChildBackend


def answered(detail) -> bool:
    last = detail.messages[-1] if detail.messages else None
    return bool(last) and last["role"] == "assistant" and not last.get("toolCalls") and not detail.next


def fresh(database, tmp_path, name: str) -> dict[str, str]:
    """A database of its own for each stop: a new SQLite file; on PostgreSQL the test's one
    database (each stop's run starts a conversation of its own there)."""
    return {} if "DATABASE_URL" in database else {"DATABASE_PATH": str(tmp_path / f"{name}.db")}


async def reference(lab, open_service, tmp_path, message: str, database=None):
    """The uninterrupted run: its commits in order, its transcript, its fetches and model calls."""
    writes = []
    before = (lab.fetches("index.html"), lab.model_calls())
    async with open_service(**fresh(database or {}, tmp_path, "reference")) as agent:
        agent.on_write = writes.append
        run = await agent.chat(message)
        assert (await run.wait()).event == "end"
        detail = await agent.get_conversation(run.conversation)
    return writes, detail, (lab.fetches("index.html") - before[0], lab.model_calls() - before[1])


async def cancelled_after_commit(agent, message: str, k: int):
    """Start a run and cancel it right after its `k`-th commit; the run, and the commit."""
    seen, cancels = [], []

    def observe(write):
        seen.append(write)
        if len(seen) == k:
            cancels.append(asyncio.get_running_loop().create_task(agent.cancel(write.conversation)))

    agent.on_write = observe
    run = await agent.chat(message)
    await run.wait()
    for cancel in cancels:
        try:
            await cancel
        except SophosError as late:  # the run had recorded its outcome and left
            assert late.code == RUN_NOT_ACTIVE
    agent.on_write = None
    return run, seen[k - 1]


@pytest.mark.crash_matrix
@pytest.mark.both_backends(postgres_full_matrix=True)
async def test_a_cancel_right_after_any_commit_leaves_the_conversation_answered_or_resumable(
        lab, open_service, tmp_path, database, every_point):
    message = f"Fetch {lab.page('index.html')}"
    writes, done, (fetches, model_calls) = await reference(lab, open_service, tmp_path, message, database)
    assert [w.kind for w in writes] == ["run", "checkpoint", "writes", "checkpoint", "writes", "checkpoint",
                                        "writes", "checkpoint", "writes", "checkpoint", "outcome"]
    outcomes = []
    for k in kill_points([write.describe() for write in writes], every_point):
        before = (lab.fetches("index.html"), lab.model_calls())
        async with open_service(**fresh(database, tmp_path, f"point-{k}")) as agent:
            run, write = await cancelled_after_commit(agent, message, k)
            stopped = await agent.get_conversation(run.conversation)
            outcomes.append((write.describe(), stopped.conversation.status, stopped.next))
            assert stopped.resumable or answered(stopped), (k, write.describe(), stopped)
            while stopped.resumable:
                assert (await (await agent.resume(run.conversation)).wait()).event == "end"
                stopped = await agent.get_conversation(run.conversation)
        after = (lab.fetches("index.html") - before[0], lab.model_calls() - before[1])

        assert plain(stopped.messages) == plain(done.messages), (k, write.describe())
        assert after == (fetches, model_calls), (k, write.describe())  # no finished step ran twice

    # The instants of the window were reached: a step's writes committed, its checkpoint not.
    assert ("writes tools (messages, branch:to:agent)", "cancelled", ("tools",)) in outcomes, outcomes


async def stopped_at_each_commit(lab, open_service, tmp_path, message: str, every: bool):
    """For each commit of the uninterrupted run but its outcome (or a sample: `kill_points`): a
    fresh service whose run of `message` was cancelled right after that commit, with what it
    showed then and the fetches."""
    writes, _, _ = await reference(lab, open_service, tmp_path, message)
    for k in kill_points([write.describe() for write in writes[:-1]], every):
        async with open_service(DATABASE_PATH=str(tmp_path / f"point-{k}.db")) as agent:
            run, write = await cancelled_after_commit(agent, message, k)
            yield k, agent, run, await agent.get_conversation(run.conversation), lab.fetches("index.html")


@pytest.mark.crash_matrix
async def test_a_new_message_after_a_stop_between_a_steps_writes_and_its_checkpoint_keeps_that_step(
        lab, open_service, tmp_path, every_point):
    """LangGraph drops the latest checkpoint's pending writes when a run starts with input; the
    kit checkpoints them first, so what the stopped run did stays, ahead of the new message."""
    message = f"Fetch {lab.page('index.html')}"
    async for k, agent, run, stopped, fetches in stopped_at_each_commit(lab, open_service, tmp_path, message, every_point):
        assert (await (await agent.chat("Hello there", run.conversation)).wait()).event == "end"
        final = await agent.get_conversation(run.conversation)

        kept = [m["id"] for m in stopped.messages]
        assert [m["id"] for m in final.messages][:len(kept)] == kept, k
        assert [m["content"] for m in final.messages if m["role"] == "user"] == [message, "Hello there"], k
        assert roles(final)[-2:] == ["user", "assistant"] and not final.next, k
        assert lab.fetches("index.html") == fetches, k  # nothing of the stopped run was repeated


@pytest.mark.crash_matrix
async def test_a_new_message_cancelled_before_it_folds_the_stopped_step_keeps_it_for_the_resume(
        lab, open_service, tmp_path, every_point):
    """The step is checkpointed by the run that carries the new input, as its first work: a
    cancel right after that `chat()` stops it before, and the resume (which carries the same
    input) checkpoints it then."""
    message = f"Fetch {lab.page('index.html')}"
    async for k, agent, run, stopped, fetches in stopped_at_each_commit(lab, open_service, tmp_path, message, every_point):
        follow_up = await agent.chat("Hello there", run.conversation)
        await agent.cancel(run.conversation)
        await follow_up.wait()
        detail = await agent.get_conversation(run.conversation)
        while detail.resumable:
            assert (await (await agent.resume(run.conversation)).wait()).event == "end"
            detail = await agent.get_conversation(run.conversation)

        kept = [m["id"] for m in stopped.messages]
        assert [m["id"] for m in detail.messages][:len(kept)] == kept, k
        assert [m["content"] for m in detail.messages if m["role"] == "user"] == [message, "Hello there"], k
        assert lab.fetches("index.html") == fetches, k


async def test_a_write_observer_that_raises_changes_nothing_for_the_run(lab, open_service):
    def failing(write):
        raise RuntimeError(f"the observer broke on {write.describe()}")

    async with open_service() as agent:
        agent.on_write = failing
        first = await agent.chat(f"Fetch {lab.page('index.html')}")
        ended = await first.wait()
        second = await (await agent.chat("Hello there", first.conversation)).wait()
        detail = await agent.get_conversation(first.conversation)

    assert (ended.event, ended.data["status"]) == ("end", "completed")
    assert (second.event, second.data["status"]) == ("end", "completed")
    assert roles(detail) == ["user", "assistant", "tool", "assistant", "user", "assistant"]


@pytest.mark.both_backends
@pytest.mark.parametrize("delay_ms", [0, 1, 2, 5, 10, 20, 50])
async def test_a_cancel_at_any_delay_after_chat_returns_leaves_the_conversation_answered_or_resumable(
        lab, open_service, delay_ms):
    """Not a barrier: the delay spreads where the cancel lands (0 is right after `chat()`)."""
    message = f"Fetch {lab.page('index.html')}"
    async with open_service() as agent:
        run = await agent.chat(message)
        await asyncio.sleep(delay_ms / 1000)  # where the cancel lands, spread on purpose: not a wait for anything
        try:
            await agent.cancel(run.conversation)
        except SophosError as late:
            assert late.code == RUN_NOT_ACTIVE
        stopped = await agent.get_conversation(run.conversation)
        assert stopped.resumable or answered(stopped), stopped
        while stopped.resumable:
            assert (await (await agent.resume(run.conversation)).wait()).event == "end"
            stopped = await agent.get_conversation(run.conversation)

    assert roles(stopped) == ["user", "assistant", "tool", "assistant"]


async def test_every_view_of_a_conversation_stopped_inside_the_window_says_the_same(lab, open_service, tmp_path):
    """The service, the read-only lab views, the widget's child backend and the HTTP detail."""
    message = f"Fetch {lab.page('index.html')}"
    db = tmp_path / "sophos.db"
    async with open_service() as agent:
        run, write = await cancelled_after_commit(agent, message, 7)  # the tools step's writes
        detail = await agent.get_conversation(run.conversation)
    assert write.describe() == "writes tools (messages, branch:to:agent)"

    state = views.state(db, run.conversation)
    messages, next_nodes = views.thread_view(db, run.conversation)
    with lab.worker(DATABASE_PATH=str(db)) as child:
        widget = ChildBackend(child).detail(run.conversation)
    with lab.server(DATABASE_PATH=str(db)) as server:
        http = server.request("GET", f"/api/conversations/{run.conversation}").json()

    assert (detail.next, detail.resumable) == (("tools",), True)
    assert roles(detail) == ["user", "assistant", "tool"]  # the tool's result is saved, and shown
    assert (state["last_checkpoint"]["next"], state["resumable"]) == (["tools"], True)
    assert state["roles"] == roles(detail)
    assert (next_nodes, plain(messages)) == (("tools",), plain(detail.messages))
    assert (widget.next, widget.resumable) == (("tools",), True)
    assert (http["next"], http["resumable"]) == (["tools"], True)
    assert http == conversation_detail(detail) | {"conversation": http["conversation"]}

"""Idempotent triggers: a chat with an idempotency key starts one run, however often it is sent.

The key is written with the run, in its transaction; a repeat (in the same process, another one,
or after a restart) returns the run the key started instead of starting another.
"""

import pytest

from sophos_lab.runtime.errors import BAD_REQUEST, IDEMPOTENCY_KEY_REUSED, SophosError

pytestmark = pytest.mark.both_backends


async def test_the_same_key_twice_starts_one_run_and_returns_it(open_service):
    async with open_service() as agent:
        first = await agent.chat("Hello there", idempotency_key="greeting-1")
        repeat_while_running = await agent.chat("Hello there", idempotency_key="greeting-1")
        final = await first.wait()
        repeat_after = await agent.chat("Hello there", idempotency_key="greeting-1")
        runs = await agent.list_runs()

    assert repeat_while_running is first  # still running here: the same run, to follow
    assert (repeat_after.replayed, repeat_after.id, repeat_after.conversation) == (True, first.id, first.conversation)
    assert (await repeat_after.wait()).data == final.data  # its recorded outcome
    assert [run.id for run in runs] == [first.id]


async def test_a_repeat_after_a_restart_returns_the_first_run(open_service):
    async with open_service() as agent:
        first = await (await agent.chat("Hello there", idempotency_key="greeting-2")).wait()
    async with open_service() as restarted:
        repeat = await restarted.chat("Hello there", idempotency_key="greeting-2")
        events = [event.event for event in repeat.buffer]
        runs = await restarted.list_runs()

    assert (repeat.replayed, repeat.id) == (True, first.data["run"])
    assert events == ["started", "end"]
    assert len(runs) == 1


async def test_the_same_key_with_another_request_is_refused(open_service):
    async with open_service() as agent:
        first = await (await agent.chat("Hello there", idempotency_key="greeting-3")).wait()
        refused = {}
        for label, attempt in {
            "another message": lambda: agent.chat("Hello again", idempotency_key="greeting-3"),
            "another conversation": lambda: agent.chat("Hello there", first.data["conversation"],
                                                       idempotency_key="greeting-3"),
            "a resume": lambda: agent.resume(first.data["conversation"], idempotency_key="greeting-3"),
        }.items():
            with pytest.raises(SophosError) as error:
                await attempt()
            refused[label] = error.value.code
        for bad in ("", "with space", "é", "x" * 256, 7):
            with pytest.raises(SophosError) as error:
                await agent.chat("Hello there", idempotency_key=bad)
            assert error.value.code == BAD_REQUEST
        runs = await agent.list_runs()

    assert set(refused.values()) == {IDEMPOTENCY_KEY_REUSED}
    assert len(runs) == 1  # nothing refused wrote a run


async def test_racing_repeats_in_one_process_start_one_run(open_service):
    import asyncio

    async with open_service() as agent:
        runs = await asyncio.gather(*(agent.chat("Hello there", idempotency_key="greeting-4") for _ in range(5)))
        await asyncio.gather(*(run.wait() for run in runs))
        rows = await agent.list_runs()

    assert len({run.id for run in runs}) == 1
    assert len(rows) == 1


def test_a_repeat_of_a_key_whose_process_died_mid_run_recovers_that_run_and_returns_it(lab, tmp_path):
    """The HTTP server took the key and died mid-answer (kill -9); the same key in a new process
    recovers the dead run first and returns it, instead of saying it runs elsewhere."""
    import asyncio

    message = "Write an essay on durable execution."
    files = {"DATABASE_PATH": str(tmp_path / "sophos.db"), "MEMORY_FILE_PATH": str(tmp_path / "memory.jsonl")}
    lab.model.arm("essay")
    with lab.server(**files) as server:
        answer = server.request("POST", "/api/chat", json={"message": message},
                                headers={"Idempotency-Key": "essay-1"}).json()
        lab.model.wait_paused()
        assert server.kill() == -9
    lab.model.release()

    async def repeat():
        agent = lab.service(**files)
        try:
            run = await agent.chat(message, idempotency_key="essay-1")
            return run, await run.wait(), (await agent.list_runs())
        finally:
            await agent.aclose()

    run, final, runs = asyncio.run(repeat())
    assert (run.replayed, run.id, final.data["status"]) == (True, answer["run"], "interrupted")
    assert [r.status for r in runs] == ["interrupted"]

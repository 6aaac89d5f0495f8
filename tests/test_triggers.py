"""Idempotent triggers: a chat with an idempotency key starts one run, however often it is sent.

The key is written with the run, in its transaction; a repeat (in the same process, another one,
or after a restart) returns the run the key started instead of starting another.
"""

import pytest

from sophos_lab.runtime.errors import BAD_REQUEST, IDEMPOTENCY_KEY_REUSED, SophosError


async def test_the_same_key_twice_starts_one_run_and_returns_it(open_service):
    async with open_service() as agent:
        first = await agent.chat("Hello there", idempotency_key="greeting-1")
        repeat_while_running = await agent.chat("Hello there", idempotency_key="greeting-1")
        final = await first.wait()
        repeat_after = await agent.chat("Hello there", idempotency_key="greeting-1")
        runs = agent.list_runs()

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
        runs = restarted.list_runs()

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
        runs = agent.list_runs()

    assert set(refused.values()) == {IDEMPOTENCY_KEY_REUSED}
    assert len(runs) == 1  # nothing refused wrote a run


async def test_racing_repeats_in_one_process_start_one_run(open_service):
    import asyncio

    async with open_service() as agent:
        runs = await asyncio.gather(*(agent.chat("Hello there", idempotency_key="greeting-4") for _ in range(5)))
        await asyncio.gather(*(run.wait() for run in runs))
        rows = agent.list_runs()

    assert len({run.id for run in runs}) == 1
    assert len(rows) == 1

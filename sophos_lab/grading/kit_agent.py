"""The kit's own runtime as an agent module of the grading contract: graded like yours.

    from sophos_lab.grading import KIT_AGENT, grade
    grade(KIT_AGENT, stage="kit").summary   # your agent: 45 of 45 points recover, 0 lost, 0 re-run, 1 payment

An adapter over `AgentService`, which is the lessons' agent: its `runs` table, recovery on the
next open, the accepted message stored with its run, the keyed ledger tool. Nothing here is
graded that the runtime does not do itself; the adapter only maps the contract's calls:

- `run_turn` is `chat()` and the run's final event (in a new conversation the first time: the
  kit makes its own conversation ids, and a world holds one conversation);
- `recover` opens the database, which relabels the runs of a dead process (`list_conversations`);
- `resume` is `resume()` when the conversation is resumable;
- `read` is the conversation's messages and its runs' statuses.

Every commit the runtime makes (`AgentService.on_write`: the run's row, each task's writes, each
checkpoint, the outcome) is a write point of the world, as `world.connect()` and `world.saver()`
make yours. The runtime reads its settings (the database, the model, `mcp.json`) from the same
environment the world was made from. Imported by path (the grader's child loads it as a file),
so its imports are absolute.
"""

from __future__ import annotations

from typing import Any

from sophos_lab.grading import contract
from sophos_lab.runtime.errors import SophosError
from sophos_lab.runtime.service import AgentService
from sophos_lab.runtime.settings import Settings

_service: AgentService | None = None


def service(world: contract.World) -> AgentService:
    """This process's `AgentService`, on the world's settings, reporting its commits as write points."""
    global _service
    if _service is None:
        _service = AgentService(Settings.from_env(world.env))
        _service.on_write = lambda write: contract._wrote(f"kit: {write.describe()}")
    return _service


async def kit_conversation(world: contract.World) -> str | None:
    """The kit's id of the world's one conversation (None before its first message)."""
    listed = await service(world).list_conversations()
    return listed[0].id if listed else None


async def run_turn(world: contract.World, conversation: str, message: str) -> None:
    svc = service(world)
    run = await svc.chat(message, await kit_conversation(world))
    final = await run.wait()
    if final.event != "end":
        raise RuntimeError(f"the run ended with {final.event}: {final.data}")


async def recover(world: contract.World) -> None:
    await service(world).list_conversations()  # the first open of the database recovers what the dead left


async def resume(world: contract.World, conversation: str) -> None:
    svc = service(world)
    kit_id = await kit_conversation(world)
    if kit_id is None or not (await svc.get_conversation(kit_id)).resumable:
        return
    try:
        final = await (await svc.resume(kit_id)).wait()
    except SophosError as error:
        raise RuntimeError(f"{error.code}: {error.message}") from None
    if final.event != "end":
        raise RuntimeError(f"the resume ended with {final.event}: {final.data}")


async def read(world: contract.World, conversation: str) -> dict[str, Any]:
    svc = service(world)
    kit_id = await kit_conversation(world)
    if kit_id is None:
        return {"messages": [], "runs": []}
    detail = await svc.get_conversation(kit_id)
    return {"messages": detail.messages, "runs": [run.status for run in await svc.list_runs(kit_id)]}

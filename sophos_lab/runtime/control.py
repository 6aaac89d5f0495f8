"""Run control around the lifecycle: idempotency keys (a repeated request returns the run its key
started), approval gates (approve, reject, a decision carried on after a crash) and cancel.
Part of `AgentService` (`service`), which starts the runs these decide on."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from typing import Any

from langgraph.types import Command

from . import errors, users
from .active import ActiveRun
from .agent import APPROVE, REJECT, check_config
from .tools import approval_rule, mcp_servers
from .errors import SophosError
from .events import Event
from .requests import parse_conversation_id, parse_decisions, parse_id, parse_message
from .storage.models import Gate, IdempotencyKey, KeyedRun

_KEY = re.compile(r"[\x21-\x7e]{1,255}")
"""An idempotency key: 1 to 255 visible ASCII characters (as the HTTP header allows)."""


def check_decisions(gate: Gate, decisions: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The decisions as they are recorded (without `args`), if they fit the gate: one for each
    of its calls, none for another, and `args`, where given, the call's arguments exactly (the
    person approved what they saw). Otherwise `APPROVAL_MISMATCH`, and nothing is decided."""
    calls = {call["id"]: call for call in gate.calls}
    unknown = [call_id for call_id in decisions if call_id not in calls]
    missing = [call_id for call_id in calls if call_id not in decisions]
    if unknown or missing:
        held = ", ".join(f"{call['id']} ({call['name']})" for call in gate.calls)
        raise SophosError(errors.APPROVAL_MISMATCH, (
            f"The gate holds the tool calls {held}: decide on each of them, and on no other"
            + (f"; not held here: {', '.join(unknown)}" if unknown else "")
            + (f"; no decision for: {', '.join(missing)}" if missing else "") + ". Nothing was decided."))
    for call_id, decision in decisions.items():
        if "args" in decision and decision["args"] != calls[call_id]["args"]:
            raise SophosError(errors.APPROVAL_MISMATCH, (
                f"The arguments of tool call {call_id} are {calls[call_id]['args']!r}, not "
                f"{decision['args']!r}: look at the call again before deciding. Nothing was decided."))
    return {call_id: {k: v for k, v in decision.items() if k != "args"} for call_id, decision in decisions.items()}


def every_call(gate: Gate, decision: str, reason: str | None = None) -> dict[str, dict[str, Any]]:
    """The same decision for each of the gate's calls (e.g. approve them all)."""
    return {call["id"]: {"decision": decision, **({"reason": reason} if reason else {})} for call in gate.calls}


class Control:
    """`AgentService`'s run control: keys, gates and cancel."""

    async def first_run_of(self, keyed: IdempotencyKey) -> ActiveRun | None:
        """The run an idempotency key started (None if it started none), refused with
        `IDEMPOTENCY_KEY_REUSED` if that was for another request."""
        first = await self.keyed_run(keyed)
        return None if first is None else await self._run_as_started(first.run_id)

    async def keyed_run(self, keyed: IdempotencyKey) -> KeyedRun | None:
        """The row of the run an idempotency key started (None if none), refused with
        `IDEMPOTENCY_KEY_REUSED` if that was for another request."""
        first = await self.store.keyed_run(keyed.key)
        if first is not None and first.request != keyed.request:
            raise SophosError(errors.IDEMPOTENCY_KEY_REUSED, (
                f"The idempotency key {keyed.key!r} started run {first.run_id} with a different request; "
                "use a new key for a new request."))
        return first

    @contextlib.asynccontextmanager
    async def requests_keyed(self, key: str) -> AsyncIterator[None]:
        """Held by a request with the idempotency key `key` while it looks for the key's run and
        starts one: a repeat that comes meanwhile finds the first's run, as a repeat."""
        lock = self._keys.get(key)
        if lock is None:
            lock = self._keys[key] = asyncio.Lock()
        async with lock:
            yield

    def _keyed(self, key: str | IdempotencyKey | None, request: str) -> IdempotencyKey | None:
        if key is None or isinstance(key, IdempotencyKey):
            return key
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise SophosError(errors.BAD_REQUEST, "An idempotency key must be 1 to 255 visible ASCII characters")
        return IdempotencyKey(key, request)

    async def approve(self, conversation: object, decisions: object = None, gate: str | None = None) -> ActiveRun:
        """Decide on the tool calls a waiting run holds at its gate, and carry on: a new run on
        the thread, which runs the approved calls and gives the model, for each rejected one,
        a tool result that says so, with the reason.

        `decisions` maps each pending call's id to `"approve"`, `"reject"` or `{"decision",
        "reason"?, "args"?}` (see `parse_decisions`); None approves every call of the gate
        (`reject()` rejects every one): of `gate` (its id, as the `waiting` event and
        `pending_approval` give it) if given, else of the gate waiting now. Name the gate when
        you may send the same approval again (a retry): without it, a retry after the run has
        stopped at a later gate would approve that one.
        The decisions are written, in the transaction that starts the run, before the graph
        resumes: a crash after that asks nobody again (`resume()` carries them on). The same
        decisions again are a no-op that returns the run they started (`replayed=True`);
        different ones are refused (`GATE_DECIDED`). Decisions that do not fit the gate are
        refused (`APPROVAL_MISMATCH`), and nothing waiting is `NO_APPROVAL_PENDING`.
        """
        conversation_id = (await self._existing(conversation)).id
        asked = None if decisions is None else parse_decisions(decisions)
        gate = None if gate is None else parse_id(gate, "The gate id")
        await self._graph_ready()
        await self._recover(conversation_id)
        pending = await self.pending_approval(conversation_id)
        target = await self._target_gate(conversation_id, pending, gate, asked)
        if asked is None:
            asked = every_call(target, APPROVE)
        if target.decided or pending is None or target.id != pending.id:
            return await self._repeated_approval(target, asked)
        recorded = check_decisions(target, asked)
        self._check_accepting()
        self._check_idle(conversation_id)
        check_config(self.settings)
        try:
            return await self._launch(conversation_id, [], resume=True, command=Command(resume={target.id: recorded}),
                                      decision=(target, recorded))
        except SophosError as error:
            if error.code != errors.GATE_DECIDED:
                raise
            # Another process decided meanwhile.
            return await self._repeated_approval(await self.store.gate(conversation_id, target.id), asked)

    async def reject(self, conversation: object, reason: str | None = None, gate: str | None = None) -> ActiveRun:
        """Reject every call of the gate (`gate`, else the one waiting now), with `reason` for
        the model (its tool results say the user rejected the call, and why); as `approve()`."""
        conversation_id = (await self._existing(conversation)).id
        if reason is not None and (not isinstance(reason, str) or not reason.strip()):
            raise SophosError(errors.BAD_REQUEST, f"A reason must be text that is not blank, not {reason!r}. Nothing was decided.")
        if reason is not None:
            parse_message(reason)  # text UTF-8 can store exactly
        gate = None if gate is None else parse_id(gate, "The gate id")
        target = await self._target_gate(conversation_id, await self.pending_approval(conversation_id), gate, None)
        return await self.approve(conversation_id, every_call(target, REJECT, reason), gate=target.id)

    async def _target_gate(self, conversation_id: str, pending: Gate | None, gate: str | None,
                           asked: dict[str, dict] | None) -> Gate:
        """The gate an approval is about: the one named, else the decided one whose calls the
        decisions name (a retry, while a later gate may wait), else the one waiting now, else
        (nothing waits, no decisions given) the latest one, decided: a repeat."""
        if gate is not None:
            named = await self.store.gate(conversation_id, gate)
            if named is None:
                raise SophosError(errors.NO_APPROVAL_PENDING, f"No gate {gate!r} on conversation {conversation_id}.")
            return named
        gates = list(reversed(await self.store.gates(conversation_id)))
        if asked is not None:
            for earlier in gates:
                if earlier.decided and set(asked) <= {call["id"] for call in earlier.calls}:
                    return earlier
        if pending is not None:
            return pending
        if asked is None and gates and gates[0].decided:
            return gates[0]  # nothing waits: a repeat of the latest decision
        raise SophosError(errors.NO_APPROVAL_PENDING, f"No run waits for approval on conversation {conversation_id}.")

    async def _repeated_approval(self, gate: Gate, asked: dict[str, dict[str, Any]]) -> ActiveRun:
        """An approval of a gate that is not the one waiting: the run its decision started, if
        the decisions are the same; `GATE_DECIDED` if they differ; `NO_APPROVAL_PENDING` if the
        gate was never decided (its run was superseded: nothing waits there any more)."""
        if not gate.decided:
            raise SophosError(errors.NO_APPROVAL_PENDING, (
                f"The gate {gate.id} of run {gate.run_id} no longer waits, and was never decided."))
        if check_decisions(gate, asked) != gate.decisions:
            raise SophosError(errors.GATE_DECIDED, (
                f"The gate of run {gate.run_id} was decided already, differently: "
                f"{json.dumps(gate.decisions, ensure_ascii=False)} at {gate.decided_at}. A decision "
                "cannot be changed; the run it started carried it on."))
        if gate.decided_run_id is None:
            raise SophosError(errors.NO_APPROVAL_PENDING, "The run that carried this decision is gone.")
        return await self._run_as_started(gate.decided_run_id)

    async def _check_not_waiting(self, conversation_id: str) -> None:
        gate = await self.pending_approval(conversation_id)
        if gate is not None:
            names = ", ".join(call["name"] for call in gate.calls)
            raise SophosError(errors.RUN_WAITING, (
                f"The run waits for approval of {len(gate.calls)} tool call(s) ({names}): approve or "
                "reject them (approve()) to carry on."))

    async def _decided_gate(self, conversation_id: str, interrupts: Any) -> Gate | None:
        """The decided gate among the thread's pending interrupts, if any."""
        for pending in interrupts or ():
            gate = await self.store.gate(conversation_id, pending.id)
            if gate is not None and gate.decided:
                return gate
        return None

    async def _run_as_started(self, run_id: str) -> ActiveRun:
        """A run started earlier, to follow like a new one: itself if it is active here, else
        its `started` and final events as recorded."""
        row = await self.store.get_run(run_id)
        active = self.active.get(row.conversation_id) if row else None
        if active is not None and active.id == run_id:
            return active
        if row is None:
            raise SophosError(errors.NOT_FOUND, f"Run Not Found: {run_id}")
        if row.status == "running":
            await self.store.recover(row.conversation_id)  # its owner may be gone
            row = await self.store.get_run(run_id)
        if self.settings.on_workers and (await self.store.event_span(run_id))[1]:
            return await self._remote(row.id, row.conversation_id, row.input is None, replayed=True)
        if row.status == "running":
            raise SophosError(errors.SESSION_IN_PROGRESS, (
                f"Run {run_id} is running in another process: follow it there."))
        run = ActiveRun(id=row.id, conversation=row.conversation_id, resume=row.input is None, replayed=True)
        run.publish("started", {"conversation": row.conversation_id, "run": row.id, "resume": run.resume})
        if row.error_code:
            run.publish("chat-error", {"code": row.error_code, "message": row.error_message,
                                       "conversation": row.conversation_id, "run": row.id})
        else:
            stopped_at = await self.store.run_gate(row.id) if row.status == "waiting" else None
            run.publish("end", self._end_data(row.conversation_id, row.id, row.status,
                                              stopped_at if stopped_at and not stopped_at.decided else None))
        return run

    @staticmethod
    def _end_data(conversation_id: str, run_id: str, status: str, gate: Gate | None) -> dict[str, Any]:
        data = {"conversation": conversation_id, "run": run_id, "status": status}
        if gate is not None:
            data["approval"] = {"gate": gate.id, "calls": gate.calls}
        return data

    async def cancel(self, conversation: object) -> Event:
        """Stop the conversation's active run now, mid-step, and record it `cancelled` /
        `CANCELLED` ("Cancelled by user"); the run's final event.

        The request is written to the run's row first (`cancel_requested_at`), under the lock
        the outcome is written under, and only then is the run stopped: the step in flight is
        abandoned (the model's stream closed, a tool call left unanswered) and, not finished, is
        not saved; every step finished before it stays saved, so the conversation resumes from
        `next`. Whichever of the cancel and the run's own outcome reaches the database first is
        the outcome: a run already recorded answers with its final event (`end` if it
        completed). Refused with `RUN_NOT_ACTIVE` when this process runs nothing there.
        """
        conversation_id = parse_conversation_id(conversation)
        run = self.active.get(conversation_id) if users.acting_user.get() is None else None
        if run is None:  # (a run of this process is stopped at once: nothing is read first)
            conversation_id = (await self._existing(conversation_id)).id
            run = self.active.get(conversation_id)
        if run is None and self.settings.on_workers:
            latest = await self.store.latest_run(conversation_id)
            if latest is not None and latest.status in ("queued", "running") and (await self.store.event_span(latest.id))[1]:
                # A worker's run: recorded first (a queued one is cancelled at once), then its worker told.
                remote = await self._remote(latest.id, conversation_id, latest.input is None)
                await self.store.cancel_remote(latest.id)
                return await remote.wait()
        if run is None:
            latest = await self.store.latest_run(conversation_id)
            where = (" (its latest run is running in another process: cancel it there)"
                     if latest is not None and latest.status == "running" else "")
            raise SophosError(errors.RUN_NOT_ACTIVE, f"No run is active on conversation {conversation_id}{where}.")
        if not run.cancel_requested:
            async def request() -> bool:
                # Under the lock: the outcome is either written already or will see the request.
                run.cancel_requested = not run.recorded and await self.store.request_cancel(run.id)
                return run.cancel_requested

            if await self._write(request):
                # A run whose task has not reached the graph yet is stopped by the drain at its
                # first step boundary (cancelling a task that never started would skip its
                # record); one past the graph is recording, and records `cancelled`.
                run.control.request_drain("cancel")
                if run.in_graph and run.task is not None:
                    run.task.cancel()
        return await run.wait()

    def _unasked_calls(self, state: Any) -> list[str]:
        """The tool calls needing approval that the thread's tools step, still to run, holds."""
        if not any(task.name == "tools" and task.result is None and not task.interrupts for task in state.tasks):
            return []
        messages = state.values.get("messages") or []
        needs_approval = approval_rule(mcp_servers(self.settings))
        return [call["name"] for call in getattr(messages[-1], "tool_calls", None) or []
                if needs_approval(call["name"])] if messages else []

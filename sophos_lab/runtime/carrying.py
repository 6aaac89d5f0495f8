"""What a new run carries: the messages an earlier run accepted that never reached the thread,
and the count of messages the conversation shows. Part of `AgentService` (`service`), whose
store and graph it reads."""

from __future__ import annotations

import asyncio
from typing import Any

from . import errors
from .agent import thread_config
from .counting import shown_count
from .errors import SophosError
from .storage.models import Run, unapplied_input


def pending_after(latest: Run | None, metadata: dict[str, Any] | None) -> list[dict[str, str]]:
    """The messages of `latest`, the conversation's latest run, if they never reached the thread
    whose latest checkpoint has `metadata` (None: the thread has none), else []."""
    return [] if latest is None else unapplied_input(latest.id, latest.input, (metadata or {}).get("run_id"))


class Carrying:
    """`AgentService`'s reads of what a run's input is to carry on, and what a conversation counts."""

    async def _carried_input(self, conversation_id: str, latest: Run) -> list[dict[str, str]]:
        """`_pending_input` for a new message after the `latest` run. The common case (it
        completed, so its input is in the thread) reads no checkpoint; otherwise the thread's
        latest state (live: a gate a carried decision has answered no longer holds it)."""
        if latest.status == "completed":
            return []
        state = await self._graph.aget_state(thread_config(conversation_id))
        if state.interrupts:  # live: not those a decision carried on has answered
            # The thread stopped at a gate that the latest run did not get past (it stopped
            # before recording it, or before carrying its decision on): a new message would
            # leave the held calls unanswered.
            raise SophosError(errors.RUN_WAITING, (
                "The thread stopped at an approval gate that its latest run did not get past: "
                "resume() to carry on (a recorded decision is carried on, else the gate is shown again)."))
        if unasked := self._unasked_calls(state):
            # The run stopped after the model asked for these and before its tools step saved
            # the gate: a new message would drop them with nobody asked, where a run stopped a
            # moment later (at its gate) refuses it. The same answer at either point.
            raise SophosError(errors.RUN_WAITING, (
                f"The thread's last turn holds {len(unasked)} tool call(s) that need approval "
                f"({', '.join(unasked)}), and its run stopped before it asked: resume() to reach "
                "the gate, then approve or reject them."))
        return pending_after(latest, state.metadata)

    async def _pending_input(self, conversation_id: str, metadata: dict[str, Any] | None) -> list[dict[str, str]]:
        """The messages of the latest run if they never reached the thread, else [].

        `metadata` is that of the thread's latest checkpoint (None when there is none)."""
        return pending_after(await self.store.latest_run(conversation_id), metadata)

    async def _message_count(self, graph: Any, conversation_id: str) -> int | None:
        try:
            state = await graph.aget_state(thread_config(conversation_id))
        except (Exception, asyncio.CancelledError):  # a late shutdown cancel must not skip the record
            return None
        # What get_conversation will show (see `counting`): an accepted message a cancel kept
        # out of the thread counts too.
        return shown_count(state.values.get("messages", []), await self._pending_input(conversation_id, state.metadata))

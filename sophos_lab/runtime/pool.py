"""A pool of workers, the service's side (PostgreSQL, `SOPHOS_LAB_RUNS=workers`; see `queue` and
`workers`): queue a run instead of running it, follow a worker's run from the events table,
and, as a worker, claim a queued run and run it. Part of `AgentService` (`service`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import Callable
from typing import Any

from langchain_core.messages import HumanMessage
from langgraph.types import Command

from . import errors
from .active import ActiveRun
from .agent import thread_config
from .checkpointer import DurableWrite
from .events import Event
from .storage.models import Gate, IdempotencyKey, Run, Seen, carried_ids

log = logging.getLogger(__name__)


class Pool:
    """`AgentService`'s side of a pool of workers."""

    async def _queue(self, conversation_id: str, messages: list[dict[str, str]], resume: bool, title: str | None,
                     idempotency: IdempotencyKey | None, decision: tuple[Gate, dict[str, dict]] | None,
                     after: Seen | None = None) -> Any:
        run_id = str(uuid.uuid4())

        async def queue() -> None:
            self._check_accepting()
            await self.store.queue_run(run_id, conversation_id, messages, title, idempotency, decision, resume, after)
            self._observe(DurableWrite("run", conversation_id))

        await self._write(queue)
        return await self._remote(run_id, conversation_id, resume)

    async def _remote(self, run_id: str, conversation_id: str, resume: bool, replayed: bool = False) -> Any:
        """A worker's run, to follow from the events table (`queue.RemoteRun`)."""
        from .queue import EventFeed, RemoteRun

        if self._feed is None:
            self._feed = EventFeed(self.settings.database_url)
        dropped, last = await self.store.event_span(run_id)
        return RemoteRun(run_id, conversation_id, resume, self._feed, self._look, self.settings.lease_seconds / 3,
                         dropped=dropped, last_id=last, replayed=replayed)

    async def _look(self, run: Any) -> None:
        """No news of a worker's run for a while: if its worker is gone, relabel it (which writes
        its final event), or write the final event of an outcome it recorded and did not announce."""
        await self._recover(run.conversation)
        await self.store.close_orphaned_events(run.id)

    async def run_to_follow(self, conversation_id: str, after: int) -> Any:
        """With workers: the conversation's latest run to follow from the events table, if it is
        queued or running, or if the client has events of it (`after`) still kept; else None."""
        latest = await self.store.latest_run(conversation_id)
        if latest is None:
            return None
        dropped, last = await self.store.event_span(latest.id)
        if not last:
            return None  # no events kept
        finished = latest.status not in ("queued", "running")
        if finished and not 0 < after < last and (dropped == last or await self.store.final_event_kept(latest.id)):
            return None  # a finished run the client has every event of, or whose events a crash took
        # A finished run whose events are kept but not its final one: its worker has written the
        # outcome and not given the final event yet (persist, then notify). It is followed to
        # that event, or to the one a look writes for it if the worker died in between.
        return await self._remote(latest.id, conversation_id, latest.input is None)

    async def claim(self, sink: Callable[[str, str, Event], None]) -> ActiveRun | None:
        """As a worker: claim the next queued run and run it, with the input `resume()` would work
        out for it (the accepted messages if they never reached the thread, a recorded gate
        decision, else the thread's `next`); None when there is none to claim. Its events go to
        `sink`, numbered after those it gave already (`started`, written when it was queued).

        The claim and the run's place in `active` are one step under the lock, so the lease
        keeper never finds the run claimed and unattended; every database call after it is in
        the run's task, which records an outcome or gives the run up, whatever fails."""
        graph = await self._graph_ready()

        async def claim() -> tuple[ActiveRun, Run] | None:
            try:
                row = await self.store.claim_run()
            except Exception as error:
                if errors.database_unavailable(error):
                    self._note_stray()  # the claim may have committed with its answer lost
                raise
            if row is None:
                return None
            run = ActiveRun(id=row.id, conversation=row.conversation_id, resume=row.input is None,
                            keep=self.settings.event_buffer, sink=sink,
                            input_ids=carried_ids(json.loads(row.input) if row.input else None))
            self.active[row.conversation_id] = run
            return run, row

        claimed = await self._write(claim)
        if claimed is None:
            return None
        run, row = claimed
        self._keep_lease()
        run.task = asyncio.create_task(self._execute_claimed(run, row, graph))
        return run

    async def _execute_claimed(self, run: ActiveRun, row: Run, graph: Any) -> None:
        try:
            self._point("claimed")
            run.dropped = (await self.store.event_span(row.id))[1]  # ids go on after those it gave
            state = await graph.aget_state(thread_config(row.conversation_id))
            pending = await self._pending_input(row.conversation_id, state.metadata)
            graph_input = None
            if pending:
                graph_input = {"messages": [HumanMessage(m["content"], id=m["id"]) for m in pending]}
            elif (decided := await self._decided_gate(row.conversation_id, state.interrupts)) is not None:
                graph_input = Command(resume={decided.id: decided.decisions})
        except Exception:
            # Not started: given up now, as a crash's run would be (re-queued or relabelled, its
            # final event written), or, if even that fails, by the lease keeper once it can.
            log.warning("could not start claimed run %s; giving it up", row.id, exc_info=True)
            self.active.pop(row.conversation_id, None)
            self._note_stray()
            with contextlib.suppress(Exception):
                await self._write(self._give_up_strays)
            return
        await self._execute(run, graph, graph_input, fold=bool(pending))

    def cancel_here(self, run_id: str) -> None:
        """As a worker: another process recorded a cancel of this run (`queue.request_cancel`):
        stop it as `cancel()` stops a run of its own."""
        run = next((run for run in self.active.values() if run.id == run_id), None)
        if run is None or run.cancel_requested or run.recorded:
            return
        run.cancel_requested = True
        run.control.request_drain("cancel")
        if run.in_graph and run.task is not None:
            run.task.cancel()

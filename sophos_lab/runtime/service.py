"""The run lifecycle: start, stream, record, resume, and shut down honestly.

A run is one attempt to advance a conversation's thread. Persist, then notify, at every step:

- The `running` row is written before the graph starts, in one transaction with the user's
  message (`runs.input`) and, for a new conversation, the conversation itself. Only then is
  `started` published and `chat()` returns: an accepted message is on disk before anyone is told.
- A finished step is reported (`leave`, `call`, `result`) only once its checkpoint is saved.
- The outcome and the message count are written in one transaction before the final event.

A resume is a new run on the same thread. If the latest run's message never reached the thread
(the process died before LangGraph's first checkpoint), the resume enters that same message,
with the same id; otherwise it streams `None`, so LangGraph runs only the nodes in `next`.

Runs belong to the process that started them (see `ownership`): it renews a lease while it has
runs, another process relabels the run only once its owner is gone, and a process that lost a
run writes nothing more (the saver's fence and the outcome's `owner_id` check).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
import weakref
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from langchain_core.messages import HumanMessage
from langgraph.errors import GraphDrained
from langgraph.types import Command

from . import errors, users
from .active import ActiveRun
from .agent import (
    AGENT_NODES, ATTEMPT_WATCH, CARRIED_DECISIONS, AgentParts, AttemptWatch, build_graph, chat_model, check_config,
    classify_failure, read_system_prompt, thread_config,
)
from .carrying import Carrying, pending_after
from .checkpointer import DurableWrite, NotifyingSaver, WriteObserver, is_fenced
from .control import Control
from .errors import SophosError
from .events import DurableGate, Event, StreamTranslator
from .housekeeping import Housekeeping
from .lease import Lease
from .pool import Pool
from .progress import unfolded, work_left
from .reading import Reading
from .requests import canonical_request, parse_conversation_id, parse_message
from .settings import Settings
from .storage import open_storage
from .storage.models import SETTLED, Conversation, Gate, IdempotencyKey, LatestRunChanged, Seen, carried_ids, seen, utc_now
from .tools import McpTools, approval_rule, mcp_servers

log = logging.getLogger(__name__)


class AgentService(Reading, Carrying, Control, Pool, Lease, Housekeeping):
    """The durable agent of one process: conversations, runs and their events. Here its run
    lifecycle; around it `reading`, `control`, `pool`, `lease`, `housekeeping` and `storage`."""

    def __init__(self, settings: Settings | None = None, log_dir: Path | None = None) -> None:
        self.settings = settings or Settings.from_env()
        self.store = open_storage(self.settings)
        """The application tables (`storage.rules.Storage`), awaited: no call waits on the loop."""
        self.tools = McpTools(self.settings, log_dir=log_dir, idle_seconds=self.settings.user_tools_idle_seconds)
        self.active: dict[str, ActiveRun] = {}
        self.accepting = True
        self._graph = None
        self._saver: NotifyingSaver | None = None
        self._saver_conn = None
        self._opening = asyncio.Lock()
        self._writing = asyncio.Lock()
        """Held by each write of a run's life (`_write`) and by the saver's writes, so that this
        process's own decisions about a run (its start, a cancel, its outcome, the lease) and
        its checkpoints are made one after the other: a cancel recorded between a step's writes
        and its checkpoint stops the run before that checkpoint begins."""
        self._keys: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self._lease_keeper: asyncio.Task | None = None
        self._unrecorded: dict[str, str] = {}
        """run id → conversation: this process's runs whose outcome it could not write (a full
        disk). Their rows say `running` under a live owner, which recovery leaves alone: they are
        relabelled `interrupted` here, as a crash's are, once the disk has room again (at the
        conversation's next start or look, or the lease keeper's next round)."""
        self._strays_possible = False
        """A write of a run's life failed (a claim, a start, an outcome): a run may be `running`
        under this owner with no task working on it. The lease keeper looks until none is."""
        self._feed = None
        """PostgreSQL with workers: the `LISTEN` connection that wakes followers of remote runs."""
        self.at_point: Callable[[str], None] | None = None
        """Called by name just before the database calls of a run's life that a fault may hit:
        `claimed` (a worker's claim committed, nothing read yet), `settled` and `read` (a new
        message, its conversation assumed settled or read, nothing written yet), `owner`,
        `budget` and `outcome`. Fault tests stop the database there (`SOPHOS_LAB_STOP_AT` stops a worker itself)."""
        self.on_write: WriteObserver | None = None
        """Called right after each commit a run makes, in order, before any event tells of it:
        the run's row, each task's pending writes, each checkpoint, the outcome (see
        `DurableWrite`). Crash tests stop the process there; a lesson can print them."""

    async def open(self) -> None:
        """Open the database (running recovery) and build the graph now, not on first use."""
        await self._graph_ready()

    async def chat(
        self, message: object, conversation: object = None, idempotency_key: str | IdempotencyKey | None = None,
    ) -> ActiveRun:
        """Start a run with a new user message, in a new conversation unless one is given.

        With `idempotency_key`, the key is written with the run, in its transaction. The same
        key again, from any process and after any restart, starts nothing: it returns the run
        the key started (`replayed=True`; still running here, or holding its recorded outcome),
        if the request is the same (message and conversation), and is refused with
        `IDEMPOTENCY_KEY_REUSED` otherwise."""
        text = parse_message(message)
        conversation_id = None if conversation is None else parse_conversation_id(conversation)
        keyed = self._keyed(idempotency_key, canonical_request(False, text, conversation_id))
        if keyed is not None and (first := await self.first_run_of(keyed)) is not None:
            return first
        try:
            if conversation_id is not None and (run := await self._chat_settled(text, conversation_id, keyed)):
                return run
            return await self._taken(lambda: self._chat(text, conversation_id, keyed))
        except SophosError:
            # A request with the same key may have started its run while this one was checked.
            if keyed is not None and (first := await self.first_run_of(keyed)) is not None:
                return first
            raise

    async def _chat_settled(self, text: str, conversation_id: str, keyed: IdempotencyKey | None) -> ActiveRun | None:
        """The common case, nothing read first: a message after a completed run starts expecting
        just that (`SETTLED`, checked in the start's transaction). None, nothing written, if it is
        not so, or a check `_chat` makes would refuse it (here busy, a bad config, a user's
        limits): then `_chat` reads the conversation and decides in its own order."""
        self._check_accepting()
        if conversation_id in self.active or users.acting_user.get() is not None:
            return None
        try:
            check_config(self.settings)
        except SophosError:
            return None
        await self._graph_ready()
        self._point("settled")
        try:
            return await self._launch(conversation_id, [{"id": str(uuid.uuid4()), "content": text}], resume=False,
                                      idempotency=keyed, before="completed", after=SETTLED)
        except LatestRunChanged:
            return None

    async def _chat(self, text: str, conversation_id: str | None, keyed: IdempotencyKey | None) -> ActiveRun:
        self._check_accepting()
        if new := conversation_id is None:  # the conversation is written with the run, the acting user's
            conversation_id, latest, owner = str(uuid.uuid4()), None, users.acting_user.get()
        else:  # the latest run read once, used thrice
            conversation_id, latest, owner = await self.store.before_message(conversation_id)
            self._point("read")
        self._check_idle(conversation_id)
        if latest is not None and latest.status == "waiting":
            await self._check_not_waiting(conversation_id)
        check_config(self.settings)  # a bad mcp.json or system.md is refused with nothing written
        await self._graph_ready()
        # A message accepted earlier that never reached the thread goes first: nothing is dropped.
        carried = [] if latest is None else await self._carried_input(conversation_id, latest)
        messages = [*carried, {"id": str(uuid.uuid4()), "content": text}]
        return await self._launch(conversation_id, messages, resume=False, title=text if new else None,
                                  idempotency=keyed, before=latest.status if latest else None, owner=(owner,),
                                  after=None if new else seen(latest))  # still so when it is written

    async def resume(self, conversation: object, idempotency_key: str | IdempotencyKey | None = None) -> ActiveRun:
        """Start a run that continues the thread from its latest checkpoint (`idempotency_key`
        as in `chat`).

        Refused with `RUN_WAITING` while the run waits at an approval gate (approve or reject
        instead). A gate decided by a run that stopped before it carried the decision on (a
        crash, a shutdown) is carried on now, with the recorded decision: nobody is asked again.
        """
        conversation_id = parse_conversation_id(conversation)
        keyed = self._keyed(idempotency_key, canonical_request(True, None, conversation_id))
        if keyed is not None and (first := await self.first_run_of(keyed)) is not None:
            return first
        try:
            return await self._taken(lambda: self._resume(conversation_id, keyed))
        except SophosError:
            if keyed is not None and (first := await self.first_run_of(keyed)) is not None:
                return first
            raise

    async def _resume(self, conversation_id: str, keyed: IdempotencyKey | None) -> ActiveRun:
        self._check_accepting()
        conversation_id = (await self._existing(conversation_id)).id
        self._check_idle(conversation_id)
        check_config(self.settings)
        graph = await self._graph_ready()
        await self._recover(conversation_id)
        await self._check_not_waiting(conversation_id)
        latest = await self.store.latest_run(conversation_id)  # before the thread: see `after`
        state = await graph.aget_state(thread_config(conversation_id))
        pending = pending_after(latest, state.metadata)
        if not work_left(state) and not pending:
            raise SophosError(errors.RUN_NOT_RESUMABLE, "Nothing to resume: the last run finished")
        decided = await self._decided_gate(conversation_id, state.interrupts)
        command = None if decided is None else Command(resume={decided.id: decided.decisions})
        return await self._launch(conversation_id, pending, resume=True, idempotency=keyed, command=command,
                                  after=seen(latest))

    async def _taken(self, take: Callable[[], Awaitable[ActiveRun]]) -> ActiveRun:
        """`take()` (a chat or resume that read the latest run), once more if another came first."""
        try:
            return await take()
        except LatestRunChanged:
            try:
                return await take()
            except LatestRunChanged as changed:
                raise SophosError(errors.SESSION_IN_PROGRESS, (
                    "Previous request still in progress: other runs of the conversation started while "
                    "this one was taken. Nothing of it was written; send it again.")) from changed

    async def ask(self, message: str, conversation: str | None = None) -> Event:
        """Start a chat run and wait for its final event (handy in a notebook cell)."""
        return await (await self.chat(message, conversation)).wait()

    # shutting down

    def request_drain(self, reason: str = "shutdown") -> None:
        """Stop accepting runs and ask each active run to stop at its next step boundary.

        Safe to call from a signal handler: it only sets flags.
        """
        self.accepting = False
        for run in list(self.active.values()):
            run.control.request_drain(reason)

    async def drain(self, timeout: float | None = None) -> None:
        """Stop accepting runs; each active run stops at its next step boundary, or is cancelled
        after `timeout` (default `SHUTDOWN_TIMEOUT`). Each is recorded and publishes its final event."""
        self.request_drain()
        tasks = [run.task for run in self.active.values() if run.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self.settings.shutdown_timeout if timeout is None else timeout)
            for task in pending:
                task.cancel()  # recorded as interrupted / SHUTDOWN by _execute
            if pending:
                await asyncio.wait(pending)

    async def shutdown(self, timeout: float | None = None) -> None:
        """Drain active runs (up to `timeout`, default `SHUTDOWN_TIMEOUT`), record them, close."""
        await self.drain(timeout)
        await self.aclose()

    async def aclose(self) -> None:
        """Close MCP servers and database connections now, whatever is running."""
        if self._lease_keeper is not None:
            self._lease_keeper.cancel()
        await self.tools.aclose()
        if self._feed is not None:
            await self._feed.aclose()
        conn, self._saver_conn, self._graph = self._saver_conn, None, None
        if conn is not None:
            await self._saver.release()
            await conn.close()
        await self.store.aclose()

    # internals

    async def _existing(self, conversation: object) -> Conversation:
        conversation_id = parse_conversation_id(conversation)
        summary = await self.store.get_conversation(conversation_id)
        if summary is None:
            raise SophosError(errors.NOT_FOUND, f"Conversation Not Found: {conversation_id}")
        return summary

    async def _owned(self, conversation: object) -> str:
        """The id, once the acting user is known to own it (`NOT_FOUND` otherwise); with no user
        acting, only parsed: the retention calls must not open a file before their own checks."""
        if users.acting_user.get() is None:
            return parse_conversation_id(conversation)
        return (await self._existing(conversation)).id

    def _check_accepting(self) -> None:
        if not self.accepting:
            raise SophosError(errors.SHUTDOWN, "The agent is shutting down and accepts no new runs.")

    def _check_idle(self, conversation_id: str) -> None:
        if conversation_id in self.active:
            raise SophosError(errors.SESSION_IN_PROGRESS, "Previous request still in progress")

    async def _graph_ready(self):
        """The compiled graph; opens the store first, so recovery precedes any thread read."""
        async with self._opening:  # concurrent first callers must not open two savers
            if self._graph is None:
                await self._build_graph()
        return self._graph

    async def _build_graph(self) -> None:
        await self.store.open()  # the first open runs migrations and recovery
        owner = None if self.settings.single_owner else self.store.owner.id
        if self.settings.database_url:
            from .storage import postgres

            conn, saver = await postgres.open_saver(self.settings.database_url, owner, self._writing)
        else:
            import aiosqlite

            conn = await aiosqlite.connect(self.settings.database_path)
            await conn.execute("PRAGMA busy_timeout = 5000")
            saver = NotifyingSaver(conn, lock=self._writing)
            await saver.setup()
            if owner is not None:
                await saver.fence(owner)
        saver.on_write = self._observe
        model = chat_model(self.settings)  # once: building a client costs ~20 ms (its TLS context)
        parts = AgentParts(
            model=lambda: model,
            tools=lambda: self.tools.get(users.run_owner.get()),
            system_prompt=lambda: read_system_prompt(self.settings),
            approvals=lambda: approval_rule(mcp_servers(self.settings)),
        )
        self._saver_conn, self._saver, self._graph = conn, saver, build_graph(parts, saver, settings=self.settings)

    async def _recover(self, conversation_id: str) -> int:
        """`store.recover` for the conversation, and this process's own runs there whose outcome
        could not be written (a full disk; left for a later look if the disk is full still)."""
        return await self._relabel_unrecorded(conversation_id, refuse=False) + await self.store.recover(conversation_id)

    async def _relabel_unrecorded(self, conversation_id: str, refuse: bool) -> int:
        stranded = [run_id for run_id, there in self._unrecorded.items() if there == conversation_id]
        if not stranded:
            return 0
        try:
            count = await self.store.relabel(stranded)
        except SophosError as error:
            if refuse or error.code != errors.STORAGE_FULL:
                raise
            return 0
        for run_id in stranded:
            del self._unrecorded[run_id]
        return count

    def _point(self, name: str) -> None:
        if self.at_point is not None:
            self.at_point(name)

    def _observe(self, write: DurableWrite) -> None:
        if self.on_write is not None:
            try:
                self.on_write(write)
            except Exception:  # an observer's failure is its own: the run goes on
                log.exception("the write observer failed on %s", write)

    async def _write(self, write: Callable[..., Any], *args: Any) -> Any:
        """Await a write of a run's life (`write(*args)`) holding `_writing`: this process's flags
        about its runs (`active`, `recorded`, `cancel_requested`) change with the rows they mirror."""
        async with self._writing:
            return await write(*args)

    async def _launch(
        self, conversation_id: str, messages: list[dict[str, str]], resume: bool, title: str | None = None,
        idempotency: IdempotencyKey | None = None, command: Command | None = None,
        decision: tuple[Gate, dict[str, dict]] | None = None, before: str | None = None,
        owner: tuple[str | None] | None = None, after: Seen | None = None,
    ) -> ActiveRun:
        """Write the run (with its messages, key and gate decision), then publish `started` and
        run the graph: with the messages, or `command` (a gate's decisions), or from `next`.
        `after` is the conversation's latest run as the caller read it (`Storage.start_run`).
        With workers, queue it instead (the same row `queued`, and its `started` event): a
        worker claims it and works out the same input (`start_claimed`)."""
        if self.settings.on_workers:
            return await self._queue(conversation_id, messages, resume, title, idempotency, decision, after)
        run = ActiveRun(id=str(uuid.uuid4()), conversation=conversation_id, resume=resume,
                        keep=self.settings.event_buffer, input_ids=carried_ids(messages), before=before, owner=owner)

        async def start() -> None:
            self._check_accepting()  # again, under the lock: a shutdown may have begun meanwhile
            await self._relabel_unrecorded(conversation_id, refuse=True)
            try:
                owner_read = await self.store.start_run(run.id, conversation_id, messages, title, idempotency,
                                                        decision, after)
            except BaseException as error:  # a cancel or a cut connection: its commit may have landed,
                if isinstance(error, asyncio.CancelledError) or errors.database_unavailable(error):
                    self._note_stray()  # the answer lost: a run of ours with no task
                raise
            self.active[conversation_id] = run
            run.owner = run.owner or owner_read
            self._observe(DurableWrite("run", conversation_id))

        await self._write(start)
        self._keep_lease()
        run.publish("started", {"conversation": conversation_id, "run": run.id, "resume": resume})
        graph_input = {"messages": [HumanMessage(m["content"], id=m["id"]) for m in messages]} if messages else command
        # New input on a thread that has runs: a step they left unfolded is checkpointed first.
        fold = bool(messages) and title is None
        run.task = asyncio.create_task(self._execute(run, self._graph, graph_input, fold))
        return run

    async def _execute(self, run: ActiveRun, graph: Any, graph_input: Any, fold: bool = False) -> None:
        """The run's life after its row: the graph, the outcome, the final event. Whatever fails,
        the run leaves `active`, and a run left without a recorded outcome is given up by the
        lease keeper (`_give_up_strays`), never held by this live process for good."""
        try:
            await self._advance(run, graph, graph_input, fold)
        finally:
            if self.active.get(run.conversation) is run:
                del self.active[run.conversation]
            if not run.finished:
                self._note_stray()
                log.error("run %s stopped without its final event", run.id)
                run.publish("chat-error", {
                    "code": errors.AGENT_FAILURE, "conversation": run.conversation, "run": run.id,
                    "message": ("The run stopped before its outcome was recorded; it is relabelled "
                                "interrupted (resumable) as soon as the database can be written.")})

    async def _while_unavailable(self, attempt: Callable[[], Any], what: str) -> Any:
        """`await attempt()`, again and again while the database is unavailable (PostgreSQL
        restarting: `errors.database_unavailable`), waiting 0.1 s, then twice as long each time
        up to 2 s. Any other error is raised at once; so is a cancel (a shutdown)."""
        wait = 0.1
        while True:
            try:
                return await attempt()
            except Exception as error:
                if not errors.database_unavailable(error):
                    raise
                log.warning("the database is unavailable for %s (%s); trying again in %.1f s", what,
                            str(error).strip() or type(error).__name__, wait)
            await asyncio.sleep(wait)  # a backoff, not a barrier
            wait = min(wait * 2, 2.0)

    async def _recorded_already(self, run_id: str, status: str, error: tuple[str, str] | None) -> bool:
        """After an outcome write whose answer was lost (the connection cut at its commit), is
        this outcome the one the row holds? Then it was written, and the retry found it so."""
        row = await self.store.get_run(run_id)
        mine = self.store.owner is None or (row is not None and row.owner_id == self.store.owner.id)
        return row is not None and mine and (row.status, row.error_code) == (status, error[0] if error else None)

    async def _advance(self, run: ActiveRun, graph: Any, graph_input: Any, fold: bool) -> None:
        config = {
            **thread_config(run.conversation),
            "metadata": {"run_id": run.id},
            "recursion_limit": self.settings.recursion_limit,
        }
        if isinstance(graph_input, Command) and isinstance(graph_input.resume, dict):
            # The tools step holds every call it carries a decision for, whatever mcp.json says now.
            carried = {call_id: decision for decisions in graph_input.resume.values() for call_id, decision in decisions.items()}
            config["configurable"][CARRIED_DECISIONS] = carried
        translator = StreamTranslator(model_name=self.settings.ollama_model)
        gate = DurableGate(run.publish)
        self._saver.listeners[run.conversation] = run.checkpoint_listener(gate.saved)

        def retrying(node: str, notice: dict[str, Any]) -> None:
            # Live, like a token: a retry is news about a step in flight, not a saved fact.
            step = translator.open_step(node)
            gate.offer("trace", {**step, "event": "retry", "data": notice}, None)

        watch = AttemptWatch(on_retry=retrying, before_step=self._saver._turn, stopped=lambda: run.cancel_requested)
        ATTEMPT_WATCH.set(watch)  # this task's context, which the graph's tasks inherit
        status, error, budget = "completed", None, None
        run.in_graph = True
        try:
            # The conversation's owner's own MCP servers serve its tools (a memory of theirs only);
            # the owner comes from the row, never from the model.
            if run.owner is None:
                self._point("owner")
                run.owner = (await users.owner_of(self.store, run.conversation),)
            users.run_owner.set(owner := run.owner[0])
            self._point("budget")
            budget = await users.step_budget(self.store, owner, self.settings.user_limits,
                                             self.settings.recursion_limit, utc_now())
            config["recursion_limit"] = budget.steps
            self.tools.hold(owner)
            asyncio.current_task().add_done_callback(lambda _: self.tools.release(owner))
            if fold:
                await self._fold(graph, run)
            async for mode, chunk in graph.astream(
                graph_input, config, stream_mode=["messages", "debug"], durability="sync",
                control=run.control,
            ):
                for item in translator.feed(mode, chunk):
                    gate.offer(*item)
        except (GraphDrained, asyncio.CancelledError):
            # A drain stopped it at a step boundary, or a cancel mid-step: cancel() or a
            # shutdown whose time to drain ran out.
            status, error = "interrupted", (errors.SHUTDOWN, errors.SHUTDOWN_MESSAGE)
            if run.overdue:
                status, error = "failed", (errors.TIMEOUT, (
                    f"The run ran longer than its steps can take ({self.overdue_seconds():.0f} s) and was "
                    "stopped; every step it saved stands."))
        except Exception as exc:
            status, error = "failed", classify_failure(exc, watch.gave_up, self.settings)
            if error[0] == errors.DATABASE_UNAVAILABLE:
                log.warning("run %s stopped: the database is unavailable (%s)", run.id, exc)
            if error[0] == errors.RECURSION_LIMIT and budget is not None and budget.setting:
                error = errors.STEP_BUDGET_SPENT, budget.message
            run.lost = run.lost or is_fenced(exc)
        finally:
            run.in_graph = False
            self._saver.listeners.pop(run.conversation, None)
        steps = translator.steps_entered
        for item in translator.finish():
            gate.offer(*item)
        stopped_at = None  # the approval gate the run stopped at
        if status == "completed" and translator.interrupts:
            status, stopped_at = "waiting", self._gate_of(run, translator.interrupts[0])
        # A completed run's last checkpoint is on the stream; after a failure, ask the saver what
        # was actually written.
        count = translator.message_count if status in ("completed", "waiting") else None
        attempts = 0

        async def record() -> bool:
            nonlocal status, error, stopped_at
            if run.cancel_requested:  # written before this, under the same lock: it wins
                status, error, stopped_at = "cancelled", (errors.CANCELLED, errors.CANCELLED_MESSAGE), None
            input_ids = run.input_ids if run.input_saved else None  # the thread holds them
            recorded = await self.store.finish_run(run.id, status, count, *(error or (None, None)), gate=stopped_at,
                                                   steps=steps, input_ids=input_ids)
            if not recorded and not run.cancel_requested and await self.store.cancel_requested(run.id):
                # Another process recorded a cancel of this run before this outcome.
                run.cancel_requested = True
                status, error, stopped_at = "cancelled", (errors.CANCELLED, errors.CANCELLED_MESSAGE), None
                recorded = await self.store.finish_run(run.id, status, count, *error, steps=steps, input_ids=input_ids)
            if not recorded and attempts > 1:
                recorded = await self._recorded_already(run.id, status, error)
            run.recorded = True
            if recorded:
                self._observe(DurableWrite("outcome", run.conversation, status=status))
            return recorded

        async def record_outcome() -> bool:
            nonlocal count, attempts
            attempts += 1
            if attempts == 1:
                self._point("outcome")
            if count is None:  # after a failure, ask the saver what was actually written
                count = await self._message_count(graph, run.conversation)
            write = asyncio.ensure_future(self._write(record))
            try:
                return await asyncio.shield(write)
            except asyncio.CancelledError:  # a late shutdown cancel: let the write under way finish
                return await write

        try:
            # Persist, then notify: while the database is unavailable, the outcome waits for it
            # (followers get pings), and is written once it is back.
            if not await self._while_unavailable(record_outcome, f"the outcome of run {run.id}"):
                run.lost = True  # the run is another process's now: its record stands, not ours
        except (Exception, asyncio.CancelledError) as exc:
            # Not on disk, so not `end`: the row stays `running` under this live owner until the
            # lease keeper gives it up (`_give_up_strays`: relabelled once the database can be
            # written), or this process exits and the next open relabels it.
            log.warning("could not record the outcome of run %s", run.id, exc_info=True)
            self._unrecorded[run.id] = run.conversation
            self._note_stray()
            if isinstance(exc, asyncio.CancelledError) or errors.database_unavailable(exc):
                code = errors.DATABASE_UNAVAILABLE
            else:
                code = exc.code if isinstance(exc, SophosError) else errors.AGENT_FAILURE  # STORAGE_FULL, say
            why = str(exc) or "the process stopped while the database was unavailable"
            status, error = "failed", (code, f"The run's outcome could not be recorded: {why}")
        self._point("recorded")  # the outcome is on disk, its final event not given yet
        gate.flush()
        if run.lost:
            error = (errors.OWNERSHIP_LOST, errors.OWNERSHIP_LOST_MESSAGE)
        if error:
            run.publish("chat-error", {
                "code": error[0], "message": error[1], "conversation": run.conversation, "run": run.id,
            })
        else:
            if stopped_at is not None:
                run.publish("trace", {**(translator.waiting_step or {}), "event": "waiting",
                                      "data": {"gate": stopped_at.id, "calls": stopped_at.calls}})
            run.publish("end", self._end_data(run.conversation, run.id, status, stopped_at))

    async def _fold(self, graph: Any, run: ActiveRun) -> None:
        """Before this run's new input: checkpoint a step that a run before it finished (its writes
        saved) but did not checkpoint, without running anything again; LangGraph drops the
        latest checkpoint's pending writes when a run starts with input. Read now, after this
        run's row: no other run can change the thread any more (one run per conversation).

        The common case reads no checkpoint: a run that completed left every step checkpointed.
        The fold's checkpoint is the stopped run's (the one whose step it is): this run's own
        input has not reached the thread yet (see `unapplied_input`). A resume stops before any
        node (an input-less run passes no breakpoint in its first step, so it folds just that)."""
        if run.before is None:
            runs = await self.store.list_runs(run.conversation)
            run.before = runs[-2].status if len(runs) > 1 else "completed"
        if run.before == "completed":
            return
        config = thread_config(run.conversation)
        state = await graph.aget_state(config)
        if not unfolded(state):
            return
        config["metadata"] = {"run_id": (state.metadata or {}).get("run_id")}
        async for _ in graph.astream(None, config, stream_mode="values", durability="sync",
                                     interrupt_before=list(AGENT_NODES), control=run.control):
            pass

    @staticmethod
    def _gate_of(run: ActiveRun, interrupt: dict[str, Any]) -> Gate:
        value = interrupt["value"] if isinstance(interrupt["value"], dict) else {}
        return Gate(id=interrupt["id"], conversation_id=run.conversation, run_id=run.id,
                    calls=value.get("calls", []), created_at="")

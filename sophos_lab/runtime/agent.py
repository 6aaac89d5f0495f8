"""The agent graph: START → agent ⇄ tools → END, and how its failures become error codes.

The graph holds no resources of its own. The model, the tools and the system prompt are
resolved when a node runs, so compiling the graph or reading a thread's state never starts an
MCP server and never calls the model.
"""

from __future__ import annotations

import asyncio
import json
import re
import urllib.error
import urllib.request
import uuid
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Annotated, Any, TypedDict

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import (
    AIMessage, AnyMessage, BaseMessage, BaseMessageChunk, RemoveMessage, SystemMessage, ToolMessage,
    convert_to_messages, message_chunk_to_message,
)
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.errors import GraphRecursionError, NodeTimeoutError
from langgraph.channels import DeltaChannel
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import REMOVE_ALL_MESSAGES
from langgraph.prebuilt import ToolNode
from langgraph.types import RetryPolicy, TimeoutPolicy, interrupt

from . import errors
from .errors import SophosError
from .settings import Settings
from .tools import mcp_servers, model_facing, read_config_file, with_idempotency_key

DEFAULT_SYSTEM_PROMPT = "You are an AI assistant with access to MCP tools."
_NO_THINKING = re.compile(r"does not support thinking", re.IGNORECASE)
# Ollama's answer for a model it does not have, in its older and newer wording:
#   model 'x' not found (status code: 404)       model "x" not found, try pulling it first
_MODEL_NOT_FOUND = re.compile(r"""model\s+(?:'([^']*)'|"([^"]*)"|(\S+))\s+not found""", re.IGNORECASE)
_STATUS_SUFFIX = re.compile(r"\s*\(status code: \d+\)\s*$")


def add_message_batches(messages: list[AnyMessage], batches: list) -> list[AnyMessage]:
    """`add_messages` folded over a batch of node writes, oldest first.

    The same list as `reduce(add_messages, batches, messages)`, so the same result however the
    writes are grouped (which `DeltaChannel` needs to replay them), but the thread is copied and
    indexed once, not once per write: rebuilding a thread from its snapshot and the hundred
    writes after it is one pass over the thread, not a hundred.
    """
    if not batches:
        return messages
    merged = _as_messages(messages)
    for message in merged:
        if message.id is None:
            message.id = str(uuid.uuid4())
    index = {message.id: at for at, message in enumerate(merged)}
    for batch in batches:
        right = _as_messages(batch if isinstance(batch, list) else [batch])
        remove_all = None
        for at, message in enumerate(right):
            if message.id is None:
                message.id = str(uuid.uuid4())
            if isinstance(message, RemoveMessage) and message.id == REMOVE_ALL_MESSAGES:
                remove_all = at
        if remove_all is not None:
            merged = right[remove_all + 1:]
            index = {message.id: at for at, message in enumerate(merged)}
            continue
        removed: set[str] = set()
        for message in right:
            at = index.get(message.id)
            if at is not None:
                if isinstance(message, RemoveMessage):
                    removed.add(message.id)
                else:
                    removed.discard(message.id)
                    merged[at] = message
            elif isinstance(message, RemoveMessage):
                raise ValueError(f"Attempting to delete a message with an ID that doesn't exist ('{message.id}')")
            else:
                index[message.id] = len(merged)
                merged.append(message)
        if removed:
            merged = [message for message in merged if message.id not in removed]
            index = {message.id: at for at, message in enumerate(merged)}
    return merged


def _as_messages(items: list) -> list[AnyMessage]:
    """A new list of `items` as messages (a chunk becomes its message, a tuple or dict a message)."""
    if all(issubclass(kind, BaseMessage) and not issubclass(kind, BaseMessageChunk) for kind in set(map(type, items))):
        return list(items)
    return [message_chunk_to_message(item) for item in convert_to_messages(items)]


SNAPSHOT_FREQUENCY = 100
"""Every this many updates of the thread's messages (two per plain turn: the user's message and
the answer; four with a tool call), a checkpoint stores the whole list. Reading a thread replays
the writes since the latest such snapshot, so the cadence trades file size (each snapshot is the
whole thread again) against how far a read walks back (about 15 us per update). Measured with
benchmarks/growth.py's thread (200 turns of 4 KB): a snapshot every 50 updates makes the file
9.8x its messages, every 100 7.4x, every 200 6.2x, and the time per turn does not tell them
apart (README, Storage)."""


State = dict[str, Any]
"""What a node is given: the graph's state, as `AgentState` (or another schema, see `build_graph`)
says. Nodes are annotated with this and not with `AgentState`, which LangGraph would take as
their own input schema."""


class AgentState(TypedDict):
    # Each checkpoint stores only the messages its step added (with the whole list every
    # SNAPSHOT_FREQUENCY updates), not the whole list again: the file grows with the thread, not
    # with its square. A file written with LangGraph's default channel (`MessagesState`) still
    # reads: its checkpoints' plain lists are taken as the value to replay from.
    messages: Annotated[list[AnyMessage], DeltaChannel(add_message_batches, snapshot_frequency=SNAPSHOT_FREQUENCY)]


class ModelUnavailable(Exception):
    """Ollama answered that the configured model does not exist.

    `model` is the name in Ollama's answer (else the configured one), `host` the server that
    answered, `reason` Ollama's own words: together they make the recorded message.
    """

    def __init__(self, reason: str, model: str | None = None, host: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.model = model
        self.host = host

    @classmethod
    def from_error(cls, error: BaseException, model: str | None = None,
                   host: str | None = None) -> ModelUnavailable | None:
        """The `ModelUnavailable` for an error whose text is Ollama's "model … not found", else None."""
        text = str(error)
        found = _MODEL_NOT_FOUND.search(text)
        if found is None:
            return None
        named = next((group for group in found.groups() if group), None)
        return cls(_STATUS_SUFFIX.sub("", text).strip(), named or model, host)

    def message(self) -> str:
        where = f"OLLAMA_HOST ({self.host})" if self.host else "OLLAMA_HOST"
        return errors.MODEL_UNAVAILABLE_DETAIL.format(model=self.model or "?", where=where, reason=self.reason)


def no_approvals() -> Callable[[str], bool]:
    return lambda name: False


@dataclass
class AgentParts:
    """What the nodes resolve each time they run."""

    model: Callable[[], BaseChatModel]
    tools: Callable[[], Awaitable[list[BaseTool]]]
    system_prompt: Callable[[], str]
    approvals: Callable[[], Callable[[str], bool]] = no_approvals
    """Which tools need approval (by the name the model calls them), as the config says now."""


# --- approval gates --------------------------------------------------------------------------

APPROVE, REJECT = "approve", "reject"
REJECTED_BY_DEFAULT = "The user rejected this call."
CARRIED_DECISIONS = "sophos_lab_decisions"
"""The run config's key for the decisions a run carries into a gate (see the tools node)."""


def approval_request(calls: list[dict]) -> dict[str, Any]:
    """What the tools step's `interrupt()` holds: the calls waiting for a decision."""
    return {"type": "approval", "calls": [{"id": c["id"], "name": c["name"], "args": c["args"]} for c in calls]}


def rejected_result(call: dict, decision: dict | None) -> ToolMessage:
    """The tool result the model reads for a call a person rejected (or never decided on)."""
    reason = (decision or {}).get("reason") or REJECTED_BY_DEFAULT
    return ToolMessage(
        content=f"Not run: the user rejected this tool call. Reason: {reason}",
        tool_call_id=call["id"], name=call["name"], status="error",
    )


def read_system_prompt(settings: Settings) -> str:
    """`CONFIG_DIR/system.md`, read on every model call; an empty file means the default prompt.

    A file that is missing, unreadable or not UTF-8 raises `CONFIG_ERROR` with the path in the
    message, which fails the run.
    """
    text = read_config_file(settings.system_prompt_path, "System prompt").strip()
    return text or DEFAULT_SYSTEM_PROMPT


def check_config(settings: Settings) -> None:
    """Check `mcp.json` and `system.md` as a run reads them; a bad one raises `CONFIG_ERROR` naming it.

    It starts no MCP server and calls no model, so a run can be refused before anything is written.
    """
    mcp_servers(settings)
    read_system_prompt(settings)


def chat_model(settings: Settings) -> BaseChatModel:
    """ChatOllama pointed at `OLLAMA_HOST` / `OLLAMA_MODEL` (the scripted model or a real Ollama)."""
    import httpx
    from langchain_ollama import ChatOllama

    # `reasoning` is sent as Ollama's `think`: False asks a thinking model not to think (the
    # original's OLLAMA_THINK default); True streams `message.thinking`, kept in the message's
    # additional_kwargs["reasoning_content"] and published as `reasoning` events.
    # ChatOllama makes a sync and an async client, and each would load the CA bundle into a TLS
    # context of its own (20 ms each, on a resume's way to its first event): one, made as httpx
    # makes it (certifi, or SSL_CERT_FILE / SSL_CERT_DIR), serves both.
    return ChatOllama(
        model=settings.ollama_model, base_url=settings.ollama_host, reasoning=settings.ollama_think,
        client_kwargs={"verify": httpx.create_ssl_context()},
    )


# --- retries and timeouts -------------------------------------------------------------------

NODE_SETTINGS = {
    "agent": ("SOPHOS_LAB_MODEL_ATTEMPTS", "SOPHOS_LAB_MODEL_TIMEOUT_SECONDS"),
    "tools": ("SOPHOS_LAB_TOOL_ATTEMPTS", "SOPHOS_LAB_TOOL_TIMEOUT_SECONDS"),
}
"""Each node's settings: its attempts and its time limit per attempt."""


def is_transient(error: BaseException) -> bool:
    """Whether another attempt may succeed: a timed-out attempt, a connection refused or reset,
    a read that broke off, an HTTP 5xx. Never a model that does not exist (404), a bad
    configuration, or anything else: those fail the same way again. (A tool's own error is not
    an exception at all: it is a `ToolMessage` the model reads.)"""
    import httpx
    from ollama import ResponseError

    if isinstance(error, (ModelUnavailable, SophosError)):
        return False
    if isinstance(error, NodeTimeoutError):
        return True
    if isinstance(error, ResponseError):
        return error.status_code >= 500
    if isinstance(error, httpx.HTTPStatusError):
        return error.response.status_code >= 500
    return isinstance(error, (httpx.NetworkError, httpx.TimeoutException, httpx.RemoteProtocolError, ConnectionError))


@dataclass
class StepFailure:
    """A step whose last attempt failed: no retry follows."""

    node: str
    attempt: int
    attempts: int
    """How many attempts the node was allowed."""
    error: BaseException
    transient: bool
    answers: tuple[int | None, ...] = ()
    """The HTTP status each of the step's failed attempts got, in order (None: no answer at all)."""


@dataclass
class AttemptWatch:
    """A run's view of its steps' attempts (set for the run in `ATTEMPT_WATCH`).

    `on_retry(node, notice)` is called as soon as an attempt has failed and another will follow,
    before the wait: `notice` is `{attempt, of, wait, code, error}` (the attempt about to come).
    """

    on_retry: Callable[[str, dict[str, Any]], None]
    attempt: dict[str, int] = field(default_factory=dict)
    """The attempt each node is on (LangGraph's `node_attempt`, from 1)."""
    answers: dict[str, list[int | None]] = field(default_factory=dict)
    """Per node, the HTTP status of each failed attempt of its current step (None: no answer)."""
    gave_up: StepFailure | None = None
    before_step: Callable[[], Awaitable[None]] | None = None
    """Awaited as each attempt begins, before its work: the service's wait for a write of the
    run's life under way (a cancel being recorded), so a run stopped meanwhile stops there,
    before the step's model request or tool call."""
    stopped: Callable[[], bool] = lambda: False
    """Whether the run was cancelled (checked once `before_step` is through: the step raises
    `CancelledError` then, as the cancel of its task would, before its work)."""


ATTEMPT_WATCH: ContextVar[AttemptWatch | None] = ContextVar("sophos_attempt_watch", default=None)
"""The run's `AttemptWatch`: the service sets it in the run's task; the nodes and the retry
policies (run in that task or in tasks it starts) read it. LangGraph's retry loop tells nothing
but a log line, and a node's own stream writer is closed once its attempt has timed out."""


def failure_code(node: str, error: BaseException) -> str:
    """The code a failed attempt would be recorded with if it were the last (a retry says it)."""
    if isinstance(error, NodeTimeoutError):
        return errors.TIMEOUT
    return errors.MODEL_UNREACHABLE if node == "agent" else errors.AGENT_FAILURE


def http_status(error: BaseException) -> int | None:
    """The HTTP status a failed request got, if the server answered at all."""
    import httpx
    from ollama import ResponseError

    if isinstance(error, ResponseError) and error.status_code > 0:
        return error.status_code
    if isinstance(error, httpx.HTTPStatusError):
        return error.response.status_code
    return None


def describe_failure(node: str, error: BaseException, settings: Settings) -> str:
    """A failed attempt in words; a timeout with the setting, not LangGraph's elapsed time."""
    if isinstance(error, NodeTimeoutError):
        limit = settings.model_timeout_seconds if node == "agent" else settings.tool_timeout_seconds
        return f"the {node} step exceeded its time limit of {limit:g} s ({NODE_SETTINGS[node][1]})"
    return str(error) or type(error).__name__


def node_policies(node: str, settings: Settings) -> tuple[RetryPolicy, TimeoutPolicy]:
    """The node's retry policy (attempts, exponential backoff, transient errors only) and its
    hard time limit per attempt, from `settings`."""
    attempts = settings.model_attempts if node == "agent" else settings.tool_attempts
    limit = settings.model_timeout_seconds if node == "agent" else settings.tool_timeout_seconds

    def retry_on(error: Exception) -> bool:
        transient = is_transient(error)
        watch = ATTEMPT_WATCH.get()
        if watch is not None:
            attempt = watch.attempt.get(node, 1)
            if attempt == 1:
                watch.answers[node] = []
            watch.answers.setdefault(node, []).append(http_status(error))
            if transient and attempt < attempts:
                watch.on_retry(node, {
                    "attempt": attempt + 1, "of": attempts, "wait": settings.backoff(attempt),
                    **({"jitter": True} if settings.retry_jitter else {}),
                    "code": failure_code(node, error), "error": describe_failure(node, error, settings),
                })
            else:
                watch.gave_up = StepFailure(node, attempt, attempts, error, transient, tuple(watch.answers[node]))
        return transient

    retry = RetryPolicy(
        initial_interval=settings.retry_base_seconds, backoff_factor=2.0,
        max_interval=settings.retry_max_seconds, max_attempts=attempts, jitter=settings.retry_jitter,
        retry_on=retry_on,
    )
    return retry, TimeoutPolicy(run_timeout=limit)


async def _attempt_begins(node: str, runtime: Any) -> None:
    watch = ATTEMPT_WATCH.get()
    info = getattr(runtime, "execution_info", None)
    if watch is not None and info is not None:
        watch.attempt[node] = info.node_attempt
    if watch is not None and watch.before_step is not None:
        # A step let through once a cancel is recorded stops before its request or call: the
        # cancel of the run's task may reach this step's own task only after it has sent them.
        await watch.before_step()
        if watch.stopped():
            raise asyncio.CancelledError


def classify_failure(error: BaseException, gave_up: StepFailure | None, settings: Settings) -> tuple[str, str]:
    """`classify_error`, but a step that used up its attempts on transient errors (or timed out)
    gets the precise code, and a message that names the attempts. A single attempt that failed
    otherwise is reported as the original did (`AGENT_FAILURE` and the client's words)."""
    if gave_up is None or gave_up.error is not error or not gave_up.transient:
        return classify_error(error)
    timed_out = isinstance(error, NodeTimeoutError)
    if gave_up.attempts == 1 and not timed_out:
        return classify_error(error)
    setting = NODE_SETTINGS[gave_up.node][0]
    tries = (f"after {gave_up.attempt} attempts ({setting}={gave_up.attempts})" if gave_up.attempts > 1
             else f"in its one attempt ({setting}=1)")
    what = describe_failure(gave_up.node, error, settings)
    if timed_out:
        return errors.TIMEOUT, f"The {gave_up.node} step failed {tries}: {what}."
    if gave_up.node == "agent":
        if len(set(gave_up.answers)) == 1 and gave_up.answers[0] is not None:
            # It did answer, each time with the same error status: not the same as no answer.
            every = "its one attempt" if gave_up.attempt == 1 else f"all {gave_up.attempt} attempts"
            return errors.MODEL_UNREACHABLE, (
                f"The model answered HTTP {gave_up.answers[0]} to {every} ({setting}={gave_up.attempts}): {what}")
        return errors.MODEL_UNREACHABLE, f"The model did not answer {tries}: {what}"
    return errors.AGENT_FAILURE, f"The tools step failed {tries}: {what}"


def thread_config(conversation_id: str) -> dict[str, Any]:
    """LangGraph's config of a conversation's thread."""
    return {"configurable": {"thread_id": conversation_id}}


def build_graph(parts: AgentParts | None, checkpointer: BaseCheckpointSaver, *, schema: type = AgentState,
                settings: Settings | None = None):
    """Compile the graph. With `parts=None` the graph can only be read, not run.

    `schema` is the state's: `AgentState`, unless you want the graph as files were written
    before it (`langgraph.graph.MessagesState`, the whole list in every checkpoint), e.g. to make
    such a file and check that it still reads. `settings` gives each node its retry policy and
    time limit (`node_policies`; the defaults of `Settings` when None).
    """
    settings = settings or Settings()

    async def agent(state: State, config: RunnableConfig, runtime: Any = None) -> dict:
        assert parts is not None, "this graph was built for reading only"
        await _attempt_begins("agent", runtime)
        tools = await parts.tools()
        model = parts.model()
        bound = model.bind_tools(model_facing(tools)) if tools else model
        prompt = [SystemMessage(parts.system_prompt()), *state["messages"]]
        try:
            response = await bound.ainvoke(prompt, config)
        except Exception as error:
            missing = ModelUnavailable.from_error(
                error, getattr(model, "model", None), getattr(model, "base_url", None))
            if missing is not None:
                raise missing from error
            if _NO_THINKING.search(str(error)):
                raise SophosError(errors.THINKING_UNSUPPORTED, (
                    f"{error} (Ollama's words). OLLAMA_THINK=true asks every model call to think; "
                    "unset it, or choose a model that can think."
                )) from error
            raise
        return {"messages": [response]}

    async def tools(state: State, config: RunnableConfig, runtime: Any = None) -> dict:
        assert parts is not None, "this graph was built for reading only"
        await _attempt_begins("tools", runtime)
        thread_id = config["configurable"]["thread_id"]
        needs_approval = parts.approvals()
        # Held: what the configuration gates now, and whatever the run carries a decision for
        # (the rule may have changed while the gate waited: a rejected call must never run).
        carried = config["configurable"].get(CARRIED_DECISIONS) or {}
        calls = state["messages"][-1].tool_calls
        held = [call for call in calls if needs_approval(call["name"]) or call["id"] in carried]
        # The gate stands before every call of the turn: none runs until all are decided. The
        # first time, interrupt() stops the run here (the step is not saved, the interrupt
        # is); the resume runs the step again from the top, and interrupt() returns the
        # decisions the resume carried.
        decisions = interrupt(approval_request(held)) if held else {}
        held_ids = {call["id"] for call in held}

        async def keyed(request, execute):
            call = request.tool_call
            decision = decisions.get(call["id"])
            if call["id"] in held_ids and (decision or {}).get("decision") != APPROVE:
                return rejected_result(call, decision)
            return await execute(request.override(tool_call=with_idempotency_key(call, request.tool, thread_id)))

        # One task for all tool calls of a turn: that task is the unit a resume repeats.
        node = ToolNode(await parts.tools(), awrap_tool_call=keyed)
        return await node.ainvoke(state, config)

    builder = StateGraph(schema)
    for name, node in zip(AGENT_NODES, (agent, tools)):
        retry, timeout = node_policies(name, settings)
        builder.add_node(name, node, retry_policy=retry, timeout=timeout)
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", route_after_agent, ["tools", END])
    builder.add_edge("tools", "agent")
    return builder.compile(checkpointer=checkpointer)


AGENT_NODES = ("agent", "tools")
"""The graph's nodes: START → agent ⇄ tools → END."""


def route_after_agent(state: State) -> str:
    last = state["messages"][-1]
    return "tools" if isinstance(last, AIMessage) and last.tool_calls else END


def classify_error(error: BaseException) -> tuple[str, str]:
    """An exception that escaped the graph, as `(error_code, message)`."""
    if isinstance(error, GraphRecursionError):
        return errors.RECURSION_LIMIT, errors.RECURSION_LIMIT_MESSAGE
    if isinstance(error, ModelUnavailable):
        return errors.MODEL_UNAVAILABLE, error.message()
    if isinstance(error, SophosError):  # e.g. a CONFIG_ERROR met while the run was under way
        return error.code, error.message
    if errors.database_unavailable(error):
        return errors.DATABASE_UNAVAILABLE, (
            f"The database became unavailable during the run ({str(error).strip() or type(error).__name__}); "
            "every step it saved stands: resume once the database is back.")
    return errors.AGENT_FAILURE, str(error) or type(error).__name__ or "Agent failed"


@dataclass(frozen=True)
class Readiness:
    """The answer of the readiness check: advisory, it never blocks a run."""

    ok: bool
    message: str
    models: tuple[str, ...] = ()


def check_model(settings: Settings, timeout: float = 3.0) -> Readiness:
    """Like the original's `readyz`: does `OLLAMA_HOST` answer and list `OLLAMA_MODEL`?"""
    url = settings.ollama_host.rstrip("/") + "/api/tags"
    if "://" not in url:
        url = "http://" + url
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            body = json.load(response)
    except urllib.error.HTTPError as error:
        return Readiness(False, f"Ollama service not available (HTTP {error.code})")
    except (OSError, ValueError):
        return Readiness(False, "Failed to connect to Ollama")
    names = tuple(model.get("name", "") for model in body.get("models", []))
    if any(same_model(settings.ollama_model, name) for name in names):
        return Readiness(True, "ok", names)
    return Readiness(False, f'Ollama model "{settings.ollama_model}" not available', names)


def same_model(wanted: str, listed: str) -> bool:
    """Ollama's rule: a name without a tag means `:latest`, so `qwen3` is `qwen3:latest`, while
    `qwen3:8b` is only itself and `qwen` is not `qwen3` (case-insensitive, as Ollama's names are)."""

    def full(name: str) -> str:
        name = name.strip().lower()
        return name if ":" in name.rsplit("/", 1)[-1] else name + ":latest"

    return bool(wanted.strip()) and full(wanted) == full(listed)


async def check_model_async(settings: Settings) -> Readiness:
    return await asyncio.to_thread(check_model, settings)


def tool_names(message: Any) -> list[str]:
    return [call["name"] for call in getattr(message, "tool_calls", None) or []]

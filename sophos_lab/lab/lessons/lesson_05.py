"""Lesson 05 · Memory is not one thing: what the lesson uses besides the lesson itself.

`ask` sends one message to the lesson's agent process and records the turn; `stores` looks for a
text in each of the six stores, where each one lives; `per_call` sets each model request next to
the thread it was built from; `set_the_scene` and `test_forget_everywhere` are the exercise's
check. Read any of them with `??`, e.g. `lesson.stores??`.
"""

from __future__ import annotations

import inspect
import json
import sqlite3
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from ...runtime.service import AgentService
    from ..children import LabKernel, LabWorker
    from ..harness import Lab

CODENAME = "BLUE-HERON"
TEACH = f"Remember: the Sophos lab codename is {CODENAME}."
RECALL = "What is the lab codename?"
READ_GRAPH = "Read your entire knowledge graph, then tell me the Sophos lab codename."
HELLO = "Hello!"

STORES = ["prompt context", "conversation history", "execution state", "checkpoint history",
          "app metadata", "long-term memory"]
"""The six stores, in the order of the lesson's tables."""
DATABASE_STORES = {"conversation history", "execution state", "checkpoint history", "app metadata"}
"""The stores that live in the kit's database (`sophos.db`)."""
HOLDS = "holds the codename"
"""The column of a `stores()` table that says whose copies of the text each store holds."""

OWNER = ["nobody: built for each call", "LangGraph", "LangGraph", "LangGraph", "the app (sophos_lab)",
         "the memory MCP server"]
DELETED_BY = ["nothing to delete", "deleting the conversation", "deleting the conversation",
              "deleting the conversation (pruning takes old checkpoints)", "deleting the conversation",
              "deleting the file, or the memory__delete_* tools"]

ENTITY = {"type": "entity", "name": "Sophos lab", "entityType": "project", "observations": [f"codename is {CODENAME}"]}
"""The entity the scripted model writes when it is told the codename."""


@dataclass
class Turn:
    """One chat turn: its conversation (and the lesson's name for it, C1, C2, ...), what was sent,
    how the run ended, the tools the model called (and their arguments), the answer it streamed,
    and the model requests the turn made (from the model request log)."""

    conversation: str
    name: str
    message: str
    status: str
    tools: list[str]
    arguments: list[dict[str, Any]]
    answer: str
    requests: list[dict[str, Any]]


@dataclass
class Agent:
    """The lesson's one agent process, and the turns it has run; conversations are named C1, C2,
    ... in the order they were started."""

    lab: Lab
    child: LabKernel | LabWorker
    names: dict[str, str] = field(default_factory=dict)
    turns: list[Turn] = field(default_factory=list)

    def label(self, conversation: str | None) -> str:
        """The lesson's name for `conversation` ("C3"), else the start of its id."""
        return self.names.get(conversation, conversation[:8]) if conversation else "no conversation"


def memory_file(lab: Lab) -> Path:
    """The memory server's file: `MEMORY_FILE_PATH` of the lab's environment (`lab.root / "memory.jsonl"`)."""
    return Path(lab.env()["MEMORY_FILE_PATH"])


def memory_bytes(lab: Lab) -> bytes | None:
    """The memory file's bytes, or None when there is no file."""
    path = memory_file(lab)
    return path.read_bytes() if path.exists() else None


def memory_graph(lab: Lab) -> list[dict[str, Any]] | None:
    """The memory file's lines as JSON: one entity or relation a line (None when there is no file)."""
    path = memory_file(lab)
    if not path.exists():
        return None
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def ask(agent: Agent, message: str, conversation: str | None = None) -> Turn:
    """Send `message` (in `conversation`, else in a new one), wait for the run's end, and record
    the turn: its conversation, status, tool calls, answer and the model requests it made."""
    lab, child = agent.lab, agent.child
    first_request = lab.model_calls()
    child.chat(message, conversation)
    c = child.conversation()
    final = child.wait_final()
    agent.names.setdefault(c, f"C{len(agent.names) + 1}")
    events = child.events()
    calls = [e["data"]["data"] for e in events if e["event"] == "trace" and e["data"]["event"] == "call"]
    turn = Turn(
        conversation=c, name=agent.names[c], message=message,
        status=final["data"].get("status") if final["event"] == "end" else final["event"],
        tools=[call["name"] for call in calls],
        arguments=[call["arguments"] for call in calls],
        answer="".join(e["data"] for e in events if e["event"] == "token"),
        requests=lab.model.chat_requests()[first_request:],
    )
    agent.turns.append(turn)
    return turn


def show(turn: Turn, arguments: bool = False) -> None:
    """Print a turn: its conversation, status and tools (with their `arguments`, if asked), and the answer."""
    print(f"{turn.name}: {turn.status} | tools called: {turn.tools}")
    if arguments:
        for name, args in zip(turn.tools, turn.arguments):
            print(f"  {name} {json.dumps(args)}")
    print("answer:", turn.answer)


def roles_holding(messages: pd.DataFrame, text: str = CODENAME) -> list[str]:
    """The roles of the messages (a `lab.messages(c)` table) whose content holds `text`, in order."""
    return [m.role for m in messages.itertuples() if text in (m.content or "")]


def graph_read_in(messages: pd.DataFrame) -> dict[str, Any] | None:
    """The graph the first `memory__read_graph` result of a thread (a `lab.messages(c)` table)
    holds, as JSON; None when there is no such result or it is not JSON."""
    for m in messages.itertuples():
        if m.role == "tool" and m.name == "memory__read_graph":
            try:
                return json.loads(m.content or "")
            except ValueError:
                return None
    return None


def db_rows(lab: Lab, sql: str, *params: Any) -> list[tuple]:
    """The rows of a query on the lab's database, opened read-only (none before it exists)."""
    if not lab.db_path.exists():
        return []
    with closing(sqlite3.connect(f"file:{lab.db_path}?mode=ro", uri=True)) as conn:
        return conn.execute(sql, params).fetchall()


def rows_left(lab: Lab, conversations: list[str]) -> dict[str, int]:
    """Per table of the database, how many rows still belong to `conversations`."""
    marks = ", ".join("?" for _ in conversations)
    return {table: db_rows(lab, f"SELECT count(*) FROM {table} WHERE {column} IN ({marks})", *conversations)[0][0]
            for table, column in [("conversations", "id"), ("runs", "conversation_id"),
                                  ("checkpoints", "thread_id"), ("writes", "thread_id")]}


def _count(n: int, word: str, words: str | None = None) -> str:
    return f"{n} {word if n == 1 else words or word + 's'}"


def stores(agent: Agent, text: str = CODENAME) -> pd.DataFrame:
    """The six stores side by side: what each holds now, and whose copies of `text` it holds
    ("-": none). Each store is read where it lives: the model request log; the messages of each
    thread's latest checkpoint; that checkpoint's step, `next` and pending writes; the bytes in
    LangGraph's `checkpoints` and `writes` tables; the `conversations` and `runs` rows; the memory file."""
    lab = agent.lab
    listed = lab.conversations()
    ids = sorted(listed["id"], key=lambda c: agent.names.get(c, c))
    titles = dict(zip(listed["id"], listed["title"]))
    needle = text.encode()

    def blobs(table: str, column: str, c: str, where: str = "") -> list[bytes]:
        query = f"SELECT {column} FROM {table} WHERE thread_id = ? {where}"
        return [bytes(v or b"") for (v,) in db_rows(lab, query, c)]

    def whose(found: Callable[[str], bool]) -> str:
        return ", ".join(agent.label(c) for c in ids if found(c)) or "-"

    messages = {c: [m or "" for m in lab.messages(c)["content"]] for c in ids}
    latest = {c: lab.state(c)["last_checkpoint"] for c in ids}
    pending = {c: blobs("writes", "value", c, "AND checkpoint_id = (SELECT max(checkpoint_id) FROM checkpoints"
                        " WHERE thread_id = writes.thread_id)") for c in ids}
    saved = {c: (blobs("checkpoints", "checkpoint", c), blobs("writes", "value", c)) for c in ids}
    runs = lab.peek_runs()
    inputs = {c: " ".join(i or "" for i in runs[runs["conversation_id"] == c]["input"]) for c in ids}
    requests = lab.model.chat_requests()
    graph = memory_graph(lab)
    file = memory_file(lab)
    none = "no conversations"
    rows = [
        ("prompt context",
         f"{len(requests)} model calls so far, the last with {requests[-1]['n_messages']} messages" if requests
         else "no model call yet",
         "not stored"),
        ("conversation history",
         "; ".join(f"{agent.label(c)}: {_count(len(messages[c]), 'message')}" for c in ids) or none,
         whose(lambda c: any(text in m for m in messages[c]))),
        ("execution state",
         "; ".join(f"{agent.label(c)}: step {latest[c]['step']}, next {latest[c]['next']}, "
                   f"{_count(len(pending[c]), 'pending write')}" for c in ids) or none,
         whose(lambda c: any(needle in b for b in pending[c]))),
        ("checkpoint history",
         "; ".join(f"{agent.label(c)}: {_count(len(saved[c][0]), 'checkpoint')}, {_count(len(saved[c][1]), 'write')}"
                   for c in ids) or none,
         whose(lambda c: any(needle in b for b in saved[c][0] + saved[c][1]))),
        ("app metadata",
         f"{_count(len(ids), 'conversation')}, {_count(len(runs), 'run')}",
         whose(lambda c: text in titles[c] or text in inputs[c])),
        ("long-term memory",
         "no file" if graph is None else
         f"{file.name}: {_count(sum(i.get('type') == 'entity' for i in graph), 'entity', 'entities')}, "
         f"{_count(sum(i.get('type') == 'relation' for i in graph), 'relation')}",
         file.name if file.exists() and needle in file.read_bytes() else "-"),
    ]
    return pd.DataFrame(rows, columns=["store", "now", HOLDS])


def holding(table: pd.DataFrame) -> list[str]:
    """The stores of a `stores()` table that hold a copy, in the table's order."""
    return table.loc[~table[HOLDS].isin(["-", "not stored"]), "store"].tolist()


def owners(table: pd.DataFrame, deleted_by: bool = False) -> pd.DataFrame:
    """A `stores()` table with who owns each store (and, with `deleted_by`, what deletes it)."""
    columns = {"store": STORES, "owner": OWNER} | ({"deleted by": DELETED_BY} if deleted_by else {})
    return pd.DataFrame(columns).merge(table, on="store")


def _text_bytes(message: dict[str, Any]) -> int:
    """The bytes of a message's text: its content and its tool calls' arguments (as JSON)."""
    calls = "".join(json.dumps(call["args"]) for call in message.get("toolCalls", []))
    return len((message["content"] + calls).encode())


async def per_call(agent: Agent, service: AgentService, conversations: list[str]) -> pd.DataFrame:
    """One row per model call of `conversations`: how many messages it sent (the model request
    log), how many the thread had at the checkpoint its agent step started from, and the bytes of
    text that makes (the system prompt, read from `config/system.md` as the agent reads it, and
    the thread's messages). A call without a step, or a step without a call, leaves a blank."""
    lab = agent.lab
    system_prompt = (lab.config_dir / "system.md").read_text(encoding="utf-8").strip()
    rows = []
    for c in conversations:
        thread = (await service.get_conversation(c)).messages   # the messages, with tool-call arguments
        sent = [r["n_messages"] for t in agent.turns if t.conversation == c for r in t.requests]
        history = [p.message_count for p in lab.checkpoints(c).itertuples() if tuple(p.next) == ("agent",)]
        for call, (n_sent, n_history) in enumerate(zip_longest(sent, history), 1):
            rows.append({"conversation": agent.names[c], "call": call, "messages sent": n_sent,
                         "thread messages before it": n_history,
                         "bytes of text": None if n_history is None else
                         len(system_prompt.encode()) + sum(map(_text_bytes, thread[:n_history]))})
    return pd.DataFrame(rows)


def plot_per_call(table: pd.DataFrame) -> Figure:
    """A bar per model call of a `per_call` table: the bytes of text it sent, labelled with its messages."""
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 3))
    colours = table["conversation"].map({"C1": "tab:blue", "C2": "tab:orange"}).fillna("tab:gray")
    bars = axes.bar([f"{r.conversation} call {r.call}" for r in table.itertuples()], table["bytes of text"],
                    color=colours)
    axes.bar_label(bars, labels=[f"{n} messages" for n in table["messages sent"]], fontsize=8)
    axes.set_ylabel("bytes of text sent")
    axes.set_title("What each model call carried")
    axes.margins(y=0.15)
    figure.tight_layout()
    return figure


def summary(agent: Agent, calls: pd.DataFrame, tables: dict[str, pd.DataFrame]) -> None:
    """Print the lesson in short: each turn (its tools and the messages each of its model calls
    carried), what C1's and C2's calls carried (`calls`), and which stores held the codename at
    each stage (`tables`: a `stores()` table per stage)."""
    for t in agent.turns:
        print(f"{t.name} {t.message[:42]!r:46} {t.status:<9} tools {t.tools} "
              f"| messages per call {[r['n_messages'] for r in t.requests]}")
    print()
    print(calls.to_string(index=False))
    print()
    stages = pd.DataFrame({"store": STORES} | {stage: table[HOLDS] for stage, table in tables.items()})
    print(stages.to_string(index=False))


# --- the exercise: forget a fact everywhere ---------------------------------------------------

_SAID = {"user": "the user's message", "assistant": "the model's answer"}


def copies(agent: Agent, fact: str) -> tuple[dict[str, dict[str, str | None]], set[str]]:
    """Where `fact` is found now, each store searched where it lives (the memory file, every
    conversation's messages, every row of every table of the database): {where: {whose copy:
    what}}, and the ids of the conversations that hold one."""
    lab = agent.lab
    file = memory_file(lab)
    found: dict[str, dict[str, str | None]] = {}
    holders: set[str] = set()
    if file.exists() and fact in file.read_text(encoding="utf-8"):
        found[f"long-term memory ({file.name})"] = {}
    for c in lab.conversations()["id"]:
        kinds = [_SAID.get(m.role) or f"a {m.name} result"
                 for m in lab.messages(c).itertuples() if fact in (m.content or "")]
        if kinds:
            holders.add(c)
            found.setdefault("conversation history", {})[c] = ", ".join(dict.fromkeys(kinds))
    with closing(sqlite3.connect(f"file:{lab.db_path}?mode=ro", uri=True)) as conn:
        for (table,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name"):
            rows = conn.execute(f'SELECT * FROM "{table}"')
            columns = [column[0] for column in rows.description]
            for row in rows:
                if any(fact.encode() in (v if isinstance(v, bytes) else str(v).encode()) for v in row if v is not None):
                    values = dict(zip(columns, row))
                    owner = values.get("thread_id") or values.get("conversation_id") or values.get("id")
                    holders.add(owner)
                    found.setdefault(f"the {table} table", {})[owner] = None
    return found, holders


def _listing(agent: Agent, whose: dict[str, str | None]) -> str:
    """"C3 (what), C5": whose copies, in the order the lesson started the conversations."""
    started = list(agent.names)
    ordered = sorted(whose, key=lambda c: started.index(c) if c in started else len(started))
    return ", ".join(agent.label(c) + (f" ({whose[c]})" if whose[c] else "") for c in ordered)


@dataclass
class Scene:
    """The exercise's scene: the codename taught again, a conversation that never hears it, a
    recall through long-term memory, and the messages of every conversation that holds no copy."""

    taught: Turn
    unrelated: Turn
    reread: Turn
    kept: dict[str, list[dict[str, Any]]]


def set_the_scene(agent: Agent) -> Scene:
    """Three short runs in the lesson's agent process: teach the codename in a new conversation,
    say Hello! in another, and read the knowledge graph in a third. Raises if the scene did not
    come about (the scripted model's choices are relied on only with the scripted model)."""
    lab = agent.lab
    taught, unrelated, reread = ask(agent, TEACH), ask(agent, HELLO), ask(agent, READ_GRAPH)

    def require(holds: bool, what: str) -> None:
        if not holds:
            raise RuntimeError(f"the exercise's scene did not come about: {what}")

    require(all(t.status == "completed" for t in (taught, unrelated, reread)), "a run did not complete")
    require(lab.messages(taught.conversation)["content"].iloc[0] == TEACH, "the codename was not taught")
    if lab.scripted:
        require(CODENAME in (memory_file(lab).read_text(encoding="utf-8") if memory_file(lab).exists() else ""),
                "the memory file does not hold the codename")
        require(reread.tools == ["memory__read_graph"] and "tool" in roles_holding(lab.messages(reread.conversation)),
                "the third conversation did not read the codename from the graph")
    _, holders = copies(agent, CODENAME)
    kept = {c: lab.messages(c).to_dict("records") for c in lab.conversations()["id"] if c not in holders}
    require(taught.conversation in holders and unrelated.conversation in kept,
            "the taught conversation should hold the codename, and the Hello! one should not")
    return Scene(taught, unrelated, reread, kept)


async def attempt(function: Callable[..., Any], *args: Any) -> BaseException | None:
    """Call `function(*args)` and await what it returns if it is awaitable (an `async def`); the
    exception it raised, or None. The exercise's test says what that exception means."""
    try:
        done = function(*args)
        if inspect.isawaitable(done):
            await done
    except Exception as error:  # noqa: BLE001 - NotImplementedError too: the test says what it means
        return error
    return None


def test_forget_everywhere(agent: Agent, scene: Scene, raised: BaseException | None) -> None:
    """The exercise's test: after `forget_everywhere(lab, CODENAME)` (which raised `raised`, or
    not), no store holds the codename (the memory file, any conversation's messages, any row of
    the database), and every conversation that never held it is still there, message for message."""
    lab = agent.lab
    if raised is not None:
        raise raised
    left, _ = copies(agent, CODENAME)
    if left:
        where = "; ".join(store + (f": {_listing(agent, whose)}" if whose else "") for store, whose in left.items())
        hints = []
        memory = f"long-term memory ({memory_file(lab).name})"
        if set(left) - {memory}:
            hints.append("a conversation keeps copies of its own (what the user typed, a tool's result), whatever "
                         "happens to the memory file: delete every conversation whose messages hold it")
        if memory in left:
            hints.append("deleting conversations does not touch the memory server's file: remove its lines too")
        hint = "; ".join(hints)
        raise AssertionError(f"{CODENAME} is still found in {where}. {hint[:1].upper()}{hint[1:]}.")
    listed = set(lab.conversations()["id"])
    for c, messages in scene.kept.items():
        assert c in listed, (f"{agent.label(c)} never held {CODENAME}, and it is gone: "
                             "delete only the conversations that hold the fact")
        assert lab.messages(c).to_dict("records") == messages, (
            f"{agent.label(c)} never held {CODENAME}, and its messages changed")

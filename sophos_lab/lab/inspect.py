"""Read-only views of a lab database as pandas DataFrames.

Everything here opens the file read-only and never goes through `Store`, so looking never
triggers crash recovery: a run left `running` by a killed process still reads `running` here
until the next runtime opens the file. Checkpoints are read through LangGraph (the sync saver on
the read-only connection and a graph built for reading), never by decoding tables by hand:
most checkpoints store no messages of their own (see `runtime.agent.AgentState`), and LangGraph
rebuilds each one's messages from the nearest full copy and the writes after it.
A conversation id is checked as the service checks it: anything else is a `BAD_REQUEST`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from ..runtime.export import checkpoint_record
from ..runtime.messages import message_dtos, pending_dtos
from ..runtime.progress import is_resumable, work_left
from ..runtime.agent import thread_config
from ..runtime.requests import parse_conversation_id
from ..runtime.storage.models import unapplied_input
from ..runtime.storage.sqlite import has_table, read_only

RUN_COLUMNS = [
    "id", "conversation_id", "status", "error_code", "error_message", "started_at", "finished_at",
    "owner_id", "input", "cancel_requested_at", "steps",
]
CONVERSATION_COLUMNS = ["id", "title", "created_at", "updated_at", "message_count"]
CHECKPOINT_COLUMNS = [
    "step", "source", "next", "message_count", "last_role", "run_id", "checkpoint_id", "created_at",
]
WRITE_COLUMNS = ["checkpoint_id", "step", "task_id", "task_path", "idx", "channel", "value"]
MESSAGE_COLUMNS = ["role", "content", "name", "status", "tool_calls"]
LEDGER_COLUMNS = ["id", "to_account", "amount", "idempotency_key", "created_at"]
GATE_COLUMNS = [
    "gate", "conversation_id", "run_id", "call_id", "tool", "args", "decision", "reason", "created_at",
    "decided_at", "decided_run_id",
]


def _plain(frame: pd.DataFrame) -> pd.DataFrame:
    """Missing values as None, not NaN (pandas 3 infers a `str` dtype whose missing value is NaN),
    so that `error_code` reads None and `state()["runs"]` compares with `(status, None)`.

    The same for a column of whole numbers with a gap (pandas makes it float, e.g. `1.0, NaN`):
    it keeps its numbers as ints and the gap as None.
    """
    for column in frame.columns:
        values = frame[column]
        if values.dtype != object and pd.api.types.is_string_dtype(values.dtype):
            frame[column] = values.astype(object).where(values.notna(), None)
        elif pd.api.types.is_float_dtype(values.dtype) and values.isna().any():
            present = values.dropna()
            if (present == present.round()).all():
                frame[column] = pd.Series(
                    [None if pd.isna(v) else int(v) for v in values], index=frame.index, dtype=object)
    return frame


TEXT_LIMIT = 600
"""How many characters of a message's text the notebook display of `messages` shows."""


def _display_cell(value: Any) -> Any:
    if value is None or (isinstance(value, float) and pd.isna(value)):
        return ""
    if isinstance(value, (list, tuple)):
        return ", ".join(str(item) for item in value)
    if isinstance(value, str) and len(value) > TEXT_LIMIT:
        return value[:TEXT_LIMIT] + f"… ({len(value) - TEXT_LIMIT} more characters)"
    return value


class TextFrame(pd.DataFrame):
    """A DataFrame whose notebook display keeps text readable.

    Line breaks show as line breaks (pandas shows them as a literal `\\n`), a missing value as an
    empty cell, a list as its items, and long text is cut at `TEXT_LIMIT` characters. Only the
    display changes: the values (and `to_string()`, `print`) are those of a plain DataFrame.
    """

    @property
    def _constructor(self):
        return TextFrame

    def _repr_html_(self) -> str | None:
        if len(self) > (pd.get_option("display.max_rows") or len(self)):
            return super()._repr_html_()
        shown = pd.DataFrame(self).astype(object).map(_display_cell)
        return (
            shown.style.format(escape="html")
            .set_properties(**{"white-space": "pre-wrap", "text-align": "left", "vertical-align": "top"})
            .to_html()
        )


@dataclass
class _Reader:
    """A read-only connection to the lab's database: the SQLite file, or PostgreSQL (a URL).

    The views' SQL is SQLite's with `?` placeholders and `{order}` for insertion order (SQLite's
    `rowid`, PostgreSQL's `seq` column); `rows` turns it into PostgreSQL's where it has to."""

    conn: Any
    postgres: bool

    @property
    def order(self) -> str:
        return "seq" if self.postgres else "rowid"

    def has(self, table: str) -> bool:
        if self.postgres:
            return self.rows("SELECT to_regclass(?) IS NOT NULL", (table,))[1][0][0]
        return has_table(self.conn, table)

    def rows(self, sql: str, params: tuple = ()) -> tuple[list[str], list[tuple]]:
        """The column names and the rows (tuples) of `sql`."""
        sql = sql.replace("{order}", self.order)
        if self.postgres:
            from psycopg.rows import tuple_row

            cursor = self.conn.cursor(row_factory=tuple_row).execute(_placeholders(sql), params)
        else:
            cursor = self.conn.execute(sql, params)
        rows = cursor.fetchall()
        return [column[0] for column in cursor.description or ()], rows

    def saver(self) -> Any:
        """LangGraph's sync saver on this connection, for reading."""
        if self.postgres:
            from langgraph.checkpoint.postgres import PostgresSaver

            return PostgresSaver(self.conn)
        from langgraph.checkpoint.sqlite import SqliteSaver

        saver = SqliteSaver(self.conn)
        saver.is_setup = True  # the tables exist; setup() would try to write
        return saver


def _placeholders(sql: str) -> str:
    """SQLite's `?` placeholders as psycopg's `%s`, outside quoted strings and identifiers only,
    with every `%` doubled (psycopg reads `%` as the start of a placeholder). PostgreSQL's jsonb
    `?` operator cannot be written here: use `jsonb_exists(...)`."""
    out, quote = [], None
    for char in sql:
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "?":
            out.append("%s")
            continue
        out.append("%%" if char == "%" else char)
    return "".join(out)


@contextlib.contextmanager
def reading(database: str | Path) -> Iterator[_Reader | None]:
    """A `_Reader` on the database (None when there is no such file)."""
    if isinstance(database, str) and "://" in database:
        from ..runtime.storage.postgres import read_only as postgres_read_only

        with postgres_read_only(database) as conn:
            yield _Reader(conn, postgres=True)
        return
    with read_only(database) as conn:
        yield None if conn is None else _Reader(conn, postgres=False)


def sql(database: str | Path, query: str, params: tuple = ()) -> pd.DataFrame:
    """Any read-only query on the database, as a DataFrame (`?` placeholders, `{order}` for
    insertion order: see `_Reader`); empty when there is no such file."""
    with reading(database) as reader:
        if reader is None:
            return pd.DataFrame()
        names, rows = reader.rows(query, params)
    return _plain(pd.DataFrame(rows, columns=names))


def _query(db_path: str | Path, table: str, sql: str, params: tuple, columns: list[str]) -> pd.DataFrame:
    with reading(db_path) as reader:
        if reader is None or not reader.has(table):
            return pd.DataFrame(columns=columns)
        names, rows = reader.rows(sql, params)
        frame = pd.DataFrame(rows, columns=names)
        return _plain(frame.drop(columns=["seq"]) if "seq" in frame else frame)


def peek_runs(db_path: str | Path, conversation: str | None = None) -> pd.DataFrame:
    """The runs table as it is on disk (what `sqlite3 $DB "SELECT ..."` shows), in start order.

    All runs when `conversation` is None; otherwise it must be a conversation id.
    """
    where, params = ("", ())
    if conversation is not None:
        where, params = "WHERE conversation_id = ?", (parse_conversation_id(conversation),)
    return _query(
        db_path, "runs", f"SELECT * FROM runs {where} ORDER BY {{order}}", params, RUN_COLUMNS
    )


def gates(db_path: str | Path, conversation: str | None = None) -> pd.DataFrame:
    """The `gates` table as it is on disk, oldest first: one row per tool call a gate holds, with
    its arguments and the decision on it (`decision` and `reason` None while undecided;
    `decided_run_id` is the run that carried the decisions on). All gates when `conversation`
    is None."""
    where, params = ("", ())
    if conversation is not None:
        where, params = "WHERE conversation_id = ?", (parse_conversation_id(conversation),)
    with reading(db_path) as reader:
        if reader is None or not reader.has("gates"):
            return pd.DataFrame(columns=GATE_COLUMNS)
        _, stored = reader.rows(
            "SELECT id, conversation_id, run_id, calls, decisions, created_at, decided_at, decided_run_id"
            f" FROM gates {where} ORDER BY {{order}}", params)
    rows = []
    for gate, conversation_id, run_id, calls, decisions, created_at, decided_at, decided_run_id in stored:
        decisions = json.loads(decisions) if decisions is not None else {}
        for call in json.loads(calls):
            decided = decisions.get(call["id"], {})
            rows.append({
                "gate": gate, "conversation_id": conversation_id, "run_id": run_id, "call_id": call["id"],
                "tool": call["name"], "args": call["args"], "decision": decided.get("decision"),
                "reason": decided.get("reason"), "created_at": created_at, "decided_at": decided_at,
                "decided_run_id": decided_run_id,
            })
    return _plain(pd.DataFrame(rows, columns=GATE_COLUMNS))


def ledger(db_path: str | Path) -> pd.DataFrame:
    """The ledger server's payments table (sophos_lab/standins/ledger_server.py), oldest first."""
    return _query(db_path, "payments", "SELECT * FROM payments ORDER BY id", (), LEDGER_COLUMNS)


def pending_gate(db_path: str | Path, conversation: str) -> dict[str, Any] | None:
    """The approval gate the conversation waits at, as the runtime's `pending_approval` finds it
    (the gate of its latest run, when that run is `waiting`): `{gate, run, calls, created_at}`,
    `calls` as the model made them (`[{id, name, args}]`); None when nothing waits."""
    conversation = parse_conversation_id(conversation)
    with reading(db_path) as reader:
        if reader is None or not reader.has("gates"):
            return None
        _, rows = reader.rows(
            "SELECT g.id, g.run_id, g.calls, g.created_at FROM runs r JOIN gates g ON g.run_id = r.id"
            " WHERE r.{order} = (SELECT max({order}) FROM runs WHERE conversation_id = ?) AND r.status = 'waiting'"
            " ORDER BY g.{order} DESC LIMIT 1",
            (conversation,),
        )
    if not rows:
        return None
    gate, run, calls, created_at = rows[0]
    return {"gate": gate, "run": run, "calls": json.loads(calls), "created_at": created_at}


def conversations(db_path: str | Path) -> pd.DataFrame:
    """Conversations, most recently updated first."""
    return _query(
        db_path, "conversations", "SELECT * FROM conversations ORDER BY updated_at DESC", (),
        CONVERSATION_COLUMNS,
    )


def _read_thread(db_path: str | Path, conversation: str, read: Callable[[Any, Any, dict], Any]) -> Any:
    """`read(graph, saver, config)` on the thread, through LangGraph on a read-only connection;
    None when nothing was checkpointed."""
    from ..runtime.agent import build_graph

    conversation = parse_conversation_id(conversation)
    with reading(db_path) as reader:
        if reader is None or not reader.has("checkpoints"):
            return None
        saver = reader.saver()
        return read(build_graph(None, saver), saver, thread_config(conversation))


def _history(db_path: str | Path, conversation: str) -> list[Any]:
    """The thread's `StateSnapshot`s, oldest first (empty when nothing was checkpointed).

    Each one's values are the thread as it stood at that checkpoint, rebuilt by LangGraph: most
    checkpoints store no messages of their own (only the writes of their step), so a count or a
    last message read from a checkpoint's stored blob would be wrong; one read from its values
    is right, for files written with either messages channel."""
    return _read_thread(db_path, conversation, lambda graph, _, config: list(graph.get_state_history(config))[::-1]) or []


def _latest(db_path: str | Path, conversation: str) -> Any | None:
    """The thread as the runtime sees it (None when nothing was checkpointed): its latest
    checkpoint, live, as `AgentService.get_conversation` reads it — with the output of a task
    that finished after it (saved, not folded yet), and `work_left` the same."""
    snapshot = _read_thread(db_path, conversation, lambda graph, _, config: graph.get_state(config))
    return snapshot if snapshot is not None and snapshot.created_at is not None else None


def _pruned_rows(db_path: str | Path, conversation: str) -> list[dict[str, Any]]:
    """One row per prune of the thread (`source` says how many checkpoints went, which steps,
    and `created_at` when), to stand where those checkpoints were."""
    conversation = parse_conversation_id(conversation)
    with reading(db_path) as reader:
        if reader is None or not reader.has("prunes"):
            return []
        names, stored = reader.rows(
            "SELECT pruned_at, checkpoints, writes, bytes, first_step, last_step, kept_from FROM prunes"
            " WHERE conversation_id = ? ORDER BY id", (conversation,))
    records = [dict(zip(names, row)) for row in stored]
    rows = []
    for record in records:
        steps = "" if record["first_step"] is None else f", steps {record['first_step']} to {record['last_step']}"
        rows.append({
            "step": None, "next": (), "message_count": None, "last_role": None, "run_id": None, "checkpoint_id": None,
            "source": f"pruned: {record['checkpoints']} older checkpoints{steps}",
            "created_at": record["pruned_at"],
        })
    return rows


def checkpoints(db_path: str | Path, conversation: str) -> pd.DataFrame:
    """One row per checkpoint of the thread, oldest first, joined to the run that wrote it.

    A thread that was pruned (`sophos-lab prune`) starts with one row per prune instead of the
    checkpoints it deleted: its `source` says how many went and which steps, `created_at` when.
    """
    rows = _pruned_rows(db_path, conversation)
    for snapshot in _history(db_path, conversation):
        record = checkpoint_record(snapshot)
        last = record["last_message"]
        rows.append({
            "step": record["step"],
            "source": record["source"],
            "next": tuple(record["next"]),
            "message_count": record["message_count"],
            "last_role": last["role"] if last else None,
            "run_id": record["run_id"],
            "checkpoint_id": record["checkpoint_id"],
            "created_at": record["created_at"],
        })
    return _plain(pd.DataFrame(rows, columns=CHECKPOINT_COLUMNS))


def pending_writes(db_path: str | Path, conversation: str) -> pd.DataFrame:
    """The `writes` table of the thread: what each task wrote, including `__error__`."""
    from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

    conversation = parse_conversation_id(conversation)
    serde = JsonPlusSerializer()
    # The step of each checkpoint is in its metadata: no need to rebuild the thread at each one.
    steps = _read_thread(db_path, conversation, lambda _, saver, config: {
        saved.config["configurable"]["checkpoint_id"]: saved.metadata.get("step") for saved in saver.list(config)
    }) or {}
    with reading(db_path) as reader:
        # LangGraph's two savers name the table and its value column differently.
        table, value = ("checkpoint_writes", "blob") if reader is not None and reader.postgres else ("writes", "value")
        if reader is None or not reader.has(table):
            return pd.DataFrame(columns=WRITE_COLUMNS)
        _, rows = reader.rows(
            f"SELECT checkpoint_id, task_id, task_path, idx, channel, type, {value} FROM {table}"
            " WHERE thread_id = ? ORDER BY checkpoint_id, task_id, idx",
            (conversation,),
        )
    records = []
    for checkpoint_id, task_id, task_path, idx, channel, type_, value in rows:
        records.append({
            "checkpoint_id": checkpoint_id,
            "step": steps.get(checkpoint_id),
            "task_id": task_id,
            "task_path": task_path,
            "idx": idx,
            "channel": channel,
            "value": _short(serde.loads_typed((type_, value))),
        })
    return _plain(pd.DataFrame(records, columns=WRITE_COLUMNS))


def _pending(runs: pd.DataFrame, latest: Any | None) -> list[dict[str, str]]:
    """The latest run's messages if they never reached the thread (see `storage.models.unapplied_input`)."""
    if not len(runs):
        return []
    run = runs.iloc[-1]
    written_by = (latest.metadata or {}).get("run_id") if latest is not None else None
    return unapplied_input(run["id"], run.get("input"), written_by)


def thread_view(db_path: str | Path, conversation: str) -> tuple[list[dict[str, Any]], tuple[str, ...]]:
    """The thread's latest checkpoint as the chat widget shows it: its messages (dicts, with
    tool-call arguments) and `next` (empty when nothing was checkpointed). A message that was
    accepted but never reached the thread comes last, marked `pending`."""
    latest = _latest(db_path, conversation)
    messages = message_dtos(latest.values.get("messages", [])) if latest is not None else []
    pending = pending_dtos(_pending(peek_runs(db_path, conversation), latest))
    return messages + pending, work_left(latest)


def messages(db_path: str | Path, conversation: str) -> pd.DataFrame:
    """The messages of the latest checkpoint (a `TextFrame`: its text displays with its line breaks)."""
    latest = _latest(db_path, conversation)
    dtos = message_dtos(latest.values.get("messages", [])) if latest is not None else []
    return pd.DataFrame(
        [{
            "role": m["role"],
            "content": m["content"],
            "name": m.get("name"),
            "status": m.get("status"),
            "tool_calls": [call["name"] for call in m.get("toolCalls", [])] or None,
        } for m in dtos],
        columns=MESSAGE_COLUMNS,
    ).pipe(_plain).pipe(TextFrame)


def state(db_path: str | Path, conversation: str) -> dict[str, Any]:
    """What the seed's `state()` shell helper prints: runs, the last checkpoint, resumable, roles.

    `resumable` here is the rule the runtime applies (`progress.is_resumable`): work left on the
    thread — `next`, which counts a task that finished but whose step has no checkpoint yet —
    or a message accepted that never reached the thread (then listed under `pending`); no run
    of this conversation recorded `running`; and the latest run is not `waiting` at an approval
    gate (that one goes on with a decision, not a resume).
    """
    conversation = parse_conversation_id(conversation)  # None would read every run
    runs = peek_runs(db_path, conversation)
    latest = _latest(db_path, conversation)
    last = checkpoint_record(latest) if latest is not None else None
    dtos = message_dtos(latest.values.get("messages", [])) if latest is not None else []
    busy = bool((runs["status"] == "running").any()) if len(runs) else False
    waiting = bool(len(runs)) and runs["status"].iloc[-1] == "waiting"
    pending = _pending(runs, latest)
    return {
        "runs": [(row.status, row.error_code) for row in runs.itertuples()],
        "last_checkpoint": None if last is None else {
            "step": last["step"], "next": list(work_left(latest)), "message_count": last["message_count"],
        },
        "resumable": is_resumable(work_left(latest), bool(pending), busy or waiting),
        "roles": [m["role"] for m in dtos],
        # Only when there is one, so the shape stays the seed's in every other case.
        **({"pending": [m["content"] for m in pending]} if pending else {}),
    }


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def timeline(db_path: str | Path, conversation: str, model_requests: Any = (), failed_requests: Any = ()):
    """The timeline's matplotlib figure (still open in pyplot): each run as a bar from start to
    finish, each checkpoint as a tick labelled with its step and the node whose write made it.

    `model_requests` (ISO times of `/api/chat` requests, e.g. from the lab's request log) adds a
    marker per model call inside a run, and marks the stretch of an agent step before its model
    call (the agent node asks for its tools first; the first time in a process that starts the
    MCP servers). `failed_requests` (ISO times of the requests among them that got no answer: an
    HTTP error, or none at all) are marked ✕ instead, and the stretch from each to the next
    request of its run is labelled with its length: the retry's backoff wait (plus the time limit,
    for a request that never answered). Labels that would touch go on lines below each other, in
    a band of their run's own. `timeline_picture` is the same as a `Picture`, with its elements.
    """
    from .pictures import timeline as drawing

    conversation = parse_conversation_id(conversation)  # before a figure is made
    figure, _ = drawing.figure_and_elements(peek_runs(db_path, conversation), checkpoints(db_path, conversation),
                                            conversation, model_requests, failed_requests)
    return figure


def timeline_picture(db_path: str | Path, conversation: str, model_requests: Any = (), failed_requests: Any = ()):
    """The timeline (see `timeline`) as a `Picture` titled `runs and checkpoints of <conversation>`, whose
    elements name each run and its outcome, the checkpoints it wrote (`-1 input, 0 __start__, 1
    agent, ...`) and the number of model requests within the runs."""
    from .pictures import timeline as drawing

    conversation = parse_conversation_id(conversation)
    return drawing.draw(peek_runs(db_path, conversation), checkpoints(db_path, conversation), conversation,
                        model_requests, failed_requests)

"""What the application's tables hold, as the runtime reads them: conversations with their
latest outcome, runs, approval gates and idempotency keys, and the listing's pages and cursors.

No driver here: both backends (`sqlite`, `postgres`) give and take these, and the rules that
decide them (`rules`) read and write them the same way on either.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from datetime import datetime, timezone
from typing import Any

from ..errors import BAD_REQUEST, SophosError

RUN_STATUSES = ("running", "interrupted", "completed", "failed", "cancelled", "waiting")

PAGE_SIZE = 50
"""Conversations per page when the caller does not say."""
MAX_PAGE_SIZE = 1000


@dataclass(frozen=True)
class Conversation:
    """A conversation with the outcome of its latest run (`status` is None before any run)."""

    id: str
    title: str
    created_at: str
    updated_at: str
    message_count: int
    status: str | None
    error_code: str | None
    error_message: str | None


@dataclass(frozen=True)
class ConversationPage:
    """One page of the listing, most recently updated first."""

    conversations: list[Conversation]
    next_cursor: str | None
    """Pass it back for the page after this one; None when there is none."""


@dataclass(frozen=True)
class ListingPosition:
    """Where a page ends in the listing's order: the last row's `updated_at` and rowid."""

    updated_at: str
    rowid: int


def encode_cursor(position: ListingPosition) -> str:
    """The opaque cursor a client passes back (URL-safe base64 of JSON)."""
    raw = json.dumps([position.updated_at, position.rowid], separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_cursor(cursor: object) -> ListingPosition:
    """The position a cursor from `encode_cursor` names, given exactly as it wrote it; anything
    else is a `BAD_REQUEST`, never the first page: a client that mangled its cursor must not
    start over unawares."""
    shown = repr(cursor) if len(repr(cursor)) <= 60 else repr(cursor)[:57] + "..."
    bad = SophosError(
        BAD_REQUEST,
        f"Invalid cursor: {shown}. Pass back the next_cursor of the previous page unchanged, "
        "or no cursor for the first page.",
    )
    if not isinstance(cursor, str) or not cursor or len(cursor) > 512:
        raise bad
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        updated_at, rowid = json.loads(raw)
        if isinstance(updated_at, str):
            updated_at.encode("utf-8")  # JSON's \u escapes spell lone surrogates, which SQLite cannot bind
            if "\x00" in updated_at:  # and NUL, which no listing position holds (PostgreSQL cannot bind it)
                raise ValueError(updated_at)
    except (binascii.Error, ValueError, TypeError):  # UnicodeEncodeError is a ValueError
        raise bad from None
    if not isinstance(updated_at, str) or type(rowid) is not int or not 1 <= rowid <= 2**63 - 1:  # SQLite's integers
        raise bad
    position = ListingPosition(updated_at, rowid)
    # Base64 and JSON have other spellings of one position (padding, spare bits, spaces).
    if encode_cursor(position) != cursor:
        raise bad
    return position


def page_size(limit: object) -> int:
    """A page size: an int from 1 to `MAX_PAGE_SIZE`; anything else is a `BAD_REQUEST`."""
    if type(limit) is not int or not 1 <= limit <= MAX_PAGE_SIZE:
        raise SophosError(BAD_REQUEST, f"Invalid limit: {limit!r}. A page holds 1 to {MAX_PAGE_SIZE} conversations.")
    return limit


@dataclass(frozen=True)
class Run:
    """One attempt to advance a conversation's thread."""

    id: str
    conversation_id: str
    status: str
    error_code: str | None
    error_message: str | None
    started_at: str
    finished_at: str | None
    owner_id: str | None = None
    input: str | None = None
    """The user's messages this run adds to the thread, as JSON `[{"id", "content"}]`; once the
    thread's checkpoint holds them (the run's outcome written after its first checkpoint), only
    their ids, `[{"id"}]`: the text is stored once, in the thread (`carried_ids`)."""
    cancel_requested_at: str | None = None
    """When `cancel()` was accepted for this run (None: never asked to stop)."""
    claimed_at: str | None = None
    """PostgreSQL with workers: when a worker took the `queued` run (None: run where accepted)."""
    requeues: int = 0
    """PostgreSQL with workers: how often a crash put the run back in the queue (`RUN_REQUEUES`)."""
    steps: int = 0
    """The graph steps the run took, recorded with its outcome (0 until then); for a run a
    crash ended, the steps it saved, recorded when recovery relabels it."""


Seen = tuple[str | None, str | None]
"""The id and status of a conversation's latest run as a caller read it; (None, None): no run."""


def seen(run: Run | None) -> Seen:
    return (None, None) if run is None else (run.id, run.status)


SETTLED: Seen = (None, "completed")
"""What a start that read nothing of its conversation expects (`after`): the latest run, whichever
it is, completed, or no run at all. A new message assumes it, the common case, and reads the
conversation only when it is not so (never a `seen` value: a run always has an id)."""


def as_expected(latest: Seen, after: Seen) -> bool:
    """Whether the conversation's latest run, read inside a start, is what its caller expected."""
    return latest[1] in (None, "completed") if after == SETTLED else latest == after


class LatestRunChanged(Exception):
    """A start refused, nothing written: the conversation's latest run is no longer the one its
    caller read (`Seen`); another process started a run there, or relabelled that one, meanwhile.
    What the caller worked out from it (the messages to carry on, the step to fold) is stale."""


@dataclass(frozen=True)
class Gate:
    """An approval gate: tool calls held back until a person decides on each (see `approve`)."""

    id: str
    """LangGraph's id of the interrupt that holds the calls."""
    conversation_id: str
    run_id: str
    """The run that stopped at the gate (`waiting` until a decision starts the next one)."""
    calls: list[dict]
    """The calls held back, `[{"id", "name", "args"}]`, as the model made them."""
    created_at: str
    decisions: dict[str, dict] | None = None
    """Per tool call id `{"decision": "approve" | "reject", "reason"?}`; None while undecided."""
    decided_at: str | None = None
    decided_run_id: str | None = None
    """The run that carried the decisions into the thread."""

    @property
    def decided(self) -> bool:
        return self.decisions is not None

    def to_dict(self) -> dict:
        return {"gate": self.id, "run": self.run_id, "calls": self.calls, "created_at": self.created_at,
                "decisions": self.decisions, "decided_at": self.decided_at, "decided_run": self.decided_run_id}

@dataclass(frozen=True)
class IdempotencyKey:
    """A client's key for the request that starts a run, and that request in a canonical form."""

    key: str
    request: str


@dataclass(frozen=True)
class KeyedRun:
    """The run a key started (a row of `idempotency_keys`)."""

    key: str
    request: str
    conversation_id: str
    run_id: str
    created_at: str


def unapplied_input(run_id: str, run_input: str | None, checkpoint_run_id: str | None) -> list[dict[str, str]]:
    """The messages a conversation's latest run carries, if they never reached its thread.

    Every checkpoint names the run that wrote it, so the run's input is in the thread exactly
    when the thread's latest checkpoint is that run's.
    """
    if not run_input or checkpoint_run_id == run_id:
        return []
    return json.loads(run_input)


def carried_ids(messages: list[dict[str, str]] | None) -> str | None:
    """What `runs.input` keeps once the thread's checkpoint holds the run's messages: each one's
    id and role, not its text, so an accepted message is stored once (in the checkpoint) after
    the run has written it there. None for a resume, which carries no message."""
    if not messages:
        return None
    return json.dumps([{key: message[key] for key in ("id", "role") if key in message} for message in messages],
                      ensure_ascii=False)


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def title_from_message(message: str) -> str:
    """The first line of the first message, trimmed, cut to 50 characters plus `...`."""
    first_line = message.strip().splitlines()[0].strip() if message.strip() else ""
    if not first_line:
        return "New Conversation"
    return first_line if len(first_line) <= 50 else first_line[:50] + "..."


def run_of(row: Mapping[str, Any] | None) -> Run | None:
    """A `runs` row as a `Run`; a backend's own columns (PostgreSQL's `seq`, `last_event_id`) stay out."""
    return None if row is None else Run(**{name: row[name] for name in _RUN_FIELDS if name in row})


def gate_of(row: Mapping[str, Any] | None) -> Gate | None:
    """A `gates` row as a `Gate`, its calls and decisions read back from their JSON."""
    if row is None:
        return None
    values = {name: row[name] for name in _GATE_FIELDS}
    values["calls"] = json.loads(values["calls"])
    values["decisions"] = None if values["decisions"] is None else json.loads(values["decisions"])
    return Gate(**values)


_RUN_FIELDS = tuple(field.name for field in fields(Run))
_GATE_FIELDS = tuple(field.name for field in fields(Gate))
CONVERSATION_FIELDS = tuple(field.name for field in fields(Conversation))
assert not hasattr(Conversation, "__post_init__") and "__slots__" not in vars(Conversation), (
    "conversations_of fills a Conversation's __dict__ and runs no __init__ (see there)")


def conversations_of(rows: Any) -> list[Conversation]:
    """Conversations from tuple rows of their fields in order (`CONVERSATION_FIELDS`), each made
    without running `Conversation.__init__`.

    A frozen dataclass's `__init__` sets every field with `object.__setattr__`, eight calls a row:
    at 10,000 conversations about half as long as the query takes (benchmarks/listing.py).
    Filling a new instance's `__dict__` from the row takes less than half of that, and gives the
    same object: Conversation has no defaults, no `__post_init__` and no slots, so `==`, `hash`,
    `repr`, `asdict`, `replace` and pickling see no difference. The price is memory: the fields
    sit in a dict of the instance's own, about 64 bytes more a conversation than `__init__`'s
    inline values, for a list that is read once and dropped. Tuples, not named rows: nothing
    here reads a column by name.
    """
    new, names = object.__new__, CONVERSATION_FIELDS
    listed: list[Conversation] = []
    append = listed.append
    for row in rows:
        conversation = new(Conversation)
        conversation.__dict__.update(zip(names, row))
        append(conversation)
    return listed

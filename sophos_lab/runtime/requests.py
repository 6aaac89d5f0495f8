"""What a request may ask of the service, checked before anything is read or written: a
conversation id, a message, a gate's or a tool call's id, decisions on a gate; and a request in
the canonical form its idempotency key is kept with."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from . import errors
from .agent import APPROVE, REJECT
from .errors import SophosError

_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[1-5][0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", re.I)


def parse_conversation_id(value: object) -> str:
    """A conversation id: a UUID (versions 1-5), normalised to lower case."""
    if not isinstance(value, str) or not _UUID.fullmatch(value):
        raise SophosError(errors.BAD_REQUEST, f"Invalid Conversation ID: {value!r}")
    return value.lower()


def parse_message(value: object) -> str:
    """A user message: text that is not blank and that UTF-8 can store exactly as it is.

    A lone surrogate (`"\\ud800"`) has no UTF-8 form: storing it would alter the message.
    """
    if not isinstance(value, str) or not value.strip():
        raise SophosError(errors.BAD_REQUEST, "A message is required (it may not be empty).")
    return storable(value, "The message", "Nothing was stored.")


def parse_id(value: object, what: str) -> str:
    """A gate's or a tool call's id (`what` names which): a non-empty string that UTF-8 can
    encode, as every id stored in the database is; anything else can name nothing there."""
    if not isinstance(value, str) or not value or "\x00" in value:
        raise SophosError(errors.BAD_REQUEST, (
            f"{what} {value!r} is not a non-empty string without NUL characters. Nothing was decided."))
    return storable(value, what, "Nothing was decided.")


def storable(text: str, what: str, outcome: str) -> str:
    """`text` if UTF-8 can encode it (SQLite holds UTF-8), else a `BAD_REQUEST`: a lone surrogate
    (`"\\ud800"`) has no UTF-8 form, and storing it would alter it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise SophosError(
            errors.BAD_REQUEST,
            f"{what} is not valid Unicode: a lone surrogate {text[error.start]!r} at position {error.start}. {outcome}",
        ) from None
    return text


def parse_decisions(value: object) -> dict[str, dict[str, Any]]:
    """Decisions on a gate's tool calls: `{tool_call_id: "approve" | "reject" | {"decision",
    "reason"?, "args"?}}`. Returns them as `{id: {"decision", "reason"?, "args"?}}`; anything
    else is a `BAD_REQUEST` that names what is wrong. (`args`, if given, must be the call's
    arguments exactly: see `check_decisions`.)"""
    def bad(why: str) -> SophosError:
        return SophosError(errors.BAD_REQUEST, f"Invalid decisions: {why}. Nothing was decided.")

    if not isinstance(value, Mapping) or not value:
        raise bad('give a mapping of tool call ids to "approve" or "reject" (or {"decision", "reason"})')
    decisions = {}
    for call_id, decision in value.items():
        call_id = parse_id(call_id, "The tool call id")
        if isinstance(decision, str):
            decision = {"decision": decision}
        if not isinstance(decision, Mapping):
            raise bad(f"the decision for {call_id!r} is neither a string nor a mapping")
        unknown = set(decision) - {"decision", "reason", "args"}
        if unknown:
            raise bad(f"the decision for {call_id!r} has unknown keys {sorted(map(str, unknown))}")
        if decision.get("decision") not in (APPROVE, REJECT):
            raise bad(f'the decision for {call_id!r} is {decision.get("decision")!r}, not "approve" or "reject"')
        out = {"decision": decision["decision"]}
        if decision.get("reason") is not None:
            out["reason"] = parse_message(decision["reason"]) if isinstance(decision["reason"], str) else None
            if out["reason"] is None:
                raise bad(f"the reason for {call_id!r} is not text")
        if "args" in decision:
            if not isinstance(decision["args"], Mapping):
                raise bad(f"the args for {call_id!r} are not a mapping")
            out["args"] = dict(decision["args"])
        decisions[call_id] = out
    return decisions


def canonical_request(resume: bool, message: object, conversation: str | None) -> str:
    """What a request asks for, as a repeat with its idempotency key must ask it again (a
    resume has no message)."""
    asked = {"resume": True, "conversation": conversation} if resume else {"message": message, "conversation": conversation}
    return json.dumps(asked, sort_keys=True, ensure_ascii=True)

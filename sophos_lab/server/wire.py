"""What goes over the wire: the error envelope, status codes and the JSON shapes (the original's
`ConversationSummary`, `ConversationDetail` and the kit's runs), in the original's camelCase."""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse

from ..runtime import errors
from ..runtime.errors import SophosError
from ..runtime.reading import ConversationDetail
from ..runtime.storage.models import Conversation, Run

# Codes only the HTTP layer gives (the runtime's are in runtime/errors.py).
UNAUTHORIZED = "UNAUTHORIZED"
PAYLOAD_TOO_LARGE = "PAYLOAD_TOO_LARGE"
METHOD_NOT_ALLOWED = "METHOD_NOT_ALLOWED"
FETCH_ERROR = "FETCH_ERROR"
LOAD_ERROR = "LOAD_ERROR"
INTERNAL_ERROR = "INTERNAL_ERROR"

# The original's fixed texts; the runtime's own messages say more (the id it was given), but a
# client of the original may compare these strings.
INVALID_ID = "Invalid Conversation ID"
CONVERSATION_NOT_FOUND = "Conversation Not Found"

STATUS = {
    errors.BAD_REQUEST: 400,
    UNAUTHORIZED: 401,
    errors.NOT_FOUND: 404,
    METHOD_NOT_ALLOWED: 405,
    errors.SESSION_IN_PROGRESS: 409,
    errors.RUN_NOT_RESUMABLE: 409,
    errors.RUN_NOT_ACTIVE: 409,
    errors.RUN_WAITING: 409,
    errors.NO_APPROVAL_PENDING: 409,
    errors.GATE_DECIDED: 409,
    errors.TOO_MANY_RUNS: 429,
    errors.STEP_BUDGET_SPENT: 429,
    errors.APPROVAL_MISMATCH: 422,
    PAYLOAD_TOO_LARGE: 413,
    errors.IDEMPOTENCY_KEY_REUSED: 422,
    errors.SHUTDOWN: 503,
    errors.STORAGE_FULL: 507,  # Insufficient Storage: nothing was written; free space, then retry
    errors.DATABASE_UNAVAILABLE: 503,  # nothing was written; ask again after Retry-After
}
"""HTTP status per error code; any other code (CONFIG_ERROR, SCHEMA_TOO_NEW, …) is a 500."""


def error_response(code: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """`{"error": {"code", "message"}}` with the code's status (and `Retry-After` when the
    database is unavailable: the client should ask again, not give up)."""
    if code == errors.DATABASE_UNAVAILABLE:
        headers = {"Retry-After": str(errors.DATABASE_RETRY_AFTER_SECONDS), **(headers or {})}
    return JSONResponse({"error": {"code": code, "message": message}}, STATUS.get(code, 500), headers)


def unavailable(error: BaseException) -> JSONResponse:
    """The 503 for a request that met an unreachable database."""
    return error_response(errors.DATABASE_UNAVAILABLE, (
        "The database is unavailable (restarting, or the connection was lost), so this request may not "
        f"have been recorded. Ask again in {errors.DATABASE_RETRY_AFTER_SECONDS} s; with the same "
        "Idempotency-Key, a request that did get through is answered as the first time."))


def refusal(error: SophosError) -> JSONResponse:
    """A runtime refusal as the original words it (where it had fixed words)."""
    message = CONVERSATION_NOT_FOUND if error.code == errors.NOT_FOUND else error.message
    return error_response(error.code, message)


def event_json(data: Any) -> str:
    """JSON as the original's `JSON.stringify` writes it: compact, non-ASCII as is.

    A lone surrogate (no UTF-8 form) is written as a `\\udxxx` escape, as JavaScript does.
    """
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(data, separators=(",", ":"))
    return text


def error_dto(code: str | None, message: str | None) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}} if code else {}


def conversation_summary(conversation: Conversation) -> dict[str, Any]:
    """The original's `ConversationSummary`: `error` only when the latest run has a code."""
    return {
        "id": conversation.id,
        "title": conversation.title,
        "createdAt": conversation.created_at,
        "updatedAt": conversation.updated_at,
        "messageCount": conversation.message_count,
        "status": conversation.status,
        **error_dto(conversation.error_code, conversation.error_message),
    }


def conversation_detail(detail: ConversationDetail) -> dict[str, Any]:
    """The original's `ConversationDetail`, plus the thread's `next` nodes."""
    return {
        "conversation": conversation_summary(detail.conversation),
        "messages": detail.messages,
        "resumable": detail.resumable,
        "next": list(detail.next),
        "approval": None if detail.approval is None else {
            "gate": detail.approval.id, "run": detail.approval.run_id, "calls": detail.approval.calls,
            "createdAt": detail.approval.created_at},
    }


def run_dto(run: Run) -> dict[str, Any]:
    """One run (kit only): its outcome, its times, the graph steps it took (0 until it ends) and
    the user's messages it carried."""
    return {
        "id": run.id,
        "conversation": run.conversation_id,
        "status": run.status,
        **error_dto(run.error_code, run.error_message),
        "startedAt": run.started_at,
        "finishedAt": run.finished_at,
        "steps": run.steps,
        "input": json.loads(run.input) if run.input else [],
    }

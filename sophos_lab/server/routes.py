"""The endpoints, in the original's paths, bodies, status codes and order of checks.

Every handler is async and calls the service on the event loop: `AgentService` is not
thread-safe. Refusals are raised as `SophosError` and answered with the error envelope
(`app.refused`); the SSE endpoint answers refusals as a single event instead, as the original.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..runtime import errors, users
from ..runtime.agent import check_model_async
from ..runtime.errors import SophosError
from ..runtime.requests import canonical_request, parse_conversation_id
from ..runtime.service import AgentService
from ..runtime.storage.models import PAGE_SIZE, IdempotencyKey
from . import sse
from .wire import (
    CONVERSATION_NOT_FOUND, FETCH_ERROR, INVALID_ID, LOAD_ERROR, PAYLOAD_TOO_LARGE,
    conversation_detail, conversation_summary, error_response, run_dto,
)

log = logging.getLogger(__name__)

_KEY = re.compile(r"[\x21-\x7e]{1,255}")


class ExactRoute(Route):
    """A route that matches the whole path, newlines included. Starlette ends its patterns in
    `$`, which also matches before a trailing newline, and its `{name:path}` (`.*`) stops at a
    newline: `/api/chat%0a` was `/api/chat`, and `/api/conversations/<uuid>%0a` named <uuid>."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **options: Any) -> None:
        super().__init__(path, endpoint, **options)
        self.path_regex = re.compile(self.path_regex.pattern.removesuffix("$") + r"\Z", re.DOTALL)


def service_of(request: Request) -> AgentService:
    return request.app.state.service


def conversation_id(value: object) -> str:
    """A UUID (versions 1-5), lower-cased; anything else is the original's 400."""
    try:
        return parse_conversation_id(value)
    except SophosError:
        raise SophosError(errors.BAD_REQUEST, INVALID_ID) from None


async def json_object(request: Request, limit: int) -> dict:
    """The request body as a JSON object, read up to `limit` bytes (more is a 413)."""
    too_large = SophosError(PAYLOAD_TOO_LARGE, f"Request body is larger than {limit} bytes; nothing was stored.")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large
    except ClientDisconnect:  # hung up mid-body, or cut by the request timeout (server.limits)
        raise SophosError(errors.BAD_REQUEST, "The client went away before its request body arrived; nothing was stored.") from None
    try:
        value = json.loads(body)
    except ValueError:  # not JSON, or not UTF-8
        raise SophosError(errors.BAD_REQUEST, "Request body must be JSON") from None
    except RecursionError:  # json recurses once per level: Python's recursion limit stops it near 1,000
        raise SophosError(errors.BAD_REQUEST, "Request body is JSON nested too deeply to read; nothing was stored.") from None
    if not isinstance(value, dict):
        raise SophosError(errors.BAD_REQUEST, "Request body must be a JSON object")
    return value


def idempotency_key(request: Request) -> str | None:
    key = request.headers.get("idempotency-key")
    if key is not None and not _KEY.fullmatch(key):
        raise SophosError(errors.BAD_REQUEST, "Idempotency-Key must be 1 to 255 visible ASCII characters")
    return key


async def repeat_of(service: AgentService, keyed: IdempotencyKey) -> JSONResponse | None:
    """The first answer to a key that started a run already; None if it started none."""
    first = await service.keyed_run(keyed)
    if first is None:
        return None
    return JSONResponse({"conversation": first.conversation_id, "run": first.run_id},
                        headers={"Idempotent-Replayed": "true"})


async def start_chat(request: Request) -> Response:
    """`POST /api/chat`: `{message}`, `{message, conversation}` or `{resume: true, conversation}`.

    The original's order of checks, with the kit's additions in it: the body is JSON (and not
    too large); a message unless resuming; the `Idempotency-Key`, if any, is well formed; a
    conversation to resume; a valid id; a key seen before answers as it did the first time;
    then the service: unknown id (404), a run in progress (409), nothing to resume (409).
    """
    service = service_of(request)
    body = await json_object(request, request.app.state.options.max_body_bytes)
    resume = body.get("resume") is True
    message = body.get("message")
    if not resume and not (isinstance(message, str) and message.strip()):
        raise SophosError(errors.BAD_REQUEST, "Message is required")
    key = idempotency_key(request)
    conversation = body.get("conversation")
    if conversation is None:
        if resume:
            raise SophosError(errors.BAD_REQUEST, "A conversation is required to resume")
    else:
        conversation = conversation_id(conversation)
    if key is None:
        return started_response(await (service.resume(conversation) if resume else service.chat(message, conversation)))
    keyed = IdempotencyKey(key, canonical_request(resume, message, conversation))
    # One request with a key at a time here: a repeat that came while the first was starting
    # its run answers as a repeat (another process's is told apart by the database).
    async with service.requests_keyed(key):
        if (first := await repeat_of(service, keyed)) is not None:
            return first
        try:
            run = await (service.resume(conversation, keyed) if resume else service.chat(message, conversation, keyed))
        except SophosError:
            # A request with the same key may have started its run while this one was checked.
            if (first := await repeat_of(service, keyed)) is not None:
                return first
            raise
    return started_response(run)


async def follow_chat(request: Request) -> Response:
    """`GET /api/chat?conversation=<uuid>`: the run's events over SSE, replayed after `Last-Event-ID`."""
    service = service_of(request)
    options = request.app.state.options

    def stream(frames):
        return sse.event_stream(frames, options.ping_seconds, service.settings.shutdown_timeout)

    try:
        conversation = conversation_id(request.query_params.get("conversation"))
    except SophosError as invalid:
        return stream(sse.single("chat-error", invalid.to_dict()))
    after = sse.last_event_id(request.headers.get("last-event-id"))
    # A user's stream: the owner check first, so another user's run sends not a byte.
    run = service.active.get(conversation) if users.acting_user.get() is None else None
    if run is None:
        try:
            await service.conversation_summary(conversation)  # recovers a dead owner's run first
        except SophosError as error:
            message = CONVERSATION_NOT_FOUND if error.code == errors.NOT_FOUND else error.message
            return stream(sse.single("chat-error", {"code": error.code, "message": message,
                                                    "conversation": conversation}))
        run = service.active.get(conversation)
        if run is None and service.settings.on_workers:
            run = await service.run_to_follow(conversation, after)  # a worker's, from the events table
    if run is None:
        latest = await service.store.latest_run(conversation)
        if latest is not None and latest.status == "running":  # its owner, another process, is alive
            return stream(sse.single("chat-error", {
                "code": errors.SESSION_IN_PROGRESS, "conversation": conversation, "run": latest.id,
                "message": "The run is running in another process; follow it there."}))
        ended = {"conversation": conversation, "run": latest.id if latest else None,
                 "status": latest.status if latest else None}
        if (gate := await service.pending_approval(conversation)) is not None:
            ended["approval"] = {"gate": gate.id, "calls": gate.calls}
        return stream(sse.single("end", ended))
    return stream(sse.follow(run, after))


async def list_conversations(request: Request) -> Response:
    """All conversations, as the original; with `?limit=` or `?cursor=`, one page of them and the
    `next_cursor` to pass back for the next (null on the last page)."""
    query = request.query_params
    paged = "limit" in query or "cursor" in query
    try:
        if paged:
            limit = query.get("limit", str(PAGE_SIZE))
            number = int(limit) if limit.isascii() and limit.isdigit() else limit  # "²".isdigit() too
            page = await service_of(request).conversation_page(number, query.get("cursor"))
            return JSONResponse({"conversations": [conversation_summary(c) for c in page.conversations],
                                 "next_cursor": page.next_cursor})
        conversations = await service_of(request).list_conversations()
    except SophosError:
        raise
    except Exception as error:
        if errors.database_unavailable(error):
            raise
        log.exception("could not list the conversations")
        return error_response(FETCH_ERROR, "Failed to fetch conversations")
    return JSONResponse({"conversations": [conversation_summary(c) for c in conversations]})


async def get_conversation(request: Request) -> Response:
    conversation = conversation_id(request.path_params["conversation"])
    try:
        detail = await service_of(request).get_conversation(conversation)
    except SophosError:
        raise
    except Exception as error:
        if errors.database_unavailable(error):
            raise
        log.exception("could not load conversation %s", conversation)
        return error_response(LOAD_ERROR, "Failed to load conversation")
    return JSONResponse(conversation_detail(detail))


async def export_conversation(request: Request) -> Response:
    """Markdown by default (any format but `jsonl`), or the checkpoint history as JSON lines."""
    conversation = conversation_id(request.path_params["conversation"])
    service = service_of(request)
    if request.query_params.get("format") == "jsonl":
        return Response(await service.export_jsonl(conversation), headers={
            "Content-Type": "application/x-ndjson; charset=utf-8",
            "Content-Disposition": f'attachment; filename="{conversation}.checkpoints.jsonl"',
        })
    return Response(await service.export_markdown(conversation), headers={
        "Content-Type": "text/markdown; charset=utf-8",
        "Content-Disposition": f'attachment; filename="{conversation}.md"',
    })


async def list_runs(request: Request) -> Response:
    """The conversation's runs in start order (kit only), after recovery of dead owners' runs."""
    conversation = conversation_id(request.path_params["conversation"])
    service = service_of(request)
    await service.conversation_summary(conversation)
    return JSONResponse({"runs": [run_dto(run) for run in await service.list_runs(conversation)]})


async def cancel_run(request: Request) -> Response:
    """`POST /api/conversations/<uuid>/cancel` (kit only): stop the active run now; 200 with its
    final event once it is recorded (`chat-error` `CANCELLED`, or `end` if it finished first),
    409 `RUN_NOT_ACTIVE` when nothing runs there, 404 / 400 as the other endpoints."""
    conversation = conversation_id(request.path_params["conversation"])
    final = await service_of(request).cancel(conversation)
    return JSONResponse({"event": final.event, "data": final.data})


async def approve_run(request: Request) -> Response:
    """`POST /api/conversations/<uuid>/approve` (kit only), body `{"decisions": {tool_call_id:
    "approve" | "reject" | {"decision", "reason"?, "args"?}}}`, or `{"gate": id}` to approve
    every call the gate holds (`{}`: of the gate waiting now; a retry should name the gate): the
    decisions are recorded and a run carries them on; 200 `{conversation, run}`, then follow it
    with `GET /api/chat`. The same decisions again answer with the run they started
    (`Idempotent-Replayed: true`); 409 `NO_APPROVAL_PENDING` / `GATE_DECIDED`, 422
    `APPROVAL_MISMATCH`."""
    conversation, body = await decision_request(request, ("decisions", "gate"))
    run = await service_of(request).approve(conversation, body.get("decisions"), body.get("gate"))
    return started_response(run)


async def reject_run(request: Request) -> Response:
    """`POST /api/conversations/<uuid>/reject` (kit only), body `{"reason"?, "gate"?}`: reject
    every call the gate holds; answers as `approve`."""
    conversation, body = await decision_request(request, ("reason", "gate"))
    run = await service_of(request).reject(conversation, body.get("reason"), body.get("gate"))
    return started_response(run)


async def decision_request(request: Request, fields: tuple[str, ...]) -> tuple[str, dict[str, Any]]:
    """The conversation and the JSON body of an approve or reject, which may hold only `fields`."""
    conversation = conversation_id(request.path_params["conversation"])
    body = await json_object(request, request.app.state.options.max_body_bytes)
    unknown = set(body) - set(fields)
    if unknown:
        raise SophosError(errors.BAD_REQUEST, f"Unknown fields {sorted(unknown)}: give {', '.join(fields)}, or none")
    return conversation, body


def started_response(run) -> JSONResponse:
    return JSONResponse({"conversation": run.conversation, "run": run.id},
                        headers={"Idempotent-Replayed": "true"} if run.replayed else None)


async def healthz(request: Request) -> Response:
    """Touches nothing: not the database, not the model, not MCP."""
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    """Does PostgreSQL (with `DATABASE_URL`) answer, and does `OLLAMA_HOST` answer and list
    `OLLAMA_MODEL`? The model is advisory: runs are accepted either way. The database is not:
    while it is unavailable every route answers 503 `DATABASE_UNAVAILABLE`."""
    settings = service_of(request).settings
    if settings.database_url:
        from ..runtime.storage.postgres import unreachable

        if (why := await unreachable(settings.database_url)) is not None:
            return JSONResponse({"status": "error", "code": errors.DATABASE_UNAVAILABLE,
                                 "message": f"The database is unavailable: {why}"}, 503,
                                {"Retry-After": str(errors.DATABASE_RETRY_AFTER_SECONDS)})
    readiness = await check_model_async(settings)
    if readiness.ok:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "error", "message": readiness.message}, 503)


API = [
    ExactRoute("/api/chat", start_chat, methods=["POST"]),
    ExactRoute("/api/chat", follow_chat, methods=["GET"]),
    ExactRoute("/api/conversations", list_conversations, methods=["GET"]),
    ExactRoute("/api/conversations/{conversation}/export", export_conversation, methods=["GET"]),
    ExactRoute("/api/conversations/{conversation}/runs", list_runs, methods=["GET"]),
    # Run control, before the catch-all below.
    ExactRoute("/api/conversations/{conversation}/cancel", cancel_run, methods=["POST"]),
    ExactRoute("/api/conversations/{conversation}/approve", approve_run, methods=["POST"]),
    ExactRoute("/api/conversations/{conversation}/reject", reject_run, methods=["POST"]),
    # Any other path under a conversation is not a conversation id: the original's 400.
    ExactRoute("/api/conversations/{conversation:path}", get_conversation, methods=["GET"]),
    ExactRoute("/api/healthz", healthz, methods=["GET"]),
    ExactRoute("/api/readyz", readyz, methods=["GET"]),
]

"""Error codes and the exception that carries them.

Run outcomes use `AGENT_FAILURE`, `MODEL_UNAVAILABLE`, `RECURSION_LIMIT` (as in the original) and
`SHUTDOWN` (the kit's honest cause for a run stopped by a graceful shutdown). `OWNERSHIP_LOST`
ends a run in a process that another process has taken the run from; it is never recorded,
because the new owner's record is the one that stands. `THINKING_UNSUPPORTED`: OLLAMA_THINK=true
with a model that cannot think. `CANCELLED`: a run stopped by `cancel()` ("Cancelled by user").
A step that kept failing with transient errors until its attempts ran out ends with `TIMEOUT`
(its last attempt exceeded its time limit; also with a single attempt) or `MODEL_UNREACHABLE`
(the model step: connection errors or HTTP 5xx, after more than one attempt); the message names
the attempts. Requests that are
refused before a run starts use `BAD_REQUEST`, `NOT_FOUND`, `SESSION_IN_PROGRESS` and
`RUN_NOT_RESUMABLE`, and `cancel()` with no run active is `RUN_NOT_ACTIVE`; a database the code cannot use raises `SCHEMA_TOO_NEW` or `CONFIG_ERROR`.
`STORAGE_FULL`: the disk that holds the database is full (SQLite: "database or disk is full"); the
request was not accepted and nothing of it was written (see `store.storage_full`).
`IDEMPOTENCY_KEY_REUSED`: a key given again with a different request. Approval gates:
`RUN_WAITING` refuses a resume or a new message while a run waits for approval (approve or
reject instead), `NO_APPROVAL_PENDING` an approval where nothing waits, `APPROVAL_MISMATCH` a
decision that does not fit the gate (an unknown or missing tool call id, arguments that
changed, a decision that is neither approve nor reject), and `GATE_DECIDED` a decision that
differs from the one a gate already has. `REPLAY_GONE`: a follower
asked to replay events that the run's bounded buffer no longer keeps (reload the conversation
and follow again from the events still kept). Users of one server: `TOO_MANY_RUNS` refuses a run
beyond a user's running or queued limit, and `STEP_BUDGET_SPENT` both refuses a run of a user
whose runs have taken their day's steps and ends a run that used the steps its user had left
(resumable, like `RECURSION_LIMIT`). `DATABASE_UNAVAILABLE`: PostgreSQL cannot be reached (down,
restarting, or the connection was cut); a request refused with it wrote nothing and may be sent
again (HTTP 503 with `Retry-After`), and a run it stopped keeps every step it saved (resumable).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

AGENT_FAILURE = "AGENT_FAILURE"
MODEL_UNAVAILABLE = "MODEL_UNAVAILABLE"
RECURSION_LIMIT = "RECURSION_LIMIT"
SHUTDOWN = "SHUTDOWN"
OWNERSHIP_LOST = "OWNERSHIP_LOST"
THINKING_UNSUPPORTED = "THINKING_UNSUPPORTED"
CANCELLED = "CANCELLED"
MODEL_UNREACHABLE = "MODEL_UNREACHABLE"
TIMEOUT = "TIMEOUT"

BAD_REQUEST = "BAD_REQUEST"
NOT_FOUND = "NOT_FOUND"
SESSION_IN_PROGRESS = "SESSION_IN_PROGRESS"
RUN_NOT_RESUMABLE = "RUN_NOT_RESUMABLE"
RUN_NOT_ACTIVE = "RUN_NOT_ACTIVE"
SCHEMA_TOO_NEW = "SCHEMA_TOO_NEW"
CONFIG_ERROR = "CONFIG_ERROR"
STORAGE_FULL = "STORAGE_FULL"
IDEMPOTENCY_KEY_REUSED = "IDEMPOTENCY_KEY_REUSED"
REPLAY_GONE = "REPLAY_GONE"
RUN_WAITING = "RUN_WAITING"
NO_APPROVAL_PENDING = "NO_APPROVAL_PENDING"
APPROVAL_MISMATCH = "APPROVAL_MISMATCH"
GATE_DECIDED = "GATE_DECIDED"
TOO_MANY_RUNS = "TOO_MANY_RUNS"
STEP_BUDGET_SPENT = "STEP_BUDGET_SPENT"
DATABASE_UNAVAILABLE = "DATABASE_UNAVAILABLE"
DATABASE_RETRY_AFTER_SECONDS = 2
"""What a refusal with `DATABASE_UNAVAILABLE` tells the client to wait before asking again."""

RECURSION_LIMIT_MESSAGE = "The agent reached its step limit (AGENT_RECURSION_LIMIT) without finishing."
# What a MODEL_UNAVAILABLE run records: the model, the server and Ollama's own words, e.g.
# The model "x" is not available from OLLAMA_HOST (http://127.0.0.1:11434): model 'x' not found
MODEL_UNAVAILABLE_DETAIL = 'The model "{model}" is not available from {where}: {reason}'
SHUTDOWN_MESSAGE = "The process shut down before the run finished; its progress is saved."
CANCELLED_MESSAGE = "Cancelled by user"
OWNERSHIP_LOST_MESSAGE = (
    "Another process took this run over: this one stopped renewing its lease (frozen or hung) and "
    "was presumed dead. It wrote nothing after that; the conversation continues where the other left it."
)


@dataclass
class SophosError(Exception):
    """A refusal or failure with a stable code and a message for people."""

    code: str
    message: str

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"

    def to_dict(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


def database_unavailable(error: BaseException) -> bool:
    """Does `error` say PostgreSQL could not be reached, rather than that a request was wrong?

    A connection that failed or was cut (no SQLSTATE, class 08), the server shutting down,
    crashed or still starting (class 57P: `pg_terminate_backend`, a restart), a pool with no
    connection to give, or the kit's own `DATABASE_UNAVAILABLE`. Not a lock timeout, a full disk
    or a constraint: those are answers of a server that is up.
    """
    if isinstance(error, SophosError):
        return error.code == DATABASE_UNAVAILABLE
    psycopg = sys.modules.get("psycopg")  # never imported: not a PostgreSQL error
    if psycopg is None or not isinstance(error, psycopg.OperationalError):
        return False
    pool = sys.modules.get("psycopg_pool")
    if pool is not None and isinstance(error, pool.PoolTimeout):
        return True
    state = getattr(error, "sqlstate", None)
    return state is None or state.startswith(("08", "57P"))

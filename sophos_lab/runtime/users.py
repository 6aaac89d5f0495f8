"""Users of one server: names, tokens (stored hashed) and which conversations are whose.

Without users (the default, a learner's own laptop) there is one user, and nothing here is in
the way. Once `sophos-lab user add NAME` has made one, the HTTP server wants a user's token on
every API request, and a request acts for that user only: `acting_user` holds the user's id for
the request's whole task (and the runs it starts), and the stores' conversation queries answer
for that user's conversations only. Another user's conversation id is answered exactly as an id
that does not exist (`NOT_FOUND`, by the same query, so in the same time). The instructor's CLI
acts for no user, and sees every conversation.

The check that matters for a run is made inside the transaction that starts it
(`check_owner`): the conversation's row is read there with the user's id, locked until the
commit on PostgreSQL (SQLite's write transaction holds the whole file), so a deletion of the user
or the conversation cannot slip in between the check and the run.

A token is 32 random bytes (URL-safe base64), shown once; the database keeps its SHA-256. A
slow password hash is for secrets people choose; a random token has nothing to guess from, and a
fast hash keeps each request's lookup an index probe.
"""

from __future__ import annotations

import contextvars
import hashlib
import re
import secrets
import uuid
from dataclasses import dataclass
from typing import Any

from . import errors
from .errors import SophosError

acting_user: contextvars.ContextVar[str | None] = contextvars.ContextVar("sophos_lab_acting_user", default=None)
"""The id of the user a request acts for; None: no user (single-user mode, the instructor's CLI)."""

run_owner: contextvars.ContextVar[str | None] = contextvars.ContextVar("sophos_lab_run_owner", default=None)
"""Inside a run's task: the id of the user who owns its conversation (None: no user), whose own
MCP servers serve its tools (`tools.McpTools`). Set from the conversation's row."""

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


@dataclass(frozen=True)
class User:
    id: str
    name: str
    created_at: str
    revoked_at: str | None = None

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def check_name(name: object) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise SophosError(errors.BAD_REQUEST, (
            f"Invalid user name: {name!r}. A name is 1 to 64 letters, digits, dots, dashes or "
            "underscores, starting with a letter or a digit."))
    return name


def _user(row: Any) -> User:
    return User(row["id"], row["name"], row["created_at"], row["revoked_at"])


def check_owner(conversation_id: str, found: tuple | None) -> None:
    """Inside the transaction that starts a run on an existing conversation, whose row it has
    read (`found`: its `user_id` first; None when there is none) and holds locked to the commit:
    `NOT_FOUND` unless the acting user (if any) owns it."""
    user = acting_user.get()
    if user is not None and (found is None or found[0] != user):
        raise SophosError(errors.NOT_FOUND, f"Conversation Not Found: {conversation_id}")


def mine(alias: str = "c") -> tuple[str, dict[str, Any]]:
    """The acting user's filter on conversations, `(" AND <alias>.user_id = :acting_user", {...})`,
    or nothing when no user acts."""
    user = acting_user.get()
    return ("", {}) if user is None else (f" AND {alias}.user_id = :acting_user", {"acting_user": user})


@dataclass(frozen=True)
class Limits:
    """What one user may have at once and spend (`Settings.user_limits`): runs running and
    queued, and graph steps per run and per UTC day."""

    running: int = 2
    queued: int = 10
    steps_per_run: int = 25
    """As `AGENT_RECURSION_LIMIT`'s default: a user's run has no budget of its own unless set lower."""
    steps_per_day: int = 1000


def day_start(now: str) -> str:
    """The start of the UTC day of `now` (a `utc_now()` string), in the same format, so that a
    run's `started_at` compares with it as text."""
    return now[:10] + "T00:00:00.000000+00:00"


async def steps_today(tx: Any, user: str, now: str) -> int:
    """The graph steps the user's runs started today (UTC) have recorded (`runs.steps`, written
    with each run's outcome, or when a run a crash ended is relabelled)."""
    return int(await tx.value(
        "SELECT coalesce(sum(r.steps), 0) FROM runs r JOIN conversations c ON c.id = r.conversation_id"
        " WHERE c.user_id = :user AND r.started_at >= :day", {"user": user, "day": day_start(now)}))


@dataclass(frozen=True)
class StepBudget:
    """The most steps a run may take, and, when a user's budget is what holds it there, which
    setting (`STEP_BUDGET_SPENT` then names it; otherwise `AGENT_RECURSION_LIMIT` holds it)."""

    steps: int
    setting: str | None = None
    limit: int | None = None
    """The setting's value."""

    @property
    def message(self) -> str:
        return (f"The run used the {self.steps} steps its user had left ({self.setting}={self.limit}) without "
                "finishing; its progress is saved, and a resume carries on once the budget allows.")


async def step_budget(storage: Any, user: str | None, limits: Limits, recursion_limit: int, now: str) -> StepBudget:
    """A run's step budget, counted as it starts: the recursion limit, or less for a user (their
    per-run budget, and what is left of their day's). Runs running side by side are each given
    what was left when they started, so a day's budget can be exceeded by the runs then in
    flight (at most `SOPHOS_LAB_USER_MAX_RUNNING` of them)."""
    budget = StepBudget(recursion_limit)
    if user is None:
        return budget
    if limits.steps_per_run < budget.steps:
        budget = StepBudget(limits.steps_per_run, "SOPHOS_LAB_USER_MAX_STEPS_PER_RUN", limits.steps_per_run)
    async with storage.reading() as tx:
        left = limits.steps_per_day - await steps_today(tx, user, now)
    if left < budget.steps:
        budget = StepBudget(max(left, 1), "SOPHOS_LAB_USER_MAX_STEPS_PER_DAY", limits.steps_per_day)
    return budget


async def check_limits(tx: Any, status: str, limits: Limits, now: str) -> None:
    """Inside the transaction that starts a run (`status` `running`) or queues one (`queued`):
    `TOO_MANY_RUNS` if the acting user has as many as their limit already, `STEP_BUDGET_SPENT`
    if their runs have taken their day's steps. The user's row is locked first (PostgreSQL;
    SQLite's write transaction holds the file), so two requests of one user are counted one
    after the other."""
    user = acting_user.get()
    if user is None:
        return
    await tx.execute("SELECT 1 FROM users WHERE id = :user{for_update}", {"user": user})
    row = await tx.row(
        "SELECT count(*) FILTER (WHERE r.status = 'running') AS running,"
        " count(*) FILTER (WHERE r.status = 'queued') AS queued"
        " FROM runs r JOIN conversations c ON c.id = r.conversation_id"
        " WHERE c.user_id = :user AND r.status IN ('running', 'queued')", {"user": user})
    limit, setting = ((limits.running, "SOPHOS_LAB_USER_MAX_RUNNING") if status == "running"
                      else (limits.queued, "SOPHOS_LAB_USER_MAX_QUEUED"))
    if row[status] >= limit:
        runs = f"{row[status]} run{'' if row[status] == 1 else 's'}"
        raise SophosError(errors.TOO_MANY_RUNS, (
            f"You have {runs} {status} already, the most one user may have at once on this server "
            f"({setting}={limit}); wait for one to end, or cancel one. Nothing was stored."))
    spent = await steps_today(tx, user, now)
    if spent >= limits.steps_per_day:
        raise SophosError(errors.STEP_BUDGET_SPENT, (
            f"Your runs have taken {spent} steps today, this server's budget for one user "
            f"(SOPHOS_LAB_USER_MAX_STEPS_PER_DAY={limits.steps_per_day}); it starts again at 00:00 UTC. "
            "Nothing was stored."))


async def owner_of(storage: Any, conversation_id: str) -> str | None:
    """The id of the user who owns the conversation (None: no user, or no such conversation)."""
    async with storage.reading() as tx:
        return await tx.value("SELECT user_id FROM conversations WHERE id = :id", {"id": conversation_id})


def scoped_key(key: str) -> str:
    """An idempotency key as stored: each user's keys are their own (two users may send the same)."""
    user = acting_user.get()
    return key if user is None else f"{user}/{key}"


# the CLI's side: on a storage (`storage.open_storage`), as the instructor

async def add_user(storage: Any, name: str, now: str) -> tuple[User, str]:
    """A new user and its token (shown once: only its hash is kept)."""
    name = check_name(name)
    token = secrets.token_urlsafe(32)
    user = User(str(uuid.uuid4()), name, now)
    async with storage.transaction() as tx:
        if await tx.row("SELECT 1 FROM users WHERE name = :name", {"name": name}) is not None:
            raise SophosError(errors.BAD_REQUEST, f"There is a user {name!r} already; nothing was changed.")
        await tx.execute("INSERT INTO users (id, name, token_hash, created_at) VALUES (:id, :name, :hash, :now)",
                         {"id": user.id, "name": name, "hash": hash_token(token), "now": now})
    return user, token


async def list_users(storage: Any) -> list[tuple[User, int]]:
    """Every user, oldest first, with how many conversations each has."""
    async with storage.reading() as tx:
        rows = await tx.rows(
            "SELECT u.id, u.name, u.created_at, u.revoked_at, (SELECT count(*) FROM conversations c"
            " WHERE c.user_id = u.id) AS conversations FROM users u ORDER BY u.created_at, u.name")
    return [(_user(row), row["conversations"]) for row in rows]


async def find_user(storage: Any, name: str) -> User:
    async with storage.reading() as tx:
        row = await tx.row("SELECT * FROM users WHERE name = :name", {"name": check_name(name)})
    if row is None:
        raise SophosError(errors.NOT_FOUND, f"No user {name!r}; `sophos-lab user list` shows who there is.")
    return _user(row)


async def revoke_user(storage: Any, name: str, now: str) -> User:
    """The user's token stops working at once (its conversations stay; `delete_user` removes them)."""
    user = await find_user(storage, name)
    if not user.revoked:
        async with storage.transaction() as tx:
            await tx.execute("UPDATE users SET revoked_at = :now WHERE id = :id", {"now": now, "id": user.id})
    return await find_user(storage, name)


async def user_conversations(storage: Any, user: User) -> list[str]:
    async with storage.reading() as tx:
        return [row[0] for row in await tx.tuples("SELECT id FROM conversations WHERE user_id = :id ORDER BY id",
                                                  {"id": user.id})]


async def forget_user(storage: Any, user: User) -> None:
    """The user's row, once its conversations are gone (a conversation of theirs left refuses it)."""
    async with storage.transaction() as tx:
        if await tx.row("SELECT 1 FROM conversations WHERE user_id = :id LIMIT 1", {"id": user.id}):
            raise SophosError(errors.BAD_REQUEST, (
                f"User {user.name!r} has a conversation again (started while it was deleted?); "
                "run the delete again."))
        await tx.execute("DELETE FROM users WHERE id = :id", {"id": user.id})


# the server's side

async def has_users(storage: Any) -> bool:
    async with storage.reading() as tx:
        return await tx.row("SELECT 1 FROM users LIMIT 1") is not None


async def user_for_token(storage: Any, token: str) -> User | None:
    async with storage.reading() as tx:
        row = await tx.row("SELECT * FROM users WHERE token_hash = :hash", {"hash": hash_token(token)})
    return None if row is None else _user(row)

"""Settings read from the environment, with the original system's names and defaults."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

from .users import Limits

T = TypeVar("T", int, float)

DEFAULT_OLLAMA_HOST = "http://localhost:11434"
DEFAULT_OLLAMA_MODEL = "qwen3"
DEFAULT_DATABASE_PATH = "data/db/sophos.db"
DEFAULT_CONFIG_DIR = "config"
DEFAULT_MEMORY_FILE_PATH = "data/memory/memory.jsonl"
DEFAULT_RECURSION_LIMIT = 25
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
DEFAULT_LEASE_SECONDS = 15.0
DEFAULT_EVENT_BUFFER = 10_000
DEFAULT_MODEL_ATTEMPTS = 3
DEFAULT_TOOL_ATTEMPTS = 1
DEFAULT_RETRY_BASE_SECONDS = 1.0
DEFAULT_RETRY_MAX_SECONDS = 30.0
DEFAULT_MODEL_TIMEOUT_SECONDS = 600.0
DEFAULT_TOOL_TIMEOUT_SECONDS = 120.0
DEFAULT_USER_TOOLS_IDLE_SECONDS = 300.0
DEFAULT_USER_MAX_RUNNING = Limits.running
DEFAULT_USER_MAX_QUEUED = Limits.queued
DEFAULT_USER_MAX_STEPS_PER_RUN = Limits.steps_per_run
DEFAULT_USER_MAX_STEPS_PER_DAY = Limits.steps_per_day


@dataclass(frozen=True)
class Settings:
    """Everything the runtime needs to know about its surroundings.

    Unset and empty variables both fall back to the default, as in the original.
    Relative paths are resolved against the working directory when the settings are built.
    """

    ollama_host: str = DEFAULT_OLLAMA_HOST
    ollama_model: str = DEFAULT_OLLAMA_MODEL
    database_path: Path = Path(DEFAULT_DATABASE_PATH)
    database_url: str | None = None
    """`DATABASE_URL`: a `postgresql://` URL puts the tables and the checkpoints on PostgreSQL
    (see `postgres`) instead of the file at `database_path`; unset, the file."""
    config_dir: Path = Path(DEFAULT_CONFIG_DIR)
    memory_file_path: Path = Path(DEFAULT_MEMORY_FILE_PATH)
    recursion_limit: int = DEFAULT_RECURSION_LIMIT
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT
    naive_shutdown: bool = False
    """Reproduce the original's shutdown (close everything, no drain) instead of draining."""
    ollama_think: bool = False
    """`OLLAMA_THINK`, as in the original: the model thinks only when it is `true`."""
    lease_seconds: float = DEFAULT_LEASE_SECONDS
    """How long a process's claim on its running runs lasts unless renewed (every third of it)."""
    single_owner: bool = False
    """Reproduce the original's ownership: a `running` run at first open means dead, and no
    process checks who owns a run before writing (lesson 08b shows what that costs)."""
    event_buffer: int = DEFAULT_EVENT_BUFFER
    """How many of a run's latest events are kept for replay (`Last-Event-ID`); older ones go."""
    runs: str = "here"
    """`SOPHOS_LAB_RUNS`: `here` (this process runs the runs it accepts) or `workers`
    (PostgreSQL only: it queues them, and a pool of workers, `sophos-lab worker`, runs them;
    see `queue`). Anything else is refused when the database is opened."""
    requeue_limit: int = 0
    """`SOPHOS_LAB_REQUEUE` (a pool of workers): how many times a run whose worker died goes back in
    the queue by itself, recorded in `runs.requeues`; 0 (the default): never, it is `interrupted`
    and resuming it stays a decision."""
    model_attempts: int = DEFAULT_MODEL_ATTEMPTS
    """Attempts of one model step (the first included) when it fails with a transient error."""
    tool_attempts: int = DEFAULT_TOOL_ATTEMPTS
    """Attempts of one tools step. One by default: a retry repeats every tool call of the turn,
    and only tools that store the runtime's idempotency key are safe to repeat."""
    retry_base_seconds: float = DEFAULT_RETRY_BASE_SECONDS
    """The wait before the first retry; retry n waits min(base * 2^(n-1), `retry_max_seconds`)."""
    retry_max_seconds: float = DEFAULT_RETRY_MAX_SECONDS
    retry_jitter: bool = False
    """Add up to 1 s at random to each wait (LangGraph's jitter); off, so the waits are exact."""
    model_timeout_seconds: float = DEFAULT_MODEL_TIMEOUT_SECONDS
    """Hard wall-clock cap on one attempt of a model step (the whole streamed answer)."""
    tool_timeout_seconds: float = DEFAULT_TOOL_TIMEOUT_SECONDS
    """Hard wall-clock cap on one attempt of a tools step (all the turn's tool calls)."""
    user_tools_idle_seconds: float = DEFAULT_USER_TOOLS_IDLE_SECONDS
    """`SOPHOS_LAB_USER_TOOLS_IDLE_SECONDS`: how long a user's own MCP servers (`"per_user": true`)
    stay up in a process after that user's last run there ends."""
    user_max_running: int = DEFAULT_USER_MAX_RUNNING
    """`SOPHOS_LAB_USER_MAX_RUNNING`: a user's runs running at once (more are refused with
    `TOO_MANY_RUNS`, or with workers wait in the queue); users only, not the single-user mode."""
    user_max_queued: int = DEFAULT_USER_MAX_QUEUED
    """`SOPHOS_LAB_USER_MAX_QUEUED` (workers): a user's runs waiting in the queue at once; the next
    is refused with `TOO_MANY_RUNS`."""
    user_max_steps_per_run: int = DEFAULT_USER_MAX_STEPS_PER_RUN
    """`SOPHOS_LAB_USER_MAX_STEPS_PER_RUN`: the graph steps one run of a user may take; below
    `AGENT_RECURSION_LIMIT` it ends such a run with `STEP_BUDGET_SPENT` (resumable)."""
    user_max_steps_per_day: int = DEFAULT_USER_MAX_STEPS_PER_DAY
    """`SOPHOS_LAB_USER_MAX_STEPS_PER_DAY`: the graph steps a user's runs may take in one UTC
    day; a run gets at most what is left as it starts, and once none is left a new run is refused
    with `STEP_BUDGET_SPENT`."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Build settings from `environ` (default: `os.environ`)."""
        env = os.environ if environ is None else environ

        def get(name: str, default: str) -> str:
            return env.get(name) or default

        return cls(
            ollama_host=get("OLLAMA_HOST", DEFAULT_OLLAMA_HOST),
            ollama_model=get("OLLAMA_MODEL", DEFAULT_OLLAMA_MODEL),
            database_path=_absolute(get("DATABASE_PATH", DEFAULT_DATABASE_PATH)),
            database_url=env.get("DATABASE_URL") or None,
            config_dir=_absolute(get("CONFIG_DIR", DEFAULT_CONFIG_DIR)),
            memory_file_path=_absolute(get("MEMORY_FILE_PATH", DEFAULT_MEMORY_FILE_PATH)),
            ollama_think=(env.get("OLLAMA_THINK") or "").strip().lower() == "true",
            recursion_limit=positive(env.get("AGENT_RECURSION_LIMIT"), DEFAULT_RECURSION_LIMIT, int),
            shutdown_timeout=positive(env.get("SHUTDOWN_TIMEOUT"), DEFAULT_SHUTDOWN_TIMEOUT, float),
            naive_shutdown=_flag(env.get("SOPHOS_LAB_NAIVE_SHUTDOWN")),
            lease_seconds=positive(env.get("SOPHOS_LAB_LEASE_SECONDS"), DEFAULT_LEASE_SECONDS, float),
            single_owner=_flag(env.get("SOPHOS_LAB_SINGLE_OWNER")),
            event_buffer=positive(env.get("SOPHOS_LAB_EVENT_BUFFER"), DEFAULT_EVENT_BUFFER, int),
            runs=(env.get("SOPHOS_LAB_RUNS") or "here").strip().lower(),
            requeue_limit=positive(env.get("SOPHOS_LAB_REQUEUE"), 0, int),
            model_attempts=positive(env.get("SOPHOS_LAB_MODEL_ATTEMPTS"), DEFAULT_MODEL_ATTEMPTS, int),
            tool_attempts=positive(env.get("SOPHOS_LAB_TOOL_ATTEMPTS"), DEFAULT_TOOL_ATTEMPTS, int),
            retry_base_seconds=positive(env.get("SOPHOS_LAB_RETRY_BASE_SECONDS"), DEFAULT_RETRY_BASE_SECONDS, float),
            retry_max_seconds=positive(env.get("SOPHOS_LAB_RETRY_MAX_SECONDS"), DEFAULT_RETRY_MAX_SECONDS, float),
            retry_jitter=_flag(env.get("SOPHOS_LAB_RETRY_JITTER")),
            model_timeout_seconds=positive(
                env.get("SOPHOS_LAB_MODEL_TIMEOUT_SECONDS"), DEFAULT_MODEL_TIMEOUT_SECONDS, float),
            tool_timeout_seconds=positive(
                env.get("SOPHOS_LAB_TOOL_TIMEOUT_SECONDS"), DEFAULT_TOOL_TIMEOUT_SECONDS, float),
            user_tools_idle_seconds=positive(
                env.get("SOPHOS_LAB_USER_TOOLS_IDLE_SECONDS"), DEFAULT_USER_TOOLS_IDLE_SECONDS, float),
            user_max_running=positive(env.get("SOPHOS_LAB_USER_MAX_RUNNING"), DEFAULT_USER_MAX_RUNNING, int),
            user_max_queued=positive(env.get("SOPHOS_LAB_USER_MAX_QUEUED"), DEFAULT_USER_MAX_QUEUED, int),
            user_max_steps_per_run=positive(
                env.get("SOPHOS_LAB_USER_MAX_STEPS_PER_RUN"), DEFAULT_USER_MAX_STEPS_PER_RUN, int),
            user_max_steps_per_day=positive(
                env.get("SOPHOS_LAB_USER_MAX_STEPS_PER_DAY"), DEFAULT_USER_MAX_STEPS_PER_DAY, int),
        )

    def with_changes(self, **changes: object) -> Settings:
        """A copy with some fields replaced."""
        return replace(self, **changes)

    def backoff(self, retry: int) -> float:
        """The wait before retry `retry` (1 for the first): min(base * 2^(retry-1), max), without
        jitter. With base 1 and max 30: 1, 2, 4, 8, 16, 30, 30..."""
        return min(self.retry_base_seconds * 2 ** (retry - 1), self.retry_max_seconds)

    @property
    def user_limits(self) -> Limits:
        return Limits(self.user_max_running, self.user_max_queued,
                      self.user_max_steps_per_run, self.user_max_steps_per_day)

    @property
    def on_workers(self) -> bool:
        """Runs accepted here are queued for a pool of workers (`runs == "workers"`)."""
        return self.runs == "workers"

    @property
    def database(self) -> str:
        """Where the data is, as one string: the URL, or the file's path."""
        return self.database_url or str(self.database_path)

    @property
    def system_prompt_path(self) -> Path:
        return self.config_dir / "system.md"

    @property
    def mcp_config_path(self) -> Path:
        return self.config_dir / "mcp.json"


def _absolute(value: str) -> Path:
    return Path(value).expanduser().absolute()


def _flag(raw: str | None) -> bool:
    return (raw or "").lower() in ("1", "true", "yes")


def positive(raw: str | None, default: T, kind: Callable[[str], T]) -> T:
    """The original's rule: unset, empty, unparsable or <= 0 all mean the default."""
    try:
        value = kind(raw or "")
    except ValueError:
        return default
    return value if value > 0 else default

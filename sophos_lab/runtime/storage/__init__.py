"""The application's tables, on SQLite or PostgreSQL, behind one async seam.

Read in this order: `models` (what the tables hold), `rules` (`Storage`: every rule, once; its
plain reads of runs, keys and gates in `reads`), `connector` (what a backend gives the rules),
then the backends, `sqlite` and `postgres` (with their schemas, and PostgreSQL's queue). `blocking` runs a `Storage` for code that is not async
(the CLI, the lab's helpers in a notebook cell).
"""

from __future__ import annotations

from typing import Any

from ..errors import CONFIG_ERROR, SophosError


def open_storage(settings: Any) -> Any:
    """The application tables where the settings put them: the SQLite file, or PostgreSQL
    (`DATABASE_URL`). A `rules.Storage`; nothing is opened yet."""
    from .rules import Storage

    if settings.runs not in ("here", "workers"):
        raise SophosError(CONFIG_ERROR, (
            f"SOPHOS_LAB_RUNS is {settings.runs!r}: say `here` (this process runs its runs; the default) "
            "or `workers` (a pool of workers runs them; PostgreSQL only)."))
    if settings.on_workers and (not settings.database_url or settings.single_owner):
        raise SophosError(CONFIG_ERROR, (
            "SOPHOS_LAB_RUNS=workers needs DATABASE_URL (a pool of workers shares a PostgreSQL "
            "database) and the kit's ownership (not SOPHOS_LAB_SINGLE_OWNER)."))
    options = dict(lease_seconds=settings.lease_seconds, single_owner=settings.single_owner,
                   limits=settings.user_limits)
    if not settings.database_url:
        from .sqlite import SqliteConnector

        return Storage(SqliteConnector(settings.database_path), **options)
    from .postgres import PostgresConnector, is_postgres_url
    from .postgres_queue import QueueStorage

    if not is_postgres_url(settings.database_url):
        raise SophosError(CONFIG_ERROR, (
            "DATABASE_URL must be a postgresql:// (or postgres://) URL; unset it to use the SQLite file "
            "at DATABASE_PATH."))
    return QueueStorage(PostgresConnector(settings.database_url), requeue_limit=settings.requeue_limit, **options)


def sqlite_storage(path: Any, **options: Any) -> Any:
    """A `Storage` on the SQLite file at `path` (`Storage`'s options: lease, single owner, limits)."""
    from .rules import Storage
    from .sqlite import SqliteConnector

    return Storage(SqliteConnector(path), **options)


def postgres_storage(url: str, **options: Any) -> Any:
    """A `Storage` on the PostgreSQL database at `url` (with its queue: `postgres_queue.QueueStorage`)."""
    from .postgres import PostgresConnector
    from .postgres_queue import QueueStorage

    return QueueStorage(PostgresConnector(url), **options)

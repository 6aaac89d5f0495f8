"""`sophos-lab`'s commands on the database: `delete`, `prune`, `vacuum`, `user` and
`migrate-to-postgres` (see `cli`)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from .environment import lab_environment
from .runtime.settings import Settings

RETENTION_NOTE = (
    "Only the database file (DATABASE_PATH, or --database) is changed: the memory server's file "
    "(MEMORY_FILE_PATH) and any other MCP server's data are never touched."
)


def with_service(args: argparse.Namespace, environ: Mapping[str, str] | None, name: str,
                 command: Callable[[Any], Awaitable[None]]) -> int:
    """Run `command` on an `AgentService` of the lab's database (or `--database`, the file named
    rather than DATABASE_URL's server): 0 when it is done, 1 with the refusal on stderr."""
    from .runtime.errors import SophosError
    from .runtime.service import AgentService

    env = lab_environment(environ)
    if args.database:
        env["DATABASE_PATH"] = args.database
        env.pop("DATABASE_URL", None)
    service = AgentService(Settings.from_env(env))

    async def run() -> int:
        try:
            await command(service)
        except SophosError as error:
            print(f"sophos-lab {name}: {error}", file=sys.stderr)
            return 1
        finally:
            await service.aclose()
        return 0

    return asyncio.run(run())


def retention(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> int:
    """`delete`, `prune` and `vacuum` on the lab's database (or `--database`); 0 when done.

    A refusal (an unknown conversation, one that a live process is running) is printed with its
    code on stderr and returns 1, with nothing changed.
    """
    from .runtime import retention as rules
    from .runtime.errors import SophosError

    async def run(service) -> None:
        if args.command == "delete":
            print((await service.delete_conversation(args.conversation, dry_run=args.dry_run)).describe())
        elif args.command == "prune":
            rules.parse_keep(args.keep)  # a bad --keep is refused once, not once per conversation
            targets = await service.conversation_ids() if args.all else [args.conversation]
            for conversation in targets:
                try:
                    print((await service.prune_conversation(
                        conversation, keep=args.keep, dry_run=args.dry_run)).describe())
                except SophosError as error:
                    if not args.all:
                        raise
                    print(f"{conversation}: left as it is: {error}")
            if args.all and not targets:
                where = "the database at DATABASE_URL" if service.settings.database_url else service.settings.database_path
                print(f"{where}: no conversations")
        if args.command == "vacuum" or (args.vacuum and not args.dry_run):
            print((await service.vacuum()).describe())

    return with_service(args, environ, args.command, run)


def migrate_to_postgres(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> int:
    """`migrate-to-postgres`: copy the lab's SQLite file (or `--database`) into PostgreSQL
    (`--to`, else DATABASE_URL); 0 when copied and read back the same, else 1 with the reason."""
    from .runtime.errors import SophosError
    from .runtime.pg_copy import copy_to_postgres
    from .runtime.storage.postgres import is_postgres_url

    env = lab_environment(environ)
    settings = Settings.from_env({**env, **({"DATABASE_PATH": args.database} if args.database else {})})
    url = args.to or env.get("DATABASE_URL")
    if not is_postgres_url(url):
        print("sophos-lab migrate-to-postgres: name the database with --to postgresql://... or DATABASE_URL",
              file=sys.stderr)
        return 1
    try:
        print(f"{settings.database_path}: {copy_to_postgres(settings.database_path, url).describe()}")
    except SophosError as error:
        print(f"sophos-lab migrate-to-postgres: {error}", file=sys.stderr)
        return 1
    return 0


def user_command(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> int:
    """`user add | list | revoke | delete` on the lab's database (or `--database`); 0 when done.

    `add` prints the new user's token once (the database keeps only its SHA-256). A refusal (a
    name taken or unknown, a run of the user's still live) is printed on stderr and returns 1,
    with nothing changed.
    """
    from .runtime import users
    from .runtime.storage.models import utc_now

    async def run(service) -> None:
        if args.action == "add":
            user, token = await users.add_user(service.store, args.name, utc_now())
            print(f"user {user.name} added; its token (shown this once, keep it):\n{token}")
        elif args.action == "list":
            listed = await users.list_users(service.store)
            for user, conversations in listed:
                state = f"revoked {user.revoked_at}" if user.revoked else "active"
                print(f"{user.name}\t{state}\tsince {user.created_at}\t{conversations} conversation(s)")
            if not listed:
                print("no users: the server runs in single-user mode (see `sophos-lab user add`)")
        elif args.action == "revoke":
            user = await users.revoke_user(service.store, args.name, utc_now())
            print(f"user {user.name}: token revoked at {user.revoked_at}; its conversations are kept "
                  "(`sophos-lab user delete` removes them)")
        elif args.action == "delete":
            removals = await service.delete_user(args.name, dry_run=args.dry_run)
            for removal in removals:
                print(removal.describe())
            verb = "would be deleted" if args.dry_run else "deleted"
            print(f"user {args.name} {verb}, with {len(removals)} conversation(s)"
                  + ("; nothing was changed" if args.dry_run else ""))

    return with_service(args, environ, f"user {args.action}", run)


def add_user_commands(commands: argparse._SubParsersAction) -> None:
    user = commands.add_parser(
        "user", help="users of a shared server: add (prints a token), list, revoke, delete",
        description="Users of one server. With any user, every API request needs a user's token (or "
                    "SOPHOS_LAB_TOKEN, the instructor's, which sees everything), and each user sees only "
                    "their own conversations. Without users the server is single-user (the default).")
    actions = user.add_subparsers(dest="action", required=True)
    parsers = {
        "add": actions.add_parser("add", help="add a user and print its token, once"),
        "list": actions.add_parser("list", help="every user, whether revoked, and how many conversations"),
        "revoke": actions.add_parser("revoke", help="stop a user's token working now (conversations kept)"),
        "delete": actions.add_parser(
            "delete", help="delete a user with every conversation, run, checkpoint, gate and key of theirs"),
    }
    for action, parser in parsers.items():
        if action != "list":
            parser.add_argument("name", help="the user's name (letters, digits, . _ -)")
        parser.add_argument("--database", metavar="PATH",
                            help="the SQLite file (default: DATABASE_PATH or DATABASE_URL, else the lab's)")
    parsers["delete"].add_argument("--dry-run", action="store_true", help="say what would be deleted; change nothing")


def add_retention_commands(commands: argparse._SubParsersAction) -> None:
    def database(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--database", metavar="PATH",
                            help="the SQLite file (default: DATABASE_PATH, else the lab's .lab/default/sophos.db)")

    delete = commands.add_parser(
        "delete", help="delete a conversation: its runs, checkpoints and writes, in one transaction",
        description="Delete a conversation with its runs, checkpoints, writes and prune records, in one "
                    "transaction. Refused while a live process runs it; a crashed run is recovered first. "
                    + RETENTION_NOTE)
    delete.add_argument("conversation", help="the conversation id")
    delete.add_argument("--dry-run", action="store_true", help="say what would be deleted; change nothing")
    delete.add_argument("--vacuum", action="store_true", help="VACUUM afterwards to shrink the file")
    database(delete)

    prune = commands.add_parser(
        "prune", help="delete a thread's older checkpoints, keeping its messages and its resume",
        description="Delete the older checkpoints of a conversation's thread and their writes. The thread "
                    "keeps its messages exactly and still resumes; its runs are kept, and the history "
                    "view says what was pruned. " + RETENTION_NOTE)
    target = prune.add_mutually_exclusive_group(required=True)
    target.add_argument("conversation", nargs="?", help="the conversation id")
    target.add_argument("--all", action="store_true", help="every conversation (running ones are left out)")
    prune.add_argument("--keep", type=int, metavar="N",
                       help="keep the newest N checkpoints (default: those of the latest run)")
    prune.add_argument("--dry-run", action="store_true", help="say what would be deleted; change nothing")
    prune.add_argument("--vacuum", action="store_true", help="VACUUM afterwards to shrink the file")
    database(prune)

    vacuum = commands.add_parser(
        "vacuum", help="shrink the database file: give deleted rows' space back (SQLite VACUUM)",
        description="VACUUM the database and fold its WAL back into it; print its size before and after. "
                    "Refused while a run is running. " + RETENTION_NOTE)
    database(vacuum)

"""Deleting, pruning and vacuuming, and removing a user, as the service is asked to (the rules
are `retention`'s): only the database's tables, and a deleted user's own MCP servers' files;
the memory server's file of anyone else is never touched. Part of `AgentService` (`service`)."""

from __future__ import annotations

import shutil

from . import errors, retention, users
from .errors import SophosError
from .ownership import Owner
from .retention import Removal, Vacuum
from .tools import user_memory_path


class Housekeeping:
    """`AgentService`'s retention calls."""

    async def delete_conversation(self, conversation: object, dry_run: bool = False) -> Removal:
        """Delete the conversation with its runs, checkpoints, writes and prune records, in one
        transaction; what went (with `dry_run`: what would go, nothing changed).

        Refused with `SESSION_IN_PROGRESS` while a live process runs it. A run whose process is
        gone (a crash) goes with it, so a crashed conversation can be deleted.
        """
        conversation_id = await self._owned(conversation)
        self._check_idle(conversation_id)
        return await retention.delete_conversation(self.store, conversation_id, self._retention_owner(), dry_run)

    async def prune_conversation(self, conversation: object, keep: int | None = None,
                                 dry_run: bool = False) -> Removal:
        """Delete the thread's older checkpoints and their writes, keeping its state exactly.

        Kept: the newest `keep` checkpoints of the thread (default: those of the run that wrote
        the latest one) and their writes; the oldest kept one is given the whole message list,
        so the thread reads, resumes and takes new messages as before. Runs are all kept. Each
        prune is recorded (`prunes`) and shown by the checkpoint-history view. Refused while a
        live process runs the conversation; `dry_run` says what would go and changes nothing.
        """
        conversation_id = await self._owned(conversation)
        keep = retention.parse_keep(keep)
        self._check_idle(conversation_id)
        return await retention.prune_conversation(self.store, conversation_id, keep, self._retention_owner(), dry_run)

    async def vacuum(self) -> Vacuum:
        """Give the space of deleted rows back to the file system (`VACUUM`, then the WAL folded
        back into the file; on PostgreSQL `VACUUM FULL` of the kit's and LangGraph's tables); the
        size before and after. Refused while a run is running."""
        if not self.settings.database_url and not self.store.is_open and not self.settings.database_path.exists():
            raise SophosError(errors.NOT_FOUND, f"No database at {self.settings.database_path}")
        return await retention.vacuum(self.store, self._retention_owner())

    async def delete_user(self, name: str, dry_run: bool = False) -> list[Removal]:
        """Delete a user with every conversation of theirs (runs, checkpoints, writes, gates,
        idempotency keys, prunes: each conversation in one transaction, as `delete_conversation`),
        then the user and the files of their own MCP servers (their memory); what went, a removal per conversation (`dry_run`: what would go,
        nothing changed). Refused, before anything goes, while a run of theirs is live."""
        user = await users.find_user(self.store, name)
        conversations = await users.user_conversations(self.store, user)
        removals = [await self.delete_conversation(c, dry_run=True) for c in conversations]  # refusals first
        if dry_run:
            return removals
        removals = [await self.delete_conversation(c) for c in conversations]
        await users.forget_user(self.store, user)
        await self.tools.stop_user(user.id)
        shutil.rmtree(user_memory_path(self.settings, user.id).parent, ignore_errors=True)
        return removals

    async def conversation_ids(self) -> list[str]:
        """Every conversation id, oldest first (read-only on SQLite; what `prune --all` goes through)."""
        return await retention.conversation_ids(self.store)

    def _retention_owner(self) -> Owner | None:
        """Who judges whether a run's owner is gone: this store (a fresh identity before it is
        open); None under the original's single-owner rule, where every `running` run is live."""
        if self.settings.single_owner:
            return None
        return self.store.owner or Owner.here()

"""The lease this process keeps on its runs: renewed while it has runs, a run taken over by another
process stopped, the runs no task of this process works on any more given up, a run that ran
longer than its steps can take stopped. Part of `AgentService` (`service`)."""

from __future__ import annotations

import asyncio
import logging
import time

from .active import ActiveRun

log = logging.getLogger(__name__)


class Lease:
    """`AgentService`'s lease keeper."""

    def _keep_lease(self) -> None:
        if self.settings.single_owner or (self._lease_keeper is not None and not self._lease_keeper.done()):
            return
        self._lease_keeper = asyncio.create_task(self._renew_lease())

    async def _renew_lease(self) -> None:
        """While this process has runs, renew its lease; a run taken over stops at its next step.
        Each round also gives up this owner's runs that no task works on (`_give_up_strays`) and
        stops a run that has run longer than its steps can take (`overdue_seconds`)."""
        async def renew() -> list[ActiveRun]:
            # Under the lock, so a run is either recorded already or still ours to vouch for.
            runs = [run for run in self.active.values() if not run.recorded]
            lost = await self.store.renew_lease([run.id for run in runs])
            return [run for run in runs if run.id in lost]

        wait = self.store.renewal_in()  # a third of a lease after it was last written
        while self.active or self._strays_possible:
            await asyncio.sleep(wait)
            wait = self.settings.lease_seconds / 3
            try:
                lost = await self._write(renew)
            except Exception:
                log.warning("could not renew the lease of %s", self.store.owner, exc_info=True)
                continue
            wait = self.store.renewal_in()
            for run in lost:
                if not run.lost:
                    run.lost = True
                    run.control.request_drain("ownership lost")
            if self._strays_possible:
                try:
                    await self._write(self._give_up_strays)
                except Exception:
                    log.warning("could not give up the runs no task works on; trying again", exc_info=True)
            self._stop_overdue()

    def _note_stray(self) -> None:
        """A write of a run's life failed: a run may now be ours with no task on it."""
        self._strays_possible = True
        self._keep_lease()

    async def _give_up_strays(self) -> int:
        """Give up the runs `running` under this owner that no task of this process works on: a
        claim or a start whose commit landed but whose answer was lost, a claimed run whose
        start failed, an outcome that could not be written. Re-queued or relabelled as a gone
        owner's are (`store.give_up`), so no conversation stays refused behind a live process.
        Under the lock: a run is in `active` from the write that makes it ours."""
        working = {run.id for run in self.active.values() if run.task is None or not run.task.done()}
        strays = [run_id for run_id in await self.store.owned_runs() if run_id not in working]
        given_up = await self.store.give_up(strays) if strays else 0
        for run_id in strays:
            self._unrecorded.pop(run_id, None)
        self._strays_possible = False
        if given_up:
            log.warning("gave up %d run(s) no task of this process works on: %s", given_up, ", ".join(strays))
        return given_up

    def overdue_seconds(self) -> float:
        """The longest a run can take: its step limit, each step at its time limit for each of
        its attempts (the model's and the tools' alternate), and a lease for the outcome."""
        step = (self.settings.model_timeout_seconds * self.settings.model_attempts
                + self.settings.tool_timeout_seconds * self.settings.tool_attempts) / 2
        return self.settings.recursion_limit * step + self.settings.lease_seconds

    def _stop_overdue(self) -> None:
        now = time.monotonic()
        for run in list(self.active.values()):
            if (run.task is not None and not run.task.done() and not run.overdue
                    and now - run.began > self.overdue_seconds()):
                log.warning("run %s has run longer than it can (%.0f s): stopping it", run.id, self.overdue_seconds())
                run.overdue = True
                run.task.cancel()

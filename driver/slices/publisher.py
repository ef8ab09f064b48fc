"""Publishing one pool's ResourceSlices: build, plan against the server, apply.

Shared by the node plugin (its node's pool) and the controller (DevicePool pools).
The plan is minimal (``drasil.driver.slices.plan``); a conflict means someone else wrote
in between, so we list again and re-plan rather than overwrite.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from drasil.driver.kubeapi import ConflictError, KubeApi
from drasil.driver.objects import JsonDict
from drasil.driver.slices.plan import PublishPlan, plan_publish

log = logging.getLogger(__name__)

MAX_CONFLICT_RETRIES = 5


@dataclass
class PoolPublisher:
    """Makes the server's slices of (driver, pool) equal the desired ones."""

    api: KubeApi
    driver: str
    pool: str
    on_write: Callable[[str, bool], None] | None = None  # (verb, ok), for metrics

    def publish(self, desired: Sequence[JsonDict]) -> PublishPlan:
        """Apply the minimal plan; returns it (``plan.writes == 0``: nothing changed)."""
        for attempt in range(1, MAX_CONFLICT_RETRIES + 1):
            existing = self.api.list_slices(driver=self.driver, pool=self.pool)
            plan = plan_publish(desired=desired, existing=existing)
            try:
                self._apply(plan)
            except ConflictError as err:
                log.info(
                    "slice conflict; planning again",
                    extra={"pool": self.pool, "attempt": attempt, "error": str(err)},
                )
                continue
            if plan.writes:
                log.info(
                    "published ResourceSlices",
                    extra={"pool": self.pool, "generation": plan.generation, "writes": plan.writes},
                )
            return plan
        raise ConflictError(
            f"pool {self.pool}: slices kept changing under us after {MAX_CONFLICT_RETRIES} tries"
        )

    def _apply(self, plan: PublishPlan) -> None:
        # Creates and updates first: the pool is complete at the new generation before
        # the old slices go, so the scheduler never sees it empty.
        for obj in plan.creates:
            self._count("create", partial(self.api.create_slice, obj))
        for obj in plan.updates:
            self._count("update", partial(self.api.replace_slice, obj))
        for d in plan.deletes:
            delete = partial(
                self.api.delete_slice, d.name, uid=d.uid, resource_version=d.resource_version
            )
            self._count("delete", delete)

    def _count(self, verb: str, call: Callable[[], object]) -> None:
        try:
            call()
        except Exception:
            if self.on_write:
                self.on_write(verb, False)
            raise
        if self.on_write:
            self.on_write(verb, True)

"""DevicePools reconciled against the API server: publish, report, clean up.

One reconcile of a DevicePool:

1. decode it and build the desired slices (``devicepools``); a problem becomes
   Ready=False ``InvalidSpec`` and nothing is written;
2. refuse a pool name whose slices another owner controls (a node's plugin
   publishes a pool named after its node): Ready=False ``PoolConflict``;
3. plan against the existing slices; if anything must change, send every create and
   update as a server-side dry run first, so what the API server would reject
   (Ready=False ``Rejected``, its message in words) never half-replaces a good pool;
4. publish through ``PoolPublisher`` (minimal writes, generation semantics);
5. write ``status`` only if it differs.

A DevicePool whose ``spec.driver`` names another driver is not ours: our slices of it
(left from before the change) are deleted, and its status is the other controller's.

Transient API errors propagate; the caller retries. Deleting a DevicePool deletes
its slices here and, should the controller be down, through their ownerReferences.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from drasil.api.devicepool import DevicePool, DevicePoolError
from drasil.api.devicepool import parse_devicepool as parse_pool
from drasil.controller.devicepools import (
    POOL_LABEL,
    PoolStatus,
    desired_slices,
    foreign_owner,
    now_rfc3339,
    pool_driver,
    published_message,
    status_patch,
)
from drasil.controller.metrics import ControllerMetrics
from drasil.driver.devicepools import PoolSpecError
from drasil.driver.kubeapi import ApiError, KubeApi
from drasil.driver.objects import JsonDict, status_of
from drasil.driver.slices.plan import PublishPlan, plan_publish
from drasil.driver.slices.publisher import PoolPublisher

log = logging.getLogger(__name__)

SKIPPED = "skipped"


def api_message(err: ApiError) -> str:
    """The API server's own words for a failed request (its Status.message)."""
    try:
        body = json.loads(err.body or "{}")
    except (TypeError, ValueError):
        body = {}
    message = body.get("message") if isinstance(body, dict) else None
    return str(message or f"{err.status} {err.reason}")


@dataclass(frozen=True)
class Outcome:
    """What a reconcile did (a metrics label) and the status it leads to."""

    result: str
    status: PoolStatus | None


class PoolSync:
    """Reconciles the DevicePools of one driver (thread-safe per pool, not across)."""

    def __init__(self, api: KubeApi, *, driver: str, metrics: ControllerMetrics) -> None:
        self.api = api
        self.driver = driver
        self.metrics = metrics

    # ---- reconcile ----------------------------------------------------------------

    def reconcile(self, obj: Mapping[str, Any], *, attach_failed: Collection[str] = ()) -> str:
        """Make the pool's slices and status match the object; returns the result.

        ``attach_failed``: devices whose simulated attach failed (tainted while the
        fabric still fails them)."""
        name = str((obj.get("metadata") or {}).get("name", ""))
        try:
            pool = parse_pool(obj)
        except DevicePoolError as err:
            outcome = self._invalid(obj, str(err), generation=_generation(obj))
        else:
            if pool_driver(pool, self.driver) != self.driver:
                # Another driver publishes it now; ours go (only ours: the chart's
                # admission policy lets each controller touch its own driver's slices).
                self.remove(name)
                return SKIPPED
            outcome = self._publish(pool, obj, attach_failed)
        if outcome.status is not None:
            self._write_status(name, status_of(obj), outcome.status)
        self.metrics.pool_publishes.labels(outcome.result).inc()
        return outcome.result

    def _invalid(self, obj: Mapping[str, Any], reason: str, *, generation: int | None) -> Outcome:
        kept = list(status_of(obj).get("publishedSlices") or [])
        suffix = "; the previously published slices are kept" if kept else ""
        status = PoolStatus(False, "InvalidSpec", reason + suffix, tuple(kept), generation)
        return Outcome("invalid", status)

    def _publish(
        self, pool: DevicePool, obj: Mapping[str, Any], attach_failed: Collection[str]
    ) -> Outcome:
        generation = _generation(obj)
        try:
            desired = desired_slices(pool, driver=self.driver, attach_failed=attach_failed)
        except PoolSpecError as err:
            return self._invalid(obj, str(err), generation=generation)
        existing = self.api.list_slices(driver=self.driver, pool=pool.name)
        kept = tuple(str(s["metadata"]["name"]) for s in existing)
        foreign = foreign_owner(existing)
        if foreign is not None:
            message = (
                f"pool {pool.name} of driver {self.driver} is published by {foreign}; "
                "give the DevicePool another name"
            )
            return Outcome("conflict", PoolStatus(False, "PoolConflict", message, kept, generation))
        plan = plan_publish(desired=desired, existing=existing)
        rejection = self._dry_run(plan) if not plan.empty else None
        if rejection is None and not plan.empty:
            rejection = self._apply(pool.name, desired)
        if rejection is not None:
            suffix = "; the previously published slices are kept" if kept else ""
            status = PoolStatus(False, "Rejected", rejection + suffix, kept, generation)
            return Outcome("rejected", status)
        names = tuple(str(s["metadata"]["name"]) for s in desired)
        message = published_message(desired, driver=self.driver, pool=pool.name)
        status = PoolStatus(True, "Published", message, names, generation)
        return Outcome("unchanged" if plan.empty else "published", status)

    def _dry_run(self, plan: PublishPlan) -> str | None:
        """What the API server would reject in the plan's writes, in its words."""
        writes = [(obj, True) for obj in plan.creates] + [(obj, False) for obj in plan.updates]
        for obj, create in writes:
            try:
                self.api.dry_run_slice(obj, create=create)
            except ApiError as err:
                if err.status == 422:
                    name = obj["metadata"]["name"]
                    return f"the API server rejects ResourceSlice {name}: {api_message(err)}"
                if err.status not in (404, 409):  # races are the publisher's to resolve
                    raise
        return None

    def _apply(self, pool: str, desired: Sequence[JsonDict]) -> str | None:
        publisher = PoolPublisher(
            api=self.api, driver=self.driver, pool=pool, on_write=self.metrics.slice_write
        )
        try:
            publisher.publish(desired)
        except ApiError as err:
            if err.status == 422:
                return f"the API server rejected a ResourceSlice: {api_message(err)}"
            raise
        return None

    # ---- slices by label ----------------------------------------------------------

    def labelled_slices(self, name: str) -> list[JsonDict]:
        """Every slice of our driver this DevicePool published."""
        return self.api.list_resources(
            "resourceslices",
            label_selector=f"{POOL_LABEL}={name}",
            field_selector=f"spec.driver={self.driver}",
        )

    def remove(self, name: str) -> int:
        """The DevicePool is gone or no longer ours: delete our slices of it now."""
        slices = self.labelled_slices(name)
        for obj in slices:
            self._delete(obj)
        if slices:
            log.info("deleted the slices of a removed DevicePool", extra={"pool": name})
        return len(slices)

    def _delete(self, obj: Mapping[str, Any]) -> None:
        meta = obj["metadata"]
        ok = False
        try:
            self.api.delete_slice(
                meta["name"], uid=meta["uid"], resource_version=meta["resourceVersion"]
            )
            ok = True
        finally:
            self.metrics.slice_write("delete", ok)

    # ---- status -------------------------------------------------------------------

    def _write_status(self, name: str, current: Any, wanted: PoolStatus) -> None:
        patch = status_patch(
            current if isinstance(current, Mapping) else None, wanted, now=now_rfc3339()
        )
        if patch is None:
            return
        if not self.api.patch_devicepool_status(name, patch):
            return  # deleted meanwhile: nothing to report on
        log.info(
            "DevicePool status",
            extra={
                "pool": name,
                "ready": wanted.ready,
                "reason": wanted.reason,
                "text": wanted.message,
            },
        )


def _generation(obj: Mapping[str, Any]) -> int | None:
    value = (obj.get("metadata") or {}).get("generation")
    return value if isinstance(value, int) else None

"""Publishing one pool's ResourceSlices: build, plan against the server, apply.

Shared by the node plugin (its node's pool) and the controller (DevicePool pools).
The plan is minimal (``drasil.driver.slices.plan``); a conflict means someone else wrote
in between, so we list again and re-plan rather than overwrite.

A device field behind a feature gate that is off is dropped by the API server without
an error. Published anyway, the server's slices would never equal the desired ones and
every event would write them again; so a field a write came back without is named in a
warning, with its gate, and left out of this publisher's slices from then on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Final

from drasil.driver.kubeapi import ConflictError, KubeApi
from drasil.driver.objects import JsonDict
from drasil.driver.slices.plan import PublishPlan, plan_publish

log = logging.getLogger(__name__)

MAX_CONFLICT_RETRIES = 5

GATED_DEVICE_FIELDS: Final = {"nodeAllocatableResources": "DRANodeAllocatableResources"}
"""Device fields drasil may publish that the API server drops while their gate is off."""


@dataclass
class PoolPublisher:
    """Makes the server's slices of (driver, pool) equal the desired ones."""

    api: KubeApi
    driver: str
    pool: str
    on_write: Callable[[str, bool], None] | None = None  # (verb, ok), for metrics
    # Gated device fields the server dropped from a write (module docstring).
    dropped: set[str] = field(default_factory=set)

    def publish(self, desired: Sequence[JsonDict]) -> PublishPlan:
        """Apply the minimal plan; returns it (``plan.writes == 0``: nothing changed)."""
        if self.dropped:
            desired = [_without(obj, self.dropped) for obj in desired]
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
            self._check_kept(obj, self._count("create", partial(self.api.create_slice, obj)))
        for obj in plan.updates:
            self._check_kept(obj, self._count("update", partial(self.api.replace_slice, obj)))
        for d in plan.deletes:
            delete = partial(
                self.api.delete_slice, d.name, uid=d.uid, resource_version=d.resource_version
            )
            self._count("delete", delete)

    def _count(self, verb: str, call: Callable[[], object]) -> object:
        try:
            written = call()
        except Exception:
            if self.on_write:
                self.on_write(verb, False)
            raise
        if self.on_write:
            self.on_write(verb, True)
        return written

    def _check_kept(self, sent: Mapping[str, Any], written: object) -> None:
        if not isinstance(written, Mapping):
            return
        for name, gate in GATED_DEVICE_FIELDS.items():
            if name in self.dropped or not _has(sent, name) or _has(written, name):
                continue
            self.dropped.add(name)
            log.warning(
                "the API server dropped a device field of the slices: its feature gate is off; "
                "publishing without it",
                extra={"pool": self.pool, "field": name, "featureGate": gate},
            )


def _devices(obj: Mapping[str, Any]) -> list[Any]:
    devices = (obj.get("spec") or {}).get("devices")
    return devices if isinstance(devices, list) else []


def _has(obj: Mapping[str, Any], name: str) -> bool:
    return any(isinstance(d, Mapping) and name in d for d in _devices(obj))


def _without(obj: JsonDict, names: set[str]) -> JsonDict:
    spec = dict(obj.get("spec") or {})
    if "devices" not in spec:
        return obj  # a slice of shared counters only
    spec["devices"] = [
        {k: v for k, v in d.items() if k not in names} if isinstance(d, Mapping) else d
        for d in _devices(obj)
    ]
    return {**obj, "spec": spec}

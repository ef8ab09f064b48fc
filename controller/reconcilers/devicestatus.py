"""``status.devices`` of claims that hold DevicePool devices, written when it differs.

A claim is looked at when its event arrives and again when marked due: its simulated
attach is due (``attaching``), or its pool was published ready for the first time
(claims allocated before a restart). What an entry says is ``drasil.controller.
devicestatus``'s; when an attach is done, ``drasil.controller.attach``'s.

A device whose attach fails is tainted before the failure is written: the scheduler
reacts to the failure by allocating again, and should find the taint by then
(KEP-5007 asks the provider for this). The failure marks the pool due
(``PoolReconciler.mark_attach_failed``) and the claim due at once; the tick publishes
pools before it looks at claims, so the failure is written one tick later, after the
pool carries the taint (or, should the pool fail to publish, after ``TAINT_WAIT``).
"""

from __future__ import annotations

import logging
import threading
import time

from drasil.api.devicepool import DevicePoolError, SimulatedFabric, parse_devicepool
from drasil.controller.attach import (
    Attach,
    AttachState,
    allocated_at,
    allocated_node,
    has_binding_conditions,
    recorded,
    simulate,
)
from drasil.controller.devicepools import now_rfc3339
from drasil.controller.devicestatus import (
    EntryKey,
    apply_entries,
    desired_entries,
    entry_key,
    needs_apply,
    pool_results,
)
from drasil.controller.metrics import ControllerMetrics
from drasil.controller.options import FIELD_MANAGER
from drasil.controller.reconcilers.due import DueQueue
from drasil.controller.reconcilers.pools import PoolReconciler
from drasil.controller.state import ClusterView, Key, key_of
from drasil.driver.kubeapi import KubeApi
from drasil.driver.objects import JsonObject, ResourceClaim, meta

log = logging.getLogger(__name__)

TAINT_WAIT = 10.0  # seconds a failure waits at most for its device's taint to publish


class DeviceStatusReconciler:
    """Our ``status.devices`` entries, and the simulated attaches behind them."""

    def __init__(
        self,
        *,
        api: KubeApi,
        view: ClusterView,
        pools: PoolReconciler,
        driver: str,
        metrics: ControllerMetrics,
    ) -> None:
        self.api = api
        self.view = view
        self.pools = pools
        self.driver = driver
        self.metrics = metrics
        self.due: DueQueue[Key] = DueQueue()  # claims, on the wall clock (attach times)
        self._lock = threading.Lock()
        # When a claim without allocationTimestamp was first seen, per device; when a
        # failed attach was first held back for its taint.
        self._first_seen: dict[tuple[str, EntryKey], float] = {}
        self._held: dict[tuple[str, EntryKey], float] = {}

    def run_due(self) -> None:
        for pool in self.pools.ready.pop_due(float("inf")):
            for claim in self.view.claims_allocated_from(pool):
                self.update_safely(claim)
        for key in self.due.pop_due(time.time()):
            kept = self.view.claim(key)
            if kept is not None:
                self.update_safely(kept)

    def forget(self, uid: str, key: Key) -> None:
        self.due.forget(key)
        with self._lock:
            for seen in [k for k in self._first_seen if k[0] == uid]:
                del self._first_seen[seen]
            for held in [k for k in self._held if k[0] == uid]:
                del self._held[held]

    def update_safely(self, claim: JsonObject) -> None:
        try:
            self.update(claim)
        except Exception as err:  # the next event of the claim tries again
            self.metrics.device_status_writes.labels("error").inc()
            log.warning(
                "could not write status.devices",
                extra={"claim": "/".join(key_of(claim)), "error": repr(err)},
            )

    def update(self, claim: JsonObject) -> bool:
        """Apply our status.devices entries if they differ; returns whether it wrote."""
        pools = self.view.published_pools()
        attaches = self._attaches(claim, pools)
        if attaches is None:
            return False  # a failure waits for its taint
        entries = desired_entries(
            claim, driver=self.driver, pools=pools, now=now_rfc3339(), attaches=attaches
        )
        if not needs_apply(claim, entries, driver=self.driver, pools=pools):
            return False
        apply_entries(self.api, claim, entries, manager=FIELD_MANAGER)
        self.metrics.device_status_writes.labels("success").inc()
        log.info(
            "wrote status.devices",
            extra={"claim": "/".join(key_of(claim)), "devices": len(entries)},
        )
        return True

    def _attaches(self, claim: JsonObject, pools: set[str]) -> dict[EntryKey, Attach] | None:
        """The attach of each allocated DevicePool device with binding conditions;
        None while a new failure waits for its device's taint to be published."""
        existing = {entry_key(e): e for e in ResourceClaim(claim).devices}
        now, node, uid = time.time(), allocated_node(claim), meta(claim).uid
        attaches: dict[EntryKey, Attach] = {}
        waiting = False
        for result in pool_results(claim, driver=self.driver, pools=pools):
            if not has_binding_conditions(result):
                continue
            key, entry = entry_key(result), existing.get(entry_key(result))
            started = allocated_at(claim) or self._seen(uid, key, now)
            fabric = self._fabric(key[1])
            attach = simulate(result, entry, fabric=fabric, started=started, now=now, node=node)
            if attach.state is AttachState.PENDING:
                self.due.mark(key_of(claim), attach.due)
            elif attach.state is AttachState.FAILED and recorded(result, entry) is None:
                waiting |= self._hold_for_taint(uid, key, now)
            attaches[key] = attach
        if waiting:
            self.due.mark(key_of(claim), now)
            return None
        return attaches

    def _hold_for_taint(self, uid: str, key: EntryKey, now: float) -> bool:
        """Whether the failure of device ``key`` must wait for its taint."""
        pool, device = key[1], key[2]
        if self.pools.taint_published(pool, device):
            return False
        self.pools.mark_attach_failed(pool, device)
        with self._lock:
            since = self._held.setdefault((uid, key), now)
        return now - since < TAINT_WAIT

    def _seen(self, uid: str, key: EntryKey, now: float) -> float:
        with self._lock:
            return self._first_seen.setdefault((uid, key), now)

    def _fabric(self, pool: str) -> SimulatedFabric | None:
        obj = self.view.pool(pool)
        try:
            return parse_devicepool(obj).spec.simulated_fabric if obj else None
        except DevicePoolError:
            return None  # reported on the pool; attach as if it had no fabric settings

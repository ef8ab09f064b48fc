"""The controller's event router and its once-a-second tick.

kopf delivers every event of the watched kinds to the async ``on_*`` methods (see
``operator``). They update the in-memory ``ClusterView`` on the event loop, and hand
what the event means to the reconciler of each concern (``drasil.controller.
reconcilers``), in a worker thread (``asyncio.to_thread``) when it talks to the API
server, so a slow request never stalls the watches. kopf serializes events per object.

The walk of one ResourceClaim:

1. ``on_claim``: the view keeps what it needs of the claim (``state.kept_claim``) and
   indexes it while unallocated; in a thread, its opaque configs are checked
   (``configs``: ``InvalidDeviceConfig`` Events) and its DevicePool devices get their
   ``status.devices`` (``devicestatus``: an attach still pending marks the claim due
   at its time; a failed one marks the pool due for its taint);
2. ``on_pod``: a Pod using the claim is indexed while it waits to be scheduled, and
   hears of the claim's config problems; the Pod watch holds unscheduled Pods only
   (``operator``), so a Pod that gets a node arrives as DELETED and leaves the index;
3. the tick: due pools are published, then due claims' status written, then pending
   claims that are due explained (``explanations``: ``Unsatisfiable`` Events; due
   once a waiting Pod was refused by kube-scheduler, or was queued a long time);
4. deletion: every reconciler forgets the claim.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

from drasil.controller.devicepools import POOL_LABEL
from drasil.controller.events import EventRecorder
from drasil.controller.heap import release_free_memory
from drasil.controller.leader import pause
from drasil.controller.metrics import ControllerMetrics
from drasil.controller.options import ControllerOptions
from drasil.controller.reconcilers.configs import ConfigReconciler
from drasil.controller.reconcilers.devicestatus import DeviceStatusReconciler
from drasil.controller.reconcilers.explanations import ExplanationReconciler
from drasil.controller.reconcilers.pools import PoolReconciler
from drasil.controller.state import ClusterView, key_of
from drasil.driver.kubeapi import KubeApi
from drasil.driver.objects import JsonObject, meta

log = logging.getLogger(__name__)

# Seconds between malloc_trim calls: often enough that a burst of Pods does not leave
# its parsed events' pages behind for long, rarely enough to cost nothing.
TRIM_PERIOD = 10.0

Event = Mapping[str, Any]


class Controller:
    """Everything the leader does; constructed anew each time a replica leads."""

    def __init__(
        self, *, api: KubeApi, options: ControllerOptions, metrics: ControllerMetrics
    ) -> None:
        self.api = api
        self.driver = options.driver_name
        self.view = ClusterView(driver=self.driver)
        self.events = EventRecorder(api, metrics)
        self.pools = PoolReconciler(
            api=api,
            view=self.view,
            driver=self.driver,
            metrics=metrics,
            resync_period=options.resync_period,
        )
        self.configs = ConfigReconciler(view=self.view, events=self.events, driver=self.driver)
        self.device_status = DeviceStatusReconciler(
            api=api, view=self.view, pools=self.pools, driver=self.driver, metrics=metrics
        )
        self.explanations = ExplanationReconciler(
            api=api,
            view=self.view,
            events=self.events,
            driver=self.driver,
            metrics=metrics,
            explain_after=options.explain_after,
            stall_after=options.stall_after,
        )

    # ---- events -----------------------------------------------------------------------

    async def on_pool(self, event: Event, **_: Any) -> None:
        obj = event["object"]
        name = meta(obj).name
        if event.get("type") == "DELETED":
            self.view.drop_pool(obj)
            self.pools.forget(name)
            await asyncio.to_thread(self.pools.remove, name)
            return
        self.view.put_pool(obj)
        if self.pools.changed(name):
            await asyncio.to_thread(self.pools.reconcile, name)

    async def on_claim(self, event: Event, **_: Any) -> None:
        obj = event["object"]
        if event.get("type") == "DELETED":
            self.view.drop_claim(obj)
            self._forget(obj)
            self.device_status.forget(meta(obj).uid, key_of(obj))
            self.explanations.forget(meta(obj).uid)
            return
        self.view.put_claim(obj)
        await asyncio.to_thread(self._claim_changed, obj)

    def _claim_changed(self, claim: JsonObject) -> None:
        self.configs.check(claim)
        self.device_status.update_safely(claim)

    async def on_template(self, event: Event, **_: Any) -> None:
        obj = event["object"]
        if event.get("type") == "DELETED":
            self._forget(obj)
            return
        await asyncio.to_thread(self.configs.check, obj)

    def _forget(self, obj: JsonObject) -> None:
        self.events.memory.forget(meta(obj).uid)
        self.configs.forget(str(obj.get("kind", "")), key_of(obj))

    async def on_pod(self, event: Event, **_: Any) -> None:
        obj = event["object"]
        if event.get("type") == "DELETED":
            self.view.drop_pod(obj)
            self.events.memory.forget(meta(obj).uid)
            return
        pod = self.view.put_pod(obj)
        found = self.configs.problems_of(pod) if pod is not None else []
        if pod is not None and found:
            await asyncio.to_thread(self.configs.warn_pod, pod, found)

    async def on_slice(self, event: Event, **_: Any) -> None:
        obj = event["object"]
        if event.get("type") != "DELETED":
            self.view.put_slice(obj)
            return
        self.view.drop_slice(obj)
        pool = meta(obj).labels.get(POOL_LABEL)
        if isinstance(pool, str) and pool:
            self.pools.slice_deleted(pool)  # someone deleted a slice of ours: repair it

    async def on_class(self, event: Event, **_: Any) -> None:
        obj = event["object"]
        if event.get("type") == "DELETED":
            self.view.drop_class(obj)
        else:
            self.view.put_class(obj)

    async def on_taint_rule(self, event: Event, **_: Any) -> None:
        obj = event["object"]
        if event.get("type") == "DELETED":
            self.view.drop_taint_rule(obj)
        else:
            self.view.put_taint_rule(obj)

    # ---- the tick ---------------------------------------------------------------------

    async def run(self, stop: asyncio.Event, *, period: float = 1.0) -> None:
        """Tick until ``stop``: what each reconciler has due; and now and then give
        back the memory the watch events' objects left free (``heap``)."""
        trimmed = time.monotonic()
        while not stop.is_set():
            try:
                await self.tick(time.monotonic())
            except Exception:
                log.exception("housekeeping failed")
            if time.monotonic() - trimmed >= TRIM_PERIOD:
                release_free_memory()
                trimmed = time.monotonic()
            await pause(stop, period)

    async def tick(self, now: float) -> None:
        # Pools first: a claim whose attach failed waits for its device's taint.
        if self.pools.due.any_due(now):
            await asyncio.to_thread(self.pools.run_due, now)
        if len(self.pools.ready) or self.device_status.due.any_due(time.time()):
            await asyncio.to_thread(self.device_status.run_due)
        due = self.explanations.due(now)
        if due:
            await asyncio.to_thread(self.explanations.explain_round, due, now)

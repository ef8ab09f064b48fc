"""DevicePools: published on every change of ``metadata.generation``, retried with
backoff after an error, re-published every ``--resync-period`` (repairs slices someone
edited) and right after one of their slices is deleted.

Work arrives as marks in ``due`` (pool names): a watch event of a pool or of one of
its slices, a failed attach to taint (``mark_attach_failed``), a retry or resync.
A pool published ready for the first time is marked in ``ready`` for the
status.devices reconciler (claims allocated from it before a restart). Per pool a
lock keeps the event path and the tick apart.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from drasil.controller.metrics import ControllerMetrics
from drasil.controller.poolsync import PoolSync
from drasil.controller.reconcilers.due import DueQueue
from drasil.controller.state import ClusterView
from drasil.driver.kubeapi import KubeApi
from drasil.driver.objects import meta

log = logging.getLogger(__name__)

RETRY_DELAYS = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
READY_RESULTS = frozenset({"published", "unchanged"})


@dataclass
class PoolProgress:
    """Per DevicePool: what was published last, and how publishing goes."""

    done: tuple[str, int] | None = None  # (uid, generation) last reconciled
    failures: int = 0
    ready: bool = False


class PoolReconciler:
    """Publishes the driver's DevicePools (their objects read from the ClusterView)."""

    def __init__(
        self,
        *,
        api: KubeApi,
        view: ClusterView,
        driver: str,
        metrics: ControllerMetrics,
        resync_period: float,
    ) -> None:
        self.view = view
        self.metrics = metrics
        self.resync_period = resync_period
        self.sync = PoolSync(api, driver=driver, metrics=metrics)
        self.due: DueQueue[str] = DueQueue()
        self.ready: DueQueue[str] = DueQueue()  # read by the status.devices reconciler
        self._lock = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}
        self._progress: dict[str, PoolProgress] = {}
        # Devices whose simulated attach failed, per pool: tainted in its slices (lost
        # on restart, when a failing device may be tried once more), and those whose
        # taint a publish has carried since.
        self._attach_failed: dict[str, set[str]] = {}
        self._tainted: dict[str, set[str]] = {}

    # ---- marks (any thread) ---------------------------------------------------------

    def changed(self, name: str) -> bool:
        """Whether the pool's object differs from what was last reconciled."""
        obj = self.view.pool(name)
        with self._lock:
            progress = self._progress.get(name)
        done = progress.done if progress else None
        return obj is not None and done != (meta(obj).uid, meta(obj).generation)

    def slice_deleted(self, name: str) -> None:
        """Someone deleted a slice of the pool: repair it at the next tick."""
        with self._lock:
            known = name in self._progress
        if known:
            self.due.mark(name, time.monotonic())

    def mark_attach_failed(self, pool: str, device: str) -> None:
        """Taint ``device`` in its pool's slices: re-published at the next tick."""
        with self._lock:
            failed = self._attach_failed.setdefault(pool, set())
            if device in failed:
                return
            failed.add(device)
        log.info("simulated attach failed", extra={"pool": pool, "device": device})
        self.due.mark(pool, time.monotonic())

    def taint_published(self, pool: str, device: str) -> bool:
        """Whether a publish since ``mark_attach_failed`` carried the device's taint."""
        with self._lock:
            return device in self._tainted.get(pool, ())

    def forget(self, name: str) -> None:
        with self._lock:
            self._progress.pop(name, None)
        self.due.forget(name)

    # ---- work -----------------------------------------------------------------------

    def run_due(self, now: float) -> None:
        for name in self.due.pop_due(now):
            self.reconcile(name)

    def remove(self, name: str) -> None:
        """The DevicePool was deleted: delete its slices (unless it is back)."""
        with self._pool_lock(name):
            if self.view.pool(name) is None:
                self.sync.remove(name)

    def reconcile(self, name: str) -> None:
        """Reconcile one DevicePool now; on an error, plan a retry with backoff."""
        with self._pool_lock(name):
            obj = self.view.pool(name)
            if obj is None:
                return
            with self._lock:
                progress = self._progress.setdefault(name, PoolProgress())
                failed = set(self._attach_failed.get(name, ()))
            try:
                result = self.sync.reconcile(obj, attach_failed=failed)
            except Exception:
                self._retry(name, progress)
                return
            first = progress.done is None
            progress.done = (meta(obj).uid, meta(obj).generation)
            progress.failures = 0
            progress.ready = result in READY_RESULTS
            with self._lock:
                self._tainted[name] = failed
                ready = sum(p.ready for p in self._progress.values())
        self.due.mark(name, time.monotonic() + self.resync_period)
        self.metrics.pools_ready.set(ready)
        if first and progress.ready:
            self.ready.mark(name, 0.0)

    def _retry(self, name: str, progress: PoolProgress) -> None:
        delay = RETRY_DELAYS[min(progress.failures, len(RETRY_DELAYS) - 1)]
        progress.failures += 1
        self.due.mark(name, time.monotonic() + delay)
        self.metrics.pool_publishes.labels("error").inc()
        log.exception("publishing a DevicePool failed", extra={"pool": name, "retry": delay})

    def _pool_lock(self, name: str) -> threading.Lock:
        with self._lock:
            return self._locks.setdefault(name, threading.Lock())

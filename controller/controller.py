"""The controller's reactions to watch events, and its once-a-second housekeeping.

kopf delivers every event of the watched kinds to the async ``on_*`` methods (see
``operator``). They update the in-memory ``ClusterView`` on the event loop and hand
anything that talks to the API server to a worker thread (``asyncio.to_thread``),
so a slow request never stalls the watches. kopf serializes events per object; per
DevicePool a lock also keeps the event path and the periodic resync apart.

- DevicePools: published on every change of ``metadata.generation``, retried with
  backoff after an error, re-published every ``--resync-period`` (repairs slices
  someone edited) and right after one of their slices is deleted.
- ResourceClaims and ResourceClaimTemplates: opaque configs checked on every event;
  each distinct problem is one ``InvalidDeviceConfig`` Event on the object and on the
  Pods using it. Allocated claims get our ``status.devices`` entries for DevicePool
  devices.
- Pods: reduced to the claims they use; a new Pod of a broken claim hears about it.
- Pending claims: every second ``PendingClaims`` says which to explain; each is
  re-read from the API server (the cache may be a moment old), explained against the
  cached slices, claims, classes and DeviceTaintRules, and an ``Unsatisfiable`` Event
  goes to the claim and its waiting Pods when the text is new.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from drasil.controller.devicepools import POOL_LABEL, now_rfc3339
from drasil.controller.devicestatus import apply_entries, desired_entries, needs_apply
from drasil.controller.events import (
    EXPLANATION_INCOMPLETE,
    INVALID_DEVICE_CONFIG,
    UNSATISFIABLE,
    EventRecorder,
    ObjectRef,
)
from drasil.controller.leader import pause
from drasil.controller.metrics import ControllerMetrics
from drasil.controller.options import FIELD_MANAGER, ControllerOptions
from drasil.controller.pending import PendingClaims
from drasil.controller.poolsync import PoolSync
from drasil.controller.state import ClusterView, Key, key_of
from drasil.driver.cel.selectors import CelDeviceCache
from drasil.driver.claims.configcheck import config_problems
from drasil.driver.explain.claims import explain_claim
from drasil.driver.kubeapi import KubeApi

log = logging.getLogger(__name__)

JsonObject = Mapping[str, Any]
RETRY_DELAYS = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
READY_RESULTS = frozenset({"published", "unchanged"})
MIN_RECHECK = 30.0
NODES_MAX_AGE = 10.0  # Node labels and taints change rarely; explanations are slow anyway


def _meta(obj: JsonObject) -> JsonObject:
    meta = obj.get("metadata")
    return meta if isinstance(meta, Mapping) else {}


def _uid(obj: JsonObject) -> str:
    return str(_meta(obj).get("uid", ""))


@dataclass
class PoolProgress:
    """Per DevicePool: what was published last and when to look again."""

    done: tuple[str, int] | None = None  # (uid, generation) last reconciled
    due: float = 0.0  # monotonic time of the next reconcile; 0: none planned
    failures: int = 0
    ready: bool = False


class Controller:
    """Everything the leader does; constructed anew each time a replica leads."""

    def __init__(
        self, *, api: KubeApi, options: ControllerOptions, metrics: ControllerMetrics
    ) -> None:
        self.api = api
        self.options = options
        self.driver = options.driver_name
        self.metrics = metrics
        self.view = ClusterView(driver=self.driver)
        self.events = EventRecorder(api, metrics)
        self.pools = PoolSync(api, driver=self.driver, metrics=metrics)
        self.pending = PendingClaims(
            explain_after=options.explain_after, recheck=max(options.explain_after, MIN_RECHECK)
        )
        self.cel_cache = CelDeviceCache()
        self._invalid: dict[tuple[str, str, str], list[str]] = {}
        self._lock = threading.Lock()
        self._pool_locks: dict[str, threading.Lock] = {}
        self._progress: dict[str, PoolProgress] = {}
        # (read at, Nodes): one list serves every explanation for a few seconds, so many
        # pending claims do not mean as many lists of every Node. Never longer than the
        # explanation delay: a Node made before a Pod is then always in the list.
        self._nodes: tuple[float, Sequence[JsonObject] | None] = (float("-inf"), None)
        self._nodes_max_age = min(NODES_MAX_AGE, options.explain_after)

    # ---- DevicePools ----------------------------------------------------------------

    async def on_pool(self, event: Mapping[str, Any], **_: Any) -> None:
        obj = event["object"]
        name = str(_meta(obj).get("name", ""))
        if event.get("type") == "DELETED":
            self.view.drop_pool(obj)
            self._progress.pop(name, None)
            await asyncio.to_thread(self._remove_pool, name)
            return
        self.view.put_pool(obj)
        progress = self._progress.setdefault(name, PoolProgress())
        if progress.done != (_uid(obj), _meta(obj).get("generation")):
            await asyncio.to_thread(self.sync_pool, name)

    def _remove_pool(self, name: str) -> None:
        with self._pool_lock(name):
            if self.view.pool(name) is None:  # not re-created meanwhile
                self.pools.remove(name)

    def _pool_lock(self, name: str) -> threading.Lock:
        with self._lock:
            return self._pool_locks.setdefault(name, threading.Lock())

    def sync_pool(self, name: str) -> None:
        """Reconcile one DevicePool now; on an error, plan a retry with backoff."""
        with self._pool_lock(name):
            obj = self.view.pool(name)
            if obj is None:
                return
            progress = self._progress.setdefault(name, PoolProgress())
            try:
                result = self.pools.reconcile(obj)
            except Exception:
                delay = RETRY_DELAYS[min(progress.failures, len(RETRY_DELAYS) - 1)]
                progress.failures += 1
                progress.due = time.monotonic() + delay
                self.metrics.pool_publishes.labels("error").inc()
                log.exception(
                    "publishing a DevicePool failed", extra={"pool": name, "retry": delay}
                )
                return
            first = progress.done is None
            progress.done = (_uid(obj), int(_meta(obj).get("generation") or 0))
            progress.failures = 0
            progress.due = time.monotonic() + self.options.resync_period
            progress.ready = result in READY_RESULTS
        self.metrics.pools_ready.set(sum(p.ready for p in list(self._progress.values())))
        if first and progress.ready:
            self._refresh_device_status(name)

    def _refresh_device_status(self, pool: str) -> None:
        """Claims allocated from a pool seen for the first time (e.g. after a restart)."""
        for claim in self.view.claims_allocated_from(pool):
            self._update_device_status_safely(claim)

    def due_pools(self, now: float) -> list[str]:
        # A copy: worker threads add entries while the event loop looks.
        return [n for n, p in list(self._progress.items()) if p.due and p.due <= now]

    # ---- claims, templates, pods ----------------------------------------------------

    async def on_claim(self, event: Mapping[str, Any], **_: Any) -> None:
        obj = event["object"]
        if event.get("type") == "DELETED":
            self.view.drop_claim(obj)
            self._forget(obj)
            return
        self.view.put_claim(obj)
        await asyncio.to_thread(self._check_claim, obj)

    async def on_template(self, event: Mapping[str, Any], **_: Any) -> None:
        obj = event["object"]
        if event.get("type") == "DELETED":
            self._forget(obj)
            return
        await asyncio.to_thread(self.check_configs, obj)

    def _forget(self, obj: JsonObject) -> None:
        uid = _uid(obj)
        self.events.memory.forget(uid)
        self.pending.forget(uid)
        namespace, name = key_of(obj)
        with self._lock:
            self._invalid.pop((str(obj.get("kind", "")), namespace, name), None)

    def _check_claim(self, claim: JsonObject) -> None:
        self.check_configs(claim)
        self._update_device_status_safely(claim)

    def _update_device_status_safely(self, claim: JsonObject) -> None:
        try:
            self.update_device_status(claim)
        except Exception as err:  # the next event of the claim tries again
            self.metrics.device_status_writes.labels("error").inc()
            log.warning(
                "could not write status.devices",
                extra={"claim": "/".join(key_of(claim)), "error": repr(err)},
            )

    def check_configs(self, obj: JsonObject) -> list[str]:
        """Check the object's opaque configs; Event each new problem on it and its Pods."""
        kind = str(obj.get("kind", ""))
        key = key_of(obj)
        problems = config_problems(obj, driver=self.driver)
        with self._lock:
            if problems:
                self._invalid[(kind, *key)] = problems
            else:
                self._invalid.pop((kind, *key), None)
        ref = ObjectRef.of(obj)
        self.events.memory.keep_only(ref.uid, INVALID_DEVICE_CONFIG, problems)
        for problem in problems:
            self.events.warn(ref, reason=INVALID_DEVICE_CONFIG, message=problem)
        for pod in self.view.pods_using(kind, key):
            if kind == "ResourceClaimTemplate" or key[1] in pod.direct:
                self._warn_pod(pod.ref(), kind=kind, name=key[1], problems=problems)
        return problems

    def _warn_pod(self, pod: ObjectRef, *, kind: str, name: str, problems: list[str]) -> None:
        for problem in problems:
            self.events.warn(pod, reason=INVALID_DEVICE_CONFIG, message=f"{kind} {name}: {problem}")

    async def on_pod(self, event: Mapping[str, Any], **_: Any) -> None:
        obj = event["object"]
        if event.get("type") == "DELETED":
            self.view.drop_pod(obj)
            self.events.memory.forget(_uid(obj))
            return
        ref = self.view.put_pod(obj)
        if ref is None:
            return
        uses = [("ResourceClaim", n) for n in ref.direct]
        uses += [("ResourceClaimTemplate", n) for n in ref.templates]
        for kind, name, problems in self._problems_of(ref.namespace, uses):
            await asyncio.to_thread(
                self._warn_pod, ref.ref(), kind=kind, name=name, problems=problems
            )

    def _problems_of(
        self, namespace: str, uses: list[tuple[str, str]]
    ) -> list[tuple[str, str, list[str]]]:
        with self._lock:
            found = [
                (kind, name, self._invalid.get((kind, namespace, name))) for kind, name in uses
            ]
        return [(kind, name, problems) for kind, name, problems in found if problems]

    # ---- status.devices -------------------------------------------------------------

    def update_device_status(self, claim: JsonObject) -> bool:
        """Apply our status.devices entries if they differ; returns whether it wrote."""
        pools = self.view.published_pools()
        entries = desired_entries(claim, driver=self.driver, pools=pools, now=now_rfc3339())
        if not needs_apply(claim, entries, driver=self.driver, pools=pools):
            return False
        apply_entries(self.api, claim, entries, manager=FIELD_MANAGER)
        self.metrics.device_status_writes.labels("success").inc()
        log.info(
            "wrote status.devices",
            extra={"claim": "/".join(key_of(claim)), "devices": len(entries)},
        )
        return True

    # ---- slices and classes ---------------------------------------------------------

    async def on_slice(self, event: Mapping[str, Any], **_: Any) -> None:
        obj = event["object"]
        if event.get("type") != "DELETED":
            self.view.put_slice(obj)
            return
        self.view.drop_slice(obj)
        pool = (_meta(obj).get("labels") or {}).get(POOL_LABEL)
        progress = self._progress.get(str(pool)) if pool else None
        if progress is not None:
            progress.due = time.monotonic()  # someone deleted a slice of ours: repair it

    async def on_class(self, event: Mapping[str, Any], **_: Any) -> None:
        obj = event["object"]
        if event.get("type") == "DELETED":
            self.view.drop_class(obj)
        else:
            self.view.put_class(obj)

    async def on_taint_rule(self, event: Mapping[str, Any], **_: Any) -> None:
        obj = event["object"]
        if event.get("type") == "DELETED":
            self.view.drop_taint_rule(obj)
        else:
            self.view.put_taint_rule(obj)

    # ---- housekeeping ---------------------------------------------------------------

    async def run(self, stop: asyncio.Event, *, period: float = 1.0) -> None:
        """Tick until ``stop``: pool retries and resyncs, pending-claim explanations."""
        while not stop.is_set():
            try:
                await self.tick(time.monotonic())
            except Exception:
                log.exception("housekeeping failed")
            await pause(stop, period)

    async def tick(self, now: float) -> None:
        for name in self.due_pools(now):
            await asyncio.to_thread(self.sync_pool, name)
        waiting: dict[str, Key] = {}
        for claim in self.view.unallocated_claims():
            key = key_of(claim)
            if any(p.waiting for p in self.view.pods_using("ResourceClaim", key)):
                waiting[_uid(claim)] = key
        for uid in self.pending.update(waiting, now=now):
            try:
                await asyncio.to_thread(self.explain, waiting[uid])
            except Exception:  # tried again at the next recheck, not every second
                log.exception("explaining a claim failed", extra={"claim": "/".join(waiting[uid])})
            self.pending.explained(uid, now=now)

    def nodes(self, *, now: float) -> Sequence[JsonObject] | None:
        """Every Node, a few seconds old at most (None: not allowed to list them)."""
        read_at, nodes = self._nodes
        if now - read_at >= self._nodes_max_age:
            nodes = self.api.list_nodes()
            self._nodes = (now, nodes)
        return nodes

    def explain(self, key: Key) -> str | None:
        """Explain one pending claim and post the result; returns the message posted."""
        claim = self.api.get_claim(*key)
        if claim is None or (claim.get("status") or {}).get("allocation"):
            return None
        snapshot = self.view.explain_snapshot()
        # Read fresh, like the claim: the Pods' node constraints and the Nodes decide
        # which free devices can serve the claim at all.
        waiting = [p for p in self.view.pods_using("ResourceClaim", key) if p.waiting]
        pods = [obj for p in waiting if (obj := self.api.get_pod(p.namespace, p.name))]
        nodes = self.nodes(now=time.monotonic())
        started = time.perf_counter()
        explanation = explain_claim(
            claim,
            slices=snapshot.slices,
            claims=snapshot.claims,
            classes=snapshot.classes,
            taint_rules=snapshot.taint_rules,
            driver=self.driver,
            cache=self.cel_cache,
            nodes=nodes,
            pods=pods,
        )
        self.metrics.explain_duration.observe(time.perf_counter() - started)
        ref = ObjectRef.of(claim)
        if explanation.cut_short and not explanation.unsatisfiable:
            message = explanation.summary()
            self.events.memory.keep_only(ref.uid, EXPLANATION_INCOMPLETE, [message])
            self.events.warn(ref, reason=EXPLANATION_INCOMPLETE, message=message)
            return message
        if not explanation.unsatisfiable:
            log.debug("pending claim looks satisfiable", extra={"claim": explanation.claim})
            return None
        message = explanation.message()
        self.events.memory.keep_only(ref.uid, UNSATISFIABLE, [message])
        self.events.warn(ref, reason=UNSATISFIABLE, message=message)
        on_pod = f"ResourceClaim {key[1]}: {message}"
        for pod in self.view.pods_using("ResourceClaim", key):
            if pod.waiting:
                self.events.warn(pod.ref(), reason=UNSATISFIABLE, message=on_pod)
        return message

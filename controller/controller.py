"""The controller's reactions to watch events, and its once-a-second housekeeping.

kopf delivers every event of the watched kinds to the async ``on_*`` methods (see
``operator``). They update the in-memory ``ClusterView`` on the event loop and hand
anything that talks to the API server to a worker thread (``asyncio.to_thread``),
so a slow request never stalls the watches. kopf serializes events per object; per
DevicePool a lock also keeps the event path and the periodic resync apart.

- DevicePools: published on every change of ``metadata.generation``, retried with
  backoff after an error, re-published every ``--resync-period`` (repairs slices
  someone edited) and right after one of their slices is deleted.
- ResourceClaims and ResourceClaimTemplates: opaque configs checked on every event
  (decoded, and a strategy drasil would not apply refused: ``MPS`` for a MIG device,
  or for a GPU while the cluster publishes no consumable GPU); each distinct problem
  is one ``InvalidDeviceConfig`` Event on the object and on the Pods using it.
  Allocated claims get our ``status.devices`` entries for DevicePool
  devices; a device with binding conditions is attached first (``attach``, simulated):
  the claim is looked at again when its attach is due, a failed device is tainted
  before the failure is reported, so the scheduler picks another one.
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
from drasil.controller.devicepools import POOL_LABEL, now_rfc3339
from drasil.controller.devicestatus import (
    EntryKey,
    apply_entries,
    desired_entries,
    entry_key,
    needs_apply,
    pool_results,
)
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
from drasil.driver.explain.claims import ExplainContext, explain_claim, prepare_fleet
from drasil.driver.kubeapi import KubeApi
from drasil.driver.objects import JsonObject, ResourceClaim, meta

log = logging.getLogger(__name__)

RETRY_DELAYS = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
READY_RESULTS = frozenset({"published", "unchanged"})
MIN_RECHECK = 30.0
NODES_MAX_AGE = 10.0  # Node labels and taints change rarely; explanations are slow anyway
# A round of explanations shares one view of the fleet's devices and their holders for
# at most this long; an explanation is a snapshot anyway, re-checked every MIN_RECHECK.
FLEET_MAX_AGE = 5.0


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
        # Simulated attaches (under _lock): devices whose attach failed, per pool (they
        # are tainted; lost on restart, when a failing device may be tried once more),
        # when a claim without allocationTimestamp was first seen, and when to look at
        # a claim again because an attach of it is due.
        self._attach_failed: dict[str, set[str]] = {}
        self._first_seen: dict[tuple[str, EntryKey], float] = {}
        self._attach_due: dict[Key, float] = {}

    # ---- DevicePools ----------------------------------------------------------------

    async def on_pool(self, event: Mapping[str, Any], **_: Any) -> None:
        obj = event["object"]
        name = meta(obj).name
        if event.get("type") == "DELETED":
            self.view.drop_pool(obj)
            self._progress.pop(name, None)
            await asyncio.to_thread(self._remove_pool, name)
            return
        self.view.put_pool(obj)
        progress = self._progress.setdefault(name, PoolProgress())
        if progress.done != (meta(obj).uid, meta(obj).generation):
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
                result = self.pools.reconcile(obj, attach_failed=self._failed_in(name))
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
            progress.done = (meta(obj).uid, meta(obj).generation)
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
        uid = meta(obj).uid
        self.events.memory.forget(uid)
        self.pending.forget(uid)
        namespace, name = key_of(obj)
        with self._lock:
            self._invalid.pop((str(obj.get("kind", "")), namespace, name), None)
            self._attach_due.pop((namespace, name), None)
            for seen in [k for k in self._first_seen if k[0] == uid]:
                del self._first_seen[seen]

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
        # MPS in a GpuConfig is applied to shares of consumable GPUs only: with none in
        # the cluster, such a config is refused now rather than at prepare.
        shared = self.view.may_share_gpus()
        problems = config_problems(obj, driver=self.driver, shared_gpus=shared)
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
            self.events.memory.forget(meta(obj).uid)
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
        attaches = self._attaches(claim, pools)
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

    # ---- binding conditions: the simulated fabric ------------------------------------

    def _attaches(self, claim: JsonObject, pools: set[str]) -> dict[EntryKey, Attach]:
        """The attach of each allocated DevicePool device with binding conditions.

        A device whose attach fails is tainted (its pool re-published) before the
        failure is written: the scheduler reacts to the failure by allocating again,
        and should find the taint by then (KEP-5007 asks the provider for this).
        """
        existing = {entry_key(e): e for e in ResourceClaim(claim).devices}
        now, node = time.time(), allocated_node(claim)
        attaches: dict[EntryKey, Attach] = {}
        for result in pool_results(claim, driver=self.driver, pools=pools):
            if not has_binding_conditions(result):
                continue
            key, entry = entry_key(result), existing.get(entry_key(result))
            started = allocated_at(claim) or self._seen(meta(claim).uid, key, now)
            attach = simulate(
                result, entry, fabric=self._fabric(key[1]), started=started, now=now, node=node
            )
            if attach.state is AttachState.PENDING:
                self._due(key_of(claim), attach.due)
            elif attach.state is AttachState.FAILED and recorded(result, entry) is None:
                self._taint_failed(key[1], key[2])
            attaches[key] = attach
        return attaches

    def _seen(self, uid: str, key: EntryKey, now: float) -> float:
        with self._lock:
            return self._first_seen.setdefault((uid, key), now)

    def _due(self, claim: Key, due: float) -> None:
        with self._lock:
            self._attach_due[claim] = min(due, self._attach_due.get(claim, due))

    def _fabric(self, pool: str) -> SimulatedFabric | None:
        obj = self.view.pool(pool)
        try:
            return parse_devicepool(obj).spec.simulated_fabric if obj else None
        except DevicePoolError:
            return None  # reported on the pool; attach as if it had no fabric settings

    def _failed_in(self, pool: str) -> set[str]:
        with self._lock:
            return set(self._attach_failed.get(pool, ()))

    def _taint_failed(self, pool: str, device: str) -> None:
        with self._lock:
            known = device in self._attach_failed.setdefault(pool, set())
            self._attach_failed[pool].add(device)
        if not known:
            log.info("simulated attach failed", extra={"pool": pool, "device": device})
            self.sync_pool(pool)

    def due_attaches(self, now: float) -> list[Key]:
        """Claims with an attach due by ``now`` (each handed out once)."""
        with self._lock:
            due = [key for key, at in self._attach_due.items() if at <= now]
            for key in due:
                del self._attach_due[key]
        return due

    def _recheck(self, key: Key) -> None:
        claim = self.view.claim(key)
        if claim is not None:
            self._update_device_status_safely(claim)

    # ---- slices and classes ---------------------------------------------------------

    async def on_slice(self, event: Mapping[str, Any], **_: Any) -> None:
        obj = event["object"]
        if event.get("type") != "DELETED":
            self.view.put_slice(obj)
            return
        self.view.drop_slice(obj)
        pool = meta(obj).labels.get(POOL_LABEL)
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
        for key in self.due_attaches(time.time()):
            await asyncio.to_thread(self._recheck, key)
        waiting: dict[str, Key] = {}
        for claim in self.view.unallocated_claims():
            key = key_of(claim)
            if any(p.waiting for p in self.view.pods_using("ResourceClaim", key)):
                waiting[meta(claim).uid] = key
        fleet: tuple[float, ExplainContext] | None = None
        for uid in self.pending.update(waiting, now=now):
            try:
                fleet = await asyncio.to_thread(self._fresh_fleet, fleet)
                await asyncio.to_thread(self.explain, waiting[uid], fleet=fleet[1])
            except Exception:  # tried again at the next recheck, not every second
                log.exception("explaining a claim failed", extra={"claim": "/".join(waiting[uid])})
            self.pending.explained(uid, now=now)

    def _fresh_fleet(
        self, fleet: tuple[float, ExplainContext] | None
    ) -> tuple[float, ExplainContext]:
        """The fleet (devices and their holders) for a round of explanations: built
        once for all claims due in this tick, not once per claim, so a burst of
        pending claims costs one pass over the fleet plus a little per claim; built
        again when a long round has made it older than FLEET_MAX_AGE."""
        now = time.monotonic()
        if fleet is not None and now - fleet[0] < FLEET_MAX_AGE:
            return fleet
        snapshot = self.view.explain_snapshot()
        built = prepare_fleet(
            slices=snapshot.slices, claims=snapshot.claims, driver=self.driver, cache=self.cel_cache
        )
        return now, built

    def nodes(self, *, now: float) -> Sequence[JsonObject] | None:
        """Every Node, a few seconds old at most (None: not allowed to list them)."""
        read_at, nodes = self._nodes
        if now - read_at >= self._nodes_max_age:
            nodes = self.api.list_nodes()
            self._nodes = (now, nodes)
        return nodes

    def explain(self, key: Key, *, fleet: ExplainContext | None = None) -> str | None:
        """Explain one pending claim and post the result; returns the message posted.
        ``fleet``: ``prepare_fleet`` of the current view, shared by a round of claims."""
        claim = self.api.get_claim(*key)
        if claim is None or ResourceClaim(claim).allocated:
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
            fleet=fleet,
        )
        self.metrics.explain_duration.observe(time.perf_counter() - started)
        ref = ObjectRef.of(claim)
        if explanation.cut_short and not explanation.unsatisfiable:
            message = explanation.summary()
            if self._deferred(ref, EXPLANATION_INCOMPLETE, message):
                return None
            self.events.memory.keep_only(ref.uid, EXPLANATION_INCOMPLETE, [message])
            self.events.warn(ref, reason=EXPLANATION_INCOMPLETE, message=message)
            return message
        if not explanation.unsatisfiable:
            log.debug("pending claim looks satisfiable", extra={"claim": explanation.claim})
            return None
        message = explanation.message()
        if self._deferred(ref, UNSATISFIABLE, message):
            return None
        self.events.memory.keep_only(ref.uid, UNSATISFIABLE, [message])
        self.events.warn(ref, reason=UNSATISFIABLE, message=message)
        on_pod = f"ResourceClaim {key[1]}: {message}"
        for pod in self.view.pods_using("ResourceClaim", key):
            if pod.waiting:
                self.events.warn(pod.ref(), reason=UNSATISFIABLE, message=on_pod)
        return message

    def _deferred(self, ref: ObjectRef, reason: str, message: str) -> bool:
        """A changed explanation waits for the next re-check when the repost budget is
        spent (events.RepostBudget); its Pods' Events follow the claim's."""
        if self.events.budget_allows(ref, reason=reason, message=message):
            return False
        self.metrics.events_deferred.labels(reason).inc()
        return True

"""Why a pending claim cannot be allocated, as ``Unsatisfiable`` Events.

Every tick ``PendingClaims`` says which claims to explain: unallocated, with a Pod
waiting, for ``--explain-after`` once kube-scheduler has answered one of the Pods (for
``--stall-after`` while they are only queued), then again every ``MIN_RECHECK``. Only
unallocated claims are walked (the ClusterView indexes them), not every claim. Each
due claim is re-read from the API server (the cache may be a moment old), explained
against the cached slices, claims, classes and DeviceTaintRules, and an
``Unsatisfiable`` Event goes to the claim and its waiting Pods when the text is new.
A claim that the explanations find satisfiable for ``--stall-after`` seconds gets one
``SchedulerNotRetried`` Event instead (``controller/stalls.py``): the wait is not capacity.
Waiting Pods of a PodGroup are named with their group; a satisfiable claim whose Pods
belong to a gang with fewer members than its minCount gets a ``GangIncomplete`` Event
(``drasil.driver.explain.groups``): the wait is the gang's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from datetime import UTC, datetime

from drasil.controller.events import (
    EXPLANATION_INCOMPLETE,
    GANG_INCOMPLETE,
    SCHEDULER_NOT_RETRIED,
    UNSATISFIABLE,
    EventRecorder,
    ObjectRef,
)
from drasil.controller.metrics import ControllerMetrics
from drasil.controller.pending import PendingClaims
from drasil.controller.stalls import STALL_AFTER, Episode, SchedulerStalls
from drasil.controller.state import ClusterView, Key
from drasil.driver.cel.selectors import CelDeviceCache
from drasil.driver.explain.claims import ExplainContext, explain_claim, prepare_fleet
from drasil.driver.explain.groups import (
    GroupWait,
    gang_message,
    group_waits,
    pod_groups,
    with_groups,
)
from drasil.driver.explain.inventory import usage_of
from drasil.driver.kubeapi import KubeApi
from drasil.driver.objects import JsonDict, JsonObject, Pod, ResourceClaim, mapping, meta

log = logging.getLogger(__name__)

MIN_RECHECK = 30.0
NODES_MAX_AGE = 10.0  # Node labels and taints change rarely; explanations are slow anyway
# A round of explanations shares one view of the fleet's devices and their holders for
# at most this long; an explanation is a snapshot anyway, re-checked every MIN_RECHECK.
FLEET_MAX_AGE = 5.0


def _member_of(obj: JsonObject, key: Key) -> bool:
    pod = Pod(obj)
    alive = not pod.meta.deletion_timestamp
    return alive and (pod.meta.namespace, pod.pod_group) == key


def node_fit(node: JsonObject) -> JsonDict:
    """What explanations read of a Node (``drasil.driver.explain.nodefit``): its name,
    labels, taints and whether it is cordoned. The rest (status, managedFields) is
    most of a parsed Node, and the list stays between rounds: one Node's worth per
    node of the fleet, kept for nothing."""
    m = meta(node)
    spec = mapping(node.get("spec"))
    kept_spec = {k: spec[k] for k in ("taints", "unschedulable") if k in spec}
    return {"metadata": {"name": m.name, "labels": m.labels}, "spec": kept_spec}


class ExplanationReconciler:
    """Pending claims explained, each Event posted once per new text."""

    def __init__(
        self,
        *,
        api: KubeApi,
        view: ClusterView,
        events: EventRecorder,
        driver: str,
        metrics: ControllerMetrics,
        explain_after: float,
        stall_after: float = STALL_AFTER,
    ) -> None:
        self.api = api
        self.view = view
        self.events = events
        self.driver = driver
        self.metrics = metrics
        self.pending = PendingClaims(
            explain_after=explain_after,
            recheck=max(explain_after, MIN_RECHECK),
            queued_after=stall_after,
        )
        self.stalls = SchedulerStalls(stall_after)
        self._last_tick = 0.0  # the tick's clock, also for claims forgotten between ticks
        self.cel_cache = CelDeviceCache()
        # (read at, Nodes): one list serves every explanation for a few seconds, so many
        # pending claims do not mean as many lists of every Node. Never longer than the
        # explanation delay: a Node made before a Pod is then always in the list.
        self._nodes: tuple[float, Sequence[JsonObject] | None] = (float("-inf"), None)
        self._nodes_max_age = min(NODES_MAX_AGE, explain_after)

    def due(self, now: float) -> list[Key]:
        """The pending claims to explain now (runs on the event loop: cheap)."""
        self._last_tick = now
        waiting: dict[str, Key] = {}
        answered: dict[str, bool] = {}
        for uid, key in self.view.unallocated_claims():
            pods = [p for p in self.view.pods_using("ResourceClaim", key) if p.waiting]
            if pods:
                waiting[uid] = key
                answered[uid] = any(p.answered for p in pods)
        if not waiting:
            self._drop_caches()
        due = self.pending.update(answered, now=now)
        for uid in due:
            self.pending.explained(uid, now=now)
        for waited in self.stalls.ended_except(set(waiting), now=now):
            self.metrics.satisfiable_wait.observe(waited)
        self.metrics.stalled_claims.set(self.stalls.stalled(now=now))
        return [waiting[uid] for uid in due]

    def _drop_caches(self) -> None:
        """With no claim pending, nothing is explained until one is: the CEL view of
        every device (about 1.2 KiB each) and the list of Nodes would only be kept
        for nothing, through the hours a fleet runs full. The first round after builds
        them again (the views about 0.3 ms per node of 8 GPUs, once)."""
        if len(self.cel_cache):
            self.cel_cache.clear()
        self._nodes = (float("-inf"), None)

    def forget(self, uid: str) -> None:
        self.pending.forget(uid)
        waited = self.stalls.ended(uid, now=self._last_tick)
        if waited is not None:
            self.metrics.satisfiable_wait.observe(waited)

    def explain_round(self, keys: list[Key], now: float) -> None:
        """Explain ``keys`` at the tick ``now``, sharing one fleet between them (a worker
        thread)."""
        fleet: tuple[float, ExplainContext] | None = None
        for key in keys:
            try:
                fleet = self._fresh_fleet(fleet)
                self.explain(key, fleet=fleet[1], now=now)
            except Exception:  # tried again at the next recheck, not every second
                log.exception("explaining a claim failed", extra={"claim": "/".join(key)})

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
        # The usage from the kept claims' results rather than their JSON: with thousands
        # of claims that is most of a round's cost, every tick while Pods wait.
        built = prepare_fleet(
            slices=self.view.explain_snapshot(claims=False).slices,
            claims=(),
            driver=self.driver,
            cache=self.cel_cache,
            usage=usage_of(self.view.holdings()),
        )
        return now, built

    def nodes(self, *, now: float) -> Sequence[JsonObject] | None:
        """Every Node as ``node_fit`` sees it, a few seconds old at most (None: not
        allowed to list them)."""
        read_at, nodes = self._nodes
        if now - read_at >= self._nodes_max_age:
            listed = self.api.list_nodes()
            nodes = [node_fit(n) for n in listed] if listed is not None else None
            self._nodes = (now, nodes)
        return nodes

    def explain(
        self, key: Key, *, fleet: ExplainContext | None = None, now: float | None = None
    ) -> str | None:
        """Explain one pending claim and post the result; returns the message posted.
        ``fleet``: ``prepare_fleet`` of the current view, shared by a round of claims;
        ``now``: the tick's clock (monotonic where not given)."""
        claim = self.api.get_claim(*key)
        if claim is None or ResourceClaim(claim).allocated:
            return None
        # The claim is unallocated: with a round's fleet its usage is there already.
        snapshot = self.view.explain_snapshot(claims=fleet is None)
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
        if explanation.cut_short or explanation.unsatisfiable:
            self.stalls.unsatisfiable(ref.uid)
        if explanation.cut_short and not explanation.unsatisfiable:
            message = explanation.summary()
            if self._deferred(ref, EXPLANATION_INCOMPLETE, message):
                return None
            self.events.memory.keep_only(ref.uid, EXPLANATION_INCOMPLETE, [message])
            self.events.warn(ref, reason=EXPLANATION_INCOMPLETE, message=message)
            return message
        waits = self._group_waits(pods)
        if not explanation.unsatisfiable:
            log.debug("pending claim looks satisfiable", extra={"claim": explanation.claim})
            gang = gang_message(waits)
            if gang is not None:
                # Not a scheduler that forgot the Pods: no stall episode runs meanwhile.
                self.stalls.unsatisfiable(ref.uid)
                return self._post(ref, key, GANG_INCOMPLETE, gang)
            at = time.monotonic() if now is None else now
            episode = self.stalls.satisfiable(ref.uid, now=at, wall=time.time())
            return None if episode is None else self._stalled(ref, key, episode, waits)
        return self._post(ref, key, UNSATISFIABLE, with_groups(explanation.message(), waits))

    def _post(self, ref: ObjectRef, key: Key, reason: str, message: str) -> str | None:
        """``message`` to the claim and its waiting Pods, unless it waits for the
        repost budget; the message posted, or None."""
        if self._deferred(ref, reason, message):
            return None
        self.events.memory.keep_only(ref.uid, reason, [message])
        self._tell(ref, key, reason, message)
        return message

    def _group_waits(self, pods: Sequence[JsonObject]) -> list[GroupWait]:
        """The PodGroups of the waiting Pods, read now; a group that cannot be read
        (the API not served, no RBAC) is left out: naming it is a courtesy."""
        groups: dict[Key, JsonObject | None] = {}
        members: dict[Key, int] = {}
        listed: dict[str, Sequence[JsonObject] | None] = {}  # one list per namespace
        for key in pod_groups(pods):
            try:
                groups[key] = self.api.get_pod_group(*key)
                if key[0] not in listed:
                    listed[key[0]] = self.api.list_pods(key[0])
            except Exception as err:
                log.debug("PodGroup not read", extra={"podGroup": "/".join(key), "error": str(err)})
                groups.pop(key, None)
                continue
            named = listed[key[0]]
            members[key] = sum(
                1 for p in (named if named is not None else pods) if _member_of(p, key)
            )
        return group_waits(groups, members)

    def _stalled(
        self, ref: ObjectRef, key: Key, episode: Episode, waits: Sequence[GroupWait] = ()
    ) -> str:
        """Tell the claim and its waiting Pods that their wait is not capacity."""
        since = datetime.fromtimestamp(episode.since_wall, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        message = (
            f"satisfiable since {since}: every explanation since finds devices for all "
            f"requests, yet the claim is unallocated; kube-scheduler has not retried its Pod "
            f"(it retries unschedulable Pods on a related change, or within 5 minutes). "
            f"The wait is not capacity."
        )
        message = with_groups(message, waits)
        self.metrics.scheduler_stalls.inc()
        self._tell(ref, key, SCHEDULER_NOT_RETRIED, message)
        return message

    def _tell(self, ref: ObjectRef, key: Key, reason: str, message: str) -> None:
        """``message`` as an Event on the claim and on each Pod waiting for it."""
        self.events.warn(ref, reason=reason, message=message)
        on_pod = f"ResourceClaim {key[1]}: {message}"
        for pod in self.view.pods_using("ResourceClaim", key):
            if pod.waiting:
                self.events.warn(pod.ref(), reason=reason, message=on_pod)

    def _deferred(self, ref: ObjectRef, reason: str, message: str) -> bool:
        """A changed explanation waits for the next re-check when the repost budget is
        spent (events.RepostBudget); its Pods' Events follow the claim's."""
        if self.events.budget_allows(ref, reason=reason, message=message):
            return False
        self.metrics.events_deferred.labels(reason).inc()
        return True

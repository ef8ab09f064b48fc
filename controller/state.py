"""What the controller knows of the cluster, fed by kopf's watch events, kept in memory.

Nothing here is written to the objects themselves (docs/design.md#decisions: no kopf annotations,
finalizers or status on objects we do not own): claims, Pods, slices, classes,
DeviceTaintRules and DevicePools live in plain dicts, replaced on every event and
dropped on deletion. Pods are reduced to the claims they use, which is all the
controller needs of them. Readers on worker threads get copies under the lock.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

from drasil.controller.events import ObjectRef
from drasil.driver.explain.inventory import is_driver_class, request_classes
from drasil.driver.objects import JsonObject, ResourceClaim, meta

Key = tuple[str, str]  # namespace, name


def key_of(obj: JsonObject) -> Key:
    m = meta(obj)
    return m.namespace, m.name


def _allocated_pools(claim: JsonObject) -> set[tuple[str, str]]:
    results = ResourceClaim(claim).results()
    return {(str(r.get("driver", "")), str(r.get("pool", ""))) for r in results}


def _unallocated_of(claim: ResourceClaim, classes: set[str]) -> bool:
    """Not allocated, not being deleted, and asking for one of ``classes``."""
    return (
        not claim.allocated
        and not claim.meta.deletion_timestamp
        and bool(request_classes(claim.spec) & classes)
    )


@dataclass(frozen=True)
class PodRef:
    """A Pod as far as claims go: which it uses, and whether it waits to be scheduled.

    ``claims`` holds every ResourceClaim of the Pod, ``direct`` only those it names
    itself (``resourceClaimName``), not those made for it from a template: a problem
    of a generated claim is its template's, which the Pod hears about once.
    """

    namespace: str
    name: str
    uid: str
    claims: frozenset[str]
    templates: frozenset[str]
    waiting: bool
    direct: frozenset[str] = frozenset()

    @classmethod
    def of(cls, pod: JsonObject) -> PodRef | None:
        """None for a Pod that uses no ResourceClaim."""
        spec, status, m = pod.get("spec") or {}, pod.get("status") or {}, meta(pod)
        entries = spec.get("resourceClaims") or []
        if not entries:
            return None
        direct = {str(e["resourceClaimName"]) for e in entries if e.get("resourceClaimName")}
        claims = direct | {
            str(s["resourceClaimName"])
            for s in status.get("resourceClaimStatuses") or []
            if s.get("resourceClaimName")
        }
        templates = {
            str(e["resourceClaimTemplateName"])
            for e in entries
            if e.get("resourceClaimTemplateName")
        }
        waiting = not spec.get("nodeName") and not m.deletion_timestamp
        return cls(
            namespace=m.namespace,
            name=m.name,
            uid=m.uid,
            claims=frozenset(claims),
            templates=frozenset(templates),
            waiting=waiting and status.get("phase", "Pending") == "Pending",
            direct=frozenset(direct),
        )

    def ref(self) -> ObjectRef:
        return ObjectRef("v1", "Pod", self.namespace, self.name, self.uid)


@dataclass(frozen=True)
class ExplainSnapshot:
    slices: list[JsonObject]
    claims: list[JsonObject]
    classes: list[JsonObject]
    taint_rules: list[JsonObject] = field(default_factory=list)


class ClusterView:
    """Claims, Pods (as PodRefs), the driver's slices, DeviceClasses and DevicePools."""

    def __init__(self, *, driver: str) -> None:
        self.driver = driver
        self._lock = threading.Lock()
        self._claims: dict[Key, JsonObject] = {}
        self._pods: dict[str, PodRef] = {}
        self._by_claim: dict[Key, set[str]] = defaultdict(set)
        self._by_template: dict[Key, set[str]] = defaultdict(set)
        self._slices: dict[str, JsonObject] = {}
        self._sharing_slices: set[str] = set()  # slices with a device of several claims
        self._classes: dict[str, JsonObject] = {}
        self._pools: dict[str, JsonObject] = {}
        self._taint_rules: dict[str, JsonObject] = {}

    # ---- claims -------------------------------------------------------------------

    def put_claim(self, claim: JsonObject) -> None:
        with self._lock:
            self._claims[key_of(claim)] = claim

    def drop_claim(self, claim: JsonObject) -> None:
        with self._lock:
            self._claims.pop(key_of(claim), None)

    def claim(self, key: Key) -> JsonObject | None:
        with self._lock:
            return self._claims.get(key)

    def unallocated_claims(self) -> list[JsonObject]:
        """Claims without an allocation that use a DeviceClass of the driver."""
        with self._lock:
            classes = self._driver_classes()
            claims = list(self._claims.values())
        return [c for c in claims if _unallocated_of(ResourceClaim(c), classes)]

    def claims_allocated_from(self, pool: str) -> list[JsonObject]:
        """Claims with a result of the driver from ``pool``."""
        with self._lock:
            claims = list(self._claims.values())
        return [c for c in claims if (self.driver, pool) in _allocated_pools(c)]

    # ---- pods ---------------------------------------------------------------------

    def put_pod(self, pod: JsonObject) -> PodRef | None:
        ref = PodRef.of(pod)
        uid = meta(pod).uid
        with self._lock:
            self._unindex(uid)
            if ref is not None:
                self._pods[uid] = ref
                for name in ref.claims:
                    self._by_claim[(ref.namespace, name)].add(uid)
                for name in ref.templates:
                    self._by_template[(ref.namespace, name)].add(uid)
        return ref

    def drop_pod(self, pod: JsonObject) -> None:
        with self._lock:
            self._unindex(meta(pod).uid)

    def _unindex(self, uid: str) -> None:
        old = self._pods.pop(uid, None)
        if old is None:
            return
        for index, names in ((self._by_claim, old.claims), (self._by_template, old.templates)):
            for name in names:
                uids = index.get((old.namespace, name))
                if uids is not None:
                    uids.discard(uid)
                    if not uids:
                        del index[(old.namespace, name)]

    def pods_using(self, kind: str, key: Key) -> list[PodRef]:
        """Pods using the ResourceClaim or ResourceClaimTemplate ``key``."""
        index = self._by_template if kind == "ResourceClaimTemplate" else self._by_claim
        with self._lock:
            return [self._pods[uid] for uid in sorted(index.get(key, ())) if uid in self._pods]

    # ---- slices, classes, pools ---------------------------------------------------

    def put_slice(self, obj: JsonObject) -> None:
        spec = obj.get("spec") or {}
        if spec.get("driver") != self.driver:
            return
        name = meta(obj).name
        devices = spec.get("devices")
        sharing = isinstance(devices, list) and any(
            isinstance(d, Mapping) and d.get("allowMultipleAllocations") is True for d in devices
        )
        with self._lock:
            self._slices[name] = obj
            if sharing:
                self._sharing_slices.add(name)
            else:
                self._sharing_slices.discard(name)

    def drop_slice(self, obj: JsonObject) -> None:
        name = meta(obj).name
        with self._lock:
            self._slices.pop(name, None)
            self._sharing_slices.discard(name)

    def may_share_gpus(self) -> bool:
        """Whether a device of the driver may be allocated as a share (a GPU published
        with ``allowMultipleAllocations``, ``--gpu-sharing consumable``): False only
        when slices of the driver are known and none has such a device."""
        with self._lock:
            return bool(self._sharing_slices) or not self._slices

    def put_class(self, obj: JsonObject) -> None:
        with self._lock:
            self._classes[meta(obj).name] = obj

    def drop_class(self, obj: JsonObject) -> None:
        with self._lock:
            self._classes.pop(meta(obj).name, None)

    def _driver_classes(self) -> set[str]:
        return {n for n, c in self._classes.items() if is_driver_class(c, self.driver)}

    def put_taint_rule(self, obj: JsonObject) -> None:
        # Cluster-scoped and few; kept whole, since matching needs only their spec.
        with self._lock:
            self._taint_rules[meta(obj).name] = obj

    def drop_taint_rule(self, obj: JsonObject) -> None:
        with self._lock:
            self._taint_rules.pop(meta(obj).name, None)

    def put_pool(self, obj: JsonObject) -> None:
        with self._lock:
            self._pools[meta(obj).name] = obj

    def drop_pool(self, obj: JsonObject) -> None:
        with self._lock:
            self._pools.pop(meta(obj).name, None)

    def pool(self, name: str) -> JsonObject | None:
        with self._lock:
            return self._pools.get(name)

    def published_pools(self) -> set[str]:
        """Names of DevicePools this driver publishes (their pools' names)."""
        with self._lock:
            pools = list(self._pools.values())
        return {
            meta(p).name
            for p in pools
            if ((p.get("spec") or {}).get("driver") or self.driver) == self.driver
        }

    def explain_snapshot(self) -> ExplainSnapshot:
        with self._lock:
            return ExplainSnapshot(
                slices=list(self._slices.values()),
                claims=list(self._claims.values()),
                classes=list(self._classes.values()),
                taint_rules=list(self._taint_rules.values()),
            )

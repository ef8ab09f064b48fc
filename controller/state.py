"""What the controller knows of the cluster, fed by kopf's watch events, kept in memory.

Nothing here is written to the objects themselves (docs/design.md#decisions: no kopf annotations,
finalizers or status on objects we do not own): claims, Pods, slices, classes,
DeviceTaintRules and DevicePools live in plain dicts, replaced on every event and
dropped on deletion. Readers on worker threads get copies under the lock.

Memory follows what the controller needs, not what the cluster holds: a claim is
kept as ``kept_claim`` (its name, uid, deletion, and what the driver was allocated:
no spec, no other drivers' results, no managedFields), and an index of the
unallocated ones with the classes they ask for lets the tick walk only those. Pods
are reduced to the claims they use. Other objects are kept without managedFields.

Slices are kept whole (explanations read every device), but most of a device is the
same on every node of a fleet: ``{"string": "Hopper"}``, ``{"value": "80Gi"}``. Each
slice's attribute and capacity values are ``SharedValues``: one object per distinct
value across the fleet instead of one per device, which takes a parsed slice of
8 GPUs from about 36 KiB to 12. Nothing mutates a kept object, so sharing is safe.
"""

from __future__ import annotations

import sys
import threading
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

from drasil.controller.events import ObjectRef
from drasil.driver.explain.inventory import is_driver_class, request_classes
from drasil.driver.objects import (
    JsonDict,
    JsonObject,
    Pod,
    ResourceClaim,
    ResourceSlice,
    mapping,
    meta,
    text,
)

Key = tuple[str, str]  # namespace, name


def key_of(obj: JsonObject) -> Key:
    m = meta(obj)
    return m.namespace, m.name


def _allocated_pools(claim: JsonObject) -> set[tuple[str, str]]:
    results = ResourceClaim(claim).results()
    return {(str(r.get("driver", "")), str(r.get("pool", ""))) for r in results}


def without_managed_fields(obj: JsonObject) -> JsonObject:
    """``obj`` without ``metadata.managedFields`` (often half an object's size)."""
    metadata = obj.get("metadata")
    if not isinstance(metadata, Mapping) or "managedFields" not in metadata:
        return obj
    kept = {k: v for k, v in metadata.items() if k != "managedFields"}
    return {**obj, "metadata": kept}


def _interned(value: object) -> object:
    return sys.intern(value) if isinstance(value, str) else value


def kept_claim(obj: JsonObject, *, driver: str) -> JsonDict:
    """What the controller keeps of a claim: what the usage of devices (explanations),
    ``status.devices`` and the attaches read (about 3 KiB in memory where the whole
    claim takes 14). A pending claim is explained from a fresh read of the API
    server, so its spec is not kept. The strings that repeat from claim to claim
    (namespace, driver, pool, device and request names) are interned: every event
    parses its own copies, which would otherwise stay, one set per claim."""
    claim = ResourceClaim(obj)
    m = claim.meta
    metadata: JsonDict = {"name": m.name, "namespace": sys.intern(m.namespace), "uid": m.uid}
    if m.deletion_timestamp:
        metadata["deletionTimestamp"] = m.deletion_timestamp
    kept: JsonDict = {
        "apiVersion": _interned(obj.get("apiVersion")),
        "kind": _interned(obj.get("kind")),
    }
    kept["metadata"] = metadata
    status: JsonDict = {}
    if claim.allocated:
        results = claim.results(driver)
        interned = [{k: _interned(v) for k, v in r.items()} for r in results]
        allocation: JsonDict = {"devices": {"results": interned}}
        # Where and when it was allocated matter to attaches alone.
        if any(r.get("bindingConditions") for r in results):
            if claim.node_selector:
                allocation["nodeSelector"] = claim.node_selector
            if claim.allocation_timestamp:
                allocation["allocationTimestamp"] = claim.allocation_timestamp
        status["allocation"] = allocation
    ours = [entry for entry in claim.devices if entry.get("driver") == driver]
    if ours:
        status["devices"] = ours
    if status:
        kept["status"] = status
    return kept


class SharedValues:
    """One instance of each distinct attribute or capacity value of the slices' devices
    (a one-entry dict of a scalar, as ``{"int": 0}``). ``MAX`` bounds the table: past
    it, it starts over; values already shared stay shared."""

    MAX = 1 << 16

    def __init__(self) -> None:
        self._values: dict[tuple[str, type, object], JsonDict] = {}

    def __len__(self) -> int:
        return len(self._values)

    def slice(self, obj: JsonObject) -> JsonObject:
        """``obj`` with its devices' attribute and capacity values shared, rebuilt
        (never changed in place: the watch event's object is not ours)."""
        spec = mapping(obj.get("spec"))
        devices = spec.get("devices")
        if not isinstance(devices, list):
            return obj
        return {**obj, "spec": {**spec, "devices": [self._device(d) for d in devices]}}

    def _device(self, device: object) -> object:
        if not isinstance(device, Mapping):
            return device
        kept = dict(device)
        for field_name in ("attributes", "capacity"):
            entries = device.get(field_name)
            if isinstance(entries, Mapping):
                kept[field_name] = {name: self.value(v) for name, v in entries.items()}
        return kept

    def value(self, value: object) -> object:
        """The shared instance equal to ``value`` if it is a one-entry dict of a scalar
        (the type is part of the key: ``{"int": 1}`` is not ``{"int": True}``)."""
        if not isinstance(value, dict) or len(value) != 1:
            return value
        [(kind, scalar)] = value.items()
        if not isinstance(scalar, str | int | float | bool):
            return value
        key = (kind, type(scalar), scalar)
        found = self._values.get(key)
        if found is None:
            if len(self._values) >= self.MAX:
                self._values.clear()
            found = self._values[key] = value
        return found


@dataclass(frozen=True, slots=True)
class Unallocated:
    """A claim the scheduler has yet to allocate, and the DeviceClasses it asks for."""

    uid: str
    classes: frozenset[str]


@dataclass(frozen=True, slots=True)
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
    def of(cls, obj: JsonObject) -> PodRef | None:
        """None for a Pod that uses no ResourceClaim."""
        pod = Pod(obj)
        entries = pod.resource_claims
        if not entries:
            return None
        direct = {text(e.get("resourceClaimName")) for e in entries} - {""}
        made = {text(s.get("resourceClaimName")) for s in pod.claim_statuses} - {""}
        templates = {text(e.get("resourceClaimTemplateName")) for e in entries} - {""}
        m = pod.meta
        waiting = not pod.node_name and not m.deletion_timestamp
        return cls(
            namespace=sys.intern(m.namespace),
            name=m.name,
            uid=m.uid,
            claims=frozenset(direct | made),
            templates=frozenset(templates),
            waiting=waiting and (pod.phase or "Pending") == "Pending",
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
        self._claims: dict[Key, JsonObject] = {}  # kept_claim of each
        self._unallocated: dict[Key, Unallocated] = {}
        self._pods: dict[str, PodRef] = {}
        self._by_claim: dict[Key, set[str]] = defaultdict(set)
        self._by_template: dict[Key, set[str]] = defaultdict(set)
        self._slices: dict[str, JsonObject] = {}
        self._shared = SharedValues()  # under the lock, as _slices
        self._sharing_slices: set[str] = set()  # slices with a device of several claims
        self._classes: dict[str, JsonObject] = {}
        self._pools: dict[str, JsonObject] = {}
        self._taint_rules: dict[str, JsonObject] = {}

    # ---- claims -------------------------------------------------------------------

    def put_claim(self, claim: JsonObject) -> None:
        key, kept, view = key_of(claim), kept_claim(claim, driver=self.driver), ResourceClaim(claim)
        pending = not view.allocated and not view.meta.deletion_timestamp
        classes = frozenset(request_classes(view.spec)) if pending else frozenset()
        with self._lock:
            self._claims[key] = kept
            if classes:
                self._unallocated[key] = Unallocated(view.meta.uid, classes)
            else:
                self._unallocated.pop(key, None)

    def drop_claim(self, claim: JsonObject) -> None:
        key = key_of(claim)
        with self._lock:
            self._claims.pop(key, None)
            self._unallocated.pop(key, None)

    def claim(self, key: Key) -> JsonObject | None:
        with self._lock:
            return self._claims.get(key)

    def unallocated_claims(self) -> list[tuple[str, Key]]:
        """(uid, key) of the claims without an allocation, not being deleted, that ask
        for a DeviceClass of the driver: only those are walked, not every claim."""
        with self._lock:
            classes = self._driver_classes()
            return [(u.uid, key) for key, u in self._unallocated.items() if u.classes & classes]

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
        view = ResourceSlice(obj)
        if view.driver != self.driver:
            return
        name = view.meta.name
        sharing = any(d.get("allowMultipleAllocations") is True for d in view.devices)
        with self._lock:
            self._slices[name] = self._shared.slice(without_managed_fields(obj))
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
            self._classes[meta(obj).name] = without_managed_fields(obj)

    def drop_class(self, obj: JsonObject) -> None:
        with self._lock:
            self._classes.pop(meta(obj).name, None)

    def _driver_classes(self) -> set[str]:
        return {n for n, c in self._classes.items() if is_driver_class(c, self.driver)}

    def put_taint_rule(self, obj: JsonObject) -> None:
        # Cluster-scoped and few; kept whole, since matching needs only their spec.
        with self._lock:
            self._taint_rules[meta(obj).name] = without_managed_fields(obj)

    def drop_taint_rule(self, obj: JsonObject) -> None:
        with self._lock:
            self._taint_rules.pop(meta(obj).name, None)

    def put_pool(self, obj: JsonObject) -> None:
        with self._lock:
            self._pools[meta(obj).name] = without_managed_fields(obj)

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
            if (text(mapping(p.get("spec")).get("driver")) or self.driver) == self.driver
        }

    def explain_snapshot(self) -> ExplainSnapshot:
        with self._lock:
            return ExplainSnapshot(
                slices=list(self._slices.values()),
                claims=list(self._claims.values()),
                classes=list(self._classes.values()),
                taint_rules=list(self._taint_rules.values()),
            )

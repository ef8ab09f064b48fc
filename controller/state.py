"""What the controller knows of the cluster, fed by kopf's watch events, kept in memory.

Nothing here is written to the objects themselves (docs/design.md#decisions: no kopf annotations,
finalizers or status on objects we do not own): claims, Pods, slices, classes,
DeviceTaintRules and DevicePools live in plain dicts, replaced on every event and
dropped on deletion. Readers on worker threads get copies under the lock.

Memory follows what the controller needs, not what the cluster holds: a claim is
kept as a ``KeptClaim`` (its name, uid, deletion, and what the driver was allocated:
no spec, no other drivers' results, no managedFields; slots, not nested JSON), and an
index of the unallocated ones with the classes they ask for lets the tick walk only
those. Pods are reduced to the claims they use (``PodRef``, indexed by ``UidIndex``).
Other objects are kept without managedFields.

Slices are kept whole (explanations read every device), but most of a device is the
same on every node of a fleet: ``{"string": "Hopper"}``, ``{"value": "80Gi"}``. Each
slice's attribute and capacity values are ``SharedValues``: one object per distinct
value (and per distinct capacity) across the fleet instead of one per device, and the
attribute names are interned, which takes a parsed slice of 8 GPUs from about 36 KiB
to 7. Nothing mutates a kept object, so sharing is safe.
"""

from __future__ import annotations

import sys
import threading
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
    """What the controller keeps of a claim, as JSON (``KeptClaim.json``)."""
    return KeptClaim.of(obj, driver=driver).json()


@dataclass(frozen=True, slots=True)
class KeptClaim:
    """What the controller keeps of a claim: what the usage of devices (explanations),
    ``status.devices`` and the attaches read. A pending claim is explained from a fresh
    read of the API server, so its spec is not kept.

    Slots, not the JSON it stands for: the nested dicts of a claim's JSON (object,
    metadata, status, allocation, devices) cost about 0.7 KiB a claim, kept for every
    claim in the cluster; ``json()`` builds them for the moment a reader needs them.
    The strings that repeat from claim to claim (namespace, driver, pool, device and
    request names) are interned: every event parses its own copies, which would
    otherwise stay, one set per claim; so is the name, which the claim's Pod holds too.
    """

    api_version: object
    kind: object
    namespace: str
    name: str
    uid: str
    deletion: str
    allocated: bool
    results: tuple[JsonDict, ...]  # the driver's allocation results
    devices: tuple[JsonObject, ...]  # the driver's status.devices entries
    # Where and when it was allocated matter to attaches alone (bindingConditions).
    node_selector: JsonObject | None
    allocation_timestamp: str

    @classmethod
    def of(cls, obj: JsonObject, *, driver: str) -> KeptClaim:
        claim = ResourceClaim(obj)
        m = claim.meta
        results = claim.results(driver) if claim.allocated else ()
        attaching = any(r.get("bindingConditions") for r in results)
        return cls(
            api_version=_interned(obj.get("apiVersion")),
            kind=_interned(obj.get("kind")),
            namespace=sys.intern(m.namespace),
            name=sys.intern(m.name),
            uid=m.uid,
            deletion=m.deletion_timestamp or "",
            allocated=claim.allocated,
            results=tuple({k: _interned(v) for k, v in r.items()} for r in results),
            devices=tuple(entry for entry in claim.devices if entry.get("driver") == driver),
            node_selector=(claim.node_selector or None) if attaching else None,
            allocation_timestamp=claim.allocation_timestamp if attaching else "",
        )

    @property
    def ref(self) -> str:
        """``namespace/name``, as explanations name holders."""
        return f"{self.namespace}/{self.name}"

    def holds_from(self, driver: str, pool: str) -> bool:
        """Whether a result of ``driver`` comes from ``pool``."""
        return any(r.get("driver") == driver and r.get("pool") == pool for r in self.results)

    def json(self) -> JsonDict:
        """The claim as JSON with only the kept fields (a new dict each call; the
        results and entries in it are shared and must not be changed)."""
        metadata: JsonDict = {"name": self.name, "namespace": self.namespace, "uid": self.uid}
        if self.deletion:
            metadata["deletionTimestamp"] = self.deletion
        kept: JsonDict = {"apiVersion": self.api_version, "kind": self.kind, "metadata": metadata}
        status: JsonDict = {}
        if self.allocated:
            allocation: JsonDict = {"devices": {"results": list(self.results)}}
            if self.node_selector:
                allocation["nodeSelector"] = self.node_selector
            if self.allocation_timestamp:
                allocation["allocationTimestamp"] = self.allocation_timestamp
            status["allocation"] = allocation
        if self.devices:
            status["devices"] = list(self.devices)
        if status:
            kept["status"] = status
        return kept


def _scalar_key(value: object) -> tuple[str, type, object] | None:
    """What tells a one-entry dict of a scalar from another (the type is part of it:
    ``{"int": 1}`` is not ``{"int": True}``); None for any other value."""
    if not isinstance(value, dict) or len(value) != 1:
        return None
    [(kind, scalar)] = value.items()
    if not isinstance(scalar, str | int | float | bool):
        return None
    return (kind, type(scalar), scalar)


class SharedValues:
    """One instance of each distinct attribute or capacity value of the slices' devices
    (a one-entry dict of a scalar, as ``{"int": 0}``), and of each distinct capacity
    of a device (``{"memory": {"value": "80Gi"}}``: equal on every GPU of a model,
    where attributes differ in uuid and bus id). ``MAX`` bounds each table: past it,
    it starts over; values already shared stay shared."""

    MAX = 1 << 16

    def __init__(self) -> None:
        self._values: dict[tuple[str, type, object], JsonDict] = {}
        # By (name, id of its shared value) pairs: the value's entry in _values, or
        # the capacity here, keeps it alive, so its id is not reused meanwhile.
        self._capacities: dict[tuple[tuple[str, int], ...], JsonDict] = {}

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
        # Keys and names are interned: a parsed slice has its own copy of each
        # attribute's name ("resource.kubernetes.io/pciBusID", ...), about 1 KiB a slice.
        kept = {sys.intern(k): _interned(v) if k == "name" else v for k, v in device.items()}
        for field_name in ("attributes", "capacity"):
            entries = device.get(field_name)
            if isinstance(entries, Mapping):
                kept[field_name] = {sys.intern(n): self.value(v) for n, v in entries.items()}
        capacity = kept.get("capacity")
        if isinstance(capacity, dict):
            kept["capacity"] = self._capacity(capacity)
        return kept

    def _capacity(self, capacity: JsonDict) -> JsonDict:
        if not all(_scalar_key(v) for v in capacity.values()):
            return capacity  # a value not shared would make a key of its own
        key = tuple((name, id(value)) for name, value in capacity.items())
        found = self._capacities.get(key)
        if found is None:
            if len(self._capacities) >= self.MAX:
                self._capacities.clear()
            found = self._capacities[key] = capacity
        return found

    def value(self, value: object) -> object:
        """The shared instance equal to ``value`` if it is a one-entry dict of a scalar
        (the type is part of the key: ``{"int": 1}`` is not ``{"int": True}``)."""
        key = _scalar_key(value)
        if key is None or not isinstance(value, dict):
            return value
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


def _names(names: set[str]) -> tuple[str, ...]:
    """Sorted and interned: a tuple of one name is 48 bytes where a frozenset is 216
    (a Pod has one or two claims); a claim's name is then one object with the kept
    claim's, a template's one object for all its Pods."""
    return tuple(sorted(sys.intern(n) for n in names))


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
    claims: tuple[str, ...]
    templates: tuple[str, ...]
    waiting: bool
    direct: tuple[str, ...] = ()
    # kube-scheduler has had its say: PodScheduled is False (Unschedulable, gated, an
    # error). A Pod of a PodGroup counts too: a gang waits for its members before the
    # scheduler's queue, without a condition. Otherwise the Pod is only queued.
    answered: bool = False

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
        refused = any(c.type == "PodScheduled" and c.status == "False" for c in pod.conditions)
        return cls(
            namespace=sys.intern(m.namespace),
            name=m.name,
            uid=m.uid,
            claims=_names(direct | made),
            templates=_names(templates),
            waiting=waiting and (pod.phase or "Pending") == "Pending",
            direct=_names(direct),
            answered=refused or bool(pod.pod_group),
        )

    def ref(self) -> ObjectRef:
        return ObjectRef("v1", "Pod", self.namespace, self.name, self.uid)


class UidIndex:
    """Pod uids by the (namespace, name) of a claim or template they use.

    Most keys have one Pod (a claim made from a template is its Pod's alone): its uid
    is the entry itself, and a set (216 bytes) is made only for a second Pod.
    """

    def __init__(self) -> None:
        self._uids: dict[Key, str | set[str]] = {}

    def __len__(self) -> int:
        return len(self._uids)

    def add(self, key: Key, uid: str) -> None:
        found = self._uids.get(key)
        if found is None:
            self._uids[key] = uid
        elif isinstance(found, set):
            found.add(uid)
        elif found != uid:
            self._uids[key] = {found, uid}

    def discard(self, key: Key, uid: str) -> None:
        found = self._uids.get(key)
        if isinstance(found, set):
            found.discard(uid)
            if len(found) == 1:
                [self._uids[key]] = found
        elif found == uid:
            del self._uids[key]

    def get(self, key: Key) -> tuple[str, ...]:
        found = self._uids.get(key)
        if found is None:
            return ()
        return (found,) if isinstance(found, str) else tuple(found)


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
        self._claims: dict[Key, KeptClaim] = {}
        self._unallocated: dict[Key, Unallocated] = {}
        self._pods: dict[str, PodRef] = {}
        self._by_claim = UidIndex()
        self._by_template = UidIndex()
        self._slices: dict[str, JsonObject] = {}
        self._shared = SharedValues()  # under the lock, as _slices
        self._classes: dict[str, JsonObject] = {}
        self._pools: dict[str, JsonObject] = {}
        self._taint_rules: dict[str, JsonObject] = {}

    # ---- claims -------------------------------------------------------------------

    def put_claim(self, claim: JsonObject) -> None:
        view, kept = ResourceClaim(claim), KeptClaim.of(claim, driver=self.driver)
        key = (kept.namespace, kept.name)  # the interned strings, not the event's copies
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
        """The kept claim as JSON (``KeptClaim.json``)."""
        with self._lock:
            kept = self._claims.get(key)
        return kept.json() if kept is not None else None

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
        return [c.json() for c in claims if c.holds_from(self.driver, pool)]

    def holdings(self) -> list[tuple[str, tuple[JsonDict, ...]]]:
        """(``namespace/name``, the driver's allocation results) of every claim that
        holds devices of the driver: what explanations count as used (``usage_of``),
        read from the kept claims without building their JSON."""
        with self._lock:
            claims = list(self._claims.values())
        return [(c.ref, c.results) for c in claims if c.results]

    # ---- pods ---------------------------------------------------------------------

    def put_pod(self, pod: JsonObject) -> PodRef | None:
        ref = PodRef.of(pod)
        uid = meta(pod).uid
        with self._lock:
            self._unindex(uid)
            if ref is not None:
                self._pods[uid] = ref
                for name in ref.claims:
                    self._by_claim.add((ref.namespace, name), uid)
                for name in ref.templates:
                    self._by_template.add((ref.namespace, name), uid)
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
                index.discard((old.namespace, name), uid)

    def pods_using(self, kind: str, key: Key) -> list[PodRef]:
        """Pods using the ResourceClaim or ResourceClaimTemplate ``key``."""
        index = self._by_template if kind == "ResourceClaimTemplate" else self._by_claim
        with self._lock:
            return [self._pods[uid] for uid in sorted(index.get(key)) if uid in self._pods]

    # ---- slices, classes, pools ---------------------------------------------------

    def put_slice(self, obj: JsonObject) -> None:
        view = ResourceSlice(obj)
        if view.driver != self.driver:
            return
        name = view.meta.name
        with self._lock:
            self._slices[name] = self._shared.slice(without_managed_fields(obj))

    def drop_slice(self, obj: JsonObject) -> None:
        name = meta(obj).name
        with self._lock:
            self._slices.pop(name, None)

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

    def explain_snapshot(self, *, claims: bool = True) -> ExplainSnapshot:
        """What explanations read; ``claims=False`` leaves the claims out (their JSON
        is built for the snapshot: a round's shared fleet needs it, a single
        explanation with that fleet does not)."""
        with self._lock:
            kept = list(self._claims.values()) if claims else []
            slices, classes = list(self._slices.values()), list(self._classes.values())
            rules = list(self._taint_rules.values())
        # Outside the lock: a few ms for thousands of claims.
        as_json: list[JsonObject] = [c.json() for c in kept]
        return ExplainSnapshot(slices=slices, claims=as_json, classes=classes, taint_rules=rules)

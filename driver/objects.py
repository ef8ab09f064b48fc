"""Kubernetes objects as the API server's JSON: the one set of type aliases, and
read-only views of object metadata, conditions, ResourceClaims, Pods, ResourceSlices,
DeviceClasses and any object's status.

Everything drasil reads from the API server stays plain JSON (docs/design.md#decisions:
typed models drop fields they do not know). The views here only spare every reader
its own walk of ``status.allocation`` and friends: they copy nothing, validate
nothing and compute each field on access, so they cost next to nothing on the
kubelet plugin's prepare path.

A claim is written by users and by other controllers, so any field may hold the wrong
type. No accessor raises on that: a value that is not a mapping (or a list, or a
string) where one is expected counts as absent, as ``(x.get("status") or {})`` did
before. Callers that must *report* malformed input (``drasil.driver.claims.
deviceconfigs``) validate it themselves.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

JsonObject = Mapping[str, Any]
"""A JSON object as read: never mutated through this name."""
JsonDict = dict[str, Any]
"""A JSON object code builds or changes (a request body, a slice being made)."""

# Shared by every absent field, so it must be one nobody can fill.
_EMPTY: JsonObject = MappingProxyType({})


def mapping(value: object) -> JsonObject:
    """``value`` if it is a JSON object, else an empty one (absent or malformed)."""
    return value if isinstance(value, Mapping) else _EMPTY


def objects(value: object) -> tuple[JsonObject, ...]:
    """The JSON objects of a list; anything else (or any other entry) is left out."""
    if not isinstance(value, (list, tuple)):
        return ()
    return tuple(item for item in value if isinstance(item, Mapping))


def text(value: object) -> str:
    """A string field, "" when absent or not a string."""
    return value if isinstance(value, str) else ""


# --- metadata ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ObjectMeta:
    """The parts of ``metadata`` drasil reads, of any object."""

    namespace: str = ""
    name: str = ""
    uid: str = ""
    generation: int = 0
    resource_version: str = ""
    deletion_timestamp: str = ""
    labels: JsonObject = field(default_factory=lambda: _EMPTY)
    annotations: JsonObject = field(default_factory=lambda: _EMPTY)

    @property
    def ref(self) -> str:
        """``namespace/name``, as claims are named in texts."""
        return f"{self.namespace}/{self.name}"


def meta(obj: JsonObject) -> ObjectMeta:
    """The metadata of ``obj`` (empty fields where it has none)."""
    raw = mapping(obj.get("metadata"))
    generation = raw.get("generation")
    return ObjectMeta(
        namespace=text(raw.get("namespace")),
        name=text(raw.get("name")),
        uid=text(raw.get("uid")),
        # bool is an int to Python, never a generation.
        generation=generation if type(generation) is int else 0,
        resource_version=text(raw.get("resourceVersion")),
        deletion_timestamp=text(raw.get("deletionTimestamp")),
        labels=mapping(raw.get("labels")),
        annotations=mapping(raw.get("annotations")),
    )


def status_of(obj: JsonObject) -> JsonObject:
    """``status`` of any object (a DevicePool, a Node); empty when absent or malformed."""
    return mapping(obj.get("status"))


@dataclass(frozen=True, slots=True)
class JsonView:
    """What every view reads the same way: the object's JSON (``obj``, kept as given),
    its metadata, spec and status."""

    obj: JsonObject

    @property
    def meta(self) -> ObjectMeta:
        return meta(self.obj)

    @property
    def spec(self) -> JsonObject:
        return mapping(self.obj.get("spec"))

    @property
    def status(self) -> JsonObject:
        return mapping(self.obj.get("status"))


# --- conditions --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Condition:
    """One ``metav1.Condition`` (or a Pod's condition) as written."""

    type: str
    status: str
    reason: str = ""
    message: str = ""
    last_transition_time: str = ""

    @property
    def true(self) -> bool:
        return self.status == "True"


def conditions(obj: JsonObject) -> tuple[Condition, ...]:
    """``obj["conditions"]`` (a status, a status.devices entry), malformed ones left out."""
    return tuple(
        Condition(
            type=text(c.get("type")),
            status=text(c.get("status")),
            reason=text(c.get("reason")),
            message=text(c.get("message")),
            last_transition_time=text(c.get("lastTransitionTime")),
        )
        for c in objects(obj.get("conditions"))
    )


def condition(obj: JsonObject | None, kind: str) -> Condition | None:
    """The condition of type ``kind`` in ``obj`` (None: no such condition)."""
    return next((c for c in conditions(obj or _EMPTY) if c.type == kind), None)


def is_true(obj: JsonObject | None, kind: str) -> bool:
    found = condition(obj, kind)
    return found is not None and found.true


# --- ResourceClaims ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Consumer:
    """One entry of a claim's ``status.reservedFor``."""

    api_group: str
    resource: str
    name: str
    uid: str

    @property
    def is_pod(self) -> bool:
        """A core-group Pod (the other consumers are controllers' own kinds)."""
        return self.resource == "pods" and not self.api_group


@dataclass(frozen=True, slots=True)
class ResourceClaim(JsonView):
    """A read-only view of one ResourceClaim's JSON (``obj``, kept as given)."""

    @property
    def requests(self) -> tuple[JsonObject, ...]:
        """``spec.devices.requests``."""
        return objects(mapping(self.spec.get("devices")).get("requests"))

    @property
    def allocation(self) -> JsonObject | None:
        """``status.allocation``; None when the claim has none (or garbage)."""
        allocation = self.status.get("allocation")
        return allocation if isinstance(allocation, Mapping) else None

    @property
    def allocated(self) -> bool:
        """Whether the claim is allocated: the scheduler never writes an empty allocation."""
        return bool(self.allocation)

    def results(self, driver: str | None = None) -> tuple[JsonObject, ...]:
        """``status.allocation.devices.results``, only ``driver``'s when one is named."""
        devices = mapping(mapping(self.allocation).get("devices"))
        results = objects(devices.get("results"))
        if driver is None:
            return results
        return tuple(r for r in results if r.get("driver") == driver)

    @property
    def node_selector(self) -> JsonObject:
        """``status.allocation.nodeSelector`` (empty: the devices reach every node)."""
        return mapping(mapping(self.allocation).get("nodeSelector"))

    @property
    def allocated_node(self) -> str:
        """The one node a ``bindsToNode`` allocation is limited to (a ``metadata.name``
        field selector); "" when the allocation names none."""
        for term in objects(self.node_selector.get("nodeSelectorTerms")):
            for match in objects(term.get("matchFields")):
                values = match.get("values")
                if match.get("key") != "metadata.name" or not isinstance(values, list):
                    continue
                if len(values) == 1:
                    return text(values[0])
        return ""

    @property
    def allocation_timestamp(self) -> str:
        """``status.allocation.allocationTimestamp`` as written ("" when absent)."""
        return text(mapping(self.allocation).get("allocationTimestamp"))

    @property
    def reserved_for(self) -> tuple[Consumer, ...]:
        """``status.reservedFor``: who may use the claim."""
        return tuple(
            Consumer(
                api_group=text(c.get("apiGroup")),
                resource=text(c.get("resource")),
                name=text(c.get("name")),
                uid=text(c.get("uid")),
            )
            for c in objects(self.status.get("reservedFor"))
        )

    @property
    def devices(self) -> tuple[JsonObject, ...]:
        """``status.devices``: the drivers' per-device entries (conditions, data)."""
        return objects(self.status.get("devices"))


# --- Pods and PodGroups -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Pod(JsonView):
    """A read-only view of one Pod's JSON: the parts about scheduling and claims."""

    @property
    def node_name(self) -> str:
        """``spec.nodeName``: "" until the Pod is bound."""
        return text(self.spec.get("nodeName"))

    @property
    def phase(self) -> str:
        return text(self.status.get("phase"))

    @property
    def conditions(self) -> tuple[Condition, ...]:
        return conditions(self.status)

    @property
    def container_statuses(self) -> tuple[JsonObject, ...]:
        return objects(self.status.get("containerStatuses"))

    @property
    def pod_group(self) -> str:
        """``spec.schedulingGroup.podGroupName``: the PodGroup the Pod is scheduled in
        ("" when none)."""
        return text(mapping(self.spec.get("schedulingGroup")).get("podGroupName"))

    @property
    def resource_claims(self) -> tuple[JsonObject, ...]:
        """``spec.resourceClaims``: the claims the Pod names or has made from templates."""
        return objects(self.spec.get("resourceClaims"))

    @property
    def claim_statuses(self) -> tuple[JsonObject, ...]:
        """``status.resourceClaimStatuses``: the names of the claims made for it."""
        return objects(self.status.get("resourceClaimStatuses"))


# --- ResourceSlices and DeviceClasses ----------------------------------------------


@dataclass(frozen=True, slots=True)
class PodGroup(JsonView):
    """A read-only view of a ``scheduling.k8s.io`` PodGroup: its gang policy."""

    @property
    def min_count(self) -> int | None:
        """``spec.schedulingPolicy.gang.minCount``; None for a basic (non-gang) group."""
        gang = mapping(mapping(self.spec.get("schedulingPolicy")).get("gang"))
        count = gang.get("minCount")
        return count if isinstance(count, int) and not isinstance(count, bool) else None


@dataclass(frozen=True, slots=True)
class ResourceSlice(JsonView):
    """A read-only view of one ResourceSlice's JSON."""

    @property
    def driver(self) -> str:
        return text(self.spec.get("driver"))

    @property
    def pool(self) -> str:
        """``spec.pool.name``."""
        return text(mapping(self.spec.get("pool")).get("name"))

    @property
    def node_name(self) -> str:
        return text(self.spec.get("nodeName"))

    @property
    def devices(self) -> tuple[JsonObject, ...]:
        return objects(self.spec.get("devices"))


@dataclass(frozen=True, slots=True)
class DeviceClass(JsonView):
    """A read-only view of one DeviceClass's JSON."""

    @property
    def expressions(self) -> tuple[str, ...]:
        """The CEL expressions of ``spec.selectors``."""
        return tuple(
            text(mapping(s.get("cel")).get("expression"))
            for s in objects(self.spec.get("selectors"))
        )

    @property
    def config(self) -> tuple[JsonObject, ...]:
        """``spec.config``: the class's opaque configs."""
        return objects(self.spec.get("config"))

"""Planning the writes that make a pool's ResourceSlices match the desired ones.

``plan_publish`` is pure: it compares the slices ``build_slices`` produced with the
slices of the same pool the API server holds (as JSON dicts, e.g. from a raw list
response, so no field is lost to client models) and returns the minimal plan under
the pool generation semantics of ``docs/design.md#pool-generations``:

- If the existing slices already say what the desired ones say (same names, same
  content apart from the generation, one common generation and a matching
  ``resourceSliceCount``), the plan is empty: zero writes.
- Otherwise the pool moves to generation ``max(existing) + 1``. Every desired slice
  is written with it and with ``resourceSliceCount = len(desired)``: an update (PUT
  with the existing ``resourceVersion``) where a slice of that name exists, a create
  otherwise. Existing slices without a desired counterpart are deleted with UID and
  resourceVersion preconditions.

Apply a plan in this order: all creates and updates first, then the deletes. The
scheduler uses the newest generation once it has seen ``resourceSliceCount`` slices
of it, so the old slices stop mattering as soon as the new ones are complete, and
deleting them last never leaves the pool empty. On a conflict (409/412) list the
pool again and plan again; the generation only moves forward.

Content is compared the way the API server stores it: empty lists and maps equal
missing ones, quantities compare by value (``1000`` equals ``1k``) in capacities,
counters, request policies and host-resource overheads alike,
``allowMultipleAllocations: false`` equals its absence, and a taint's ``timeAdded``,
which the server fills in, is ignored.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from drasil.api.quantity import QuantityError, parse_quantity
from drasil.driver.objects import JsonDict


@dataclass(frozen=True)
class SliceDeletion:
    """An existing slice to delete, with the preconditions that make it safe."""

    name: str
    uid: str
    resource_version: str


@dataclass(frozen=True)
class PublishPlan:
    """Writes for one pool; apply ``creates`` and ``updates``, then ``deletes``."""

    generation: int
    creates: tuple[JsonDict, ...] = field(default=())
    updates: tuple[JsonDict, ...] = field(default=())
    deletes: tuple[SliceDeletion, ...] = field(default=())

    @property
    def writes(self) -> int:
        return len(self.creates) + len(self.updates) + len(self.deletes)

    @property
    def empty(self) -> bool:
        return self.writes == 0


def _name(obj: Mapping[str, Any]) -> str:
    return str(obj["metadata"]["name"])


def _pool(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    pool: Mapping[str, Any] = obj["spec"]["pool"]
    return pool


def _pool_id(obj: Mapping[str, Any]) -> tuple[str, str]:
    return str(obj["spec"]["driver"]), str(_pool(obj)["name"])


def _check_one_pool(desired: Sequence[JsonDict], existing: Sequence[Mapping[str, Any]]) -> None:
    pools = {_pool_id(s) for s in (*desired, *existing)}
    if len(pools) > 1:
        found = ", ".join(f"{driver}/{pool}" for driver, pool in sorted(pools))
        raise ValueError(f"plan_publish plans one pool at a time, got {found}")


def plan_publish(
    *, desired: Sequence[JsonDict], existing: Sequence[Mapping[str, Any]]
) -> PublishPlan:
    """The writes that turn ``existing`` into ``desired`` (see the module docstring)."""
    _check_one_pool(desired, existing)
    current = max((int(_pool(s).get("generation", 0)) for s in existing), default=0)
    if _unchanged(desired, existing):
        return PublishPlan(generation=current)
    generation = current + 1
    by_name = {_name(s): s for s in existing}
    creates: list[JsonDict] = []
    updates: list[JsonDict] = []
    for obj in desired:
        body = _at_generation(obj, generation=generation, count=len(desired))
        old = by_name.get(_name(obj))
        if old is None:
            creates.append(body)
        else:
            body["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
            updates.append(body)
    wanted = {_name(s) for s in desired}
    deletes = [_deletion(s) for s in existing if _name(s) not in wanted]
    return PublishPlan(
        generation=generation,
        creates=tuple(creates),
        updates=tuple(updates),
        deletes=tuple(deletes),
    )


def _deletion(obj: Mapping[str, Any]) -> SliceDeletion:
    metadata = obj["metadata"]
    return SliceDeletion(
        name=metadata["name"], uid=metadata["uid"], resource_version=metadata["resourceVersion"]
    )


def _at_generation(obj: JsonDict, *, generation: int, count: int) -> JsonDict:
    body = copy.deepcopy(obj)
    body["spec"]["pool"]["generation"] = generation
    body["spec"]["pool"]["resourceSliceCount"] = count
    return body


def _unchanged(desired: Sequence[JsonDict], existing: Sequence[Mapping[str, Any]]) -> bool:
    if len(desired) != len(existing) or not existing:
        return False
    if len({_pool(s).get("generation") for s in existing}) != 1:
        return False  # a half-finished publish: finish it under a new generation
    if any(_pool(s).get("resourceSliceCount") != len(existing) for s in existing):
        return False
    by_name = {_name(s): s for s in existing}
    return all(
        _name(s) in by_name and comparable(s) == comparable(by_name[_name(s)]) for s in desired
    )


def comparable(obj: Mapping[str, Any]) -> Any:
    """What of a slice counts for "unchanged": spec without generation, labels, owners."""
    spec = dict(obj.get("spec", {}))
    spec["pool"] = {"name": spec.get("pool", {}).get("name")}
    spec["devices"] = [_device(d) for d in spec.get("devices") or []]
    spec["sharedCounters"] = [
        {"name": c.get("name"), "counters": _quantities(c.get("counters"))}
        for c in spec.get("sharedCounters") or []
    ]
    metadata = obj.get("metadata", {})
    owners = [
        {key: ref.get(key) for key in ("apiVersion", "kind", "name", "uid", "controller")}
        for ref in metadata.get("ownerReferences") or []
    ]
    return _prune({"spec": spec, "labels": metadata.get("labels"), "owners": owners})


def _device(device: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(device)
    out["capacity"] = {
        name: _capacity(entry) for name, entry in _quantities(device.get("capacity")).items()
    }
    # false and absent mean the same to the scheduler; only true is ever written.
    out["allowMultipleAllocations"] = device.get("allowMultipleAllocations") or None
    out["consumesCounters"] = [
        {"counterSet": c.get("counterSet"), "counters": _quantities(c.get("counters"))}
        for c in device.get("consumesCounters") or []
    ]
    out["taints"] = [
        {k: v for k, v in t.items() if k != "timeAdded"} for t in device.get("taints") or []
    ]
    out["nodeAllocatableResources"] = {
        name: _overhead(entry)
        for name, entry in (device.get("nodeAllocatableResources") or {}).items()
    }
    return out


def _overhead(entry: Mapping[str, Any]) -> dict[str, Any]:
    """A nodeAllocatableResources entry with its overhead's quantities by value."""
    overhead = entry.get("overhead")
    if not isinstance(overhead, Mapping):
        return dict(entry)
    return {**entry, "overhead": {key: _value(value) for key, value in overhead.items()}}


def _quantities(entries: Mapping[str, Any] | None) -> dict[str, Any]:
    return {
        name: {**entry, "value": _value(entry.get("value"))}
        for name, entry in (entries or {}).items()
    }


def _capacity(entry: Mapping[str, Any]) -> dict[str, Any]:
    """A capacity with its request policy's quantities compared by value too."""
    policy = entry.get("requestPolicy")
    if not isinstance(policy, Mapping):
        return dict(entry)
    bounds = policy.get("validRange")
    normal: dict[str, Any] = {
        **policy,
        "default": _value(policy.get("default")),
        "validValues": [_value(v) for v in policy.get("validValues") or []],
    }
    if isinstance(bounds, Mapping):
        normal["validRange"] = {key: _value(bounds[key]) for key in bounds}
    return {**entry, "requestPolicy": normal}


def _value(text: Any) -> Decimal | Any:
    try:
        return parse_quantity(text)
    except QuantityError:
        return text  # not ours to judge here; unequal strings stay unequal


def _prune(value: Any) -> Any:
    """Drop None, empty lists and empty maps, as the API server's JSON omits them."""
    if isinstance(value, Mapping):
        pruned = {k: _prune(v) for k, v in value.items()}
        return {k: v for k, v in pruned.items() if v not in (None, [], {})}
    if isinstance(value, list | tuple):
        return [_prune(v) for v in value]
    return value

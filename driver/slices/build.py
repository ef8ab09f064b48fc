"""ResourceSlice objects (``resource.k8s.io/v1``) for one pool of devices.

``build_slices`` turns ``Device`` objects into plain JSON dicts, ready for the API
server, split under the per-slice limits (``docs/design.md#resourceslice-limits``): at most 128
devices per slice, 64 once a slice holds a device with taints or counter
consumptions, at most 2048 consumed counters per slice (summed over its devices'
``consumesCounters``), and shared counters in slices of their own (at most 8 counter
sets each). Counter slices come first, then device slices, all numbered in one sequence.

The output is a pure function of the input: devices are sorted by a natural key
(``gpu-2`` before ``gpu-10``), attribute and capacity maps by name, and slice names
are derived from pool, driver and position (``<pool>-<driver with dots as dashes>-<n>``,
hashed down when longer than a DNS subdomain allows). An unchanged inventory
therefore yields byte-identical slices, and ``drasil.driver.slices.plan`` can match them
to existing ones by name.

``drasil.driver.slices.validate`` holds the limits and the API server's rules;
``build_slices`` runs its ``validate_slice`` on every slice.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from drasil.api.quantity import format_bytes
from drasil.driver.devices import (
    CapacityPolicy,
    CounterConsumption,
    CounterSet,
    Device,
    attribute_json,
)
from drasil.driver.objects import JsonDict
from drasil.driver.slices.validate import (
    MAX_CONSUMED_COUNTERS_PER_SLICE,
    MAX_COUNTER_SETS_PER_SLICE,
    MAX_DEVICES_PER_SLICE,
    MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS,
    MAX_SUBDOMAIN,
    SliceValidationError,
    TaintEffect,
    consumed_counters,
    is_restricted,
    validate_slice,
)

API_VERSION = "resource.k8s.io/v1"
KIND = "ResourceSlice"

_EMPTY: Mapping[str, Any] = MappingProxyType({})


@dataclass(frozen=True)
class Taint:
    """A device taint; ``time_added`` (RFC 3339) is filled in by the API server if None."""

    key: str
    effect: TaintEffect
    value: str = ""
    time_added: str | None = None


@dataclass(frozen=True)
class OwnerRef:
    """The owner of a pool's slices; node-local slices are owned by their Node."""

    api_version: str
    kind: str
    name: str
    uid: str
    controller: bool = True

    @classmethod
    def node(cls, *, name: str, uid: str) -> OwnerRef:
        return cls(api_version="v1", kind="Node", name=name, uid=uid)

    def to_json(self) -> JsonDict:
        return {
            "apiVersion": self.api_version,
            "kind": self.kind,
            "name": self.name,
            "uid": self.uid,
            "controller": self.controller,
        }


def natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key that orders digit runs by value: ``gpu-2`` before ``gpu-10``."""
    return tuple(
        (0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", name) if part
    )


def _dns_subdomain_of(text: str) -> str:
    cleaned = re.sub(r"[^a-z0-9.-]", "-", text.lower())
    labels = [label.strip("-") for label in cleaned.split(".")]
    return ".".join(label for label in labels if label) or "pool"


def slice_name(*, pool: str, driver: str, index: int) -> str:
    """``<pool>-<driver with dots as dashes>-<index>``, always a valid object name."""
    base = _dns_subdomain_of(f"{pool}-{driver.replace('.', '-')}")
    suffix = f"-{index}"
    room = MAX_SUBDOMAIN - len(suffix)
    if len(base) > room:
        # Keep names unique when long pools share a prefix: end them with a hash.
        digest = hashlib.sha256(f"{pool}\0{driver}".encode()).hexdigest()[:10]
        base = f"{base[: room - 11].rstrip('-.')}-{digest}"
    return base + suffix


# -- building ---------------------------------------------------------------------


def quantity(value: int) -> str:
    """A capacity or counter value as a Quantity: ``80Gi`` for whole MiB, else ``14``."""
    if value >= 2**20 and value % 2**20 == 0:
        return format_bytes(value)
    return str(value)


def _counters(counters: Mapping[str, int]) -> JsonDict:
    return {name: {"value": quantity(counters[name])} for name in sorted(counters)}


def _request_policy(policy: CapacityPolicy) -> JsonDict:
    valid_range: JsonDict = {"min": quantity(policy.minimum)}
    if policy.maximum is not None:
        valid_range["max"] = quantity(policy.maximum)
    if policy.step is not None:
        valid_range["step"] = quantity(policy.step)
    return {"default": quantity(policy.default), "validRange": valid_range}


def _capacity(device: Device) -> JsonDict:
    out = _counters(device.capacity)
    for name in sorted(device.capacity_policies):
        if name not in out:
            # A policy for a capacity the device lacks is a discovery bug; the API
            # server would not see it at all, so fail here where it is clear.
            raise SliceValidationError(
                f'device "{device.name}": request policy for unknown capacity "{name}"'
            )
        out[name]["requestPolicy"] = _request_policy(device.capacity_policies[name])
    return out


def _taint(taint: Taint) -> JsonDict:
    out: JsonDict = {"key": taint.key}
    if taint.value:
        out["value"] = taint.value
    out["effect"] = taint.effect.value
    if taint.time_added is not None:
        out["timeAdded"] = taint.time_added
    return out


def _device(
    device: Device, taints: Sequence[Taint], consumes: Sequence[CounterConsumption]
) -> JsonDict:
    out: JsonDict = {"name": device.name}
    if device.attributes:
        attrs = device.attributes
        out["attributes"] = {name: attribute_json(attrs[name]) for name in sorted(attrs)}
    if device.capacity:
        out["capacity"] = _capacity(device)
    if device.allow_multiple_allocations:
        out["allowMultipleAllocations"] = True
    if consumes:
        out["consumesCounters"] = [
            {"counterSet": c.counter_set, "counters": _counters(c.counters)} for c in consumes
        ]
    if taints:
        out["taints"] = [_taint(t) for t in taints]
    out.update(_binding(device))
    if device.host_resources:
        # drasil.driver.hostresources: an overhead each Pod using the device takes.
        hosts = device.host_resources
        out["nodeAllocatableResources"] = {
            name: {"overhead": {"perPod": hosts[name]}} for name in sorted(hosts)
        }
    return out


def _binding(device: Device) -> JsonDict:
    out: JsonDict = {}
    if device.binds_to_node:
        out["bindsToNode"] = True
    if device.binding_conditions:
        out["bindingConditions"] = list(device.binding_conditions)
    if device.binding_failure_conditions:
        out["bindingFailureConditions"] = list(device.binding_failure_conditions)
    return out


def _device_chunks(devices: Sequence[JsonDict]) -> Iterator[list[JsonDict]]:
    chunk: list[JsonDict] = []
    restricted = False
    consumed = 0
    for device in devices:
        would_restrict = restricted or is_restricted(device)
        limit = (
            MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS
            if would_restrict
            else MAX_DEVICES_PER_SLICE
        )
        counters = consumed_counters(device)
        if chunk and (
            len(chunk) + 1 > limit or consumed + counters > MAX_CONSUMED_COUNTERS_PER_SLICE
        ):
            yield chunk
            chunk, would_restrict, consumed = [], is_restricted(device), 0
        chunk.append(device)
        restricted = would_restrict
        consumed += counters
    if chunk:
        yield chunk


def _counter_chunks(counter_sets: Sequence[CounterSet]) -> Iterator[list[JsonDict]]:
    ordered = sorted(counter_sets, key=lambda c: natural_key(c.name))
    for start in range(0, len(ordered), MAX_COUNTER_SETS_PER_SLICE):
        chunk = ordered[start : start + MAX_COUNTER_SETS_PER_SLICE]
        yield [{"name": c.name, "counters": _counters(c.counters)} for c in chunk]


def _node_selection(
    *, node_name: str | None, node_selector: Mapping[str, Any] | None, all_nodes: bool
) -> JsonDict:
    chosen = [node_name is not None, node_selector is not None, all_nodes]
    if sum(chosen) != 1:
        raise ValueError("set exactly one of node_name, node_selector and all_nodes")
    if node_name is not None:
        return {"nodeName": node_name}
    if node_selector is not None:
        return {"nodeSelector": dict(node_selector)}
    return {"allNodes": True}


def _check_inputs(
    devices: Sequence[Device],
    taints: Mapping[str, Sequence[Taint]],
    consumes: Mapping[str, Sequence[CounterConsumption]],
) -> None:
    names = [d.name for d in devices]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise SliceValidationError(f"device names used more than once: {', '.join(duplicates)}")
    # Taints or counters for a device we do not publish are a caller bug, not a no-op.
    unknown = sorted((set(taints) | set(consumes)) - set(names))
    if unknown:
        raise SliceValidationError(f"taints or counters for unknown devices: {', '.join(unknown)}")


def build_slices(
    *,
    driver: str,
    pool: str,
    devices: Sequence[Device],
    node_name: str | None = None,
    node_selector: Mapping[str, Any] | None = None,
    all_nodes: bool = False,
    taints: Mapping[str, Sequence[Taint]] = _EMPTY,
    counter_sets: Sequence[CounterSet] = (),
    consumes: Mapping[str, Sequence[CounterConsumption]] = _EMPTY,
    generation: int,
    owner: OwnerRef | None,
    labels: Mapping[str, str] = _EMPTY,
) -> list[JsonDict]:
    """All ResourceSlices of one pool (see the module docstring).

    Exactly one of ``node_name``, ``node_selector`` (a NodeSelector with one term) and
    ``all_nodes`` must be given; ``taints`` and ``consumes`` are keyed by device name.
    A pool without devices and counters still gets one empty slice, so consumers can
    tell "no devices" from "not published". ``generation`` is written as given;
    ``drasil.driver.slices.plan.plan_publish`` replaces it with the pool's next one.
    """
    selection = _node_selection(
        node_name=node_name, node_selector=node_selector, all_nodes=all_nodes
    )
    ordered = sorted(devices, key=lambda d: (natural_key(d.name), d.name))
    _check_inputs(ordered, taints, consumes)
    device_objects = [
        _device(d, taints.get(d.name, ()), consumes.get(d.name, d.consumes_counters))
        for d in ordered
    ]
    bodies: list[JsonDict] = [{"sharedCounters": c} for c in _counter_chunks(counter_sets)]
    bodies += [{"devices": chunk} for chunk in _device_chunks(device_objects)]
    if not bodies:
        bodies = [{"devices": []}]
    slices = [
        _slice(
            name=slice_name(pool=pool, driver=driver, index=index),
            spec={
                "driver": driver,
                "pool": {"name": pool, "generation": generation, "resourceSliceCount": len(bodies)},
                **selection,
                **body,
            },
            owner=owner,
            labels=labels,
        )
        for index, body in enumerate(bodies)
    ]
    _check_counter_references(slices)
    for obj in slices:
        validate_slice(obj)
    return slices


def _slice(
    *, name: str, spec: JsonDict, owner: OwnerRef | None, labels: Mapping[str, str]
) -> JsonDict:
    metadata: JsonDict = {"name": name}
    if labels:
        metadata["labels"] = {key: labels[key] for key in sorted(labels)}
    if owner is not None:
        metadata["ownerReferences"] = [owner.to_json()]
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata, "spec": spec}


def _check_counter_references(slices: Sequence[JsonDict]) -> None:
    known: dict[str, set[str]] = {}
    for obj in slices:
        for counter_set in obj["spec"].get("sharedCounters", ()):
            known[counter_set["name"]] = set(counter_set["counters"])
    for obj in slices:
        for device in obj["spec"].get("devices", ()):
            for use in device.get("consumesCounters", ()):
                missing = set(use["counters"]) - known.get(use["counterSet"], set())
                if use["counterSet"] not in known or missing:
                    raise SliceValidationError(
                        f'device "{device["name"]}": consumesCounters: counter set '
                        f'"{use["counterSet"]}" or counters {sorted(missing)} are not in the pool'
                    )

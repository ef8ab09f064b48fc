"""What a pending claim is explained against: the devices of complete pools, their holders.

``build_inventory`` reads the driver's ResourceSlices as the scheduler does (newest
generation of complete pools only), converts each device to CEL values once and
indexes the pools' shared counter sets (read lazily by ``counters``);
``build_usage`` counts which devices (and how much of shareable ones) other claims
already hold. Both are pure: the callers fetch the JSON.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, cast

from drasil.api.quantity import QuantityError, format_bytes, parse_quantity
from drasil.driver.cel.selectors import CelDevice, CelDeviceCache, SelectorResult
from drasil.driver.objects import DeviceClass, JsonObject, ResourceClaim, mapping, meta, objects

DeviceKey = tuple[str, str]  # (pool, device) within one driver
SetKey = tuple[str, str]  # (pool, counter set) within one driver


# --- the devices the scheduler considers -------------------------------------------


@dataclass(frozen=True)
class InventoryDevice:
    """One device of a complete pool, with its CEL form converted once."""

    pool: str
    name: str
    spec: JsonObject
    cel: CelDevice
    # The one node the device is reachable from (a node-local slice, or the device's
    # own nodeName with perDeviceNodeSelection); None for allNodes and nodeSelector.
    node: str | None = None

    @property
    def key(self) -> DeviceKey:
        return (self.pool, self.name)


@dataclass(frozen=True)
class Inventory:
    """The driver's devices the allocator would look at, and pools it would skip."""

    driver: str
    devices: tuple[InventoryDevice, ...]
    incomplete_pools: tuple[str, ...] = ()
    # Every definition of each counter set, as published: a set defined twice in a
    # pool is the pool's error, and ``counters`` reports it rather than picking one.
    counter_sets: Mapping[SetKey, tuple[JsonObject, ...]] = field(default_factory=dict)
    # Each selector's result per device, filled as explanations evaluate them: the
    # pending claims of one round mostly ask through the same class and selectors, and
    # a device's result cannot change while the inventory lives (built anew from the
    # slices for each round). Only what an explanation evaluated is kept, no longer
    # than the inventory. By expression, then by the device object's id (the devices
    # live as long as the inventory).
    selected: dict[str, dict[int, SelectorResult]] = field(
        default_factory=dict, compare=False, repr=False
    )


def object_spec(obj: JsonObject) -> JsonObject:
    return cast(JsonObject, obj.get("spec") or {})


def _generation(obj: JsonObject) -> int:
    return int((object_spec(obj).get("pool") or {}).get("generation") or 0)


def build_inventory(
    slices: Iterable[JsonObject], *, driver: str, cache: CelDeviceCache | None = None
) -> Inventory:
    """Devices of ``driver`` from the newest generation of each complete pool."""
    pools: dict[str, list[JsonObject]] = defaultdict(list)
    for obj in slices:
        spec = object_spec(obj)
        if spec.get("driver") == driver:
            pools[str((spec.get("pool") or {}).get("name", ""))].append(obj)
    devices: list[InventoryDevice] = []
    incomplete: list[str] = []
    counter_sets: dict[SetKey, list[JsonObject]] = defaultdict(list)
    for pool, members in sorted(pools.items()):
        newest = max(_generation(s) for s in members)
        current = [s for s in members if _generation(s) == newest]
        wanted = int((object_spec(current[0]).get("pool") or {}).get("resourceSliceCount") or 1)
        if len(current) < wanted:
            # The scheduler waits for every slice of the newest generation.
            incomplete.append(f"{pool} ({len(current)} of {wanted} slices)")
            continue
        devices.extend(_pool_devices(pool, current, cache))
        for counter_set in _shared_counters(current):
            counter_sets[(pool, str(counter_set.get("name", "")))].append(counter_set)
    return Inventory(
        driver=driver,
        devices=tuple(devices),
        incomplete_pools=tuple(incomplete),
        counter_sets={k: tuple(v) for k, v in counter_sets.items()},
    )


def _shared_counters(slices: Sequence[JsonObject]) -> Iterator[JsonObject]:
    """The counter sets of a pool's slices; malformed entries are skipped here and
    show up as missing sets for the devices that reference them."""
    for obj in slices:
        entries = object_spec(obj).get("sharedCounters") or []
        if isinstance(entries, list):
            yield from (e for e in entries if isinstance(e, Mapping))


def _pool_devices(
    pool: str, slices: Sequence[JsonObject], cache: CelDeviceCache | None
) -> Iterator[InventoryDevice]:
    for obj in slices:
        specs = object_spec(obj).get("devices") or []
        converted = cache.devices(obj) if cache is not None else None
        slice_node = object_spec(obj).get("nodeName") or None
        for index, spec in enumerate(specs):
            cel = (
                converted[index]
                if converted is not None
                else CelDevice.from_json(spec, driver=str(object_spec(obj)["driver"]))
            )
            node = slice_node or spec.get("nodeName") or None
            yield InventoryDevice(
                pool=pool, name=str(spec.get("name", "")), spec=spec, cel=cel, node=node
            )


# --- who holds what ----------------------------------------------------------------


@dataclass(frozen=True)
class Usage:
    """Devices of the driver held by allocated claims (admin access holds nothing)."""

    holders: Mapping[DeviceKey, tuple[str, ...]]
    consumed: Mapping[DeviceKey, Mapping[str, Decimal]]


def claim_ref(claim: JsonObject) -> str:
    return meta(claim).ref


def build_usage(claims: Iterable[JsonObject], *, driver: str, skip_uid: str = "") -> Usage:
    """What the allocated ``claims`` hold; ``skip_uid`` is the claim being explained."""
    return usage_of(_holdings(claims, driver=driver, skip_uid=skip_uid))


def _holdings(
    claims: Iterable[JsonObject], *, driver: str, skip_uid: str
) -> Iterator[tuple[str, tuple[JsonObject, ...]]]:
    for claim in claims:
        results = ResourceClaim(claim).results(driver)
        if results and not (skip_uid and meta(claim).uid == skip_uid):
            yield claim_ref(claim), results


def usage_of(holdings: Iterable[tuple[str, Iterable[JsonObject]]]) -> Usage:
    """What claims hold, given as (``namespace/name``, the driver's allocation results)
    of each: ``build_usage`` without reading the claims' JSON, for a caller that keeps
    the results already (the controller: thousands of claims each round)."""
    holders: dict[DeviceKey, list[str]] = defaultdict(list)
    consumed: dict[DeviceKey, dict[str, Decimal]] = defaultdict(dict)
    for ref, results in holdings:
        for result in results:
            if result.get("adminAccess"):
                continue
            key = (str(result.get("pool", "")), str(result.get("device", "")))
            if result.get("shareID"):
                _add_consumed(consumed[key], result.get("consumedCapacity") or {})
            holders[key].append(ref)
    return Usage(
        holders={k: tuple(sorted(set(v))) for k, v in holders.items()},
        consumed=dict(consumed),
    )


def _add_consumed(total: dict[str, Decimal], consumed: Mapping[str, Any]) -> None:
    for name, value in consumed.items():
        amount = quantity_value(value)
        if amount is not None:
            total[name] = total.get(name, Decimal(0)) + amount


def quantity_value(value: object) -> Decimal | None:
    try:
        return parse_quantity(str(value))
    except QuantityError:
        return None


def amount_text(value: Decimal) -> str:
    """An amount as users write quantities: ``12Gi``, ``1536Mi`` for whole MiB (bytes
    in binary units), else the plain number: ``25``, ``0.5`` (never ``5E-7``)."""
    if value == value.to_integral_value():
        whole = int(value)
        if whole >= 2**20 and whole % 2**20 == 0:
            return format_bytes(whole)
        return str(whole)
    return format(value.normalize(), "f")


# --- DeviceClasses -----------------------------------------------------------------


def is_driver_class(device_class: JsonObject, driver: str) -> bool:
    """Whether a DeviceClass selects devices of ``driver``.

    Classes name their driver in a selector (``device.driver == "gpu.drasil.dev"`` or
    ``device.attributes["gpu.drasil.dev"]...``) or in an opaque config entry.
    """
    view = DeviceClass(device_class)
    quoted = (f'"{driver}"', f"'{driver}'")
    if any(q in expression for expression in view.expressions for q in quoted):
        return True
    return any(mapping(entry.get("opaque")).get("driver") == driver for entry in view.config)


def request_classes(claim_spec: JsonObject) -> set[str]:
    """The DeviceClass names a claim spec (``spec`` of a claim) uses."""
    names: set[str] = set()
    for request in objects(mapping(claim_spec.get("devices")).get("requests")):
        exactly = request.get("exactly")
        if exactly and exactly.get("deviceClassName"):
            names.add(str(exactly["deviceClassName"]))
        for sub in request.get("firstAvailable") or []:
            if sub.get("deviceClassName"):
                names.add(str(sub["deviceClassName"]))
    return names

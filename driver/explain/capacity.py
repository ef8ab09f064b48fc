"""Stage 4 of a request: does a device have the capacity the request asks for?

For a device without ``allowMultipleAllocations`` a ``capacity.requests`` amount is a
lower bound on the device's capacity, nothing more. A device with
``allowMultipleAllocations`` (KEP-5075) is shared: every allocation consumes from
each of its capacities, and the scheduler fits the allocation into what the other
claims' ``consumedCapacity`` left. What one allocation consumes, per capacity:

- an amount the request names, rounded up by the capacity's ``requestPolicy``: to
  ``validRange.min``, then to ``min + n * step``, refused above ``validRange.max``;
  or to the smallest of ``validValues`` that covers it, refused above the largest;
- for a capacity the request does not name, the policy's ``default``, and without a
  policy (or a default) the whole capacity.

``shortfall`` says why one device does not fit, ``shortfall_texts`` words a
request's shortfalls grouped by capacity, naming the amounts: ``gpu-1 has 12Gi of
memory left; request needs 20Gi``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from enum import StrEnum
from typing import Any

from drasil.driver.explain.inventory import InventoryDevice, amount_text, quantity_value

JsonEntry = Mapping[str, Any]
MAX_CAPACITY_GROUPS = 3


class Why(StrEnum):
    """Why a device's capacity does not cover a request."""

    LEFT = "left"  # shared: other claims left too little
    SIZE = "size"  # not shared: the device is too small
    POLICY = "policy"  # shared: the request asks more than one allocation may take
    MISSING = "missing"  # the device has no such capacity


@dataclass(frozen=True)
class Shortfall:
    """One device that does not fit, on its first capacity that falls short."""

    device: str
    capacity: str  # as users write it: bare for the driver's own capacities
    why: Why
    have: Decimal = Decimal(0)  # left, size, or the policy's largest allowed amount
    needed: Decimal = Decimal(0)  # after the policy's rounding


def _display(name: str, driver: str) -> str:
    domain, _, ident = name.rpartition("/")
    return ident if domain in ("", driver) else name


def _entries(device: InventoryDevice, driver: str) -> dict[str, JsonEntry]:
    return {
        _display(str(k), driver): v or {} for k, v in (device.spec.get("capacity") or {}).items()
    }


def _valid_values(policy: JsonEntry) -> list[Decimal]:
    found = (quantity_value(x) for x in policy.get("validValues") or [])
    return [v for v in found if v is not None]


def _rounded(amount: Decimal, policy: JsonEntry) -> Decimal | None:
    """The amount one allocation takes for ``amount`` asked; None when the policy refuses."""
    values = _valid_values(policy)
    if policy.get("validValues"):
        return min((v for v in values if v >= amount), default=None)
    bounds = policy.get("validRange")
    if not isinstance(bounds, Mapping):
        return amount
    low = quantity_value(bounds.get("min")) or Decimal(0)
    step = quantity_value(bounds.get("step"))
    high = quantity_value(bounds.get("max"))
    taken = max(amount, low)
    if step:
        taken = low + math.ceil((taken - low) / step) * step
    return None if high is not None and taken > high else taken


def _policy_limit(policy: JsonEntry, value: Decimal) -> Decimal:
    values = _valid_values(policy)
    if values:
        return max(values)
    bounds = policy.get("validRange") or {}
    return quantity_value(bounds.get("max")) or value


def _consumption(entry: JsonEntry, asked: Decimal | None) -> Decimal | None:
    """What one allocation takes of a shared capacity; None when the policy refuses."""
    policy = entry.get("requestPolicy") or {}
    value = quantity_value(entry.get("value")) or Decimal(0)
    if asked is None:
        default = quantity_value(policy.get("default"))
        return value if default is None else default
    return _rounded(asked, policy)


def _asked(wanted: Mapping[str, Any], driver: str) -> dict[str, Decimal | None]:
    return {_display(str(k), driver): quantity_value(v) for k, v in wanted.items()}


def shortfall(
    device: InventoryDevice,
    wanted: Mapping[str, Any],
    *,
    used: Mapping[str, Decimal],
    driver: str,
) -> Shortfall | None:
    """Why ``device`` cannot take the request's ``capacity.requests`` (``wanted``), or
    None when it can; ``used`` is what other claims consume of it (shared devices)."""
    entries = _entries(device, driver)
    asked = _asked(wanted, driver)
    for name in asked:
        if name not in entries:
            return Shortfall(device.name, name, Why.MISSING)
    if not device.spec.get("allowMultipleAllocations"):
        return _size_shortfall(device.name, entries, asked)
    taken = {_display(k, driver): v for k, v in used.items()}
    # The named capacities first: they are what the user asked about.
    for name in [*asked, *sorted(set(entries) - set(asked))]:
        found = _shared_shortfall(device.name, name, entries[name], asked.get(name), taken)
        if found is not None:
            return found
    return None


def _size_shortfall(
    device: str, entries: Mapping[str, JsonEntry], asked: Mapping[str, Decimal | None]
) -> Shortfall | None:
    for name, amount in asked.items():
        value = quantity_value(entries[name].get("value")) or Decimal(0)
        if amount is None or amount > value:
            return Shortfall(device, name, Why.SIZE, have=value, needed=amount or Decimal(0))
    return None


def _shared_shortfall(
    device: str,
    name: str,
    entry: JsonEntry,
    asked: Decimal | None,
    taken: Mapping[str, Decimal],
) -> Shortfall | None:
    value = quantity_value(entry.get("value")) or Decimal(0)
    needed = _consumption(entry, asked)
    if needed is None:
        limit = _policy_limit(entry.get("requestPolicy") or {}, value)
        return Shortfall(device, name, Why.POLICY, have=limit, needed=asked or Decimal(0))
    left = value - taken.get(name, Decimal(0))
    if needed > left:
        return Shortfall(device, name, Why.LEFT, have=left, needed=needed)
    return None


# --- wording -----------------------------------------------------------------------


def shortfall_texts(shortfalls: Sequence[Shortfall]) -> list[str]:
    """One text per capacity and reason, the largest groups first."""
    groups: dict[tuple[Why, str], list[Shortfall]] = defaultdict(list)
    for item in shortfalls:
        groups[item.why, item.capacity].append(item)
    ordered = sorted(groups.values(), key=len, reverse=True)
    texts = [_group_text(group) for group in ordered[:MAX_CAPACITY_GROUPS]]
    rest = sum(len(g) for g in ordered[MAX_CAPACITY_GROUPS:])
    if rest:
        texts.append(f"{rest} more devices short of other capacities")
    return texts


def _group_text(group: Sequence[Shortfall]) -> str:
    best = max(group, key=lambda s: s.have)
    name, have, needed = best.capacity, amount_text(best.have), amount_text(best.needed)
    if best.why is Why.MISSING:
        return _lead(group, f"{best.device} has", "have") + f" no capacity {name}"
    if best.why is Why.POLICY:
        if len(group) == 1:
            return (
                f"{best.device} allows at most {have} of {name} per allocation; "
                f"request asks {needed}"
            )
        return (
            f"{len(group)} devices: at most {have} of {name} per allocation on "
            f"{best.device}; request asks {needed}"
        )
    left = " left" if best.why is Why.LEFT else ""
    if len(group) == 1:
        return f"{best.device} has {have} of {name}{left}; request needs {needed}"
    most = "most" if left else "largest"
    return (
        f"{len(group)} devices: {most} {name}{left} {have} on {best.device}; request needs {needed}"
    )


def _lead(group: Sequence[Shortfall], one: str, many: str) -> str:
    return one if len(group) == 1 else f"{len(group)} devices {many}"

"""Shared counters (partitionable devices, KEP-4815) as the scheduler checks them.

A device may list ``consumesCounters``: amounts it draws from counter sets that the
slices of its own pool publish in ``sharedCounters``. The scheduler allocates it only
while every counter it draws still covers the amount after what the allocated devices
of all claims draw (admin-access results draw nothing). ``CounterBook`` reads the
sets and the devices' draws lazily, once per explanation, so claims on pools without
counters pay nothing; ``shortage_texts`` words why devices were left out, grouped per
counter set and profile (or device):

    gpu-2: placements of 3g.40gb need memory slices 4\u20137, held by claim team-a/train-1
    amdgpu-1: DPX partitions need XCD 4, held by claim team-a/train-1

Counters that number parts of a GPU read as ranges: ``memory-slice-<n>`` (drasil's MIG
memory slices) and ``xcd-<n>`` (an AMD GPU's compute dies, ``--amd-partition-mode
dynamic``); ``passthrough`` (a GPU and its device for VMs, ``--passthrough``) as whom
the GPU is with; other counters by name with what is needed and what is left.

Published counters are untrusted input. A quantity that does not parse or is negative,
a set that is missing or defined twice, a counter the set does not have: the device
drawing on it is unusable (``Draw.unusable`` says why), as it is for the scheduler.
A set or draw with more counters than ``MAX_COUNTERS`` is not read at all
(``Draw.unchecked``), and the explanation says it is incomplete.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from types import MappingProxyType
from typing import Any, Final

from drasil.api.quantity import QuantityError, parse_quantity
from drasil.driver.explain.inventory import (
    DeviceKey,
    Inventory,
    InventoryDevice,
    SetKey,
    Usage,
    amount_text,
)

CounterKey = tuple[str, str, str]  # (pool, counter set, counter)
MAX_COUNTERS: Final = 64
"""Counters read from one set, or from one device's draw on a set: twice the API
server's 32 per set, so every valid slice is read whole and a hostile one costs no
more than this per set."""
MAX_DRAWN_SETS: Final = 8  # the API server allows 2; more is not worth reading
MAX_LISTED: Final = 4  # placements, slice ranges or counters named in one group
MAX_HOLDERS_NAMED: Final = 3
SLICE_COUNTER: Final = re.compile(r"memory-slice-(\d{1,4})")
DIE_COUNTER: Final = re.compile(r"xcd-(\d{1,4})")
# Numbered counters read as ranges, with their nouns (one, several).
UNIT_COUNTERS: Final = (
    (SLICE_COUNTER, "memory slice", "memory slices"),
    (DIE_COUNTER, "XCD", "XCDs"),
)
EN_DASH: Final = "\u2013"  # ranges read "4\u20137", as typeset ranges do
_NOTHING: Final[Mapping[CounterKey, Decimal]] = MappingProxyType({})


class _Unusable(Exception):
    """The scheduler cannot allocate the device: its counters are broken."""


class _Unchecked(Exception):
    """Too many counters to read: the device is left unchecked."""


@dataclass(frozen=True)
class Draw:
    """What one device draws from its pool's counter sets when allocated."""

    amounts: Mapping[CounterKey, Decimal]
    unusable: str = ""  # why the scheduler cannot allocate the device at all
    unchecked: str = ""  # why explain did not read the device's counters


NO_DRAW: Final = Draw(_NOTHING)


@dataclass
class _SetValues:
    values: dict[str, Decimal] = field(default_factory=dict)
    bad: dict[str, str] = field(default_factory=dict)  # counter -> why it is unusable
    error: str = ""  # why no device may draw on the set
    unchecked: str = ""


@dataclass(frozen=True)
class Shortage:
    """A device left out for want of counters: what it lacks and who holds it."""

    device: InventoryDevice
    short: Mapping[CounterKey, tuple[Decimal, Decimal]]  # counter -> (needed, left)
    # Per short counter: other claims whose devices draw on it, and (the joint check)
    # requests of the claim itself.
    claims: Mapping[CounterKey, tuple[str, ...]] = field(default_factory=dict)
    requests: Mapping[CounterKey, tuple[str, ...]] = field(default_factory=dict)


class CounterBook:
    """The counter sets of an inventory and what allocated devices draw from them.

    Everything is read on first use and remembered, so each set and each device's
    draw is parsed at most once per explanation.
    """

    def __init__(self, inventory: Inventory, usage: Usage) -> None:
        self._inventory = inventory
        self._usage = usage
        self._sets: dict[SetKey, _SetValues] = {}
        self._draws: dict[DeviceKey, Draw] = {}
        self._taken: dict[CounterKey, Decimal] | None = None
        self._takers: dict[CounterKey, set[str]] = defaultdict(set)

    def draw(self, device: InventoryDevice) -> Draw:
        if not device.spec.get("consumesCounters"):
            return NO_DRAW
        draw = self._draws.get(device.key)
        if draw is None:
            draw = self._draws[device.key] = self._read_draw(device)
        return draw

    def drawing_already(self, device: InventoryDevice) -> bool:
        """An allocated device (shared, or used with admin access) already draws its
        counters: allocating it again takes nothing more."""
        return device.key in self._usage.holders

    def left(self, key: CounterKey) -> Decimal:
        """What the allocated devices of other claims leave of one counter."""
        total = self._set(key[:2]).values.get(key[2], Decimal(0))
        return total - self._taken_by_others().get(key, Decimal(0))

    def takers(self, key: CounterKey) -> tuple[str, ...]:
        self._taken_by_others()
        return tuple(sorted(self._takers.get(key, ())))

    def shortage(
        self, device: InventoryDevice, *, also: Mapping[CounterKey, Decimal] = _NOTHING
    ) -> Shortage | None:
        """Why ``device`` cannot draw its counters (with ``also`` drawn besides)."""
        short = {
            key: (amount, self.left(key) - also.get(key, Decimal(0)))
            for key, amount in self.draw(device).amounts.items()
        }
        short = {key: pair for key, pair in short.items() if pair[0] > pair[1]}
        if not short:
            return None
        return Shortage(device, short, claims={key: self.takers(key) for key in short})

    def _taken_by_others(self) -> dict[CounterKey, Decimal]:
        if self._taken is None:
            self._taken = {}
            index = {d.key: d for d in self._inventory.devices}
            for key, holders in self._usage.holders.items():
                device = index.get(key)
                if device is None:
                    continue  # no longer published: the scheduler cannot count it either
                for counter, amount in self.draw(device).amounts.items():
                    self._taken[counter] = self._taken.get(counter, Decimal(0)) + amount
                    self._takers[counter].update(holders)
        return self._taken

    def _set(self, key: SetKey) -> _SetValues:
        values = self._sets.get(key)
        if values is None:
            values = self._sets[key] = _read_set(key, self._inventory.counter_sets.get(key, ()))
        return values

    def _read_draw(self, device: InventoryDevice) -> Draw:
        amounts: dict[CounterKey, Decimal] = {}
        try:
            for entry in _entries(device.spec.get("consumesCounters")):
                self._add_entry(device.pool, entry, amounts)
        except _Unusable as err:
            return Draw(amounts, unusable=str(err))
        except _Unchecked as err:
            return Draw(amounts, unchecked=str(err))
        return Draw(amounts)

    def _add_entry(
        self, pool: str, entry: Mapping[str, Any], amounts: dict[CounterKey, Decimal]
    ) -> None:
        name = _clip(entry.get("counterSet", ""))
        counters = entry.get("counters") or {}
        if not isinstance(counters, Mapping):
            raise _Unusable(f"its draw on counter set {name} is not a map of counters")
        if len(counters) > MAX_COUNTERS:
            raise _Unchecked(
                f"it draws {len(counters)} counters from counter set {name}, "
                f"more than the {MAX_COUNTERS} explain reads"
            )
        values = self._set((pool, name))
        if values.error:
            raise _Unusable(values.error)
        if values.unchecked:
            raise _Unchecked(values.unchecked)
        for counter, value in counters.items():
            amount = _quantity(value)
            if isinstance(amount, str):
                raise _Unusable(f"it draws {amount} of {_clip(counter)} from counter set {name}")
            if counter in values.bad:
                raise _Unusable(values.bad[counter])
            if counter not in values.values:
                raise _Unusable(f"counter set {name} has no counter {_clip(counter)}")
            key = (pool, name, str(counter))
            # Two entries for one set add up: the stricter reading of a malformed draw.
            amounts[key] = amounts.get(key, Decimal(0)) + amount


def _entries(value: object) -> Iterator[Mapping[str, Any]]:
    if not isinstance(value, list):
        raise _Unusable("consumesCounters is not a list")
    if len(value) > MAX_DRAWN_SETS:
        raise _Unchecked(
            f"it draws on {len(value)} counter sets, more than the {MAX_DRAWN_SETS} explain reads"
        )
    for entry in value:
        if not isinstance(entry, Mapping):
            raise _Unusable("a consumesCounters entry is not an object")
        yield entry


def _read_set(key: SetKey, found: Sequence[Mapping[str, Any]]) -> _SetValues:
    pool, name = key
    if not found:
        return _SetValues(error=f"counter set {name} does not exist in pool {pool}")
    if len(found) > 1:
        return _SetValues(error=f"counter set {name} is defined {len(found)} times in pool {pool}")
    counters = found[0].get("counters") or {}
    if not isinstance(counters, Mapping):
        return _SetValues(error=f"counter set {name} of pool {pool} has no map of counters")
    if len(counters) > MAX_COUNTERS:
        return _SetValues(
            unchecked=f"counter set {name} of pool {pool} has {len(counters)} counters, "
            f"more than the {MAX_COUNTERS} explain reads"
        )
    values = _SetValues()
    for counter, value in counters.items():
        amount = _quantity(value)
        if isinstance(amount, str):
            values.bad[str(counter)] = f"counter {_clip(counter)} of set {name} is {amount}"
        else:
            values.values[str(counter)] = amount
    return values


def _quantity(counter: object) -> Decimal | str:
    """A counter's ``{value: <quantity>}`` as a number, or what is wrong with it."""
    value = counter.get("value") if isinstance(counter, Mapping) else None
    try:
        amount = parse_quantity(str(value))
    except QuantityError:
        return f"an invalid quantity {_clip(value)!r}"
    if amount < 0:
        return f"a negative quantity {_clip(value)!r}"
    return amount


def _clip(value: object, limit: int = 40) -> str:
    text = str(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


# --- wording -----------------------------------------------------------------------


@dataclass(frozen=True)
class _Group:
    """The devices of one counter set and profile (or device) left out, worded."""

    where: str  # the counter set: ``gpu-2``, or ``node-a/gpu-2`` across pools
    what: str  # ``placements of 3g.40gb need memory slices 4\u20137``
    claims: frozenset[str]
    requests: frozenset[str]
    devices: int


def shortage_texts(shortages: Sequence[Shortage], *, driver: str) -> list[tuple[int, str]]:
    """(devices, text) per counter set and profile (or device), in device order.

    Sets whose texts differ only in the set and the holders share one text (``gpu-0,
    gpu-1 and gpu-2: placements of 4g.40gb need …``): eight GPUs of a node, or a
    hundred nodes, blocked alike read as one line, not as many.
    """
    by_set: dict[tuple[str, str, str], list[Shortage]] = defaultdict(list)
    for shortage in shortages:
        pool, name, _ = min(shortage.short)
        by_set[(pool, name, _subject_key(shortage.device, driver))].append(shortage)
    several_pools = len({key[0] for key in by_set}) > 1
    alike: dict[tuple[str, bool], list[_Group]] = defaultdict(list)
    for members in by_set.values():
        group = _group(members, several_pools=several_pools, driver=driver)
        alike[(group.what, bool(group.claims or group.requests))].append(group)
    return [(sum(g.devices for g in groups), _text(groups)) for groups in alike.values()]


def _text(groups: Sequence[_Group]) -> str:
    where = listing([g.where for g in groups], limit=MAX_LISTED)
    claims = sorted({c for g in groups for c in g.claims})
    requests = sorted({r for g in groups for r in g.requests})
    return f"{where}: {groups[0].what}{_holders(claims, requests)}"


def device_attribute(device: InventoryDevice, name: str, driver: str) -> object | None:
    """The value of a device's attribute, by bare or driver-qualified name."""
    attributes = device.spec.get("attributes") or {}
    entry = attributes.get(name) or attributes.get(f"{driver}/{name}")
    if not isinstance(entry, Mapping):
        return None
    return next((v for v in entry.values() if v is not None), None)


def _subject_key(device: InventoryDevice, driver: str) -> str:
    profile = device_attribute(device, "profile", driver)
    if isinstance(profile, str):
        return f"profile {profile}"
    mode = _partition_mode(device, driver)
    return f"mode {mode}" if mode else f"device {device.name}"


def _partition_mode(device: InventoryDevice, driver: str) -> str | None:
    """An AMD partition's compute mode (``CPX``), else None."""
    if device_attribute(device, "type", driver) != "amdgpu-partition":
        return None
    mode = device_attribute(device, "computePartition", driver)
    return mode if isinstance(mode, str) else None


def _group(members: Sequence[Shortage], *, several_pools: bool, driver: str) -> _Group:
    pool, name, _ = min(members[0].short)
    short_name = name.removesuffix("-counters") or name
    where = f"{pool}/{short_name}" if several_pools else short_name
    first = members[0].device
    profile = device_attribute(first, "profile", driver)
    mode = _partition_mode(first, driver)
    if isinstance(profile, str):
        subject, verb = f"placements of {profile}{_starts(members, driver)}", "need"
    elif mode is not None:
        subject, verb = f"{_clip(mode, 8)} partitions", "need"
    else:
        subject, verb = f"device {first.name}", "needs"
    pattern, units = _unit_needs(members)
    needs = units or _passthrough_needs(members, driver) or _counter_needs(members)
    # Name who holds the counters the text names, not every short one.
    named = [
        key
        for m in members
        for key in m.short
        if pattern is None or pattern.fullmatch(key[2]) is not None
    ]
    return _Group(
        where=where,
        what=f"{subject} {verb} {needs}",
        claims=frozenset(c for m in members for key in named for c in m.claims.get(key, ())),
        requests=frozenset(r for m in members for key in named for r in m.requests.get(key, ())),
        devices=len(members),
    )


PASSTHROUGH_COUNTER: Final = "passthrough"
_VFIO_TYPES: Final = frozenset({"vfio", "amdgpu-vfio"})


def _passthrough_needs(members: Sequence[Shortage], driver: str) -> str:
    """The one counter a GPU and its passthrough device draw (``--passthrough``), said
    as what it is: the GPU is with a VM, or a VM's device waits for a GPU in use."""
    if any({key[2] for key in m.short} != {PASSTHROUGH_COUNTER} for m in members):
        return ""
    if device_attribute(members[0].device, "type", driver) in _VFIO_TYPES:
        return "its GPU, which is in use as a GPU (passthrough waits for it)"
    return "its GPU, which is passed through to a virtual machine"


def _starts(members: Sequence[Shortage], driver: str) -> str:
    """`` at 0 and 4`` for several placements; one placement's slices say where it is."""
    starts = [
        start
        for m in members
        if isinstance(start := device_attribute(m.device, "placementStart", driver), int)
    ]
    # Past MAX_LISTED the slices alone say where (``placements of 1g.10gb need memory
    # slices 0\u20136``) and a list of starts is only noise.
    if not 2 <= len(members) <= MAX_LISTED or len(starts) != len(members):
        return ""
    return " at " + listing([str(s) for s in sorted(set(starts))])


def _unit_needs(members: Sequence[Shortage]) -> tuple[re.Pattern[str] | None, str]:
    """(the pattern, ``memory slices 0\u20133 and 4\u20137``) of the first numbered
    counters that are short (``UNIT_COUNTERS``); (None, "") when none are.

    When memory slices (or dies) are short they are the reason: the other counters of a
    MIG placement (multiprocessors, engines) shrink with them and would only add noise.
    """
    for pattern, one, several in UNIT_COUNTERS:
        text = _unit_ranges(members, pattern, one, several)
        if text:
            return pattern, text
    return None, ""


def _unit_ranges(
    members: Sequence[Shortage], pattern: re.Pattern[str], one: str, several: str
) -> str:
    """Each device's missing units as ranges; past MAX_LISTED ranges, the units of all
    of them as one (``0\u20136``)."""
    ranges: set[tuple[int, int]] = set()
    for member in members:
        indices = [int(m[1]) for (_, _, c) in member.short if (m := pattern.fullmatch(c))]
        ranges.update(_ranges(sorted(indices)))
    if not ranges:
        return ""
    ordered = sorted(ranges)
    if len(ordered) > MAX_LISTED:
        ordered = _ranges(sorted({i for low, high in ordered for i in range(low, high + 1)}))
    single = len(ordered) == 1 and ordered[0][0] == ordered[0][1]
    noun = one if single else several
    return f"{noun} {listing([_range_text(r) for r in ordered], limit=MAX_LISTED)}"


def _ranges(indices: Sequence[int]) -> list[tuple[int, int]]:
    ranges: list[tuple[int, int]] = []
    for index in indices:
        if ranges and index == ranges[-1][1] + 1:
            ranges[-1] = (ranges[-1][0], index)
        else:
            ranges.append((index, index))
    return ranges


def _range_text(pair: tuple[int, int]) -> str:
    return str(pair[0]) if pair[0] == pair[1] else f"{pair[0]}{EN_DASH}{pair[1]}"


def _counter_needs(members: Sequence[Shortage]) -> str:
    """``60 multiprocessors (12 left)``; the largest need of the group per counter."""
    needs: dict[str, tuple[Decimal, Decimal]] = {}
    for member in members:
        for (_, _, counter), (amount, left) in member.short.items():
            known = needs.get(counter)
            needs[counter] = (max(amount, known[0]) if known else amount, left)
    items = [
        f"{amount_text(amount)} {counter} ({amount_text(max(left, Decimal(0)))} left)"
        for counter, (amount, left) in sorted(needs.items())
    ]
    return listing(items, limit=MAX_LISTED)


def _holders(claims: Sequence[str], requests: Sequence[str]) -> str:
    parts = []
    if claims:
        noun = "claim" if len(claims) == 1 else "claims"
        parts.append(f"{noun} {listing(claims, limit=MAX_HOLDERS_NAMED)}")
    if requests:
        noun = "request" if len(requests) == 1 else "requests"
        quoted = [f'"{r}"' for r in requests]
        parts.append(f"{noun} {listing(quoted, limit=MAX_HOLDERS_NAMED)} of this claim")
    if not parts:
        return ", more than the counter set has"
    return ", held by " + " and ".join(parts)


def listing(items: Sequence[str], *, limit: int = MAX_LISTED) -> str:
    """``a``, ``a and b``, ``a, b and c``, ``a, b, c, d and 3 more``."""
    if len(items) > limit:
        return f"{', '.join(items[:limit])} and {len(items) - limit} more"
    if len(items) < 2:
        return "".join(items)
    return f"{', '.join(items[:-1])} and {items[-1]}"

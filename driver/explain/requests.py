"""One request of a pending claim walked through the allocator's filters, stage by stage."""

from __future__ import annotations

import math
import time
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from drasil.driver.cel.selectors import (
    CelCompileError,
    CelDeadlineExceeded,
    SelectorResult,
    compile_selector,
)
from drasil.driver.explain.capacity import Shortfall, shortfall, shortfall_texts
from drasil.driver.explain.counters import (
    CounterBook,
    Shortage,
    device_attribute,
    listing,
    shortage_texts,
)
from drasil.driver.explain.inventory import (
    Inventory,
    InventoryDevice,
    Usage,
    object_spec,
)
from drasil.driver.explain.nodefit import BLOCKING_EFFECTS, taint_text, tolerated
from drasil.driver.explain.taintrules import TaintRules, ruled_text
from drasil.driver.objects import JsonObject

MAX_SELECTOR_TEXT = 160
MAX_HOLDERS_NAMED = 3
MAX_COUNTER_GROUPS = 3  # counter sets and profiles worded per request


# --- one request -------------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    """One step of the funnel: ``count`` devices ``phrase`` (e.g. "pass class gpu")."""

    count: int
    phrase: str
    note: str = ""

    def text(self) -> str:
        verb_fix = self.phrase
        if self.count == 1 and verb_fix.startswith("pass "):
            verb_fix = "passes " + verb_fix[len("pass ") :]
        elif self.count == 1 and verb_fix.startswith("devices "):
            verb_fix = "device " + verb_fix[len("devices ") :]
        text = f"{self.count} {verb_fix}"
        return f"{text} ({self.note})" if self.note else text


@dataclass(frozen=True)
class RequestExplanation:
    """What happened to one request (or ``firstAvailable`` subrequest)."""

    request: str
    needed: int | None  # None: allocationMode All
    stages: tuple[Stage, ...]
    blocked: Mapping[str, int] = field(default_factory=dict)  # taint -> devices
    ruled: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # rule -> devices
    held: Mapping[str, int] = field(default_factory=dict)  # holder claim -> devices
    short_capacity: int = 0
    capacity_texts: tuple[str, ...] = ()  # the shortfalls worded, amounts named
    unusable: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # why -> devices
    # (devices, why) per counter set and profile: left out for want of shared counters
    short_counters: tuple[tuple[int, str], ...] = ()
    unchecked: str = ""  # devices whose counters were too many to read
    free: tuple[InventoryDevice, ...] = ()
    problem: str | None = None  # None: can be satisfied on its own

    @property
    def parent(self) -> str:
        return self.request.partition("/")[0]

    @property
    def alternative(self) -> str:
        """The ``firstAvailable`` subrequest's name; empty for an ``exactly`` request."""
        return self.request.partition("/")[2]

    def verdict(self) -> str:
        """The decisive part only: the stage that left no device, or what came after
        the selectors (exclusions and free devices)."""
        if self.stages and self.stages[-1].count == 0:
            return self.stages[-1].text()
        after = self._parts()[len(self.stages) :]
        if self.problem is None:
            after.append(self._shortfall())
        return "; ".join(after) or self._shortfall()

    def text(self) -> str:
        return f'request "{self.request}": ' + "; ".join(self._parts())

    def _parts(self) -> list[str]:
        parts = [stage.text() for stage in self.stages]
        if self.stages and self.stages[-1].count == 0:
            return parts
        parts += [f"{n} blocked by taint {taint}" for taint, n in self.blocked.items()]
        parts += [ruled_text(rule, names) for rule, names in self.ruled.items()]
        if self.short_capacity:
            parts.append(self.capacity_text())
        if self.held:
            parts.append(self._held_text())
        parts += [unusable_text(why, names) for why, names in self.unusable.items()]
        if self.short_counters:
            parts.append(self._counters_text())
        if self.problem and (self.free or not self._excluded()):
            parts.append(self._shortfall())
        return parts

    def capacity_text(self) -> str:
        """``gpu-1 has 12Gi of memory left; request needs 20Gi``."""
        texts = "; ".join(self.capacity_texts)
        return texts or f"{self.short_capacity} without the requested capacity left"

    def _excluded(self) -> bool:
        """Whether some devices were left out for a reason the text already names."""
        return bool(self.held or self.blocked or self.ruled or self.unusable or self.short_counters)

    def _counters_text(self) -> str:
        total = sum(n for n, _ in self.short_counters)
        texts = [text for _, text in self.short_counters[:MAX_COUNTER_GROUPS]]
        more = len(self.short_counters) - MAX_COUNTER_GROUPS
        if more > 0:
            noun = "counter set or profile" if more == 1 else "counter sets or profiles"
            texts.append(f"and {more} more {noun}")
        return f"{total} blocked by shared counters: " + "; ".join(texts)

    def _held_text(self) -> str:
        total = sum(self.held.values())
        names = _names(self.held)
        if total == self.stages[-1].count:
            lead = {1: "it is", 2: "both"}.get(total, f"all {total}")
            return f"{lead} allocated to {names}"
        return f"{total} allocated to {names}"

    def _shortfall(self) -> str:
        if self.needed is None:
            return f"{len(self.free)} free, all {self.stages[-1].count} needed (allocationMode All)"
        return f"{len(self.free)} free, {self.needed} needed"


def unusable_text(why: str, devices: Sequence[str]) -> str:
    """``device gpu-2 unusable: counter set … does not exist in pool node-a``."""
    if len(devices) == 1:
        return f"device {devices[0]} unusable: {why}"
    return f"{len(devices)} devices unusable: {why}"


def _names(held: Mapping[str, int]) -> str:
    names = list(held)
    shown = ", ".join(names[:MAX_HOLDERS_NAMED])
    more = len(names) - MAX_HOLDERS_NAMED
    return f"{shown} and {more} more" if more > 0 else shown


def _short(expression: str) -> str:
    text = " ".join(expression.split())
    return text if len(text) <= MAX_SELECTOR_TEXT else text[: MAX_SELECTOR_TEXT - 1] + "…"


class OutOfTime(Exception):
    """The explanation's time budget ran out while evaluating ``expression``."""

    def __init__(self, expression: str, *, devices: int) -> None:
        super().__init__(expression)
        self.expression = expression
        self.devices = devices

    def text(self, budget: float) -> str:
        return (
            f"stopped after {budget:g} s: selector {_short(self.expression)} is too costly "
            f"to evaluate against {self.devices} devices (the scheduler pays this cost too)"
        )


class CountersOutOfTime(OutOfTime):
    """The time budget ran out while checking the shared counters of ``devices``."""

    def __init__(self, *, devices: int) -> None:
        super().__init__("", devices=devices)

    def text(self, budget: float) -> str:
        return f"stopped after {budget:g} s checking the shared counters of {self.devices} devices"


@dataclass(frozen=True)
class _Filtered:
    devices: list[InventoryDevice]
    stage: Stage


def _select(
    devices: Sequence[InventoryDevice],
    expression: str,
    *,
    phrase: str,
    deadline: float,
    memo: dict[int, SelectorResult],
) -> _Filtered:
    """Devices passing one selector; a CEL error fails the device and is noted.
    ``memo``: its results known already, by device id (``Inventory.selected``), filled
    with the new ones.

    Raises ``OutOfTime`` past ``deadline`` (``time.monotonic()``).
    """
    try:
        selector = compile_selector(expression)
    except CelCompileError as err:
        return _Filtered([], Stage(0, phrase, note=f"does not compile: {err.detail}"))
    passed: list[InventoryDevice] = []
    errors: Counter[str] = Counter()
    for device in devices:
        result = memo.get(id(device))
        if result is None:
            try:
                result = selector.evaluate(device.cel, deadline=deadline)
            except CelDeadlineExceeded:
                raise OutOfTime(expression, devices=len(devices)) from None
            memo[id(device)] = result
        if result.matched:
            passed.append(device)
        elif result.error:
            errors[result.error] += 1
    note = ""
    if errors:
        error, _ = errors.most_common(1)[0]
        count = sum(errors.values())
        # The scheduler aborts the whole allocation on a CEL runtime error.
        note = f"CEL error on {count} device{'s' if count != 1 else ''}: {error}"
    return _Filtered(passed, Stage(len(passed), phrase, note=note))


def _selectors(owner: JsonObject) -> list[str]:
    return [str((s.get("cel") or {}).get("expression", "")) for s in owner.get("selectors") or []]


def _class_stage(
    inventory: Inventory, class_name: str, device_class: JsonObject, *, deadline: float
) -> _Filtered:
    """All selectors of the class at once; the note names one that leaves no device."""
    notes: list[str] = []
    devices = list(inventory.devices)
    for expression in _selectors(object_spec(device_class)):
        memo = inventory.selected.setdefault(expression, {})
        filtered = _select(devices, expression, phrase="", deadline=deadline, memo=memo)
        devices = filtered.devices
        if filtered.stage.note:
            notes.append(filtered.stage.note)
        if not devices:
            notes.append(f"none passes {_short(expression)}")
            break
    return _Filtered(devices, Stage(len(devices), f"pass class {class_name}", "; ".join(notes)))


def _funnel(
    request: JsonObject,
    *,
    inventory: Inventory,
    classes: Mapping[str, JsonObject],
    deadline: float,
) -> tuple[list[InventoryDevice], list[Stage], str | None]:
    """Stages 1-3: the driver's devices, the class selectors, the request selectors."""
    devices = list(inventory.devices)
    stages = [Stage(len(devices), f"devices of {inventory.driver}")]
    if not devices:
        return [], stages, f"driver {inventory.driver} has no published devices"
    class_name = str(request.get("deviceClassName", ""))
    device_class = classes.get(class_name)
    if device_class is None:
        stages.append(Stage(0, f"pass class {class_name}", note="DeviceClass not found"))
        return [], stages, f"DeviceClass {class_name} does not exist"
    filtered = _class_stage(inventory, class_name, device_class, deadline=deadline)
    stages.append(filtered.stage)
    if not filtered.devices:
        published = _published_types(devices, inventory.driver)
        note = "; ".join(n for n in (filtered.stage.note, published) if n)
        stages[-1] = replace(filtered.stage, note=note)
        return [], stages, f"no device passes class {class_name}; {published}"
    devices = filtered.devices
    for expression in _selectors(request):
        phrase = f"pass selector {_short(expression)}"
        memo = inventory.selected.setdefault(expression, {})
        filtered = _select(devices, expression, phrase=phrase, deadline=deadline, memo=memo)
        devices = filtered.devices
        stages.append(filtered.stage)
        if not devices:
            return [], stages, f"no device passes selector {_short(expression)}"
    return devices, stages, None


def _published_types(devices: Sequence[InventoryDevice], driver: str) -> str:
    """``published are 8 amdgpu-partition (compute partition CPX), 1 gpu``: what the
    driver has instead, so a class asking for whole GPUs of a node whose GPUs are cut
    into MIG devices or AMD compute partitions says so, and one asking for partitions of
    AMD GPUs that are whole (SPX) says that too."""
    counts: Counter[str] = Counter()
    for device in devices:
        kind = str(device_attribute(device, "type", driver) or "untyped")
        partition = device_attribute(device, "computePartition", driver)
        if partition:  # AMD's, whole GPUs too: the mode says why there are no parts
            kind += f" (compute partition {partition})"
        elif (profile := device_attribute(device, "profile", driver)) is not None:
            kind += f" ({profile})"
        counts[kind] += 1
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return "published are " + listing([f"{n} {kind}" for kind, n in ranked], limit=4)


def _blocking_taint(device: InventoryDevice, tolerations: Sequence[JsonObject]) -> str | None:
    for taint in device.spec.get("taints") or []:
        if taint.get("effect") in BLOCKING_EFFECTS and not tolerated(taint, tolerations):
            return taint_text(taint)
    return None


def _by_capacity(
    devices: Sequence[InventoryDevice], request: JsonObject, *, usage: Usage, driver: str
) -> tuple[list[InventoryDevice], list[Shortfall]]:
    """Stage 4: the devices whose capacity takes the request, and why the others do not."""
    wanted = (request.get("capacity") or {}).get("requests") or {}
    fitting: list[InventoryDevice] = []
    short: list[Shortfall] = []
    for device in devices:
        used = usage.consumed.get(device.key, {})
        found = shortfall(device, wanted, used=used, driver=driver)
        if found is None:
            fitting.append(device)
        else:
            short.append(found)
    return fitting, short


def _needed(request: JsonObject) -> int | None:
    if request.get("allocationMode") == "All":
        return None
    return int(request.get("count") or 1)


def explain_request(
    name: str,
    request: JsonObject,
    *,
    inventory: Inventory,
    classes: Mapping[str, JsonObject],
    usage: Usage,
    deadline: float = math.inf,
    counters: CounterBook | None = None,
    rules: TaintRules | None = None,
) -> RequestExplanation:
    """The funnel of one ``exactly`` request or ``firstAvailable`` subrequest.

    ``rules`` are the DeviceTaintRules; their taints count like the slices' own.

    Raises ``OutOfTime`` when selectors (or shared counters) are still being checked
    at ``deadline``.
    """
    devices, stages, problem = _funnel(
        request, inventory=inventory, classes=classes, deadline=deadline
    )
    needed = _needed(request)
    if problem is not None:
        return RequestExplanation(name, needed, tuple(stages), problem=problem)
    fitting, short = _by_capacity(devices, request, usage=usage, driver=inventory.driver)
    blocked: Counter[str] = Counter()
    ruled: dict[str, list[str]] = defaultdict(list)
    held: Counter[str] = Counter()
    free: list[InventoryDevice] = []
    tolerations = request.get("tolerations") or []
    rules = rules or TaintRules(driver=inventory.driver)
    for device in fitting:
        taint = _blocking_taint(device, tolerations)
        rule = rules.blocking(device, tolerations) if taint is None else None
        holders = () if _shareable(device, request) else usage.holders.get(device.key, ())
        if taint is not None:
            blocked[taint] += 1
        elif rule is not None:
            ruled[rule.text()].append(device.name)
        elif holders:
            held.update(holders[:1])
        else:
            free.append(device)
    book = counters if counters is not None else CounterBook(inventory, usage)
    checked = check_counters(free, book, deadline=deadline)
    free = checked.free
    enough = len(free) >= needed if needed is not None else len(free) == len(devices) > 0
    return RequestExplanation(
        request=name,
        needed=needed,
        stages=tuple(stages),
        blocked=dict(blocked.most_common()),
        ruled={rule: tuple(names) for rule, names in ruled.items()},
        held=dict(held.most_common()),
        short_capacity=len(short),
        capacity_texts=tuple(shortfall_texts(short)),
        unusable=checked.unusable,
        short_counters=tuple(shortage_texts(checked.shortages, driver=inventory.driver)),
        unchecked=checked.unchecked,
        free=tuple(free),
        problem=None if enough else "not enough free devices",
    )


@dataclass(frozen=True)
class CounterCheck:
    """Free devices split by their shared counters."""

    free: list[InventoryDevice]
    unusable: dict[str, tuple[str, ...]]
    shortages: list[Shortage]
    unchecked: str = ""


def check_counters(
    devices: Sequence[InventoryDevice], book: CounterBook, *, deadline: float = math.inf
) -> CounterCheck:
    """Which of ``devices`` the counters other claims left still let through.

    A device whose counters are too many to read passes (explain cannot tell) and is
    named in ``unchecked``. Raises ``CountersOutOfTime`` past ``deadline``.
    """
    free: list[InventoryDevice] = []
    unusable: dict[str, list[str]] = defaultdict(list)
    shortages: list[Shortage] = []
    unchecked: list[str] = []
    for device in devices:
        if time.monotonic() > deadline:
            raise CountersOutOfTime(devices=len(devices))
        draw = book.draw(device)
        if draw.unusable:
            unusable[draw.unusable].append(device.name)
        elif draw.unchecked:
            unchecked.append(f"device {device.name} of pool {device.pool}: {draw.unchecked}")
            free.append(device)
        elif not book.drawing_already(device) and (shortage := book.shortage(device)):
            shortages.append(shortage)
        else:
            free.append(device)
    return CounterCheck(
        free=free,
        unusable={why: tuple(names) for why, names in unusable.items()},
        shortages=shortages,
        unchecked=_unchecked_text(unchecked),
    )


def _unchecked_text(devices: Sequence[str]) -> str:
    if not devices:
        return ""
    more = f" (and {len(devices) - 1} more devices)" if len(devices) > 1 else ""
    return f"did not check the shared counters of {devices[0]}{more}"


def _shareable(device: InventoryDevice, request: JsonObject) -> bool:
    # Admin access may use devices in use; shared devices were checked by capacity.
    return bool(request.get("adminAccess")) or bool(device.spec.get("allowMultipleAllocations"))

"""Why is my ResourceClaim pending? Each request walked through the scheduler's filters.

kube-scheduler says only "cannot allocate all claims". ``explain_claim`` takes the
claim, the ResourceSlices, the other claims and the DeviceClasses (all as the API
server's JSON) and counts, for every request of the driver, how many devices survive
each stage the allocator applies, in its order:

1. the devices of the driver in complete pools (newest generation, all slices seen),
2. those passing the DeviceClass selectors,
3. those passing each of the request's selectors in turn (the first one that leaves
   none is named, with any CEL error the scheduler would hit),
4. those whose capacity covers the request's ``capacity.requests`` (for devices with
   ``allowMultipleAllocations``: what other claims left),
5. those not blocked by a taint the request does not tolerate,
6. those not allocated to other claims (with the holders named).

A request can be satisfied on its own when at least ``count`` devices (``All``: every
matching device, at least one) are left. When all are, the claim as a whole is
checked: distinct devices for all requests together and ``matchAttribute`` /
``distinctAttribute`` constraints. The result renders as an Event message
(``ClaimExplanation.message``) and as a table for ``drasil explain``
(``render_table``).

Nothing here talks to the API server except ``fetch_inputs``/``explain_from_api``,
which read what ``explain_claim`` needs through ``KubeApi`` for the CLI.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from functools import partial
from typing import Any, cast

from drasil.api.quantity import QuantityError, parse_quantity
from drasil.driver.cel.selectors import CelCompileError, CelDevice, CelDeviceCache, compile_selector
from drasil.driver.explain.nodefit import BLOCKING_EFFECTS, misfit, node_name, taint_text, tolerated
from drasil.driver.kubeapi import RESOURCE_GROUP, RESOURCE_VERSION, KubeApi

JsonObject = Mapping[str, Any]
DeviceKey = tuple[str, str]  # (pool, device) within one driver
MAX_SELECTOR_TEXT = 160
MAX_HOLDERS_NAMED = 3
MAX_MATCHING_SLOTS = 512  # beyond this the joint check would cost more than it tells
MAX_NODES_NAMED = 3


# --- the devices the scheduler considers -------------------------------------------


@dataclass(frozen=True)
class PoolDevice:
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
    devices: tuple[PoolDevice, ...]
    incomplete_pools: tuple[str, ...] = ()


def _meta(obj: JsonObject) -> JsonObject:
    return cast(JsonObject, obj.get("metadata") or {})


def _spec(obj: JsonObject) -> JsonObject:
    return cast(JsonObject, obj.get("spec") or {})


def _generation(obj: JsonObject) -> int:
    return int((_spec(obj).get("pool") or {}).get("generation") or 0)


def build_inventory(
    slices: Iterable[JsonObject], *, driver: str, cache: CelDeviceCache | None = None
) -> Inventory:
    """Devices of ``driver`` from the newest generation of each complete pool."""
    pools: dict[str, list[JsonObject]] = defaultdict(list)
    for obj in slices:
        spec = _spec(obj)
        if spec.get("driver") == driver:
            pools[str((spec.get("pool") or {}).get("name", ""))].append(obj)
    devices: list[PoolDevice] = []
    incomplete: list[str] = []
    for pool, members in sorted(pools.items()):
        newest = max(_generation(s) for s in members)
        current = [s for s in members if _generation(s) == newest]
        wanted = int((_spec(current[0]).get("pool") or {}).get("resourceSliceCount") or 1)
        if len(current) < wanted:
            # The scheduler waits for every slice of the newest generation.
            incomplete.append(f"{pool} ({len(current)} of {wanted} slices)")
            continue
        devices.extend(_pool_devices(pool, current, cache))
    return Inventory(driver=driver, devices=tuple(devices), incomplete_pools=tuple(incomplete))


def _pool_devices(
    pool: str, slices: Sequence[JsonObject], cache: CelDeviceCache | None
) -> Iterator[PoolDevice]:
    for obj in slices:
        specs = _spec(obj).get("devices") or []
        converted = cache.devices(obj) if cache is not None else None
        slice_node = _spec(obj).get("nodeName") or None
        for index, spec in enumerate(specs):
            cel = (
                converted[index]
                if converted is not None
                else CelDevice.from_json(spec, driver=str(_spec(obj)["driver"]))
            )
            node = slice_node or spec.get("nodeName") or None
            yield PoolDevice(
                pool=pool, name=str(spec.get("name", "")), spec=spec, cel=cel, node=node
            )


# --- who holds what ----------------------------------------------------------------


@dataclass(frozen=True)
class Usage:
    """Devices of the driver held by allocated claims (admin access holds nothing)."""

    holders: Mapping[DeviceKey, tuple[str, ...]]
    consumed: Mapping[DeviceKey, Mapping[str, Decimal]]


def claim_ref(claim: JsonObject) -> str:
    meta = _meta(claim)
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def build_usage(claims: Iterable[JsonObject], *, driver: str, skip_uid: str = "") -> Usage:
    """What the allocated ``claims`` hold; ``skip_uid`` is the claim being explained."""
    holders: dict[DeviceKey, list[str]] = defaultdict(list)
    consumed: dict[DeviceKey, dict[str, Decimal]] = defaultdict(dict)
    for claim in claims:
        if skip_uid and _meta(claim).get("uid") == skip_uid:
            continue
        for result in _results(claim):
            if result.get("driver") != driver or result.get("adminAccess"):
                continue
            key = (str(result.get("pool", "")), str(result.get("device", "")))
            if result.get("shareID"):
                _add_consumed(consumed[key], result.get("consumedCapacity") or {})
            holders[key].append(claim_ref(claim))
    return Usage(
        holders={k: tuple(sorted(set(v))) for k, v in holders.items()},
        consumed=dict(consumed),
    )


def _results(claim: JsonObject) -> Sequence[JsonObject]:
    allocation = (claim.get("status") or {}).get("allocation") or {}
    return cast(Sequence[JsonObject], (allocation.get("devices") or {}).get("results") or [])


def _add_consumed(total: dict[str, Decimal], consumed: Mapping[str, Any]) -> None:
    for name, value in consumed.items():
        amount = _quantity(value)
        if amount is not None:
            total[name] = total.get(name, Decimal(0)) + amount


def _quantity(value: object) -> Decimal | None:
    try:
        return parse_quantity(str(value))
    except QuantityError:
        return None


# --- DeviceClasses -----------------------------------------------------------------


def is_driver_class(device_class: JsonObject, driver: str) -> bool:
    """Whether a DeviceClass selects devices of ``driver``.

    Classes name their driver in a selector (``device.driver == "gpu.drasil.dev"`` or
    ``device.attributes["gpu.drasil.dev"]...``) or in an opaque config entry.
    """
    spec = _spec(device_class)
    quoted = (f'"{driver}"', f"'{driver}'")
    for selector in spec.get("selectors") or []:
        expression = str((selector.get("cel") or {}).get("expression", ""))
        if any(q in expression for q in quoted):
            return True
    return any(
        ((entry.get("opaque") or {}).get("driver")) == driver for entry in spec.get("config") or []
    )


def request_classes(claim_spec: JsonObject) -> set[str]:
    """The DeviceClass names a claim spec (``spec`` of a claim) uses."""
    names: set[str] = set()
    for request in (claim_spec.get("devices") or {}).get("requests") or []:
        exactly = request.get("exactly")
        if exactly and exactly.get("deviceClassName"):
            names.add(str(exactly["deviceClassName"]))
        for sub in request.get("firstAvailable") or []:
            if sub.get("deviceClassName"):
                names.add(str(sub["deviceClassName"]))
    return names


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
    held: Mapping[str, int] = field(default_factory=dict)  # holder claim -> devices
    short_capacity: int = 0
    free: tuple[PoolDevice, ...] = ()
    problem: str | None = None  # None: can be satisfied on its own

    @property
    def parent(self) -> str:
        return self.request.partition("/")[0]

    def text(self) -> str:
        return f'request "{self.request}": ' + "; ".join(self._parts())

    def _parts(self) -> list[str]:
        parts = [stage.text() for stage in self.stages]
        if self.stages and self.stages[-1].count == 0:
            return parts
        parts += [f"{n} blocked by taint {taint}" for taint, n in self.blocked.items()]
        if self.short_capacity:
            parts.append(f"{self.short_capacity} without the requested capacity left")
        if self.held:
            parts.append(self._held_text())
        if self.problem and (self.free or not (self.held or self.blocked)):
            parts.append(self._shortfall())
        return parts

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


def _names(held: Mapping[str, int]) -> str:
    names = list(held)
    shown = ", ".join(names[:MAX_HOLDERS_NAMED])
    more = len(names) - MAX_HOLDERS_NAMED
    return f"{shown} and {more} more" if more > 0 else shown


def _short(expression: str) -> str:
    text = " ".join(expression.split())
    return text if len(text) <= MAX_SELECTOR_TEXT else text[: MAX_SELECTOR_TEXT - 1] + "…"


@dataclass(frozen=True)
class _Filtered:
    devices: list[PoolDevice]
    stage: Stage


def _select(devices: Sequence[PoolDevice], expression: str, *, phrase: str) -> _Filtered:
    """Devices passing one selector; a CEL error fails the device and is noted."""
    try:
        selector = compile_selector(expression)
    except CelCompileError as err:
        return _Filtered([], Stage(0, phrase, note=f"does not compile: {err.detail}"))
    passed: list[PoolDevice] = []
    errors: Counter[str] = Counter()
    for device in devices:
        result = selector.evaluate(device.cel)
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


def _class_stage(devices: list[PoolDevice], class_name: str, device_class: JsonObject) -> _Filtered:
    """All selectors of the class at once; the note names one that leaves no device."""
    notes: list[str] = []
    for expression in _selectors(_spec(device_class)):
        filtered = _select(devices, expression, phrase="")
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
) -> tuple[list[PoolDevice], list[Stage], str | None]:
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
    filtered = _class_stage(devices, class_name, device_class)
    stages.append(filtered.stage)
    if not filtered.devices:
        return [], stages, f"no device passes class {class_name}"
    devices = filtered.devices
    for expression in _selectors(request):
        filtered = _select(devices, expression, phrase=f"pass selector {_short(expression)}")
        devices = filtered.devices
        stages.append(filtered.stage)
        if not devices:
            return [], stages, f"no device passes selector {_short(expression)}"
    return devices, stages, None


def _blocking_taint(device: PoolDevice, tolerations: Sequence[JsonObject]) -> str | None:
    for taint in device.spec.get("taints") or []:
        if taint.get("effect") in BLOCKING_EFFECTS and not tolerated(taint, tolerations):
            return taint_text(taint)
    return None


def _capacity_of(device: PoolDevice, name: str, driver: str) -> Decimal | None:
    capacity = device.spec.get("capacity") or {}
    domain, _, ident = name.rpartition("/")
    keys = [name] if domain and domain != driver else [ident, f"{driver}/{ident}"]
    for key in keys:
        if key in capacity:
            return _quantity((capacity[key] or {}).get("value"))
    return None


def _capacity_fits(
    device: PoolDevice, wanted: Mapping[str, Any], *, usage: Usage, driver: str
) -> bool:
    used = usage.consumed.get(device.key, {}) if device.spec.get("allowMultipleAllocations") else {}
    for name, value in wanted.items():
        amount, total = _quantity(value), _capacity_of(device, name, driver)
        if amount is None or total is None:
            return False
        taken = used.get(name, used.get(name.rpartition("/")[2], Decimal(0)))
        if total - taken < amount:
            return False
    return True


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
) -> RequestExplanation:
    """The funnel of one ``exactly`` request or ``firstAvailable`` subrequest."""
    devices, stages, problem = _funnel(request, inventory=inventory, classes=classes)
    needed = _needed(request)
    if problem is not None:
        return RequestExplanation(name, needed, tuple(stages), problem=problem)
    wanted = (request.get("capacity") or {}).get("requests") or {}
    fitting = [
        d for d in devices if _capacity_fits(d, wanted, usage=usage, driver=inventory.driver)
    ]
    blocked: Counter[str] = Counter()
    held: Counter[str] = Counter()
    free: list[PoolDevice] = []
    tolerations = request.get("tolerations") or []
    for device in fitting:
        taint = _blocking_taint(device, tolerations)
        holders = () if _shareable(device, request) else usage.holders.get(device.key, ())
        if taint is not None:
            blocked[taint] += 1
        elif holders:
            held.update(holders[:1])
        else:
            free.append(device)
    enough = len(free) >= needed if needed is not None else len(free) == len(devices) > 0
    return RequestExplanation(
        request=name,
        needed=needed,
        stages=tuple(stages),
        blocked=dict(blocked.most_common()),
        held=dict(held.most_common()),
        short_capacity=len(devices) - len(fitting),
        free=tuple(free),
        problem=None if enough else "not enough free devices",
    )


def _shareable(device: PoolDevice, request: JsonObject) -> bool:
    # Admin access may use devices in use; shared devices were checked by capacity.
    return bool(request.get("adminAccess")) or bool(device.spec.get("allowMultipleAllocations"))


# --- the claim ---------------------------------------------------------------------


@dataclass(frozen=True)
class ClaimExplanation:
    """Every request of the driver explained, plus what fails only jointly."""

    claim: str
    driver: str
    requests: tuple[RequestExplanation, ...]
    problems: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    allocated: bool = False

    def failing_parents(self) -> list[str]:
        """Requests none of whose alternatives can be satisfied on its own."""
        by_parent: dict[str, list[RequestExplanation]] = defaultdict(list)
        for explanation in self.requests:
            by_parent[explanation.parent].append(explanation)
        return [p for p, group in by_parent.items() if all(e.problem for e in group)]

    @property
    def unsatisfiable(self) -> bool:
        return bool(self.failing_parents() or self.problems)

    def message(self) -> str:
        """The Event text: the requests that fail, then the joint problems."""
        failing = set(self.failing_parents())
        parts = [e.text() for e in self.requests if e.parent in failing]
        parts += list(self.problems)
        return ". ".join(parts + list(self.notes)) if parts else self.summary()

    def summary(self) -> str:
        if self.allocated:
            return f"claim {self.claim} is allocated"
        if not self.requests:
            return f"claim {self.claim} has no requests for driver {self.driver}"
        return (
            f"every request of claim {self.claim} can be satisfied from the devices of "
            f"{self.driver}; the scheduler may still be working on it, or the Pod's node "
            "constraints rule the devices out"
        )


@dataclass(frozen=True)
class NodeScope:
    """The nodes every Pod of the claim may go to, and why each other node is out."""

    fits: tuple[str, ...]
    misfits: Mapping[str, str]


def node_scope(nodes: Iterable[JsonObject], pods: Sequence[JsonObject]) -> NodeScope:
    """Which of ``nodes`` all of ``pods`` fit (``drasil.driver.explain.nodefit``)."""
    fits: list[str] = []
    misfits: dict[str, str] = {}
    for node in nodes:
        reasons = [r for pod in pods if (r := misfit(pod, node))]
        if reasons:
            misfits[node_name(node)] = reasons[0]
        else:
            fits.append(node_name(node))
    return NodeScope(fits=tuple(sorted(fits)), misfits=misfits)


def _requests(claim: JsonObject) -> Iterator[tuple[str, JsonObject]]:
    for request in (_spec(claim).get("devices") or {}).get("requests") or []:
        name = str(request.get("name", ""))
        if request.get("exactly") is not None:
            yield name, request["exactly"]
        for sub in request.get("firstAvailable") or []:
            yield f"{name}/{sub.get('name', '')}", sub


def explain_claim(
    claim: JsonObject,
    *,
    slices: Iterable[JsonObject],
    claims: Iterable[JsonObject],
    classes: Iterable[JsonObject],
    driver: str,
    cache: CelDeviceCache | None = None,
    nodes: Iterable[JsonObject] | None = None,
    pods: Sequence[JsonObject] = (),
) -> ClaimExplanation:
    """Explain ``claim`` against the cluster's state (see the module docstring).

    Requests whose DeviceClass belongs to another driver are left out (noted). With
    ``nodes`` (and the ``pods`` waiting for the claim), only the nodes those Pods may
    go to count for the one-node check.
    """
    by_name = {str(_meta(c).get("name", "")): c for c in classes}
    inventory = build_inventory(slices, driver=driver, cache=cache)
    usage = build_usage(claims, driver=driver, skip_uid=str(_meta(claim).get("uid", "")))
    explained: list[RequestExplanation] = []
    others: list[str] = []
    for name, request in _requests(claim):
        device_class = by_name.get(str(request.get("deviceClassName", "")))
        if device_class is not None and not is_driver_class(device_class, driver):
            others.append(name)
            continue
        explained.append(
            explain_request(name, request, inventory=inventory, classes=by_name, usage=usage)
        )
    notes = [f"pool {p} is incomplete and not used" for p in inventory.incomplete_pools]
    if others:
        notes.append(f"requests {', '.join(others)} use classes of other drivers")
    result = ClaimExplanation(
        claim=claim_ref(claim),
        driver=driver,
        requests=tuple(explained),
        notes=tuple(notes),
        allocated=bool((claim.get("status") or {}).get("allocation")),
    )
    if result.unsatisfiable or not explained:
        return result
    scope = node_scope(nodes, pods) if nodes is not None else None
    return _with_joint_problems(result, claim, driver=driver, scope=scope)


# --- joint checks: distinct devices and constraints --------------------------------


def _chosen(explanation: ClaimExplanation) -> dict[str, RequestExplanation]:
    """Per request, the first alternative that can be satisfied, as the scheduler tries."""
    chosen: dict[str, RequestExplanation] = {}
    for e in explanation.requests:
        if e.problem is None and e.parent not in chosen:
            chosen[e.parent] = e
    return chosen


def _with_joint_problems(
    explanation: ClaimExplanation, claim: JsonObject, *, driver: str, scope: NodeScope | None
) -> ClaimExplanation:
    chosen = _chosen(explanation)
    problems = [p for p in (_distinct_devices_problem(chosen),) if p]
    if not problems and (problem := _single_node_problem(chosen, scope)):
        problems.append(problem)
    constraints = (_spec(claim).get("devices") or {}).get("constraints") or []
    for constraint in constraints:
        problem = _constraint_problem(constraint, chosen, driver=driver)
        if problem:
            problems.append(problem)
    return ClaimExplanation(
        claim=explanation.claim,
        driver=explanation.driver,
        requests=explanation.requests,
        problems=tuple(problems),
        notes=explanation.notes,
        allocated=explanation.allocated,
    )


def _slots(
    members: Iterable[RequestExplanation], keep: Callable[[PoolDevice], bool] = lambda _: True
) -> list[list[DeviceKey]]:
    """One slot per device a request needs, listing the free devices that may fill it."""
    slots: list[list[DeviceKey]] = []
    for e in members:
        count = e.needed if e.needed is not None else len(e.free)
        if any(d.spec.get("allowMultipleAllocations") for d in e.free):
            continue  # shared devices may serve several requests at once
        keys = [d.key for d in e.free if keep(d)]
        slots.extend([keys] * count)
    return slots


def _matching_size(slots: Sequence[Sequence[DeviceKey]]) -> int:
    """Maximum bipartite matching of request slots to devices (augmenting paths)."""
    owner: dict[DeviceKey, int] = {}

    def place(slot: int, seen: set[DeviceKey]) -> bool:
        for key in slots[slot]:
            if key in seen:
                continue
            seen.add(key)
            if key not in owner or place(owner[key], seen):
                owner[key] = slot
                return True
        return False

    return sum(1 for slot in range(len(slots)) if place(slot, set()))


def _distinct_devices_problem(chosen: Mapping[str, RequestExplanation]) -> str | None:
    slots = _slots(chosen.values())
    if len(chosen) < 2 or not slots or len(slots) > MAX_MATCHING_SLOTS:
        return None
    placed = _matching_size(slots)
    if placed >= len(slots):
        return None
    names = ", ".join(chosen)
    return (
        f"requests {names} need {len(slots)} distinct devices together; "
        f"the devices they may use cover only {placed}"
    )


def _node_slots(members: Iterable[RequestExplanation], node: str) -> list[list[DeviceKey]]:
    """Like ``_slots``, for the devices reachable from ``node``; a request with none
    there gets an empty slot, so that it cannot be placed."""
    slots: list[list[DeviceKey]] = []
    for e in members:
        here = [d for d in e.free if d.node in (None, node)]
        if here and any(d.spec.get("allowMultipleAllocations") for d in here):
            continue  # one shared device may serve the whole request
        count = e.needed if e.needed is not None else len(here)
        slots.extend([[d.key for d in here]] * max(count, 1))
    return slots


def _single_node_problem(
    chosen: Mapping[str, RequestExplanation], scope: NodeScope | None
) -> str | None:
    """The scheduler allocates a claim for the one node its Pod goes to: every device
    must be reachable from there. Free devices spread over several nodes, or on nodes
    the Pod may not use (``scope``), are not enough."""
    members = list(chosen.values())
    bound = sorted({d.node for e in members for d in e.free if d.node is not None})
    candidates = _candidate_nodes(members, bound, scope)
    if candidates is None:
        return None  # nothing is bound to one node, and any node will do
    if not candidates:
        return _ruled_out(bound, scope)
    best: tuple[int, int, str] = (-1, 0, "")  # (placed, needed, node)
    for node in candidates:
        slots = _node_slots(members, node)
        if len(slots) > MAX_MATCHING_SLOTS:
            return None
        placed = _matching_size(slots)
        if placed >= len(slots):
            return None
        best = max(best, (placed, len(slots), node), key=lambda b: (b[0] - b[1], b[0]))
    placed, needed, node = best
    spread = f"free devices on {len(bound)} nodes" if len(bound) > 1 else "free devices"
    text = (
        "a claim's devices must all be reachable from the one node its Pod runs on, and "
        f"no node has enough: {spread}; node {node} comes closest with {placed} of the "
        f"{needed} needed"
    )
    out = [n for n in bound if scope is not None and n not in scope.fits]
    return f"{text}; the Pod may not use {_node_list(out, scope)}" if out else text


def _candidate_nodes(
    members: Sequence[RequestExplanation], bound: Sequence[str], scope: NodeScope | None
) -> list[str] | None:
    """The nodes worth checking; None when no device is bound to one node and nothing
    is known about the nodes (every node then looks alike)."""
    if scope is None:
        return list(bound) or None
    candidates = [n for n in bound if n in scope.fits]
    if any(d.node is None for e in members for d in e.free):
        # Devices of allNodes/nodeSelector pools: one fitting node without node-bound
        # devices stands for all such nodes.
        spare = next((n for n in scope.fits if n not in bound), None)
        candidates += [spare] if spare is not None else []
    return candidates


def _ruled_out(bound: Sequence[str], scope: NodeScope | None) -> str:
    if bound:
        return "the Pod's node constraints rule out every node with free devices: " + _node_list(
            bound, scope
        )
    return "no node fits the Pod: " + _node_list(sorted(scope.misfits) if scope else [], scope)


def _node_list(names: Sequence[str], scope: NodeScope | None) -> str:
    """``node-a (why), node-b (why) and 4 more``."""
    if not names:
        return "no nodes"
    misfits = scope.misfits if scope is not None else {}
    text = ", ".join(f"{n} ({misfits.get(n, 'no such Node')})" for n in names[:MAX_NODES_NAMED])
    more = len(names) - MAX_NODES_NAMED
    return f"{text} and {more} more" if more > 0 else text


def attribute_value(device: PoolDevice, name: str, *, driver: str) -> object | None:
    """The value of a fully qualified attribute (``domain/name``) of a device, or None."""
    attributes = device.spec.get("attributes") or {}
    domain, _, ident = name.rpartition("/")
    keys = [ident, f"{driver}/{ident}"] if domain in ("", driver) else [name]
    for key in keys:
        if key in attributes:
            entry = attributes[key] or {}
            return next((v for v in entry.values() if v is not None), None)
    return None


def _constraint_problem(
    constraint: JsonObject, chosen: Mapping[str, RequestExplanation], *, driver: str
) -> str | None:
    names = [str(r) for r in constraint.get("requests") or []] or list(chosen)
    members = [chosen[n.partition("/")[0]] for n in names if n.partition("/")[0] in chosen]
    if constraint.get("matchAttribute"):
        return _match_problem(str(constraint["matchAttribute"]), members, driver=driver)
    if constraint.get("distinctAttribute"):
        return _distinct_problem(str(constraint["distinctAttribute"]), members, driver=driver)
    return None


def _has_value(device: PoolDevice, *, attribute: str, value: object, driver: str) -> bool:
    return attribute_value(device, attribute, driver=driver) == value


def _match_problem(
    attribute: str, members: Sequence[RequestExplanation], *, driver: str
) -> str | None:
    if not members:
        return None
    values = {attribute_value(d, attribute, driver=driver) for e in members for d in e.free}
    values.discard(None)
    for value in values:
        slots = _slots(
            members, partial(_has_value, attribute=attribute, value=value, driver=driver)
        )
        if len(slots) <= MAX_MATCHING_SLOTS and _matching_size(slots) == len(slots):
            return None
    names = ", ".join(e.request for e in members)
    seen = ", ".join(sorted(str(v) for v in values)[:4]) or "none"
    return (
        f"constraint matchAttribute {attribute} on requests {names} cannot hold: no value of "
        f"{attribute} has enough free devices for all of them (values of free devices: {seen})"
    )


def _distinct_problem(
    attribute: str, members: Sequence[RequestExplanation], *, driver: str
) -> str | None:
    values = {attribute_value(d, attribute, driver=driver) for e in members for d in e.free} - {
        None
    }
    needed = sum(e.needed or len(e.free) for e in members)
    if len(values) >= needed:
        return None
    names = ", ".join(e.request for e in members)
    return (
        f"constraint distinctAttribute {attribute} on requests {names} cannot hold: "
        f"{needed} devices needed, their free devices have {len(values)} distinct values"
    )


# --- the CLI's view ----------------------------------------------------------------


def render_table(explanation: ClaimExplanation) -> str:
    """``drasil explain`` output: one row per stage of each request, then the verdict."""
    rows = [("REQUEST", "DEVICES", "STAGE")]
    for e in explanation.requests:
        for stage in e.stages:
            phrase = f"{stage.phrase} ({stage.note})" if stage.note else stage.phrase
            rows.append((e.request, str(stage.count), phrase))
        if e.stages and e.stages[-1].count == 0:
            continue
        rows += [(e.request, str(n), f"blocked by taint {t}") for t, n in e.blocked.items()]
        if e.short_capacity:
            rows.append((e.request, str(e.short_capacity), "without the requested capacity"))
        rows += [(e.request, str(n), f"allocated to {h}") for h, n in e.held.items()]
        needed = "all" if e.needed is None else str(e.needed)
        rows.append((e.request, str(len(e.free)), f"free ({needed} needed)"))
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    lines = [f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]}".rstrip() for r in rows]
    verdict = explanation.message() if explanation.unsatisfiable else explanation.summary()
    return "\n".join(
        [f"claim {explanation.claim} (driver {explanation.driver})", *lines, "", verdict]
    )


@dataclass(frozen=True)
class ExplainInputs:
    """What ``explain_claim`` reads, fetched from the API server."""

    claim: JsonObject
    slices: Sequence[JsonObject]
    claims: Sequence[JsonObject]
    classes: Sequence[JsonObject]
    nodes: Sequence[JsonObject] | None = None  # None: not allowed to list them
    pods: Sequence[JsonObject] = ()  # the Pods waiting for the claim


class ClaimNotFound(LookupError):
    """The claim to explain does not exist."""


def _list(api: KubeApi, plural: str, *, field_selector: str = "") -> list[JsonObject]:
    result = api.custom.list_cluster_custom_object(
        RESOURCE_GROUP, RESOURCE_VERSION, plural, field_selector=field_selector or None
    )
    return list(cast(Mapping[str, Any], result).get("items") or [])


def fetch_inputs(api: KubeApi, *, namespace: str, name: str, driver: str) -> ExplainInputs:
    """Read the claim, the driver's slices, all claims and all DeviceClasses."""
    claim = api.get_claim(namespace, name)
    if claim is None:
        raise ClaimNotFound(f"ResourceClaim {namespace}/{name} not found")
    return ExplainInputs(
        claim=claim,
        slices=_list(api, "resourceslices", field_selector=f"spec.driver={driver}"),
        claims=_list(api, "resourceclaims"),
        classes=_list(api, "deviceclasses"),
        nodes=api.list_nodes(),
        pods=[p for p in api.list_pods(namespace) or [] if waits_for(p, name)],
    )


def waits_for(pod: JsonObject, claim_name: str) -> bool:
    """Whether ``pod`` is not yet scheduled and uses the claim ``claim_name``."""
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    if spec.get("nodeName"):
        return False
    entries = [*(spec.get("resourceClaims") or []), *(status.get("resourceClaimStatuses") or [])]
    return any(e.get("resourceClaimName") == claim_name for e in entries)


def explain_from_api(api: KubeApi, *, namespace: str, name: str, driver: str) -> ClaimExplanation:
    """``drasil explain``: fetch and explain one claim; raises ``ClaimNotFound``."""
    inputs = fetch_inputs(api, namespace=namespace, name=name, driver=driver)
    return explain_claim(
        inputs.claim,
        slices=inputs.slices,
        claims=inputs.claims,
        classes=inputs.classes,
        driver=driver,
        nodes=inputs.nodes,
        pods=inputs.pods,
    )

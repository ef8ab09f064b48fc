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
   ``allowMultipleAllocations``: what other claims left of every capacity, the
   request rounded by the capacity's ``requestPolicy`` and unnamed capacities taking
   their default; ``capacity``),
5. those not blocked by a taint the request does not tolerate, in the slice or from a
   DeviceTaintRule (``taintrules``: the rule is named),
6. those not allocated to other claims (with the holders named),
7. those whose shared counters (partitionable devices) are usable and still cover
   what they draw after the allocated devices of other claims (``counters``: the
   counter sets and profiles named, with the claims holding the counters).

A request can be satisfied on its own when at least ``count`` devices (``All``: every
matching device, at least one) are left. A ``firstAvailable`` request is explained
alternative by alternative (``gpu/h200``, ``gpu/h100``), in the order the scheduler
tries them; the texts group them under their request (``request "gpu": alternative
"h200": 0 pass selector …; alternative "h100": 2 free, 1 needed``), and for an
allocated claim name the alternative the scheduler took (from the results'
``request: "gpu/h100"``). When all are, the claim as a whole is
checked: distinct devices for all requests together, one node, the requests' shared
counters together (``jointcounters``) and ``matchAttribute`` / ``distinctAttribute``
constraints. The result renders as an Event message
(``ClaimExplanation.message``) and as a table for ``drasil explain``
(``render_table``).

Nothing here talks to the API server: ``drasil.driver.explain.fromapi`` reads what
``explain_claim`` needs for the CLI, the controller passes what it watches. The
pieces: ``inventory`` (devices of complete pools, their holders), ``requests`` (one
request's stages), ``capacity`` (capacities of shared devices), ``counters`` (shared
counters and their wording), ``jointcounters`` (the requests' counters together),
``nodefit`` (which nodes a Pod may go to), this module (the claim as a whole, joint
checks, the table).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

from drasil.driver.cel.selectors import CelDeviceCache
from drasil.driver.explain.binding import binding_waits
from drasil.driver.explain.counters import CounterBook, listing
from drasil.driver.explain.inventory import (
    DeviceKey,
    Inventory,
    InventoryDevice,
    Usage,
    build_inventory,
    build_usage,
    claim_ref,
    is_driver_class,
    object_spec,
)
from drasil.driver.explain.jointcounters import JointVerdict, joint_counter_problem
from drasil.driver.explain.nodefit import misfit, node_name
from drasil.driver.explain.requests import OutOfTime, RequestExplanation, explain_request
from drasil.driver.explain.taintrules import TaintRules, ruled_text
from drasil.driver.objects import JsonObject, ResourceClaim, meta

EXPLAIN_BUDGET = 2.0
"""Seconds of selector evaluation one explanation may take (see ``explain_claim``)."""
MAX_MATCHING_SLOTS = 512  # beyond this the joint check would cost more than it tells
MAX_NODES_NAMED = 3


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
    cut_short: str = ""  # why the explanation stopped before every request was explained
    # Allocated claims: per firstAvailable request, the alternative taken and its devices.
    taken: Mapping[str, str] = field(default_factory=dict)
    # Allocated claims: devices still waiting for their binding conditions (KEP-5007).
    binding: tuple[str, ...] = ()

    def failing_parents(self) -> list[str]:
        """Requests none of whose alternatives can be satisfied on its own."""
        return [p for p, group in self._groups().items() if all(e.problem for e in group)]

    @property
    def unsatisfiable(self) -> bool:
        return bool(self.failing_parents() or self.problems)

    def _groups(self) -> dict[str, list[RequestExplanation]]:
        by_parent: dict[str, list[RequestExplanation]] = defaultdict(list)
        for explanation in self.requests:
            by_parent[explanation.parent].append(explanation)
        return by_parent

    def alternatives(self) -> list[str]:
        """Per ``firstAvailable`` request: the alternative taken, or each one's verdict."""
        if self.taken:
            return [
                f'request "{parent}": the scheduler took alternative {taken}'
                for parent, taken in self.taken.items()
            ]
        return [
            _alternatives_text(parent, group)
            for parent, group in self._groups().items()
            if group[0].alternative
        ]

    def message(self) -> str:
        """The Event text: the requests that fail, then the joint problems."""
        failing = set(self.failing_parents())
        parts = [
            _alternatives_text(parent, group) if group[0].alternative else group[0].text()
            for parent, group in self._groups().items()
            if parent in failing
        ]
        parts += list(self.problems)
        if not parts:
            return self.summary()
        stopped = [f"then the explanation {self.cut_short}"] if self.cut_short else []
        return ". ".join(parts + list(self.notes) + stopped)

    def summary(self) -> str:
        if self.cut_short:
            return f"could not explain claim {self.claim}: {self.cut_short}"
        if self.allocated:
            return ". ".join(
                [f"claim {self.claim} is allocated", *self.binding, *self.alternatives()]
            )
        if not self.requests:
            return f"claim {self.claim} has no requests for driver {self.driver}"
        return ". ".join(
            [
                f"every request of claim {self.claim} can be satisfied from the devices of "
                f"{self.driver}; the scheduler may still be working on it, or the Pod's "
                "node constraints rule the devices out",
                *self.alternatives(),
            ]
        )


def _alternatives_text(parent: str, group: Sequence[RequestExplanation]) -> str:
    """``request "gpu": alternative "h200": …; alternative "h100": 2 free, 1 needed``,
    naming the first that fits: the scheduler takes it."""
    texts = [f'alternative "{e.alternative}": {e.verdict()}' for e in group]
    first = next((e for e in group if e.problem is None), None)
    fits = f' (the first that fits: "{first.alternative}")' if first is not None else ""
    return f'request "{parent}": ' + "; ".join(texts) + fits


def taken_alternatives(claim: JsonObject, driver: str) -> dict[str, str]:
    """``{"gpu": '"h100" (gpu-3 of pool node-a)'}`` from an allocated claim's results."""
    devices: dict[tuple[str, str], list[str]] = defaultdict(list)
    for result in ResourceClaim(claim).results(driver):
        parent, _, sub = str(result.get("request", "")).partition("/")
        if sub:
            devices[parent, sub].append(f"{result.get('device')} of pool {result.get('pool')}")
    return {parent: f'"{sub}" ({", ".join(names)})' for (parent, sub), names in devices.items()}


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
    for request in ResourceClaim(claim).requests:
        name = str(request.get("name", ""))
        if request.get("exactly") is not None:
            yield name, request["exactly"]
        for sub in request.get("firstAvailable") or []:
            yield f"{name}/{sub.get('name', '')}", sub


@dataclass(frozen=True)
class ExplainContext:
    """The devices of the driver and who holds them: what every explanation of a
    pending claim starts from, built once for many (``prepare_fleet``)."""

    inventory: Inventory
    usage: Usage


def prepare_fleet(
    *,
    slices: Iterable[JsonObject],
    claims: Iterable[JsonObject],
    driver: str,
    cache: CelDeviceCache | None = None,
    usage: Usage | None = None,
) -> ExplainContext:
    """Inventory and usage for explaining any number of **unallocated** claims: an
    unallocated claim holds nothing, so leaving it out of the usage (as
    ``explain_claim`` does for the claim it explains) changes nothing, and one
    ``ExplainContext`` serves them all. Building both is linear in the fleet's devices
    and claims; the controller builds it once per round of explanations instead of
    once per pending claim (docs/scale.md). ``usage``: the claims' usage where the
    caller has it already (``usage_of``); ``claims`` is then not read."""
    return ExplainContext(
        inventory=build_inventory(slices, driver=driver, cache=cache),
        usage=usage if usage is not None else build_usage(claims, driver=driver),
    )


def _fleet_for(
    claim: JsonObject,
    *,
    fleet: ExplainContext | None,
    slices: Iterable[JsonObject],
    claims: Iterable[JsonObject],
    driver: str,
    cache: CelDeviceCache | None,
) -> ExplainContext:
    view = ResourceClaim(claim)
    if fleet is not None and not view.allocated:
        return fleet
    # An allocated claim's own devices must not count as held by someone else.
    uid = view.meta.uid
    return ExplainContext(
        inventory=fleet.inventory if fleet else build_inventory(slices, driver=driver, cache=cache),
        usage=build_usage(claims, driver=driver, skip_uid=uid),
    )


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
    budget: float = EXPLAIN_BUDGET,
    taint_rules: Iterable[JsonObject] = (),
    fleet: ExplainContext | None = None,
) -> ClaimExplanation:
    """Explain ``claim`` against the cluster's state (see the module docstring).

    Requests whose DeviceClass belongs to another driver are left out (noted). With
    ``nodes`` (and the ``pods`` waiting for the claim), only the nodes those Pods may
    go to count for the one-node check. ``taint_rules`` (DeviceTaintRules) taint
    devices like the slices' own taints do. Selectors are evaluated for at most
    ``budget`` seconds; past it the explanation stops and says so (``cut_short``),
    so one costly claim cannot hold up the explanations of all others. ``fleet``
    (``prepare_fleet`` of the same slices and claims) saves building the inventory and
    usage again; ``slices`` and ``claims`` are then read only for an allocated claim.
    """
    deadline = time.monotonic() + budget
    by_name = {meta(c).name: c for c in classes}
    prepared = _fleet_for(
        claim, fleet=fleet, slices=slices, claims=claims, driver=driver, cache=cache
    )
    inventory, usage = prepared.inventory, prepared.usage
    book = CounterBook(inventory, usage)
    rules = TaintRules.of(taint_rules, driver=driver)
    explained: list[RequestExplanation] = []
    others: list[str] = []
    for name, request in _requests(claim):
        device_class = by_name.get(str(request.get("deviceClassName", "")))
        if device_class is not None and not is_driver_class(device_class, driver):
            others.append(name)
            continue
        try:
            explained.append(
                explain_request(
                    name,
                    request,
                    inventory=inventory,
                    classes=by_name,
                    usage=usage,
                    deadline=deadline,
                    counters=book,
                    rules=rules,
                )
            )
        except OutOfTime as err:
            cut_short = f'request "{name}": {err.text(budget)}'
            break
    else:
        # Devices whose counters were too many to read passed unchecked: say so.
        unchecked = next((e for e in explained if e.unchecked), None)
        cut_short = f'request "{unchecked.request}": {unchecked.unchecked}' if unchecked else ""
    notes = [f"pool {p} is incomplete and not used" for p in inventory.incomplete_pools]
    if others:
        notes.append(f"requests {', '.join(others)} use classes of other drivers")
    result = ClaimExplanation(
        claim=claim_ref(claim),
        driver=driver,
        requests=tuple(explained),
        notes=tuple(notes),
        allocated=ResourceClaim(claim).allocated,
        cut_short=cut_short,
        taken=taken_alternatives(claim, driver),
        binding=tuple(binding_waits(claim, driver=driver, now=time.time())),
    )
    if result.unsatisfiable or not explained or cut_short:
        return result
    scope = node_scope(nodes, pods) if nodes is not None else None
    joint = _Joint(driver=driver, scope=scope, counters=book, deadline=deadline)
    return _with_joint_problems(result, claim, joint)


# --- joint checks: distinct devices and constraints --------------------------------


def _chosen(explanation: ClaimExplanation) -> dict[str, RequestExplanation]:
    """Per request, the first alternative that can be satisfied, as the scheduler tries."""
    chosen: dict[str, RequestExplanation] = {}
    for e in explanation.requests:
        if e.problem is None and e.parent not in chosen:
            chosen[e.parent] = e
    return chosen


@dataclass(frozen=True)
class _Joint:
    """What the joint checks need besides the requests."""

    driver: str
    scope: NodeScope | None
    counters: CounterBook
    deadline: float


def _with_joint_problems(
    explanation: ClaimExplanation, claim: JsonObject, joint: _Joint
) -> ClaimExplanation:
    chosen = _chosen(explanation)
    problems = [p for p in (_distinct_devices_problem(chosen),) if p]
    if not problems and (problem := _single_node_problem(chosen, joint.scope)):
        problems.append(problem)
    incomplete = ""
    if not problems:
        # Only once distinct devices on one node exist: the search assumes both.
        verdict = _counters_together(chosen, joint)
        problems += [verdict.problem] if verdict.problem else []
        incomplete = verdict.incomplete
    constraints = (object_spec(claim).get("devices") or {}).get("constraints") or []
    for constraint in constraints:
        problem = _constraint_problem(constraint, chosen, driver=joint.driver)
        if problem:
            problems.append(problem)
    return ClaimExplanation(
        claim=explanation.claim,
        driver=explanation.driver,
        requests=explanation.requests,
        problems=tuple(problems),
        notes=explanation.notes,
        allocated=explanation.allocated,
        cut_short=incomplete,
        taken=explanation.taken,
        binding=explanation.binding,
    )


def _counters_together(chosen: Mapping[str, RequestExplanation], joint: _Joint) -> JointVerdict:
    """The requests' shared counters together, on each node their devices may share."""
    members = list(chosen.values())
    bound = sorted({d.node for e in members for d in e.free if d.node is not None})
    candidates = _candidate_nodes(members, bound, joint.scope)
    nodes: list[str | None] = list(candidates) if candidates else [None]
    return joint_counter_problem(
        members, joint.counters, nodes=nodes, driver=joint.driver, deadline=joint.deadline
    )


def _slots(
    members: Iterable[RequestExplanation], keep: Callable[[InventoryDevice], bool] = lambda _: True
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


def attribute_value(device: InventoryDevice, name: str, *, driver: str) -> object | None:
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


def _has_value(device: InventoryDevice, *, attribute: str, value: object, driver: str) -> bool:
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
        rows += [(e.request, str(len(d)), ruled_text(r, d)) for r, d in e.ruled.items()]
        if e.short_capacity:
            text = f"without the requested capacity: {e.capacity_text()}"
            rows.append((e.request, str(e.short_capacity), text))
        rows += [(e.request, str(n), f"allocated to {h}") for h, n in e.held.items()]
        rows += [
            (e.request, str(len(d)), f"unusable ({listing(d, limit=3)}): {why}")
            for why, d in e.unusable.items()
        ]
        rows += [(e.request, str(n), f"short of counters: {why}") for n, why in e.short_counters]
        needed = "all" if e.needed is None else str(e.needed)
        rows.append((e.request, str(len(e.free)), f"free ({needed} needed)"))
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    lines = [f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]}".rstrip() for r in rows]
    verdict = explanation.message() if explanation.unsatisfiable else explanation.summary()
    # The alternatives again, one line each, unless the verdict already says them.
    alternatives = [a for a in explanation.alternatives() if a not in verdict]
    return "\n".join(
        [
            f"claim {explanation.claim} (driver {explanation.driver})",
            *lines,
            "",
            *alternatives,
            verdict,
        ]
    )

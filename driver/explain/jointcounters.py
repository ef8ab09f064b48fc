"""Whether the devices a claim's requests may use fit their shared counters together.

Each request may be satisfiable alone while the claim is not: two 3g.40gb placements
and one 4g.40gb on one H100 need 12 of its 8 memory slices, and a request for several
devices may draw on one set for all of them. ``joint_counter_problem`` looks for
distinct devices, one per device a request needs, whose draws together stay within
what other claims left. That is a packing problem, so the search is a bounded
backtracking one: at most ``MAX_STEPS`` devices tried per claim and never past the
explanation's deadline; when it stops early the explanation says it is incomplete
rather than guess. Requests whose devices draw no counters cost nothing here.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Final

from drasil.driver.explain.counters import CounterBook, CounterKey, Shortage, shortage_texts
from drasil.driver.explain.inventory import DeviceKey, InventoryDevice
from drasil.driver.explain.requests import RequestExplanation

MAX_STEPS: Final = 20_000
"""Devices tried in one claim's search: a few milliseconds for real claims, which find a
fit (or run out of candidates) in far fewer; hostile ones stop here."""
MAX_SLOTS: Final = 512  # devices one claim may need before the search is not tried
MAX_GROUPS: Final = 3  # counter sets and profiles worded for the request that is stuck


class _OutOfSteps(Exception):
    """The search spent its steps or its time."""


@dataclass(frozen=True)
class Slot:
    """One device a request needs, and the devices that may fill it."""

    request: str
    candidates: tuple[InventoryDevice, ...]


@dataclass(frozen=True)
class JointVerdict:
    """The search's answer: a problem, an incomplete check, or neither (it fits)."""

    problem: str | None = None
    incomplete: str = ""


@dataclass
class _Attempt:
    """The deepest partial choice seen: how many slots it filled and with what."""

    node: str | None = None
    filled: list[tuple[str, InventoryDevice]] = field(default_factory=list)
    depth: int = -1


class _Search:
    """Backtracking over slots; slots of one request take devices in list order, so
    no set of devices is tried twice in another order, and a request with fewer
    fitting devices left than slots to fill is given up at once."""

    def __init__(self, slots: Sequence[Slot], book: CounterBook, *, steps: int, deadline: float):
        self.slots = slots
        self.book = book
        self.steps = steps
        self.deadline = deadline
        self.used: set[DeviceKey] = set()
        self.drawn: dict[CounterKey, Decimal] = {}
        self.filled: list[tuple[str, InventoryDevice]] = []
        self.best = _Attempt()
        self.run_left = _run_left(slots)

    def run(self) -> bool:
        return self._place(0, 0)

    def _place(self, index: int, first: int) -> bool:
        if index > self.best.depth:
            self.best = _Attempt(filled=list(self.filled), depth=index)
        if index == len(self.slots):
            return True
        slot = self.slots[index]
        same = index > 0 and self.slots[index - 1].request == slot.request
        fitting = [
            position
            for position in range(first if same else 0, len(slot.candidates))
            if slot.candidates[position].key not in self.used
            and self._fits(slot.candidates[position])
        ]
        if len(fitting) < self.run_left[index]:
            return False
        for position in fitting:
            # Backtracking restores what was drawn, so ``fitting`` still holds here.
            device = slot.candidates[position]
            self._take(slot.request, device, sign=1)
            if self._place(index + 1, position + 1):
                return True
            self._take(slot.request, device, sign=-1)
        return False

    def _amounts(self, device: InventoryDevice) -> Mapping[CounterKey, Decimal]:
        return {} if self.book.drawing_already(device) else self.book.draw(device).amounts

    def _fits(self, device: InventoryDevice) -> bool:
        self.steps -= 1
        if self.steps < 0 or (self.steps % 256 == 0 and time.monotonic() > self.deadline):
            raise _OutOfSteps
        return all(
            amount <= self.book.left(key) - self.drawn.get(key, Decimal(0))
            for key, amount in self._amounts(device).items()
        )

    def _take(self, request: str, device: InventoryDevice, *, sign: int) -> None:
        for key, amount in self._amounts(device).items():
            self.drawn[key] = self.drawn.get(key, Decimal(0)) + sign * amount
        if sign > 0:
            self.used.add(device.key)
            self.filled.append((request, device))
        else:
            self.used.discard(device.key)
            self.filled.pop()


def _run_left(slots: Sequence[Slot]) -> list[int]:
    """Per slot: the slots of its request from it to the request's last one."""
    left = [1] * len(slots)
    for index in range(len(slots) - 2, -1, -1):
        if slots[index].request == slots[index + 1].request:
            left[index] = left[index + 1] + 1
    return left


def request_slots(members: Sequence[RequestExplanation], node: str | None) -> list[Slot]:
    """One slot per device each request needs, from its free devices reachable from
    ``node`` (any node: None). Requests with shared devices are left out, as in the
    distinct-devices check: one shared device may serve several of them."""
    slots: list[Slot] = []
    for e in members:
        here = tuple(d for d in e.free if node is None or d.node in (None, node))
        if any(d.spec.get("allowMultipleAllocations") for d in here):
            continue
        count = e.needed if e.needed is not None else len(here)
        slots.extend([Slot(e.request, here)] * count)
    return slots


def joint_counter_problem(
    members: Sequence[RequestExplanation],
    book: CounterBook,
    *,
    nodes: Sequence[str | None],
    driver: str,
    deadline: float,
) -> JointVerdict:
    """Whether ``members`` (each satisfiable alone) fit their counters together on one
    of ``nodes`` (None: devices of any node)."""
    names = [e.request for e in members]
    if not any(book.draw(d).amounts for e in members for d in e.free):
        return JointVerdict()
    steps = MAX_STEPS
    best = _Attempt()
    needed = 0
    for node in nodes:
        slots = request_slots(members, node)
        if len(slots) > MAX_SLOTS:
            return JointVerdict(incomplete=_incomplete(names, f"{len(slots)} devices are needed"))
        search = _Search(slots, book, steps=steps, deadline=deadline)
        try:
            if search.run():
                return JointVerdict()
        except _OutOfSteps:
            return JointVerdict(incomplete=_incomplete(names, f"{MAX_STEPS} devices were tried"))
        steps = search.steps
        if search.best.depth > best.depth:
            best, needed = search.best, len(slots)
            best.node = node
    stuck = request_slots(members, best.node)[best.depth]
    return JointVerdict(
        problem=_problem_text(
            names, best=best, needed=needed, stuck=stuck, book=book, nodes=nodes, driver=driver
        )
    )


def _incomplete(names: Sequence[str], why: str) -> str:
    return (
        f"stopped checking whether requests {', '.join(names)} fit their shared counters "
        f"together ({why}); whether they do is not known"
    )


def _stuck_shortages(stuck: Slot, best: _Attempt, book: CounterBook) -> list[Shortage]:
    """Why each candidate of the first slot the best attempt could not fill is out."""
    drawn: dict[CounterKey, Decimal] = {}
    takers: dict[CounterKey, set[str]] = {}
    for request, device in best.filled:
        if book.drawing_already(device):
            continue
        for key, amount in book.draw(device).amounts.items():
            drawn[key] = drawn.get(key, Decimal(0)) + amount
            takers.setdefault(key, set()).add(request)
    used = {device.key for _, device in best.filled}
    shortages: list[Shortage] = []
    for device in stuck.candidates:
        shortage = None if device.key in used else book.shortage(device, also=drawn)
        if shortage is not None:
            requests = {key: tuple(sorted(takers.get(key, ()))) for key in shortage.short}
            shortages.append(
                Shortage(device, shortage.short, claims=shortage.claims, requests=requests)
            )
    return shortages


def _problem_text(
    names: Sequence[str],
    *,
    best: _Attempt,
    needed: int,
    stuck: Slot,
    book: CounterBook,
    nodes: Sequence[str | None],
    driver: str,
) -> str:
    """What fails, then the closest attempt found (the search stops at the first slot
    it cannot fill, so this is where a choice ran out, not a proven maximum)."""
    several = len(nodes) > 1
    on_one = " on any one node" if several else ""
    if len(names) == 1:
        text = f'request "{names[0]}": no choice of the {needed} devices it needs'
    else:
        text = (
            f"requests {', '.join(names)} fit alone but not together: no choice of the "
            f"{needed} devices they need"
        )
    text += f" stays within the shared counters those draw on{on_one}"
    groups = [t for _, t in shortage_texts(_stuck_shortages(stuck, best, book), driver=driver)]
    if not groups:
        return text
    where = f"on node {best.node}, " if several and best.node is not None else ""
    return f'{text}; {where}with {best.depth} placed, request "{stuck.request}" finds ' + "; ".join(
        groups[:MAX_GROUPS]
    )

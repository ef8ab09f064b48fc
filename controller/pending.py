"""When to explain a pending claim: unallocated, a Pod waiting, for ``--explain-after``.

The clock starts when the controller first sees the claim pending with a waiting
Pod, not at the claim's creationTimestamp: the controller's clock and the API
server's may differ, and a claim that has waited an hour before a restart still
gets its explanation one ``explain_after`` later. While the claim stays pending it
is explained again every ``recheck`` seconds; an Event is posted only when the text
changes (``EventMemory``), e.g. when the device holder finishes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class PendingClaims:
    """Per claim uid: when it started waiting, and when it was last explained."""

    explain_after: float
    recheck: float
    _since: dict[str, float] = field(default_factory=dict)
    _explained: dict[str, float] = field(default_factory=dict)

    def update(self, waiting: Iterable[str], *, now: float) -> list[str]:
        """Record which claims wait right now; returns the uids due for explaining."""
        current = set(waiting)
        for uid in set(self._since) - current:
            self.forget(uid)
        due = []
        for uid in sorted(current):
            since = self._since.setdefault(uid, now)
            last = self._explained.get(uid)
            if now - since >= self.explain_after and (last is None or now - last >= self.recheck):
                due.append(uid)
        return due

    def explained(self, uid: str, *, now: float) -> None:
        self._explained[uid] = now

    def forget(self, uid: str) -> None:
        """No longer pending (allocated, deleted, no Pod waits): start over next time."""
        self._since.pop(uid, None)
        self._explained.pop(uid, None)

    def __len__(self) -> int:
        return len(self._since)

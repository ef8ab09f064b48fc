"""When to explain a pending claim: unallocated, a Pod waiting, for long enough.

Long enough is ``explain_after`` once kube-scheduler has answered one of the claim's
waiting Pods (PodScheduled False, or the Pod is in a PodGroup: ``state.PodRef``), and
``queued_after`` (``--stall-after``) while every one is only queued: a Pod the
scheduler has not looked at yet is behind others in a busy queue (a wave of a
thousand Pods waits a minute at 500 nodes), and explaining each such claim against
the whole fleet cost more than the scheduling it waited for. A scheduler that never
comes still gets its claims explained, and called a stall, ``queued_after`` later.

The clock starts when the controller first sees the claim pending with a waiting
Pod, not at the claim's creationTimestamp: the controller's clock and the API
server's may differ, and a claim that has waited an hour before a restart still
gets its explanation one ``explain_after`` later. While the claim stays pending it
is explained again every ``recheck`` seconds; an Event is posted only when the text
changes (``EventMemory``), e.g. when the device holder finishes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass
class PendingClaims:
    """Per claim uid: when it started waiting, and when it was last explained."""

    explain_after: float
    recheck: float
    queued_after: float = 0.0  # never sooner than explain_after
    _since: dict[str, float] = field(default_factory=dict)
    _explained: dict[str, float] = field(default_factory=dict)

    def update(self, waiting: Mapping[str, bool], *, now: float) -> list[str]:
        """Record which claims wait right now, each with whether kube-scheduler has
        answered a Pod of it; returns the uids due for explaining."""
        for uid in set(self._since) - set(waiting):
            self.forget(uid)
        queued_after = max(self.explain_after, self.queued_after)
        due = []
        for uid in sorted(waiting):
            since = self._since.setdefault(uid, now)
            last = self._explained.get(uid)
            after = self.explain_after if waiting[uid] else queued_after
            if now - since >= after and (last is None or now - last >= self.recheck):
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

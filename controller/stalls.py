"""Pending claims that drasil finds satisfiable: a wait that is not capacity.

kube-scheduler retries an unschedulable Pod when an event it thinks relevant arrives, or
when it flushes its unschedulable queue (every 5 minutes by default). A missed requeue
(upstream fixed one for deleted ResourceClaims after v1.37.1) leaves a Pod waiting for
minutes while the devices it needs are free. The controller's explanation sees that:
a claim it re-checks and finds satisfiable again and again for ``stall_after`` seconds
is reported once per episode ("satisfiable since …"), counted, and when the claim stops
waiting the length of its satisfiable wait is observed, so an operator can tell a
scheduler stall from a full cluster.

An episode ends when the explanation finds the claim unsatisfiable again (capacity went
away, so a wait is normal again) or when the claim stops waiting.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

# Longer than a busy scheduler's usual delay between a claim's devices coming free and
# its Pod's retry (seconds), shorter than the scheduler's 5-minute flush.
STALL_AFTER = 60.0


@dataclass
class Episode:
    """One claim seen satisfiable without a break: since when (monotonic and wall)."""

    since: float
    since_wall: float
    reported: bool = False


class SchedulerStalls:
    """Per pending claim uid, since when each explanation found it satisfiable.

    Written by the explanation worker thread, read by the tick: one lock."""

    def __init__(self, stall_after: float = STALL_AFTER) -> None:
        self.stall_after = stall_after
        self._episodes: dict[str, Episode] = {}
        self._lock = threading.Lock()

    def satisfiable(self, uid: str, *, now: float, wall: float) -> Episode | None:
        """The claim was just found satisfiable; returns its episode when it has lasted
        ``stall_after`` and was not reported yet (the caller reports it), else None."""
        with self._lock:
            episode = self._episodes.setdefault(uid, Episode(since=now, since_wall=wall))
            if episode.reported or now - episode.since < self.stall_after:
                return None
            episode.reported = True
            return episode

    def unsatisfiable(self, uid: str) -> None:
        """The claim cannot be allocated now: its wait is capacity again."""
        with self._lock:
            self._episodes.pop(uid, None)

    def ended(self, uid: str, *, now: float) -> float | None:
        """The claim stopped waiting (allocated, deleted, or no Pod waits): how long it
        had been satisfiable, None when it was not."""
        with self._lock:
            episode = self._episodes.pop(uid, None)
        return None if episode is None else now - episode.since

    def ended_except(self, waiting: set[str], *, now: float) -> list[float]:
        """Every claim no longer in ``waiting`` ends its episode; their durations."""
        with self._lock:
            gone = [uid for uid in self._episodes if uid not in waiting]
            return [now - self._episodes.pop(uid).since for uid in gone]

    def stalled(self, *, now: float) -> int:
        """Claims satisfiable for ``stall_after`` or longer right now."""
        with self._lock:
            return sum(now - e.since >= self.stall_after for e in self._episodes.values())

    def __len__(self) -> int:
        return len(self._episodes)

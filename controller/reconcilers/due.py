"""Work marked due at a time, handed out once when that time has come.

The controller's tick asks each reconciler only for what is due, so a second with
nothing due costs nothing however many objects the cluster has. Marking a key again
keeps the earlier time; ``forget`` drops it. A heap keeps ``pop_due`` proportional
to what is due (entries made stale by ``forget`` or an earlier mark are skipped).
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class DueQueue(Generic[K]):
    """Keys and when each is due (any clock, as long as callers use the same one)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._at: dict[K, float] = {}
        self._heap: list[tuple[float, int, K]] = []
        self._order = itertools.count()  # ties in time never compare keys

    def mark(self, key: K, at: float) -> None:
        """``key`` is due at ``at``, or earlier if it already was."""
        with self._lock:
            current = self._at.get(key)
            if current is not None and current <= at:
                return
            self._at[key] = at
            heapq.heappush(self._heap, (at, next(self._order), key))

    def pop_due(self, now: float) -> list[K]:
        """The keys due by ``now``, earliest first; each is handed out once."""
        due: list[K] = []
        with self._lock:
            while self._heap and self._heap[0][0] <= now:
                at, _, key = heapq.heappop(self._heap)
                if self._at.get(key) == at:  # else forgotten or re-marked earlier
                    del self._at[key]
                    due.append(key)
        return due

    def forget(self, key: K) -> None:
        with self._lock:
            self._at.pop(key, None)
        # Its heap entry stays until popped: stale, it is skipped then.

    def any_due(self, now: float) -> bool:
        """Whether ``pop_due(now)`` may hand something out (cheap: one look)."""
        with self._lock:
            return bool(self._heap) and self._heap[0][0] <= now

    def __len__(self) -> int:
        with self._lock:
            return len(self._at)

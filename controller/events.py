"""Warning Events about objects, each distinct message posted once per object.

The controller re-checks objects on every watch event and re-explains pending claims
periodically; without memory it would post the same Event again each time. The
memory is per process, so each Event also has a name of its own (``event_name``: the
object's name and a hash of its UID, the reason and the text): a new leader, after a
roll of the Deployment, posts the current problems again under the same names and the
API server keeps the first of each (409), so a roll neither loses nor doubles an Event.
Once an Event expired (the API server's event TTL, 1 h by default) the next leader's
post of a problem that still stands is a new one.

Explanations change with the fleet: one GPU that flaps between healthy and tainted
changes the text for every pending claim at once, and each change would be an Event on
every claim and every waiting Pod. So a *changed* text about an object that already has
an Event of that reason spends from one controller-wide ``RepostBudget``; when it is
spent the post is left for the next periodic re-check. A first Event about an object
never waits: a newly pending claim is told at once, storm or not.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from drasil.controller.metrics import ControllerMetrics
from drasil.driver.kubeapi import KubeApi

log = logging.getLogger(__name__)

INVALID_DEVICE_CONFIG = "InvalidDeviceConfig"
UNSATISFIABLE = "Unsatisfiable"
EXPLANATION_INCOMPLETE = "ExplanationIncomplete"
SCHEDULER_NOT_RETRIED = "SchedulerNotRetried"
GANG_INCOMPLETE = "GangIncomplete"
COMPONENT = "drasil-controller"
# Changed texts of explanation Events per minute, controller-wide (RepostBudget).
REPOSTS_PER_MINUTE = 60


@dataclass(frozen=True)
class ObjectRef:
    """The object an Event is about (``involvedObject``)."""

    api_version: str
    kind: str
    namespace: str
    name: str
    uid: str

    @classmethod
    def of(cls, obj: Mapping[str, object]) -> ObjectRef:
        meta = obj.get("metadata")
        meta = meta if isinstance(meta, Mapping) else {}
        return cls(
            api_version=str(obj.get("apiVersion", "")),
            kind=str(obj.get("kind", "")),
            namespace=str(meta.get("namespace", "")),
            name=str(meta.get("name", "")),
            uid=str(meta.get("uid", "")),
        )

    def involved(self) -> dict[str, str]:
        return {
            "apiVersion": self.api_version,
            "kind": self.kind,
            "namespace": self.namespace,
            "name": self.name,
            "uid": self.uid,
        }

    def __str__(self) -> str:
        return f"{self.kind} {self.namespace}/{self.name}"


class EventMemory:
    """Which (reason, message) pairs were posted about which object (by uid)."""

    def __init__(self) -> None:
        self._posted: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
        # (uid, reason) that ever had an Event; keep_only does not clear it, forget does.
        self._told: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def told(self, uid: str, reason: str) -> bool:
        """Whether an Event of ``reason`` was posted about ``uid`` before (any text)."""
        with self._lock:
            return (uid, reason) in self._told

    def is_new(self, uid: str, reason: str, message: str) -> bool:
        with self._lock:
            return message not in self._posted.get(uid, {}).get(reason, set())

    def claim(self, uid: str, reason: str, message: str) -> bool:
        """True the first time ``message`` is seen for (uid, reason): post it then."""
        with self._lock:
            seen = self._posted[uid][reason]
            if message in seen:
                return False
            seen.add(message)
            self._told.add((uid, reason))
            return True

    def unclaim(self, uid: str, reason: str, message: str) -> None:
        """Forget one message (its post failed), so the next check tries again."""
        with self._lock:
            self._posted.get(uid, {}).get(reason, set()).discard(message)

    def keep_only(self, uid: str, reason: str, current: Iterable[str]) -> None:
        """Forget messages that no longer apply: if one comes back, it is news again."""
        with self._lock:
            reasons = self._posted.get(uid)
            if reasons is not None and reason in reasons:
                reasons[reason] &= set(current)

    def forget(self, uid: str) -> None:
        """The object is gone."""
        with self._lock:
            self._posted.pop(uid, None)
            self._told = {told for told in self._told if told[0] != uid}

    def __len__(self) -> int:
        with self._lock:
            return len(self._posted)


class RepostBudget:
    """A token bucket: ``per_minute`` tokens, refilled evenly; ``clock`` in seconds."""

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_minute = per_minute
        self.clock = clock
        self._tokens = float(per_minute)
        self._at = clock()
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            now = self.clock()
            refill = (now - self._at) * self.per_minute / 60.0
            self._tokens = min(float(self.per_minute), self._tokens + refill)
            self._at = now
            if self._tokens < 1.0:
                return False
            self._tokens -= 1.0
            return True


# An Event's name is a DNS subdomain (253 characters at most): the object's name,
# shortened where needed, a dot and the hash.
_NAME_ROOM = 253 - 1 - 32


def event_name(ref: ObjectRef, reason: str, message: str) -> str:
    """The one name an Event of ``reason`` and ``message`` about ``ref`` gets, whoever
    posts it: ``<object name>.<32 hex digits>``."""
    digest = hashlib.sha256(f"{ref.uid}\0{reason}\0{message}".encode()).hexdigest()[:32]
    return f"{ref.name[:_NAME_ROOM].rstrip('.-')}.{digest}"


class EventRecorder:
    """Posts Warning Events through ``KubeApi``, deduplicated by ``EventMemory``."""

    def __init__(
        self, api: KubeApi, metrics: ControllerMetrics, budget: RepostBudget | None = None
    ) -> None:
        self.api = api
        self.metrics = metrics
        self.memory = EventMemory()
        self.budget = budget or RepostBudget(REPOSTS_PER_MINUTE)

    def warn(self, ref: ObjectRef, *, reason: str, message: str) -> bool:
        """Post once per distinct message; returns whether an Event was posted."""
        if not ref.uid:
            return False
        if not self.memory.claim(ref.uid, reason, message):
            return False
        try:
            posted = self.api.post_event(
                involved=ref.involved(),
                reason=reason,
                message=message,
                component=COMPONENT,
                name=event_name(ref, reason, message),
            )
        except Exception:
            self.memory.unclaim(ref.uid, reason, message)
            raise
        if not posted:  # already there (an earlier leader's), or the API refused it
            return False
        self.metrics.events.labels(reason, ref.kind).inc()
        log.info("posted event", extra={"object": str(ref), "reason": reason, "text": message})
        return True

    def budget_allows(self, ref: ObjectRef, *, reason: str, message: str) -> bool:
        """Whether ``message`` may be posted about ``ref`` now: always for the first
        Event of ``reason`` about it and for a text already posted; a changed text
        spends one token of the repost budget (False: spent, try at the next re-check)."""
        uid = ref.uid
        if not self.memory.told(uid, reason) or not self.memory.is_new(uid, reason, message):
            return True
        return self.budget.take()

"""Warning Events about objects, each distinct message posted once per object.

The controller re-checks objects on every watch event and re-explains pending claims
periodically; without memory it would post the same Event again each time. The
memory is per process: a new leader posts the current problems once more, which
also tells users the problem still stands.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from drasil.controller.metrics import ControllerMetrics
from drasil.driver.kubeapi import KubeApi

log = logging.getLogger(__name__)

INVALID_DEVICE_CONFIG = "InvalidDeviceConfig"
UNSATISFIABLE = "Unsatisfiable"
EXPLANATION_INCOMPLETE = "ExplanationIncomplete"
COMPONENT = "drasil-controller"


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
        self._lock = threading.Lock()

    def claim(self, uid: str, reason: str, message: str) -> bool:
        """True the first time ``message`` is seen for (uid, reason): post it then."""
        with self._lock:
            seen = self._posted[uid][reason]
            if message in seen:
                return False
            seen.add(message)
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

    def __len__(self) -> int:
        with self._lock:
            return len(self._posted)


class EventRecorder:
    """Posts Warning Events through ``KubeApi``, deduplicated by ``EventMemory``."""

    def __init__(self, api: KubeApi, metrics: ControllerMetrics) -> None:
        self.api = api
        self.metrics = metrics
        self.memory = EventMemory()

    def warn(self, ref: ObjectRef, *, reason: str, message: str) -> bool:
        """Post once per distinct message; returns whether an Event was posted."""
        if not ref.uid or not self.memory.claim(ref.uid, reason, message):
            return False
        try:
            self.api.post_event(
                involved=ref.involved(), reason=reason, message=message, component=COMPONENT
            )
        except Exception:
            self.memory.unclaim(ref.uid, reason, message)
            raise
        self.metrics.events.labels(reason, ref.kind).inc()
        log.info("posted event", extra={"object": str(ref), "reason": reason, "text": message})
        return True

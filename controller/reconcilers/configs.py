"""Opaque configs of ResourceClaims and ResourceClaimTemplates, checked on every event.

Each is decoded, and a strategy drasil would not apply is refused: ``MPS`` for a request
with admin access (``drasil.driver.claims.configcheck``). Each distinct
problem is one ``InvalidDeviceConfig`` Event on the object and on the Pods using it;
a Pod that comes later hears about the problems its claims and templates have.
"""

from __future__ import annotations

import threading

from drasil.controller.events import INVALID_DEVICE_CONFIG, EventRecorder, ObjectRef
from drasil.controller.state import ClusterView, Key, PodRef, key_of
from drasil.driver.claims.configcheck import config_problems
from drasil.driver.objects import JsonObject

ObjectKey = tuple[str, str, str]  # kind, namespace, name


class ConfigReconciler:
    """The problems of each claim and template, kept until it is fixed or deleted."""

    def __init__(self, *, view: ClusterView, events: EventRecorder, driver: str) -> None:
        self.view = view
        self.events = events
        self.driver = driver
        self._lock = threading.Lock()
        self._invalid: dict[ObjectKey, list[str]] = {}

    def check(self, obj: JsonObject) -> list[str]:
        """Check the object's opaque configs; Event each new problem on it and its Pods."""
        kind = str(obj.get("kind", ""))
        key = key_of(obj)
        problems = config_problems(obj, driver=self.driver)
        with self._lock:
            if problems:
                self._invalid[(kind, *key)] = problems
            else:
                self._invalid.pop((kind, *key), None)
        ref = ObjectRef.of(obj)
        self.events.memory.keep_only(ref.uid, INVALID_DEVICE_CONFIG, problems)
        for problem in problems:
            self.events.warn(ref, reason=INVALID_DEVICE_CONFIG, message=problem)
        for pod in self.view.pods_using(kind, key):
            if kind == "ResourceClaimTemplate" or key[1] in pod.direct:
                self._warn_pod(pod.ref(), kind=kind, name=key[1], problems=problems)
        return problems

    def forget(self, kind: str, key: Key) -> None:
        with self._lock:
            self._invalid.pop((kind, *key), None)

    def problems_of(self, pod: PodRef) -> list[tuple[str, str, list[str]]]:
        """(kind, name, problems) of each claim and template ``pod`` uses that has some
        (cheap: called on the event loop for every Pod event)."""
        uses = [("ResourceClaim", n) for n in pod.direct]
        uses += [("ResourceClaimTemplate", n) for n in pod.templates]
        with self._lock:
            found = [(k, n, self._invalid.get((k, pod.namespace, n))) for k, n in uses]
        return [(kind, name, problems) for kind, name, problems in found if problems]

    def warn_pod(self, pod: PodRef, found: list[tuple[str, str, list[str]]]) -> None:
        """A new or changed Pod hears the problems ``problems_of`` found."""
        for kind, name, problems in found:
            self._warn_pod(pod.ref(), kind=kind, name=name, problems=problems)

    def _warn_pod(self, pod: ObjectRef, *, kind: str, name: str, problems: list[str]) -> None:
        for problem in problems:
            self.events.warn(pod, reason=INVALID_DEVICE_CONFIG, message=f"{kind} {name}: {problem}")

"""kopf's progress and diff-base storage, kept in this process's memory.

kopf's defaults keep handler progress and the "last handled" state in annotations
(or ``status.kopf``) of the watched objects. The controller watches ResourceClaims,
Pods and ResourceSlices it does not own, and must never write to them
(docs/design.md#decisions), so both stores live here instead. They fill up only for change
handlers (create/update/delete); the controller registers none, only event
handlers, which kopf does not track at all. The stores are a second line of defence
should one ever be added: state is lost on restart, which for event handlers is
what happens anyway.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import kopf

Progress = dict[tuple[str, str], kopf.ProgressRecord]


def _uid(body: kopf.Body) -> str:
    return str(body.get("metadata", {}).get("uid", ""))


class MemoryProgressStorage(kopf.ProgressStorage):
    """Handler progress per (object uid, handler id)."""

    def __init__(self) -> None:
        super().__init__()
        self._records: Progress = {}
        self._lock = threading.Lock()

    def fetch(self, *, key: kopf.HandlerId, body: kopf.Body) -> kopf.ProgressRecord | None:
        with self._lock:
            record = self._records.get((_uid(body), str(key)))
            return copy.deepcopy(record) if record is not None else None

    def store(
        self,
        *,
        key: kopf.HandlerId,
        record: kopf.ProgressRecord,
        body: kopf.Body,
        patch: kopf.Patch,
    ) -> None:
        with self._lock:
            self._records[(_uid(body), str(key))] = copy.deepcopy(record)

    def purge(self, *, key: kopf.HandlerId, body: kopf.Body, patch: kopf.Patch) -> None:
        with self._lock:
            self._records.pop((_uid(body), str(key)), None)

    def touch(self, *, body: kopf.Body, patch: kopf.Patch, value: str | None) -> None:
        # kopf "touches" an object to wake its own handlers up later; that is a write
        # onto the object, which is exactly what must not happen.
        return

    def clear(self, *, essence: kopf.BodyEssence) -> kopf.BodyEssence:
        return super().clear(essence=essence)


class MemoryDiffBaseStorage(kopf.DiffBaseStorage):
    """The last handled essence per object uid."""

    def __init__(self) -> None:
        super().__init__()
        self._essences: dict[str, Any] = {}
        self._lock = threading.Lock()

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        with self._lock:
            essence = self._essences.get(_uid(body))
            return copy.deepcopy(essence) if essence is not None else None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        with self._lock:
            self._essences[_uid(body)] = copy.deepcopy(essence)

    def __len__(self) -> int:
        with self._lock:
            return len(self._essences)

"""kopf's progress and diff-base storage, kept in this process's memory.

kopf's defaults keep handler progress and the "last handled" state in annotations
(or ``status.kopf``) of the watched objects. The controller watches ResourceClaims,
Pods and ResourceSlices it does not own, and must never write to them
(docs/design.md#decisions), so both stores live here instead. They fill up only for change
handlers (create/update/delete); the controller registers none, only event
handlers, which kopf does not track at all. The stores are a second line of defence
should one ever be added: state is lost on restart, which for event handlers is
what happens anyway.

kopf also builds each event's "essence" (a deep copy of the object less its system
fields, copied again by ``ProgressStorage.clear``) to diff against the stored one;
only change handlers, daemons and timers read that diff. At 500 nodes those two
copies were 17 % of the controller's busy time (docs/scale.md), so
``MemoryDiffBaseStorage.build`` returns an empty essence: with no such handler
registered (tests/controller/test_operator.py asserts it) nothing reads it. Adding
one means removing that override first.

kopf does keep a ``ResourceMemory`` per watched object (by uid, until the object is
deleted) whatever the handlers: memo, error throttler, daemon and indexing state,
about 0.8 KiB each, so 7 MiB for the 8,000 Pods and claims of a 500-node fleet.
Event handlers need none of it between two events, so ``EventOnlyMemories`` makes
each one for the event at hand and forgets it after. kopf does not export the class
it extends; ``kopf.operator`` takes an instance as ``memories``, and
tests/controller/test_operator.py fails should a kopf release change either.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterable
from typing import Any

import kopf
from kopf._cogs.structs import bodies, dicts, ephemera
from kopf._core.reactor.inventory import ResourceMemories, ResourceMemory

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

    def build(
        self,
        *,
        body: kopf.Body,
        extra_fields: Iterable[dicts.FieldSpec] | None = None,
    ) -> kopf.BodyEssence:
        # Empty on purpose: the essence feeds only change handlers, daemons and
        # timers, and the controller has none (module docstring).
        return kopf.BodyEssence()

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


class EventOnlyMemories(ResourceMemories):
    """kopf's per-object memory, made for one event and not kept (``kopf.operator``'s
    ``memories``). What it would remember serves change handlers (was the object seen
    by listing, handled once), daemons and timers (the running ones, the last body),
    indexes, and the back-off after an error in kopf's own processing; the controller
    has only event handlers and no index, and errors there start with a fresh
    back-off, as after a restart."""

    async def recall(
        self,
        raw_body: bodies.RawBody,
        *,
        memobase: ephemera.AnyMemo | None = None,
        noticed_by_listing: bool = False,
        ephemeral: bool = False,
    ) -> ResourceMemory:
        return await super().recall(
            raw_body, memobase=memobase, noticed_by_listing=noticed_by_listing, ephemeral=True
        )

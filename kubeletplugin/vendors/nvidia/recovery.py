"""MIG instances against the checkpoint at start, before kubelet's calls are served.

Dynamic mode: instances no claim holds are destroyed, lost ones re-prepared, and
those of claims prepared in static mode (before a ``migMode`` change) are kept, their
records completed first where an earlier drasil wrote none. Static mode never touches
MIG instances (they are the operator's); instances claims cut in dynamic mode stay
until those claims' unprepare destroys them, and are only named here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager

from drasil.api.checkpoint import ClaimRecord
from drasil.driver.checkpoint import CheckpointStore
from drasil.driver.devices import Device
from drasil.kubeletplugin.vendors.nvidia.migs import MigInstances


def reconcile_migs(
    migs: MigInstances,
    *,
    store: CheckpointStore,
    state_lock: Callable[[], AbstractContextManager[None]],
    devices: Mapping[str, Device],
    mig_mode: str,
) -> str:
    """What was done, for a Node Event ("" when nothing)."""
    if mig_mode != "dynamic":
        with state_lock():
            return _cut_in_dynamic_mode(store.claims())
    gpus = [d for d in devices.values() if d.mig_placement is not None]
    with state_lock():
        for uid, recorded in migs.static_records(store.claims()).items():
            store.replace_devices(uid, recorded)
        report = migs.reconcile(gpus, store.claims())
        for uid in report.missing:  # prepared again, instance and CDI spec, on the next call
            record = store.get(uid)
            if record is not None:
                store.mark_started(
                    uid, namespace=record.namespace, name=record.name, devices=record.devices
                )
    return report.message


def _cut_in_dynamic_mode(records: Mapping[str, ClaimRecord]) -> str:
    held = [
        f"{r.namespace}/{r.name}: {d.mig.profile} at {d.mig.placement_start} on {d.mig.parent_uuid}"
        for r in records.values()
        for d in r.devices
        if d.mig is not None
    ]
    if not held:
        return ""
    return (
        f"{len(held)} MIG instance(s) cut in dynamic MIG mode are held by claims prepared "
        "then; they are not offered again and are destroyed when those claims are "
        "unprepared: " + "; ".join(held)
    )

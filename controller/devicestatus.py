"""The driver's entries of a claim's ``status.devices`` for allocated DevicePool devices.

No kubelet plugin prepares a DevicePool device on a node of ours, so the controller
is the one to tell the user it is usable: an entry per allocated device with a Ready
condition. ``status.devices`` is a list map keyed by driver/pool/device/shareID with
several writers (other drivers, the node plugin for node-local devices), so it is
written by server-side apply under our own field manager: the apply names only our
entries, and the API server leaves every other writer's entries alone. An apply
always carries all our entries, because entries we applied before and leave out
would be removed.

A device with binding conditions (KEP-5007, see ``attach``) is Ready only once
attached. Until then its entry says so: the binding conditions False (reason
``Attaching``), Ready False; after a failed attach the first failure condition True
(reason ``AttachFailed``), which makes the scheduler allocate another device.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from drasil.controller.attach import Attach, AttachState
from drasil.driver.kubeapi import KubeApi
from drasil.driver.objects import ResourceClaim, condition, conditions, meta

READY_REASON = "DevicePoolDevice"
ATTACHING = "Attaching"
ATTACHED = "Attached"
ATTACH_FAILED = "AttachFailed"
EntryKey = tuple[str, str, str, str]  # driver, pool, device, shareID


def _key(entry: Mapping[str, Any]) -> EntryKey:
    return (
        str(entry.get("driver", "")),
        str(entry.get("pool", "")),
        str(entry.get("device", "")),
        str(entry.get("shareID") or ""),
    )


def _existing(claim: Mapping[str, Any]) -> dict[EntryKey, Mapping[str, Any]]:
    return {_key(entry): entry for entry in ResourceClaim(claim).devices}


def entry_key(result: Mapping[str, Any]) -> EntryKey:
    """The status.devices key of an allocation result."""
    return _key(result)


def _since(entry: Mapping[str, Any] | None, kind: str, status: str) -> str | None:
    found = condition(entry, kind)
    if found is None or found.status != status:
        return None
    return found.last_transition_time or None


def _condition(
    old: Mapping[str, Any] | None, kind: str, status: str, reason: str, message: str, *, now: str
) -> dict[str, Any]:
    # lastTransitionTime moves only when the status flips, as metav1.Condition asks.
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": _since(old, kind, status) or now,
    }


def _attach_message(result: Mapping[str, Any], attach: Attach) -> str:
    where = f" to node {attach.node}" if attach.node else ""
    device = f"device {result['device']} of DevicePool {result['pool']}"
    if attach.state is AttachState.PENDING:
        return f"attaching {device}{where} (simulated fabric)"
    if attach.state is AttachState.FAILED:
        return f"attaching {device}{where} failed (simulated fabric: failDevices)"
    return f"{device} attached{where} (simulated fabric)"


def _binding_conditions(
    result: Mapping[str, Any], attach: Attach, old: Mapping[str, Any] | None, now: str
) -> list[dict[str, Any]]:
    """Ready, the binding conditions and (after a failure) the first failure condition."""
    message = _attach_message(result, attach)
    attached = attach.state is AttachState.ATTACHED
    reason = {
        AttachState.PENDING: ATTACHING,
        AttachState.ATTACHED: ATTACHED,
        AttachState.FAILED: ATTACH_FAILED,
    }[attach.state]
    status = "True" if attached else "False"
    ready_reason = READY_REASON if attached else reason
    conditions = [_condition(old, "Ready", status, ready_reason, message, now=now)]
    conditions += [
        _condition(old, str(kind), status, reason, message, now=now)
        for kind in result.get("bindingConditions") or []
    ]
    failures = result.get("bindingFailureConditions") or []
    if attach.state is AttachState.FAILED and failures:
        conditions.append(_condition(old, str(failures[0]), "True", reason, message, now=now))
    return conditions


def pool_results(
    claim: Mapping[str, Any], *, driver: str, pools: Collection[str]
) -> list[Mapping[str, Any]]:
    return [r for r in ResourceClaim(claim).results(driver) if r.get("pool") in pools]


def desired_entries(
    claim: Mapping[str, Any],
    *,
    driver: str,
    pools: Collection[str],
    now: str,
    attaches: Mapping[EntryKey, Attach] | None = None,
) -> list[dict[str, Any]]:
    """Our entries for the claim's allocated DevicePool devices (``pools``: their names);
    ``attaches`` holds the attach of each device with binding conditions."""
    existing = _existing(claim)
    entries = []
    for result in pool_results(claim, driver=driver, pools=pools):
        entry: dict[str, Any] = {
            "driver": driver,
            "pool": result["pool"],
            "device": result["device"],
        }
        if result.get("shareID"):
            entry["shareID"] = result["shareID"]
        old = existing.get(_key(entry))
        attach = (attaches or {}).get(_key(entry))
        if attach is not None:
            entry["conditions"] = _binding_conditions(result, attach, old, now)
        else:
            message = f"device {result['device']} of DevicePool {result['pool']}"
            entry["conditions"] = [_condition(old, "Ready", "True", READY_REASON, message, now=now)]
        entry["data"] = {"devicePool": result["pool"]}
        entries.append(entry)
    return entries


def needs_apply(
    claim: Mapping[str, Any],
    entries: Sequence[Mapping[str, Any]],
    *,
    driver: str,
    pools: Collection[str],
) -> bool:
    """Whether the claim's status differs from ``entries`` in what we own."""
    existing = {
        key: entry
        for key, entry in _existing(claim).items()
        if key[0] == driver and key[1] in pools
    }
    wanted = {_key(entry): _states(entry) for entry in entries}
    return {key: _states(entry) for key, entry in existing.items()} != wanted


def _states(entry: Mapping[str, Any]) -> set[tuple[str, str, str]]:
    """What an apply would change: condition types, statuses and reasons (not times)."""
    return {(c.type, c.status, c.reason) for c in conditions(entry)}


def apply_entries(
    api: KubeApi, claim: Mapping[str, Any], entries: Sequence[Mapping[str, Any]], *, manager: str
) -> None:
    """Server-side apply of ``status.devices`` holding exactly our ``entries``."""
    m = meta(claim)
    api.apply_claim_device_status(m.namespace, m.name, entries, manager=manager)

"""The driver's entries of a claim's ``status.devices`` for allocated DevicePool devices.

No kubelet plugin prepares a DevicePool device on a node of ours, so the controller
is the one to tell the user it is usable: an entry per allocated device with a Ready
condition. ``status.devices`` is a list map keyed by driver/pool/device/shareID with
several writers (other drivers, the node plugin for node-local devices), so it is
written by server-side apply under our own field manager: the apply names only our
entries, and the API server leaves every other writer's entries alone. An apply
always carries all our entries, because entries we applied before and leave out
would be removed.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from drasil.driver.kubeapi import RESOURCE_GROUP, RESOURCE_VERSION, KubeApi

READY_REASON = "DevicePoolDevice"
EntryKey = tuple[str, str, str, str]  # driver, pool, device, shareID


def _key(entry: Mapping[str, Any]) -> EntryKey:
    return (
        str(entry.get("driver", "")),
        str(entry.get("pool", "")),
        str(entry.get("device", "")),
        str(entry.get("shareID") or ""),
    )


def _existing(claim: Mapping[str, Any]) -> dict[EntryKey, Mapping[str, Any]]:
    devices = (claim.get("status") or {}).get("devices") or []
    return {_key(entry): entry for entry in devices}


def _ready_since(entry: Mapping[str, Any] | None) -> str | None:
    for condition in (entry or {}).get("conditions") or []:
        if condition.get("type") == "Ready" and condition.get("status") == "True":
            return str(condition.get("lastTransitionTime") or "") or None
    return None


def _pool_results(
    claim: Mapping[str, Any], *, driver: str, pools: Collection[str]
) -> list[Mapping[str, Any]]:
    allocation = (claim.get("status") or {}).get("allocation") or {}
    results = (allocation.get("devices") or {}).get("results") or []
    return [r for r in results if r.get("driver") == driver and r.get("pool") in pools]


def desired_entries(
    claim: Mapping[str, Any], *, driver: str, pools: Collection[str], now: str
) -> list[dict[str, Any]]:
    """Our entries for the claim's allocated DevicePool devices (``pools``: their names)."""
    existing = _existing(claim)
    entries = []
    for result in _pool_results(claim, driver=driver, pools=pools):
        entry: dict[str, Any] = {
            "driver": driver,
            "pool": result["pool"],
            "device": result["device"],
        }
        if result.get("shareID"):
            entry["shareID"] = result["shareID"]
        since = _ready_since(existing.get(_key(entry))) or now
        entry["conditions"] = [
            {
                "type": "Ready",
                "status": "True",
                "reason": READY_REASON,
                "message": f"device {result['device']} of DevicePool {result['pool']}",
                "lastTransitionTime": since,
            }
        ]
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
    wanted = {_key(entry) for entry in entries}
    if set(existing) != wanted:
        return True
    return any(_ready_since(entry) is None for entry in existing.values())


def apply_entries(
    api: KubeApi, claim: Mapping[str, Any], entries: Sequence[Mapping[str, Any]], *, manager: str
) -> None:
    """Server-side apply of ``status.devices`` holding exactly our ``entries``."""
    meta = claim["metadata"]
    body = {
        "apiVersion": f"{RESOURCE_GROUP}/{RESOURCE_VERSION}",
        "kind": "ResourceClaim",
        "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
        "status": {"devices": list(entries)},
    }
    api.custom.patch_namespaced_custom_object_status(
        RESOURCE_GROUP,
        RESOURCE_VERSION,
        meta["namespace"],
        "resourceclaims",
        meta["name"],
        body,
        field_manager=manager,
        force=True,
        _content_type="application/apply-patch+yaml",
    )

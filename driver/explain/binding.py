"""Allocated claims whose devices wait for binding conditions (KEP-5007).

kube-scheduler allocates such a claim, then holds the Pod before binding until every
binding condition of each device is True in the claim's ``status.devices`` (at most
its binding timeout, 600 s by default, from ``allocationTimestamp``). Meanwhile the
Pod has no node and the claim looks done; these texts say what it waits for:

    waiting for attach of rack-a/remote-0 (12 s)
    attach of rack-a/remote-1 failed: AttachFailed: attaching device … failed

The time counts from the allocation, else from the oldest condition of the device's
entry; without either it is left out.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from drasil.driver.objects import JsonObject, ResourceClaim, condition, is_true


def _time(text: Any) -> float | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _entry(claim: ResourceClaim, result: JsonObject) -> JsonObject:
    # The scheduler matches entries on driver, pool and device (not shareID).
    for entry in claim.devices:
        if all(entry.get(k) == result.get(k) for k in ("driver", "pool", "device")):
            return dict(entry)
    return {}


def _since(claim: ResourceClaim, entry: JsonObject) -> float | None:
    started = _time(claim.allocation_timestamp)
    if started is not None:
        return started
    times = [_time(c.get("lastTransitionTime")) for c in entry.get("conditions") or []]
    known = [t for t in times if t is not None]
    return min(known) if known else None


def _one(claim: ResourceClaim, result: JsonObject, now: float) -> str | None:
    entry, device = _entry(claim, result), f"{result.get('pool')}/{result.get('device')}"
    for kind in result.get("bindingFailureConditions") or []:
        failed = condition(entry, str(kind))
        if failed is not None and failed.true:
            reason, message = failed.reason or kind, failed.message
            return f"attach of {device} failed: {reason}" + (f": {message}" if message else "")
    kinds = [str(k) for k in result.get("bindingConditions") or []]
    if all(is_true(entry, k) for k in kinds):
        return None
    since = _since(claim, entry)
    waited = f" ({max(0, round(now - since))} s)" if since is not None else ""
    return f"waiting for attach of {device}{waited}"


def binding_waits(claim: JsonObject, *, driver: str, now: float) -> list[str]:
    """One text per device of ``driver`` whose binding conditions are not all True."""
    view = ResourceClaim(claim)
    texts = [_one(view, r, now) for r in view.results(driver) if r.get("bindingConditions")]
    return [t for t in texts if t]

"""The simulated fabric: when a DevicePool device with binding conditions is attached.

KEP-5007 lets a device say it is not usable the moment it is allocated: the
scheduler copies the device's ``bindingConditions`` and ``bindingFailureConditions``
into the allocation result and does not bind the Pod until every binding condition
is True in the claim's ``status.devices`` entry for the device (polling every 5 s, for
at most its binding timeout, 600 s by default, counted from ``allocationTimestamp``).
A failure condition that turns True makes it un-allocate the claim and schedule the
Pod again. Someone has to attach the device and say so: for DevicePool devices
that is the controller.

drasil has no fabric manager, so the attach is SIMULATED (``spec.simulatedFabric``):
it takes ``attachSeconds`` from the allocation and fails for the devices in
``failDevices``. Everything here is pure; the controller keeps the clock.

Outcomes are read back from the claim first: a device whose binding conditions or a
failure condition are already True stays so, whatever the fabric says now, so a
restarted controller (or an edited DevicePool) never flips what the scheduler acted on.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from drasil.api.devicepool import SimulatedFabric
from drasil.driver.objects import JsonObject, ResourceClaim, is_true


class AttachState(StrEnum):
    PENDING = "pending"
    ATTACHED = "attached"
    FAILED = "failed"


@dataclass(frozen=True)
class Attach:
    """One device's attach: its state, and for a pending one when it is due (epoch s)."""

    state: AttachState
    due: float = 0.0
    node: str = ""


def parse_time(text: Any) -> float | None:
    """Seconds since the epoch of an RFC 3339 time such as ``2025-01-02T03:04:05Z``."""
    if not isinstance(text, str) or not text:
        return None
    try:
        parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return (parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)).timestamp()


def allocated_at(claim: JsonObject) -> float | None:
    """When the scheduler allocated the claim (``status.allocation.allocationTimestamp``)."""
    return parse_time(ResourceClaim(claim).allocation_timestamp)


def allocated_node(claim: JsonObject) -> str:
    """The node a ``bindsToNode`` allocation is limited to ("" when none is named)."""
    return ResourceClaim(claim).allocated_node


def has_binding_conditions(result: JsonObject) -> bool:
    return bool(result.get("bindingConditions"))


def recorded(result: JsonObject, entry: JsonObject | None) -> AttachState | None:
    """The outcome the claim already says (None: still open)."""
    if any(is_true(entry, kind) for kind in result.get("bindingFailureConditions") or []):
        return AttachState.FAILED
    if all(is_true(entry, kind) for kind in result.get("bindingConditions") or []):
        return AttachState.ATTACHED
    return None


def simulate(
    result: JsonObject,
    entry: JsonObject | None,
    *,
    fabric: SimulatedFabric | None,
    started: float,
    now: float,
    node: str = "",
) -> Attach:
    """The attach of one allocated device with binding conditions, as of ``now``.

    ``started``: the allocation time (or when the controller first saw it). Without a
    ``simulatedFabric`` the attach succeeds at once.
    """
    done = recorded(result, entry)
    if done is not None:
        return Attach(done, node=node)
    due = started + (fabric.attach_seconds if fabric else 0)
    if now < due:
        return Attach(AttachState.PENDING, due=due, node=node)
    failing = fabric is not None and str(result.get("device")) in fabric.fail_devices
    return Attach(AttachState.FAILED if failing else AttachState.ATTACHED, node=node)

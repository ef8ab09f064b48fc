"""DevicePool → ResourceSlices: the pure part (conversion, desired slices, status).

A DevicePool's devices become ``Device`` objects and go through the same
``build_slices`` as a node's GPUs, so they are split under the same limits and
checked by the same ``validate_slice`` before anything is written. Every problem
is a ``PoolSpecError`` whose message says which device and field is wrong; the
controller puts it into the Ready condition and keeps the previous slices.

The devices themselves are converted by ``drasil.driver.devicepools``, which a
node's plugin uses too when it prepares one of them.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from drasil.api.devicepool import API_VERSION, KIND, READY, DevicePool, PoolDevice
from drasil.driver.devicepools import PoolSpecError, to_device
from drasil.driver.objects import JsonDict, condition
from drasil.driver.slices.build import OwnerRef, Taint, build_slices
from drasil.driver.slices.validate import SliceValidationError, TaintEffect

POOL_LABEL = "drasil.dev/devicepool"
"""Label on every slice of a DevicePool: finds them when the driver changes or the pool goes."""

ATTACH_FAILED_TAINT = "drasil.dev/attach-failed"
"""Taint (NoSchedule) on a device whose simulated attach failed: KEP-5007 asks the
provider to keep the scheduler from picking a failed device again, and a taint does
that without taking the device out of the pool."""


def to_taints(spec: PoolDevice, *, attach_failed: bool = False) -> list[Taint]:
    taints = [
        Taint(key=t.key, value=t.value or "", effect=TaintEffect(t.effect)) for t in spec.taints
    ]
    if attach_failed:
        taints.append(Taint(key=ATTACH_FAILED_TAINT, value="", effect=TaintEffect.NO_SCHEDULE))
    return taints


def _check_fabric(pool: DevicePool) -> None:
    fabric = pool.spec.simulated_fabric
    names = {d.name for d in pool.spec.devices}
    for name in fabric.fail_devices if fabric else ():
        if name not in names:
            raise PoolSpecError(f'spec.simulatedFabric.failDevices: no device named "{name}"')


def failing_devices(pool: DevicePool, attach_failed: Collection[str]) -> set[str]:
    """Devices to taint: their attach failed and the (simulated) fabric still fails
    them. Taking a device off ``failDevices`` repairs it and lifts the taint."""
    fabric = pool.spec.simulated_fabric
    return set(attach_failed) & set(fabric.fail_devices if fabric else ())


def pool_driver(pool: DevicePool, default: str) -> str:
    return pool.spec.driver or default


def owner_of(pool: DevicePool) -> OwnerRef:
    return OwnerRef(
        api_version=API_VERSION,
        kind=KIND,
        name=pool.name,
        uid=str(pool.metadata.get("uid", "")),
    )


def _node_selection(pool: DevicePool) -> dict[str, Any]:
    selector, all_nodes = pool.spec.node_selector, pool.spec.all_nodes is True
    if (selector is not None) == all_nodes:
        raise PoolSpecError("set exactly one of spec.nodeSelector and spec.allNodes: true")
    return {"node_selector": selector} if selector is not None else {"all_nodes": True}


def desired_slices(
    pool: DevicePool, *, driver: str, attach_failed: Collection[str] = ()
) -> list[JsonDict]:
    """The ResourceSlices of the pool (generation 0: the planner sets the real one);
    devices in ``attach_failed`` are tainted while the fabric still fails them."""
    _check_fabric(pool)
    devices = [to_device(d) for d in pool.spec.devices]
    failing = failing_devices(pool, attach_failed)
    taints = {
        d.name: to_taints(d, attach_failed=d.name in failing)
        for d in pool.spec.devices
        if d.taints or d.name in failing
    }
    try:
        return build_slices(
            driver=driver,
            pool=pool.name,
            devices=devices,
            taints=taints,
            generation=0,
            owner=owner_of(pool),
            labels={POOL_LABEL: pool.name},
            **_node_selection(pool),
        )
    except SliceValidationError as err:
        raise PoolSpecError(str(err)) from None


def foreign_owner(existing: Sequence[Mapping[str, Any]]) -> str | None:
    """Who else controls slices of this pool name (a Node's plugin, another tool)."""
    for obj in existing:
        for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
            if ref.get("controller") and ref.get("kind") != KIND:
                return f"{ref.get('kind')} {ref.get('name')}"
    return None


# --- status ------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolStatus:
    """What the Ready condition and ``publishedSlices`` should say."""

    ready: bool
    reason: str
    message: str
    published: tuple[str, ...]
    generation: int | None


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def status_patch(
    current: Mapping[str, Any] | None, wanted: PoolStatus, *, now: str
) -> dict[str, Any] | None:
    """The merge patch of ``status`` that says ``wanted``, or None when it already does.

    ``lastTransitionTime`` moves only when the condition's status flips, as
    metav1.Condition asks, so repeated reconciles do not write.
    """
    current = current or {}
    old = condition(current, READY)
    status = "True" if wanted.ready else "False"
    since = old.last_transition_time if old is not None and old.status == status else ""
    ready: dict[str, Any] = {
        "type": READY,
        "status": status,
        "reason": wanted.reason,
        "message": wanted.message[:32768],
        "lastTransitionTime": since or now,
    }
    if wanted.generation is not None:
        ready["observedGeneration"] = wanted.generation
    others = [c for c in current.get("conditions") or [] if c.get("type") != READY]
    body = {
        "conditions": [*others, ready],
        "publishedSlices": list(wanted.published),
        "observedGeneration": wanted.generation,
    }
    unchanged = {k: current.get(k) for k in body} == body
    return None if unchanged else {"status": body}


def published_message(slices: Sequence[Mapping[str, Any]], *, driver: str, pool: str) -> str:
    devices = sum(len(s["spec"].get("devices") or []) for s in slices)
    return (
        f"{devices} device{'s' if devices != 1 else ''} published in {len(slices)} "
        f"ResourceSlice{'s' if len(slices) != 1 else ''} of pool {pool} (driver {driver})"
    )

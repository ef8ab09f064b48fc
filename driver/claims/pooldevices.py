"""DevicePool devices a claim holds, as the node its Pod runs on prepares them.

kube-scheduler allocates a DevicePool's devices (published by the controller) like
a node's own, and kubelet asks the plugin of the node the Pod was bound to to prepare
the claim. The allocation result names the device and its pool only, so the plugin
reads the DevicePool of each such pool (``drasil.kubeletplugin.dra.prepare``) and this
module decides, without side effects, which ``Device`` each result is and whether
this node may prepare it now:

- the DevicePool exists, is published by this driver, and still lists the device;
- a device the allocation limits to one node (``bindsToNode``) is limited to this one;
- every binding condition of the result is True in the claim's ``status.devices``:
  the device was attached (kube-scheduler binds the Pod only then, so a prepare that
  finds it otherwise was sent for an allocation that has since been undone).

The device is what the pool says (``drasil.driver.devicepools.prepared_device``: a
simulated fabric's device is a simulated GPU that appears on the node once attached).
The container gets it through the same per-device contract as a local GPU, plus
``DRASIL_DEVICE_<NAME>_POOL=<pool>`` (docs/controller.md, "What a Pod gets").
"""

from __future__ import annotations

from collections.abc import Mapping

from drasil.api.devicepool import DevicePoolError, parse_devicepool
from drasil.driver.claims.plan import PlanError
from drasil.driver.devicepools import PoolSpecError, prepared_device
from drasil.driver.devices import Device
from drasil.driver.objects import JsonObject, ResourceClaim, is_true, text

PoolDevices = dict[tuple[str, str], Device]
"""A claim's DevicePool devices by (pool, device name)."""


def foreign_pools(claim: JsonObject, *, driver: str, node_pool: str) -> tuple[str, ...]:
    """The pools other than the node's that the claim's ``driver`` results name."""
    pools = {text(r.get("pool")) for r in ResourceClaim(claim).results(driver)}
    return tuple(sorted(pools - {node_pool}))


def pool_devices(
    claim: JsonObject,
    pools: Mapping[str, JsonObject | None],
    *,
    driver: str,
    node: str,
) -> PoolDevices:
    """The claim's devices of the DevicePools in ``pools`` (read from the API; None: no
    such DevicePool), checked for this ``node``. Raises ``PlanError`` naming the
    request, device and pool when one cannot be prepared here now."""
    view = ResourceClaim(claim)
    out: PoolDevices = {}
    for result in view.results(driver):
        pool_name, name = text(result.get("pool")), text(result.get("device"))
        if pool_name not in pools:
            continue
        where = f'request "{text(result.get("request"))}": device "{name}" of pool "{pool_name}"'
        device = _device(pools[pool_name], name, driver=driver, node=node, where=where)
        if device.binds_to_node and view.allocated_node != node:
            raise PlanError(
                f"{where} is allocated to node {view.allocated_node or '(none)'!r}, "
                f"not to this node ({node})"
            )
        _check_attached(view, result, driver=driver, where=where)
        out[(pool_name, name)] = device
    return out


def _device(obj: JsonObject | None, name: str, *, driver: str, node: str, where: str) -> Device:
    if obj is None:
        raise PlanError(
            f"{where}: the pool is neither this node's ({node}) nor a DevicePool (none of "
            "that name exists: deleted since the allocation?)"
        )
    try:
        pool = parse_devicepool(obj)
    except DevicePoolError as err:
        raise PlanError(f"{where}: the DevicePool cannot be read: {err}") from None
    if pool.spec.driver not in (None, driver):
        raise PlanError(f"{where}: the DevicePool is driver {pool.spec.driver}'s, not {driver}'s")
    spec = next((d for d in pool.spec.devices if d.name == name), None)
    if spec is None:
        raise PlanError(f"{where}: the DevicePool no longer lists the device")
    try:
        return prepared_device(pool, spec)
    except PoolSpecError as err:
        raise PlanError(f"{where}: {err}") from None


def _check_attached(view: ResourceClaim, result: JsonObject, *, driver: str, where: str) -> None:
    wanted = [text(c) for c in result.get("bindingConditions") or []]
    if not wanted:
        return
    entry = next(
        (
            e
            for e in view.devices
            if (e.get("driver"), e.get("pool"), e.get("device"))
            == (driver, result.get("pool"), result.get("device"))
        ),
        None,
    )
    missing = [kind for kind in wanted if not is_true(entry, kind)]
    if missing:
        raise PlanError(
            f"{where} is not attached: binding condition {', '.join(missing)} is not True "
            "in the claim's status.devices"
        )

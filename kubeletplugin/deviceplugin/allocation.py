"""Which IDs to hand a container (GetPreferredAllocation) and what it gets (Allocate).

Preference, for kubelet's topology-unaware default and for the Topology Manager
alike: the IDs kubelet must include come first. The rest are filled from the NUMA
node the selection already leans on (or, for a fresh selection, the smallest NUMA
node that holds the whole request, which keeps the bigger ones free for bigger
requests; when none does, the biggest first), then in the same way by PCIe root
complex. With time-slicing, distinct devices come before a second replica of one
device (several replicas are asked for to get several GPUs' worth), and among equals
the least-used device (the one with the most free replicas) wins. Remaining ties go to
the lowest minor number: the same request always gets the same answer.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence

from drasil.api.kubelet.deviceplugin.v1beta1 import deviceplugin_pb2 as pb
from drasil.driver.cdi.spec import (
    ENV_NVIDIA_VISIBLE_DEVICES,
    ENV_VISIBLE_DEVICES,
    device_env_name,
    host_device_node,
)
from drasil.driver.cdi.staticspec import device_cdi_id
from drasil.driver.devices import Device, Vendor
from drasil.kubeletplugin.deviceplugin.resources import Resource, Unit

# Device nodes: the container reads and writes them; it never creates nodes ("m").
DEVICE_PERMISSIONS = "rw"
# An error names a few advertised IDs as a hint; with replicas the full list is long.
_SHOWN_KNOWN = 8

GroupKey = Callable[[Unit], Hashable | None]
_AFFINITY_LEVELS: tuple[GroupKey, ...] = (
    lambda u: u.device.numa_node,
    lambda u: u.device.pcie_root,
)


class UnknownDeviceIds(ValueError):
    """IDs kubelet sent that this resource never advertised."""

    def __init__(self, resource: str, ids: Sequence[str], *, known: Sequence[str]) -> None:
        self.resource = resource
        self.ids = tuple(ids)
        shown = ", ".join(known[:_SHOWN_KNOWN]) or "none"
        more = f" and {len(known) - _SHOWN_KNOWN} more" if len(known) > _SHOWN_KNOWN else ""
        super().__init__(
            f"unknown device IDs for resource {resource}: {', '.join(ids)} "
            f"(advertised: {shown}{more})"
        )


def resolve(resource: Resource, ids: Iterable[str]) -> list[Unit]:
    """The units behind ``ids``, in request order; ``UnknownDeviceIds`` names the rest."""
    ids = list(ids)
    unknown = [i for i in ids if i not in resource.by_id]
    if unknown:
        raise UnknownDeviceIds(resource.name, unknown, known=list(resource.by_id))
    return [resource.by_id[i] for i in ids]


def distinct_devices(units: Iterable[Unit]) -> list[Device]:
    """Each device once, in first-seen order: two replicas of one GPU are one GPU."""
    return list({u.device.name: u.device for u in units}.values())


# ---- Allocate ---------------------------------------------------------------------------


def container_response(units: Sequence[Unit], *, driver: str) -> pb.ContainerAllocateResponse:
    """CDI device names for runtimes with CDI, env and host device nodes for those
    without (AMD devices need a runtime with CDI: their nodes are given by number).

    ``DRASIL_VISIBLE_DEVICES`` and ``DRASIL_DEVICE_<NAME>`` are drasil's, for any vendor;
    ``NVIDIA_VISIBLE_DEVICES`` lists NVIDIA devices only and is left out where there
    are none (an AMD container: the NVIDIA container runtime would act on it). Each
    device's CDI name is in its vendor's spec (``drasil.driver.cdi.staticspec``).
    """
    devices = distinct_devices(units)
    envs = {ENV_VISIBLE_DEVICES: ",".join(d.uuid for d in devices)}
    if nvidia := [d for d in devices if d.vendor == Vendor.NVIDIA]:
        envs[ENV_NVIDIA_VISIBLE_DEVICES] = ",".join(d.uuid for d in nvidia)
    envs.update({device_env_name(d.name): d.uuid for d in devices})
    # Only nodes the host has by path: a runtime looks each one up on the host and fails
    # the container when it is missing. Nodes given by number (AMD's /dev/kfd and DRM
    # nodes, MIG capability nodes) reach the container through its CDI device alone,
    # which creates them (a simulated AMD GPU has no host node at all). MIG devices of
    # one GPU share its node; a runtime refuses duplicates.
    host_nodes = [host_device_node(p) for d in devices for p in d.device_nodes]
    nodes = {n.path: n.host_path or n.path for n in host_nodes}
    return pb.ContainerAllocateResponse(
        envs=envs,
        devices=[
            pb.DeviceSpec(container_path=path, host_path=host, permissions=DEVICE_PERMISSIONS)
            for path, host in nodes.items()
        ],
        cdi_devices=[
            pb.CDIDevice(name=device_cdi_id(driver=driver, device_name=d.name, vendor=d.vendor))
            for d in devices
        ],
    )


# ---- GetPreferredAllocation ---------------------------------------------------------------


def preferred(available: Sequence[Unit], *, must_include: Sequence[Unit], size: int) -> list[Unit]:
    """``size`` units from ``available`` (``must_include`` first); see the module docstring."""
    chosen = list(dict.fromkeys(must_include))
    candidates = sorted((u for u in dict.fromkeys(available) if u not in chosen), key=Unit.sort_key)
    # kubelet lists only free IDs: the device with more of them is the less used one.
    free = Counter(u.device.name for u in candidates)
    # Distinct devices first: several replicas are asked for to get several GPUs' worth.
    fresh = _one_per_device(candidates, exclude={u.device.name for u in chosen})
    picked = _fill(fresh, chosen, size - len(chosen), _AFFINITY_LEVELS, free)
    rest = [u for u in candidates if u not in picked]
    picked += _fill(rest, chosen + picked, size - len(chosen) - len(picked), _AFFINITY_LEVELS, free)
    return chosen + picked


def _one_per_device(candidates: list[Unit], *, exclude: set[str]) -> list[Unit]:
    first: dict[str, Unit] = {}
    for unit in candidates:  # sorted: each device's lowest replica
        if unit.device.name not in exclude:
            first.setdefault(unit.device.name, unit)
    return list(first.values())


def _fill(
    candidates: list[Unit],
    chosen: list[Unit],
    need: int,
    levels: tuple[GroupKey, ...],
    free: Counter[str],
) -> list[Unit]:
    if need <= 0 or not candidates:
        return []
    if not levels:
        return _spread(candidates, chosen, need, free)
    key, rest = levels[0], levels[1:]
    groups = _group(candidates, key)
    picked: list[Unit] = []
    while len(picked) < need and groups:
        best = min(groups, key=_rank(groups, key, chosen + picked, need - len(picked)))
        picked += _fill(groups.pop(best), chosen + picked, need - len(picked), rest, free)
    return picked


def _group(units: list[Unit], key: GroupKey) -> dict[Hashable | None, list[Unit]]:
    groups: dict[Hashable | None, list[Unit]] = {}
    for unit in units:  # sorted, so group order follows the lowest member
        groups.setdefault(key(unit), []).append(unit)
    return groups


def _rank(
    groups: dict[Hashable | None, list[Unit]], key: GroupKey, chosen: list[Unit], need: int
) -> Callable[[Hashable | None], tuple[int, bool, int, int]]:
    order = {k: i for i, k in enumerate(groups)}

    def rank(k: Hashable | None) -> tuple[int, bool, int, int]:
        # An unknown NUMA node or root (None) is no reason to stay together.
        affinity = 0 if k is None else sum(1 for u in chosen if key(u) == k)
        size = len(groups[k])
        fits = size >= need
        return (-affinity, not fits, size if fits else -size, order[k])

    return rank


def _spread(
    candidates: list[Unit], chosen: list[Unit], need: int, free: Counter[str]
) -> list[Unit]:
    # Round robin over devices: fewest units in the selection first, then the least used.
    taken = Counter(u.device.name for u in chosen)
    left = list(candidates)
    picked: list[Unit] = []
    while left and len(picked) < need:
        best = min(left, key=lambda u: (taken[u.device.name], -free[u.device.name], u.sort_key()))
        left.remove(best)
        picked.append(best)
        taken[best.device.name] += 1
    return picked

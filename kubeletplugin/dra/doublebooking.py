"""Another device plugin on the node advertising the same GPUs: drasil stands back.

A node that still runs NVIDIA's (or ROCm's) device plugin has its GPUs in the Node's
allocatable as an extended resource (``nvidia.com/gpu: 8``). kube-scheduler hands those
out to Pods that ask for the extended resource without knowing of DRA, while drasil's
ResourceSlices offer the same GPUs to claims: one GPU, two holders. Nothing on the node
says which of its GPUs the other plugin serves (its device IDs are its own), so while
the Node has allocatable of a resource of a vendor (``--device-plugin-resources``), the
plugin publishes none of that vendor's devices, says so in a Node Event and a metric,
and publishes them again once the other plugin is gone (kubelet then reports 0).

Claims already prepared keep what they hold: withholding only stops new allocations.
"""

from __future__ import annotations

import fnmatch
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from drasil.driver.devices import Device, Vendor
from drasil.driver.kubeapi import KubeApi

log = logging.getLogger(__name__)

# Whose GPUs a resource of a domain stands for; any other domain: every vendor's.
DOMAIN_VENDORS = {"nvidia.com": Vendor.NVIDIA, "amd.com": Vendor.AMD}
INTERVAL = 10.0  # seconds between looks at the Node
CONFLICT_REASON = "DevicePluginConflict"
CLEARED_REASON = "DevicePluginConflictCleared"


@dataclass(frozen=True)
class Conflict:
    """The resources of `patterns` the Node has allocatable (> 0), name -> count."""

    resources: Mapping[str, int]

    def withheld(self, device: Device) -> bool:
        """Whether the device is one a conflicting resource may stand for."""
        return device.vendor in self.vendors()

    def vendors(self) -> frozenset[Vendor]:
        found: set[Vendor] = set()
        for name in self.resources:
            vendor = DOMAIN_VENDORS.get(name.split("/", 1)[0])
            found.update([vendor] if vendor is not None else list(Vendor.known()))
        return frozenset(found)

    def message(self, node: str, withheld: int) -> str:
        listed = ", ".join(f"{name}: {count}" for name, count in sorted(self.resources.items()))
        vendors = " and ".join(sorted(self.vendors()))
        return (
            f"Node {node} has allocatable {listed} from another device plugin, which hands "
            f"out the same GPUs: drasil publishes none of its {withheld} {vendors} "
            "device(s) until that plugin is gone from this node (kubelet then reports 0). "
            "Remove it from this node (NVIDIA's GPU Operator: label the node "
            "nvidia.com/gpu.deploy.device-plugin=false), or, where that resource is "
            "no GPU drasil serves, leave it out of --device-plugin-resources"
        )


def conflict(allocatable: Mapping[str, str], patterns: Sequence[str]) -> Conflict:
    """The resources matching any of `patterns` (shell-style, e.g. ``nvidia.com/mig-*``)
    with a positive allocatable count. A count that is no integer is taken as present."""
    found: dict[str, int] = {}
    for name, quantity in allocatable.items():
        if not any(fnmatch.fnmatchcase(name, p) for p in patterns):
            continue
        try:
            count = int(quantity)
        except ValueError:
            count = 1
        if count > 0:
            found[name] = count
    return Conflict(found)


class DoubleBookingGuard:
    """Looks at the Node's allocatable every `interval` seconds; calls `on_change`
    with the new `Conflict` whenever the set of conflicting resources changes."""

    def __init__(
        self,
        api: KubeApi,
        *,
        node_name: str,
        patterns: Sequence[str],
        on_change: Callable[[Conflict], None],
    ) -> None:
        self.api = api
        self.node_name = node_name
        self.patterns = tuple(patterns)
        self.on_change = on_change
        self.current = Conflict({})

    def check_once(self) -> bool:
        """One look; whether the conflict changed. A Node that cannot be read changes
        nothing (the last known state stands)."""
        allocatable = self.api.get_node_allocatable(self.node_name)
        if allocatable is None:
            return False
        found = conflict(allocatable, self.patterns)
        if dict(found.resources) == dict(self.current.resources):
            return False
        self.current = found
        self.on_change(found)
        return True

    def run(self, stop: threading.Event, *, interval: float = INTERVAL) -> None:
        while True:
            try:
                self.check_once()
            except Exception as err:  # the API may be away: look again next time
                log.warning("could not read the Node's allocatable", extra={"error": str(err)})
            if stop.wait(interval):
                return

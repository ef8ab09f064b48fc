"""Passthrough devices (``--passthrough``): each whole GPU published a second time, as
a device a virtual machine gets by VFIO, the two kept apart by one shared counter.

For a GPU at PCI address ``<bdf>`` (``0000:3b:00.0``):

- counter set ``pci-<bdf as 0000-3b-00-0>`` with one counter, ``passthrough: 1``;
- the GPU consumes it, as do its shares (the scheduler draws a counter once for a
  device that several claims share), so a GPU in use is never passed through;
- the passthrough device ``vfio-<bdf as above>`` (type ``vfio`` for NVIDIA's,
  ``amdgpu-vfio`` for AMD's) consumes it too, and everything the whole GPU consumes
  besides (the memory slices of ``--mig-mode dynamic``, the XCDs of AMD's dynamic
  partitions), so no MIG device or partition of a GPU in a VM is allocated either.

A GPU in MIG mode (static) publishes no whole GPU, and so no passthrough device. A
GPU whose function is bound to ``vfio-pci`` already (a claim's VM holds it, or the
host bound it at boot) is published as the passthrough device alone: its kernel
driver does not see it. A GPU with no IOMMU group (the IOMMU is off) is not passed
through, and the skipped list says why.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Final

from drasil.driver.devices import (
    NUMA_NODE_ATTRIBUTE,
    PCI_BUS_ID_ATTRIBUTE,
    PCIE_ROOT_ATTRIBUTE,
    AttributeValue,
    CounterConsumption,
    CounterSet,
    Device,
    DeviceType,
    PciPassthrough,
)
from drasil.driver.vfio.pcisysfs import VFIO_DRIVER, PciBus, PciError, PciFunction, bdf_name

PASSTHROUGH_COUNTER: Final = "passthrough"
IOMMU_GROUP_ATTRIBUTE: Final = "iommuGroup"
IOMMUFD_ATTRIBUTE: Final = "iommuFDEnabled"  # the node's kernel has iommufd (/dev/iommu)
MAX_CONSUMED_SETS: Final = 2  # counter sets one device may draw on (resource.k8s.io/v1)


def counter_set_name(bdf: str) -> str:
    return f"pci-{bdf_name(bdf)}"


def passthrough_name(bdf: str) -> str:
    return f"vfio-{bdf_name(bdf)}"


@dataclass(frozen=True)
class VendorPassthrough:
    """One vendor's part: its GPUs' type, the passthrough type, the kernel driver and
    PCI vendor ID of its GPUs, and the device nodes a process using a GPU holds."""

    gpu_type: DeviceType
    vfio_type: DeviceType
    native_driver: str
    vendor_id: int
    busy_nodes: Callable[[Device], tuple[str, ...]]


@dataclass(frozen=True)
class VfioRequest:
    """A passthrough device to prepare, and which VFIO nodes its container gets (its
    ``VfioDeviceConfig``): the device's iommufd node where the kernel has iommufd and
    the config prefers it (else its group's), and the API device or not."""

    device: Device
    prefer_iommufd: bool = False
    api_device: bool = True


@dataclass(frozen=True)
class WithPassthrough:
    devices: tuple[Device, ...]
    counter_sets: tuple[CounterSet, ...]
    skipped: tuple[str, ...]


def with_passthrough(
    devices: Sequence[Device], bus: PciBus, vendor: VendorPassthrough
) -> WithPassthrough:
    """``devices`` with the passthrough devices added and their counters drawn."""
    out: list[Device] = []
    sets: list[CounterSet] = []
    skipped: list[str] = []
    passed: set[str] = set()  # GPUs (UUIDs) bound to vfio-pci: published as passthrough only
    seen: set[str] = set()
    iommufd = bus.iommufd_numbers() is not None
    for device in devices:
        bdf = _whole_gpu_bdf(device, vendor)
        if bdf is None:
            continue
        seen.add(bdf)
        try:
            function = bus.read(bdf)
        except PciError as err:
            skipped.append(f"passthrough of GPU {bdf}: {err}")
            continue
        why = _why_not(function, device)
        if why:
            skipped.append(f"passthrough of GPU {bdf}: {why}")
            continue
        if function.driver == VFIO_DRIVER:
            passed.add(device.uuid)
        out.append(_passthrough(device, function, vendor, iommufd=iommufd))
        sets.append(_counter_set(out[-1]))
    kept = [_drawing(d, vendor) for d in devices if not _on(d, passed)]
    found = _bound_alone(bus, vendor, seen, iommufd=iommufd)
    sets += [_counter_set(d) for d in found]
    return WithPassthrough(tuple(kept + out + found), tuple(sets), tuple(skipped))


def _counter_set(device: Device) -> CounterSet:
    assert device.passthrough is not None
    return CounterSet(counter_set_name(device.passthrough.bus_id), {PASSTHROUGH_COUNTER: 1})


def _whole_gpu_bdf(device: Device, vendor: VendorPassthrough) -> str | None:
    """The PCI address of a whole GPU of the vendor (not a part, not a placement)."""
    if device.type is not vendor.gpu_type or device.parent_uuid is not None:
        return None
    bdf = device.attributes.get(PCI_BUS_ID_ATTRIBUTE)
    return bdf if isinstance(bdf, str) else None


def _why_not(function: PciFunction, device: Device) -> str:
    if function.iommu_group is None:
        return "it has no IOMMU group (is the IOMMU on? intel_iommu=on or amd_iommu=on)"
    if len(device.consumes_counters) >= MAX_CONSUMED_SETS:
        return f"it already draws on {MAX_CONSUMED_SETS} counter sets"
    return ""


def _on(device: Device, gpus: set[str]) -> bool:
    """Whether ``device`` is (a part of) one of ``gpus``."""
    placement = device.mig_placement
    return bool(gpus) and (
        device.uuid in gpus
        or device.parent_uuid in gpus
        or (placement is not None and placement.parent_uuid in gpus)
    )


def _draw(bdf: str) -> CounterConsumption:
    return CounterConsumption(counter_set_name(bdf), {PASSTHROUGH_COUNTER: 1})


def _drawing(device: Device, vendor: VendorPassthrough) -> Device:
    """A whole GPU draws its passthrough counter; other devices stay as they are."""
    bdf = _whole_gpu_bdf(device, vendor)
    if bdf is None or len(device.consumes_counters) >= MAX_CONSUMED_SETS:
        return device
    return replace(device, consumes_counters=(*device.consumes_counters, _draw(bdf)))


def _passthrough(
    gpu: Device, function: PciFunction, vendor: VendorPassthrough, *, iommufd: bool
) -> Device:
    assert function.iommu_group is not None
    attributes = {
        key: value
        for key, value in gpu.attributes.items()
        if key in _KEPT_ATTRIBUTES or key.startswith("resource.kubernetes.io/")
    }
    return Device(
        name=passthrough_name(function.bdf),
        type=vendor.vfio_type,
        uuid=gpu.uuid,
        minor=gpu.minor,
        attributes={**attributes, **_pci_attributes(function, vendor, iommufd=iommufd)},
        capacity={k: v for k, v in gpu.capacity.items() if k == "memory"},
        numa_node=gpu.numa_node,
        pcie_root=gpu.pcie_root,
        consumes_counters=(*gpu.consumes_counters, _draw(function.bdf)),
        passthrough=PciPassthrough(
            bus_id=function.bdf,
            iommu_group=function.iommu_group,
            native_driver=vendor.native_driver,
            busy_nodes=vendor.busy_nodes(gpu),
        ),
        host_resources=gpu.host_resources,
    )


# What a VM user selects a GPU by; the rest of a GPU's attributes (CUDA versions, MIG
# facts) say what its kernel driver makes of it, and a VM runs its own.
_KEPT_ATTRIBUTES: Final = frozenset({"uuid", "productName", "brand", "architecture", "index"})


def _pci_attributes(
    function: PciFunction, vendor: VendorPassthrough, *, iommufd: bool
) -> dict[str, AttributeValue]:
    assert function.iommu_group is not None
    attributes: dict[str, AttributeValue] = {
        "type": vendor.vfio_type.value,
        PCI_BUS_ID_ATTRIBUTE: function.bdf,
        IOMMU_GROUP_ATTRIBUTE: function.iommu_group,
        # NVIDIA's names and form for its VFIO devices, so their selectors carry over.
        "vendorID": f"0x{function.vendor_id:04x}",
        "deviceID": f"0x{function.device_id:04x}",
        IOMMUFD_ATTRIBUTE: iommufd,
    }
    if function.pcie_root is not None:
        attributes[PCIE_ROOT_ATTRIBUTE] = function.pcie_root
    if function.numa_node is not None:
        attributes[NUMA_NODE_ATTRIBUTE] = function.numa_node
    return attributes


def _bound_alone(
    bus: PciBus, vendor: VendorPassthrough, seen: set[str], *, iommufd: bool
) -> list[Device]:
    """The vendor's GPUs bound to vfio-pci that discovery did not list (their kernel
    driver cannot see them): passthrough devices read from sysfs alone."""
    found = []
    for bdf in bus.functions_of(VFIO_DRIVER):
        if bdf in seen:
            continue
        try:
            function = bus.read(bdf)
        except PciError:
            continue
        if function.vendor_id != vendor.vendor_id or function.class_code >> 16 not in GPU_CLASSES:
            continue
        if function.iommu_group is None:
            continue
        found.append(
            Device(
                name=passthrough_name(bdf),
                type=vendor.vfio_type,
                uuid="",
                minor=-1,
                attributes=_pci_attributes(function, vendor, iommufd=iommufd),
                capacity={},
                numa_node=function.numa_node,
                pcie_root=function.pcie_root,
                consumes_counters=(_draw(bdf),),
                passthrough=PciPassthrough(
                    bus_id=bdf, iommu_group=function.iommu_group, native_driver=vendor.native_driver
                ),
            )
        )
    return found


# PCI base classes of GPUs: display controllers (VGA 0x0300, 3D 0x0302, an H100's) and
# processing accelerators (0x1200, an MI300X's).
GPU_CLASSES: Final = frozenset({0x03, 0x12})

"""AMD GPUs read from sysfs, turned into drasil ``Device`` objects.

Names (DNS labels, stable while the hardware and partition mode stay):

- a whole GPU is ``amdgpu-<card index>`` (``amdgpu-1``), type ``amdgpu``;
- a GPU in a partitioned compute mode (DPX, QPX, CPX) publishes its partitions and
  not itself, as a GPU in MIG mode does (the partitions hold all of its CUs and
  memory): ``amdgpu-<parent card>-<mode>-<i>`` (``amdgpu-1-cpx-3``), type
  ``amdgpu-partition``.

UUIDs are ROCm's form, ``GPU-<unique_id as 16 hex digits>``. A partition takes its
own KFD node's unique id where that differs from the GPU's and from its siblings';
otherwise (amdgpu gives every partition the GPU's id) it is ``<parent uuid>-<i>``.

Attributes are bare names in the driver's domain plus the standard qualified PCI and
NUMA ones (a partition has its parent's PCI address); capacities are ``memory``
(bytes), ``computeUnits`` and ``simdUnits``. A container gets ``/dev/kfd`` and the
device's ``/dev/dri/card<N>`` and ``/dev/dri/renderD<M>`` by number (no ROCm files:
the workload's image brings its user space).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

from drasil.driver.amd.sysfs import (
    AmdGpu,
    AmdGpuError,
    AmdPartition,
    AmdSysfs,
    DevNumbers,
    read_sysfs,
)
from drasil.driver.devices import (
    NUMA_NODE_ATTRIBUTE,
    PCI_BUS_ID_ATTRIBUTE,
    PCIE_ROOT_ATTRIBUTE,
    AttributeValue,
    CharDevice,
    CounterSet,
    Device,
    DeviceType,
    Version,
)
from drasil.driver.slices.validate import is_semver

PARTITIONED_MODES: Final = frozenset({"DPX", "QPX", "CPX"})


@dataclass(frozen=True)
class AmdDiscovery:
    devices: tuple[Device, ...]
    skipped: tuple[AmdGpuError, ...]  # GPUs not published, and why
    # The shared counters of dynamically partitioned GPUs (``partitions``).
    counter_sets: tuple[CounterSet, ...] = ()

    def driver(self) -> str:
        """``amdgpu 6.8.5``, for people (the in-tree driver has no version)."""
        versions = {d.attributes.get("driverVersion") for d in self.devices}
        known = sorted(v.value for v in versions if isinstance(v, Version))
        return f"amdgpu {', '.join(known) or '(in-tree, no version)'}"


def skipped_text(skipped: AmdGpuError) -> str:
    """``AMD GPU 0000:c1:00.0: <reason>``, for the log and ``drasil`` commands."""
    return f"AMD GPU {skipped.bdf}: {skipped.reason}"


def gpu_uuid(unique_id: int) -> str:
    return f"GPU-{unique_id:016x}"


def is_partitioned(gpu: AmdGpu) -> bool:
    return gpu.compute_partition in PARTITIONED_MODES


def discover_amd(sysfs_root: Path) -> AmdDiscovery:
    """The AMD devices of a sysfs tree; a GPU that cannot be read is skipped."""
    return devices_from_sysfs(read_sysfs(sysfs_root))


def devices_from_sysfs(snapshot: AmdSysfs) -> AmdDiscovery:
    skipped = list(snapshot.errors)
    if snapshot.kfd_dev is None:
        why = "KFD is not available (no class/kfd/kfd/dev): is amdgpu loaded with KFD?"
        skipped += [AmdGpuError(g.bdf, why) for g in snapshot.gpus]
        return AmdDiscovery((), tuple(skipped))
    devices: list[Device] = []
    for gpu in snapshot.gpus:
        if is_partitioned(gpu):
            devices += [partition_device(gpu, p, snapshot) for p in gpu.partitions]
        else:
            devices.append(whole_gpu_device(gpu, snapshot))
    return AmdDiscovery(tuple(devices), tuple(skipped))


def _char_devices(
    kfd: DevNumbers, card: int, render: int, gpu: AmdGpu, part: AmdPartition | None
) -> tuple[CharDevice, ...]:
    card_dev = part.card.dev if part else gpu.card.dev
    render_dev = part.render.dev if part else gpu.render.dev
    nodes = (
        ("/dev/kfd", kfd),
        (f"/dev/dri/card{card}", card_dev),
        (f"/dev/dri/renderD{render}", render_dev),
    )
    return tuple(CharDevice(path, path, d.major, d.minor) for path, d in nodes)


def common_attributes(gpu: AmdGpu, snapshot: AmdSysfs) -> dict[str, AttributeValue]:
    """What a GPU and its partitions share: identity of the card, mode, PCI place."""
    attrs: dict[str, AttributeValue] = {
        "vendor": "amd",
        "productName": gpu.product_name,
        "family": gpu.gfx_target,
        "deviceID": f"{gpu.device_id:#06x}",
        PCI_BUS_ID_ATTRIBUTE: gpu.bdf,
    }
    if gpu.compute_partition:
        attrs["computePartition"] = gpu.compute_partition
    if gpu.memory_partition:
        attrs["memoryPartition"] = gpu.memory_partition
    if gpu.compute_partition and gpu.memory_partition:
        profile = f"{gpu.compute_partition}_{gpu.memory_partition}".lower()
        attrs["partitionProfile"] = profile  # ROCm's DRA driver's form: cpx_nps4
    if gpu.pcie_root:
        attrs[PCIE_ROOT_ATTRIBUTE] = gpu.pcie_root
    if gpu.numa_node is not None:
        attrs[NUMA_NODE_ATTRIBUTE] = gpu.numa_node
    version = snapshot.driver_version
    if version and is_semver(version):  # what the API server takes as a version
        attrs["driverVersion"] = Version(version)
    return attrs


def whole_gpu_device(gpu: AmdGpu, snapshot: AmdSysfs) -> Device:
    assert snapshot.kfd_dev is not None
    uuid = gpu_uuid(gpu.unique_id)
    attrs = common_attributes(gpu, snapshot) | {
        "type": DeviceType.AMDGPU.value,
        "uuid": uuid,
        "cardIndex": gpu.card.index,
        "renderIndex": gpu.render.index,
    }
    return Device(
        name=f"amdgpu-{gpu.card.index}",
        type=DeviceType.AMDGPU,
        uuid=uuid,
        minor=gpu.card.index,
        attributes=attrs,
        capacity={
            "memory": gpu.memory_bytes,
            "computeUnits": gpu.compute_units,
            "simdUnits": gpu.simd_count,
        },
        char_devices=_char_devices(snapshot.kfd_dev, gpu.card.index, gpu.render.index, gpu, None),
        numa_node=gpu.numa_node,
        pcie_root=gpu.pcie_root,
    )


def partition_uuid(gpu: AmdGpu, part: AmdPartition) -> str:
    """The partition's own KFD unique id when it has one of its own, else derived."""
    ids = [p.kfd.unique_id for p in gpu.partitions]
    own = part.kfd.unique_id
    if own and own != gpu.unique_id and ids.count(own) == 1:
        return gpu_uuid(own)
    return f"{gpu_uuid(gpu.unique_id)}-{part.index}"


def partition_device(gpu: AmdGpu, part: AmdPartition, snapshot: AmdSysfs) -> Device:
    assert snapshot.kfd_dev is not None
    assert gpu.compute_partition is not None
    uuid, parent = partition_uuid(gpu, part), gpu_uuid(gpu.unique_id)
    attrs = common_attributes(gpu, snapshot) | {
        "type": DeviceType.AMDGPU_PARTITION.value,
        "uuid": uuid,
        "family": part.kfd.gfx_target,
        "cardIndex": part.card.index,
        "renderIndex": part.render.index,
        "parentUUID": parent,
        "partitionIndex": part.index,
    }
    mode = gpu.compute_partition.lower()
    return Device(
        name=f"amdgpu-{gpu.card.index}-{mode}-{part.index}",
        type=DeviceType.AMDGPU_PARTITION,
        uuid=uuid,
        minor=part.card.index,
        attributes=attrs,
        capacity={
            "memory": part.kfd.memory_bytes,
            "computeUnits": part.kfd.compute_units,
            "simdUnits": part.kfd.simd_count,
        },
        parent_uuid=parent,
        char_devices=_char_devices(snapshot.kfd_dev, part.card.index, part.render.index, gpu, part),
        numa_node=gpu.numa_node,
        pcie_root=gpu.pcie_root,
    )

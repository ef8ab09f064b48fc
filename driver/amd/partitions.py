"""AMD compute partitions switched on demand (``--amd-partition-mode dynamic``).

The counterpart of dynamic MIG: an MI300-class GPU publishes every partition its
compute modes can make, and prepare switches the GPU to the mode of the partition a
claim was given (``drasil.kubeletplugin.vendors.amd.modes``). Unlike MIG, a mode is
the whole GPU's: all partitions of a GPU are in one mode at a time, so prepare
refuses a partition of another mode while a claim holds the GPU.

What a partitionable GPU publishes (for the memory partition mode it is in now;
changing that needs a driver reload, which drasil never does):

- a counter set ``amdgpu-<card>-counters`` with one counter per compute die (XCC),
  ``xcd-0`` … ``xcd-<n-1>`` (1 each; ``n`` is the sum of KFD's ``num_xcc`` over the
  GPU's partitions, 8 on MI300X), so the scheduler never gives two claims partitions
  that overlap;
- the whole GPU ``amdgpu-<card>`` (SPX, drawing every die) where SPX suits the memory
  mode;
- for every other mode the GPU lists in ``available_compute_partition`` and that suits
  the memory mode, its partitions ``amdgpu-<card>-<mode>-<i>`` drawing dies
  ``i*k`` … ``(i+1)*k - 1`` (``k`` = dies per partition): the same names a GPU in that
  mode publishes in static mode.

A partition's memory, CUs and SIMDs are the GPU's divided by the mode's partition count
(amdgpu divides them evenly). Its device nodes and UUID exist only once the GPU is in
its mode, so a published partition has neither; ``realize`` reads them after the
switch. Modes and memory modes combine as amdgpu's ``aqua_vanjaram.c`` allows: SPX with
NPS1; DPX with NPS1 or NPS2; TPX with NPS1 or NPS3; QPX and CPX with NPS1 or NPS4.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final

from drasil.api.checkpoint import PartitionRecord
from drasil.driver.amd.devices import (
    AmdDiscovery,
    common_attributes,
    devices_from_sysfs,
    gpu_uuid,
    partition_device,
    whole_gpu_device,
)
from drasil.driver.amd.sysfs import (
    AmdGpu,
    AmdSysfs,
    SysfsError,
    amdgpu_driver_dir,
    read_sysfs,
)
from drasil.driver.devices import (
    PCI_BUS_ID_ATTRIBUTE,
    CounterConsumption,
    CounterSet,
    Device,
    DeviceType,
    HardwareError,
)

PARTITION_MODES: Final = ("static", "dynamic")
WHOLE_MODE: Final = "SPX"
# Memory partition modes each compute mode may be combined with (aqua_vanjaram.c).
MEMORY_MODES: Final[dict[str, frozenset[str]]] = {
    "SPX": frozenset({"NPS1"}),
    "DPX": frozenset({"NPS1", "NPS2"}),
    "TPX": frozenset({"NPS1", "NPS3"}),
    "QPX": frozenset({"NPS1", "NPS4"}),
    "CPX": frozenset({"NPS1", "NPS4"}),
}
_FIXED_COUNTS: Final = {"SPX": 1, "DPX": 2, "TPX": 3, "QPX": 4}  # CPX: one per die


class PartitionSwitchError(HardwareError):
    """amdgpu did not switch a GPU's compute partition mode; the message says why."""


def counter_set_name(card: int) -> str:
    """``amdgpu-1-counters``: the shared counters of the GPU with DRM card ``card``."""
    return f"amdgpu-{card}-counters"


def die_counter(index: int) -> str:
    return f"xcd-{index}"


def dies_of(gpu: AmdGpu) -> int:
    """The GPU's compute dies (XCCs), whatever mode it is in now."""
    return sum(max(p.kfd.num_xcc, 1) for p in gpu.partitions)


def partition_count(mode: str, dies: int) -> int | None:
    """How many partitions ``mode`` makes of ``dies`` dies; None: it cannot."""
    count = dies if mode == "CPX" else _FIXED_COUNTS.get(mode)
    if count is None or dies % count:
        return None
    return count


def possible_modes(gpu: AmdGpu) -> tuple[str, ...]:
    """The compute modes the GPU can be switched to without changing its memory mode."""
    if gpu.compute_partition is None or gpu.memory_partition is None:
        return ()  # no partition files: an MI200 or older
    listed = gpu.available_compute_partitions or (gpu.compute_partition,)
    dies = dies_of(gpu)
    return tuple(
        mode
        for mode in dict.fromkeys((WHOLE_MODE, *listed))
        if mode in MEMORY_MODES
        and gpu.memory_partition in MEMORY_MODES[mode]
        and partition_count(mode, dies) is not None
        and (mode == WHOLE_MODE or mode in listed)
    )


@dataclass(frozen=True)
class _Gpu:
    """What every device of one partitionable GPU shares."""

    gpu: AmdGpu
    snapshot: AmdSysfs
    dies: int

    @property
    def uuid(self) -> str:
        return gpu_uuid(self.gpu.unique_id)

    def slot(self, mode: str, index: int) -> PartitionRecord:
        count = partition_count(mode, self.dies)
        assert count is not None
        size = self.dies // count
        return PartitionRecord(
            parent_uuid=self.uuid,
            parent_bus_id=self.gpu.bdf,
            mode=mode,
            index=index,
            start=index * size,
            size=size,
        )

    def draws(self, slot: PartitionRecord) -> tuple[CounterConsumption, ...]:
        dies = range(slot.start, slot.start + slot.size)
        name = counter_set_name(self.gpu.card.index)
        return (CounterConsumption(name, {die_counter(d): 1 for d in dies}),)


def discover_dynamic(sysfs_root: Path) -> AmdDiscovery:
    """The devices of a sysfs tree as ``--amd-partition-mode dynamic`` publishes them."""
    return dynamic_from_sysfs(read_sysfs(sysfs_root))


def dynamic_from_sysfs(snapshot: AmdSysfs) -> AmdDiscovery:
    """Partitionable GPUs as all their partitions; other GPUs as in static mode."""
    static = devices_from_sysfs(snapshot)
    if snapshot.kfd_dev is None:
        return static
    devices: list[Device] = []
    counter_sets: list[CounterSet] = []
    dynamic = {g.bdf: g for g in snapshot.gpus if len(possible_modes(g)) > 1}
    for device in static.devices:
        bdf = device.attributes.get(PCI_BUS_ID_ATTRIBUTE)
        if bdf not in dynamic:
            devices.append(device)
    for gpu in dynamic.values():
        entry = _Gpu(gpu, snapshot, dies_of(gpu))
        counters = {die_counter(d): 1 for d in range(entry.dies)}
        counter_sets.append(CounterSet(counter_set_name(gpu.card.index), counters))
        devices += _gpu_devices(entry)
    return AmdDiscovery(tuple(devices), static.skipped, tuple(counter_sets))


def _gpu_devices(entry: _Gpu) -> list[Device]:
    devices = []
    for mode in possible_modes(entry.gpu):
        if mode == WHOLE_MODE:
            devices.append(_whole(entry))
            continue
        count = partition_count(mode, entry.dies)
        assert count is not None
        devices += [_partition(entry, entry.slot(mode, i), count) for i in range(count)]
    return devices


def _whole(entry: _Gpu) -> Device:
    slot = entry.slot(WHOLE_MODE, 0)
    published = whole_gpu_device(entry.gpu, entry.snapshot)
    attributes = {**published.attributes, **_mode_attributes(entry.gpu, WHOLE_MODE)}
    return replace(
        published,
        attributes=attributes,
        compute_partition=slot,
        consumes_counters=entry.draws(slot),
    )


def _mode_attributes(gpu: AmdGpu, mode: str) -> dict[str, str]:
    memory = gpu.memory_partition or ""
    return {
        "computePartition": mode,
        "partitionProfile": f"{mode}_{memory}".lower(),
    }


def _partition(entry: _Gpu, slot: PartitionRecord, count: int) -> Device:
    gpu = entry.gpu
    attributes = common_attributes(gpu, entry.snapshot) | _mode_attributes(gpu, slot.mode)
    attributes |= {
        "type": DeviceType.AMDGPU_PARTITION.value,
        "parentUUID": entry.uuid,
        "partitionIndex": slot.index,
    }
    return Device(
        name=f"amdgpu-{gpu.card.index}-{slot.mode.lower()}-{slot.index}",
        type=DeviceType.AMDGPU_PARTITION,
        uuid="",  # the partition exists once the GPU is in its mode
        minor=gpu.card.index,
        attributes=attributes,
        capacity={
            "memory": gpu.memory_bytes // count,
            "computeUnits": gpu.compute_units // count,
            "simdUnits": gpu.simd_count // count,
        },
        parent_uuid=entry.uuid,
        numa_node=gpu.numa_node,
        pcie_root=gpu.pcie_root,
        compute_partition=slot,
        consumes_counters=entry.draws(slot),
    )


# ---- after a switch --------------------------------------------------------------------


def realize(published: Device, snapshot: AmdSysfs) -> Device:
    """The published partition as it exists now: its UUID and device nodes.

    Raises ``PartitionSwitchError`` when the GPU is not in the partition's mode (or the
    partition is not in the tree), so a container never gets another partition's nodes.
    """
    slot = published.compute_partition
    assert slot is not None
    gpu = next((g for g in snapshot.gpus if g.bdf == slot.parent_bus_id), None)
    if gpu is None:
        raise PartitionSwitchError(f"GPU {slot.parent_bus_id} is not bound to amdgpu any more")
    current = gpu.compute_partition or WHOLE_MODE
    if current != slot.mode or slot.index >= len(gpu.partitions):
        raise PartitionSwitchError(
            f"GPU {slot.parent_bus_id} is in {current} mode with {len(gpu.partitions)} "
            f"partition(s); {published.name} needs {slot.mode} (was the mode changed by "
            "hand meanwhile?); kubelet retries the claim"
        )
    if slot.mode == WHOLE_MODE:
        found = whole_gpu_device(gpu, snapshot)
    else:
        found = partition_device(gpu, gpu.partitions[slot.index], snapshot)
    # What only the partition that exists has: its UUID and DRM node numbers.
    own = {k: found.attributes[k] for k in ("uuid", "cardIndex", "renderIndex")}
    return replace(
        published,
        uuid=found.uuid,
        char_devices=found.char_devices,
        attributes={**published.attributes, **own},
    )


def mode_of(snapshot: AmdSysfs, bdf: str) -> str:
    """The GPU's compute partition mode in ``snapshot`` (SPX for a GPU without
    partitions); ``PartitionSwitchError`` when the GPU is not bound to amdgpu."""
    gpu = next((g for g in snapshot.gpus if g.bdf == bdf), None)
    if gpu is None:
        raise PartitionSwitchError(f"GPU {bdf} is not bound to amdgpu any more")
    return gpu.compute_partition or WHOLE_MODE


def current_mode(root: Path, bdf: str) -> str:
    """The GPU's compute partition mode now, read from the tree."""
    return mode_of(read_sysfs(root), bdf)


ModeWriter = Callable[[Path, str, str], None]
"""Writes a compute partition mode for GPU ``bdf`` under a sysfs root; OSError as the
kernel answers (``write_mode`` on a host, the simulated tree's own on a fake one)."""


def write_mode(root: Path, bdf: str, mode: str) -> None:
    """amdgpu's sysfs file that switches the GPU's compute partition mode."""
    (amdgpu_driver_dir(root) / bdf / "current_compute_partition").write_text(mode)


def switch_mode(root: Path, bdf: str, mode: str, *, write: ModeWriter = write_mode) -> None:
    """Ask amdgpu to put the GPU in compute mode ``mode`` (through ``write``).

    amdgpu answers EBUSY while a process uses the GPU through ``/dev/kfd`` (older
    releases: any GPU of the node) and EINVAL for a mode the memory mode rules out.
    """
    try:
        write(root, bdf, mode)
    except OSError as err:
        raise PartitionSwitchError(_switch_failure(bdf, mode, err)) from err
    except (ValueError, SysfsError) as err:  # the simulated tree's refusal of a mode
        raise PartitionSwitchError(f"GPU {bdf}: {err}") from err


def _switch_failure(bdf: str, mode: str, err: OSError) -> str:
    what = f"amdgpu did not switch GPU {bdf} to {mode}"
    if err.errno == errno.EBUSY:
        return (
            f"{what}: the GPU is busy (EBUSY: a process holds it through /dev/kfd; older "
            "amdgpu releases refuse while any process on the node does); kubelet retries "
            "the claim"
        )
    if err.errno == errno.EINVAL:
        return f"{what}: amdgpu does not allow {mode} with the GPU's memory partition mode"
    return f"{what}: {err.strerror or err}"

"""MIG devices cut on demand (``--mig-mode dynamic``): placements and shared counters.

A MIG-capable GPU is published as one partitionable device: a counter set holding
what the GPU has, the full GPU consuming all of it, and one device per placement of
every GPU instance profile consuming exactly what that instance would take. The
scheduler then never hands out two devices whose counters together exceed the GPU,
which is exactly when NVML would refuse to create both instances: memory slices
cannot overlap, and the engines of the largest profile (7g) are the GPU's.

Names (DNS labels):

- the counter set of GPU ``<minor>`` is ``gpu-<minor>-counters``;
- its counters are ``memory-slice-0`` … ``memory-slice-<n-1>`` (1 each; ``n`` is the
  size of the whole-GPU placement, 8), ``memory`` (bytes, the GPU's total),
  ``multiprocessors``, ``copy-engines``, ``decoders``, ``encoders``,
  ``jpeg-engines``, ``ofa-engines`` (the 7g profile's counts); counters with a total
  of 0 are left out, and so are a device's zero consumptions;
- a placement device is ``gpu-<minor>-mig-<profile without dots and plus>-at-<start>``
  (``gpu-0-mig-3g40gb-at-4``, ``gpu-0-mig-1g10gbme-at-0``).

A placement device has the attributes and capacity of a static MIG device except
``uuid`` (the instance does not exist yet; ``Device.uuid`` is empty), plus the int
attributes ``placementStart`` and ``placementSize`` (memory slices) and
``Device.mig_placement``, which prepare uses to create the instance.

``existing_mig_instances`` lists the GPU and compute instances that exist now, for
``drasil discover``: in dynamic mode they belong to prepared claims and are not
published as devices of their own.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from drasil.driver.devices import (
    AttributeValue,
    CounterConsumption,
    CounterSet,
    Device,
    DeviceType,
    MigPlacement,
)
from drasil.driver.nvidia.nvml import (
    DeviceHandle,
    GpuInstanceProfile,
    NvmlLibrary,
    NvmlNotSupported,
    NvmlQueryError,
    Placement,
)

log = logging.getLogger(__name__)

MiB = 2**20

MEMORY = "memory"
MULTIPROCESSORS = "multiprocessors"
COPY_ENGINES = "copy-engines"
DECODERS = "decoders"
ENCODERS = "encoders"
JPEG_ENGINES = "jpeg-engines"
OFA_ENGINES = "ofa-engines"

PLACEMENT_START_ATTRIBUTE = "placementStart"
PLACEMENT_SIZE_ATTRIBUTE = "placementSize"


def memory_slice_counter(index: int) -> str:
    return f"memory-slice-{index}"


def counter_set_name(minor: int) -> str:
    """``gpu-0-counters``: the shared counters of the GPU with this minor number."""
    return f"gpu-{minor}-counters"


def compact_profile(profile: str) -> str:
    """A profile in a device name: ``1g.10gb+me`` → ``1g10gbme``, ``1g.12gb-me`` →
    ``1g12gbnome``; the sign is spelled so the two never share a name."""
    return re.sub(r"[^a-z0-9]", "", profile.lower().replace("-me", "nome"))


def placement_device_name(*, parent_minor: int, profile: str, start: int) -> str:
    """``gpu-0-mig-3g40gb-at-4`` (see the module docstring)."""
    return f"gpu-{parent_minor}-mig-{compact_profile(profile)}-at-{start}"


@dataclass(frozen=True)
class PartitionableGpu:
    """One GPU in dynamic mode: its devices (the full GPU first) and counter set.

    ``left_out`` says why a profile has no devices (its counts exceed the GPU's).
    """

    devices: tuple[Device, ...]
    counter_set: CounterSet
    left_out: tuple[str, ...] = ()


def _nonzero(counters: Mapping[str, int]) -> dict[str, int]:
    return {name: value for name, value in counters.items() if value}


def _engines(profile: GpuInstanceProfile) -> dict[str, int]:
    return {
        MULTIPROCESSORS: profile.multiprocessors,
        COPY_ENGINES: profile.copy_engines,
        DECODERS: profile.decoders,
        ENCODERS: profile.encoders,
        JPEG_ENGINES: profile.jpeg_engines,
        OFA_ENGINES: profile.ofa_engines,
    }


def gpu_counters(
    *,
    memory: int,
    profiles: Sequence[GpuInstanceProfile],
    placements: Mapping[int, Sequence[Placement]],
) -> dict[str, int]:
    """The counters of a GPU: its memory slices, memory, and the 7g profile's engines."""
    slices = max((p.start + p.size for pls in placements.values() for p in pls), default=0)
    full = max(profiles, key=lambda p: p.slice_count)
    counters = {memory_slice_counter(i): 1 for i in range(slices)}
    return _nonzero({**counters, MEMORY: memory, **_engines(full)})


def placement_consumption(profile: GpuInstanceProfile, placement: Placement) -> dict[str, int]:
    """What an instance of ``profile`` at ``placement`` takes from its GPU's counters."""
    counters = {memory_slice_counter(i): 1 for i in placement.slices}
    return _nonzero({**counters, MEMORY: profile.memory_mib * MiB, **_engines(profile)})


def _fits(consumption: Mapping[str, int], totals: Mapping[str, int]) -> bool:
    return all(value <= totals.get(name, 0) for name, value in consumption.items())


def partition(
    full: Device,
    *,
    memory: int,
    profiles: Sequence[GpuInstanceProfile],
    placements: Mapping[int, Sequence[Placement]],
) -> PartitionableGpu:
    """The full GPU ``full`` (a ``gpu-<minor>`` device) as a partitionable device."""
    totals = gpu_counters(memory=memory, profiles=profiles, placements=placements)
    counter_set = CounterSet(name=counter_set_name(full.minor), counters=totals)
    devices = [_with_consumption(full, counter_set.name, totals)]
    left_out: list[str] = []
    for profile in profiles:
        for placement in placements.get(profile.profile_id, ()):
            consumption = placement_consumption(profile, placement)
            if not _fits(consumption, totals):
                left_out.append(f"{full.name}: profile {profile.name} needs more than the GPU")
                break
            devices.append(_placement_device(full, profile, placement, counter_set.name))
    return PartitionableGpu(tuple(devices), counter_set, tuple(left_out))


def _with_consumption(device: Device, counter_set: str, counters: Mapping[str, int]) -> Device:
    return replace(device, consumes_counters=(CounterConsumption(counter_set, dict(counters)),))


def _placement_device(
    full: Device, profile: GpuInstanceProfile, placement: Placement, counter_set: str
) -> Device:
    attributes: dict[str, AttributeValue] = {
        **{k: v for k, v in full.attributes.items() if k != "uuid"},
        "type": DeviceType.MIG.value,
        "parentUUID": full.uuid,
        "profile": profile.name,
        PLACEMENT_START_ATTRIBUTE: placement.start,
        PLACEMENT_SIZE_ATTRIBUTE: placement.size,
    }
    consumption = placement_consumption(profile, placement)
    return Device(
        name=placement_device_name(
            parent_minor=full.minor, profile=profile.name, start=placement.start
        ),
        type=DeviceType.MIG,
        uuid="",
        minor=full.minor,
        attributes=attributes,
        capacity=_capacity(profile),
        parent_uuid=full.uuid,
        device_nodes=full.device_nodes,
        numa_node=full.numa_node,
        pcie_root=full.pcie_root,
        mig_placement=MigPlacement(
            parent_uuid=full.uuid,
            parent_minor=full.minor,
            profile=profile.name,
            profile_id=profile.profile_id,
            start=placement.start,
            size=placement.size,
        ),
        consumes_counters=(CounterConsumption(counter_set, consumption),),
    )


def _capacity(profile: GpuInstanceProfile) -> dict[str, int]:
    # The capacity names of a static MIG device, so selectors work on both.
    return {
        "memory": profile.memory_mib * MiB,
        "multiprocessors": profile.multiprocessors,
        "copyEngines": profile.copy_engines,
        "decoders": profile.decoders,
        "encoders": profile.encoders,
        "jpegEngines": profile.jpeg_engines,
        "ofaEngines": profile.ofa_engines,
    }


# -- what exists now ----------------------------------------------------------------


@dataclass(frozen=True)
class ExistingMig:
    """A GPU instance that exists, with its compute instance (None: it has none yet)."""

    gpu: str  # gpu-<minor>
    gpu_instance_id: int
    compute_instance_id: int | None
    profile: str
    placement: Placement
    uuid: str  # the MIG device's, "" without a compute instance

    def line(self) -> str:
        """``gpu-0 gi=1 ci=0 3g.40gb at 4 MIG-…`` (``ci=-`` and ``-`` without a CI)."""
        ci = "-" if self.compute_instance_id is None else str(self.compute_instance_id)
        where = f"{self.profile} at {self.placement.start}"
        return f"{self.gpu} gi={self.gpu_instance_id} ci={ci} {where} {self.uuid or '-'}"


def existing_mig_instances(lib: NvmlLibrary) -> list[ExistingMig]:
    """Every GPU and compute instance on GPUs in MIG mode (``lib`` initialised).

    A GPU whose queries fail is logged and left out: this is a listing, not a check.
    """
    found: list[ExistingMig] = []
    for index in range(lib.device_count()):
        try:
            found.extend(_gpu_instances(lib, lib.device_handle_by_index(index)))
        except NvmlQueryError as err:
            log.warning("cannot list MIG instances", extra={"gpu_index": index, "error": str(err)})
    return found


def _gpu_instances(lib: NvmlLibrary, handle: DeviceHandle) -> list[ExistingMig]:
    try:
        if not lib.device_mig_mode(handle).current:
            return []
    except NvmlNotSupported:
        return []
    gpu = f"gpu-{lib.device_minor_number(handle)}"
    names = {p.profile_id: p.name for p in lib.gpu_instance_profiles(handle)}
    uuids = _mig_uuids(lib, handle)
    found = []
    for gi in lib.gpu_instances(handle):
        profile = names.get(gi.profile_id, f"profile-{gi.profile_id}")
        cis: list[int | None] = [
            ci.compute_instance_id for ci in lib.compute_instances(handle, gi.gpu_instance_id)
        ]
        for ci in cis or [None]:
            uuid = uuids.get((gi.gpu_instance_id, ci), "") if ci is not None else ""
            found.append(ExistingMig(gpu, gi.gpu_instance_id, ci, profile, gi.placement, uuid))
    return found


def _mig_uuids(lib: NvmlLibrary, handle: DeviceHandle) -> dict[tuple[int, int], str]:
    uuids: dict[tuple[int, int], str] = {}
    for slot in range(lib.device_max_mig_device_count(handle)):
        try:
            mig = lib.device_mig_device_handle_by_index(handle, slot)
        except NvmlQueryError:
            continue  # an empty slot
        ids = (lib.device_gpu_instance_id(mig), lib.device_compute_instance_id(mig))
        uuids[ids] = lib.device_uuid(mig)
    return uuids

"""Discovery: what a node's NVML reports, turned into ``Device`` objects.

There is one code path for real and simulated GPUs: ``discover`` only talks to an
``NvmlLibrary`` (the pynvml adapter or the simulated fake).

Device names (DNS labels, stable for the same hardware and MIG layout):

- a full GPU is ``gpu-<minor>`` (``gpu-0``); the minor number is that of
  ``/dev/nvidia<minor>``, which survives reboots better than NVML's index;
- a MIG device is ``gpu-<parent minor>-mig-<profile>-<gi>-<ci>`` where ``<profile>``
  is the MIG profile without dots and plus signs and ``<gi>``/``<ci>`` are its GPU and
  compute instance ids (``gpu-0-mig-1g10gb-7-0`` for a 1g.10gb on GI 7, CI 0).

A GPU with MIG mode enabled publishes its MIG devices and not itself: its memory and
engines belong to the MIG devices, and handing out the whole GPU as well would give
the same hardware to two claims.

With ``mig_mode="dynamic"`` every MIG-capable GPU, whatever its MIG mode and
instances, is published as a partitionable device instead (``partitions``): the full
GPU and every placement of every MIG profile, all consuming from one counter set per
GPU (``DiscoveryResult.counter_sets``); MIG instances that exist are prepared claims'
and are not published. GPUs without MIG are published whole in both modes.

With ``gpu_sharing="consumable"`` a whole GPU that no MIG layout claims is published
with ``allowMultipleAllocations`` so several claims can share it by capacity
(KEP-5075): its ``memory`` (bytes) gets a request policy of 1Gi steps from 1Gi up to
the GPU's memory rounded down to whole GiB (the API server wants the maximum on a
step), and a new capacity ``computePercent`` (100) one of 0..100 in steps of 1 with
default 0, meaning "no compute share asked" (prepare then derives the MPS thread
percentage from the memory share). The whole GPUs of ``mig_mode="dynamic"`` are never
shareable: they keep consuming their counter set, and a shared GPU cannot be cut into
MIG devices under its tenants. Their MIG placements are, instead (``_shared_placement``):
each gets ``allowMultipleAllocations`` with the same ``memory`` and ``computePercent``
policies over the placement's own memory, its engine capacities pinned to 0 per share
(they stay readable by selectors, and cannot be asked for: MPS divides SMs, not
engines), and still consumes its counters, which kube-scheduler (1.37) takes once for
the device however many shares it holds. Prepare cuts the instance for the first
share and runs one MPS daemon on it; the last share's unprepare destroys it. Static
MIG devices are never shareable. So in dynamic MIG mode with consumable sharing the
GPUs that are not MIG-capable are shared whole and the others by MIG placement; in
static mode, every GPU whose MIG mode is off is shared whole. A GPU or placement with
less than 2 GiB of memory, where one step past the minimum would not fit, stays
exclusive.

Attributes are those of docs/design.md#names (NVIDIA's names, so selectors are portable); MIG
devices share their parent's ``index``, ``minor``, PCI attributes and product facts
(``addressingMode`` too, where NVML has one) and add ``parentUUID`` and ``profile``.
``device_nodes`` is ``/dev/nvidia<minor>`` on real hardware (for MIG devices the
parent's; the ``/dev/nvidia-caps`` nodes MIG access also needs are not handled yet) and
empty for simulated GPUs.

A GPU or MIG device whose queries fail is logged and reported in
``DiscoveryResult.skipped``; it never fails discovery. NVML itself being unusable
raises ``NvmlUnavailable`` with what to do about it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace

from drasil.driver.devices import (
    NUMA_NODE_ATTRIBUTE,
    PCI_BUS_ID_ATTRIBUTE,
    PCIE_ROOT_ATTRIBUTE,
    AttributeValue,
    CapacityPolicy,
    CounterSet,
    Device,
    DeviceType,
    MigSite,
    Version,
)
from drasil.driver.nvidia.nvml import (
    ADDRESSING_MODE_NAMES,
    ARCH_AMPERE,
    ARCHITECTURE_NAMES,
    BRAND_NAMES,
    DeviceAttributes,
    DeviceHandle,
    GpuInstance,
    MigMode,
    NvmlError,
    NvmlLibrary,
    NvmlNotFound,
    NvmlNotSupported,
    NvmlQueryError,
    NvmlUnavailable,
    mig_memory_gb,
)
from drasil.driver.nvidia.partitions import PartitionableGpu, compact_profile, partition

log = logging.getLogger(__name__)

MiB = 2**20
GiB = 2**30


# Errors that disqualify one device; anything else is a bug and should surface.
_DEVICE_ERRORS = (NvmlQueryError, ValueError)


@dataclass(frozen=True)
class SkippedDevice:
    """A GPU (``mig_index`` None) or MIG slot that discovery left out, and why."""

    index: int
    reason: str
    uuid: str | None = None
    mig_index: int | None = None


def skipped_text(skipped: SkippedDevice) -> str:
    """``NVIDIA GPU 3 MIG slot 1: <reason>``, for the log and ``drasil`` commands."""
    where = f"NVIDIA GPU {skipped.index}"
    if skipped.mig_index is not None:
        where += f" MIG slot {skipped.mig_index}"
    return f"{where}: {skipped.reason}"


@dataclass(frozen=True)
class DiscoveryResult:
    """The devices of a node, the ones that could not be published, and the shared
    counters the devices consume (dynamic MIG mode only)."""

    devices: tuple[Device, ...]
    skipped: tuple[SkippedDevice, ...]
    driver_version: Version
    cuda_driver_version: Version
    counter_sets: tuple[CounterSet, ...] = ()


def driver_description(found: DiscoveryResult) -> str:
    """``NVIDIA driver 580.65.06, CUDA 13.0``; "" where discovery found no GPU."""
    if not found.devices and not found.skipped:
        return ""
    return f"NVIDIA driver {found.driver_version.value}, CUDA {found.cuda_driver_version.value}"


MIG_MODES = ("static", "dynamic")
GPU_SHARING = ("exclusive", "consumable")

# The capacity a consumable GPU adds next to ``memory``: the share of its SMs a claim
# asks for, in percent (MPS' active thread percentage).
COMPUTE_PERCENT = "computePercent"
# Memory shares come in whole GiB: finer steps buy nothing for CUDA workloads and
# keep the scheduler's packing (and users' arithmetic) simple.
MEMORY_STEP = GiB
# Volta+ MPS serves at most 48 client contexts per GPU (NVIDIA's MPS documentation);
# each share is at least one.
MPS_CLIENT_LIMIT = 48
COMPUTE_POLICY = CapacityPolicy(default=0, minimum=0, step=1, maximum=100)


@dataclass(frozen=True)
class _System:
    driver_version: Version
    cuda_driver_version: Version
    device_count: int


@dataclass(frozen=True)
class _Gpu:
    """What a full GPU contributes to its own device or to its MIG devices."""

    index: int
    uuid: str
    minor: int
    memory: int
    attributes: Mapping[str, AttributeValue]
    device_nodes: tuple[str, ...]
    numa_node: int | None
    pcie_root: str | None


_DRIVER_VERSION = re.compile(r"\s*(\d+)(?:\.(\d+))?(?:\.(\d+))?")
_NVML_BUS_ID = re.compile(r"([0-9a-fA-F]{1,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])")


def driver_version_semver(text: str) -> str:
    """``580.95.05`` → ``580.95.5``, ``535.104`` → ``535.104.0`` (semver has no leading 0s)."""
    match = _DRIVER_VERSION.match(text)
    if match is None:
        raise ValueError(f"driver version {text!r} does not start with a number")
    return ".".join(str(int(part or 0)) for part in match.groups())


def cuda_version_semver(value: int) -> str:
    """NVML's ``12040`` → ``12.4.0`` (major * 1000 + minor * 10)."""
    if value <= 0:
        raise ValueError(f"CUDA driver version {value} is not a version")
    return f"{value // 1000}.{value % 1000 // 10}.0"


def normalize_pci_bus_id(nvml_bus_id: str) -> str:
    """NVML's ``00000000:3B:00.0`` → Kubernetes' (and sysfs') ``0000:3b:00.0``."""
    match = _NVML_BUS_ID.fullmatch(nvml_bus_id.strip())
    if match is None:
        raise ValueError(f"PCI bus id {nvml_bus_id!r} is not domain:bus:device.function")
    domain, bus, device, function = match.groups()
    return f"{int(domain, 16):04x}:{bus.lower()}:{device.lower()}.{function}"


def mig_profile_name(attributes: DeviceAttributes, *, parent_memory: int) -> str:
    """The profile name (``1g.5gb``, ``1c.3g.20gb``) the way go-nvlib derives it.

    The memory part rounds the MIG device's share of the parent up to eighths and
    scales it to the parent's size in whole GiB, so 4864 MiB of a 40 GiB A100 is 5gb.
    """
    gb = mig_memory_gb(attributes.memory_size_mib, parent_memory=parent_memory)
    g = attributes.gpu_instance_slice_count
    c = attributes.compute_instance_slice_count
    return f"{g}g.{gb}gb" if c == g else f"{c}c.{g}g.{gb}gb"


def mig_device_name(
    *, parent_minor: int, profile: str, gpu_instance: int, compute_instance: int
) -> str:
    """``gpu-0-mig-1g10gb-7-0`` (see the module docstring)."""
    compact = compact_profile(profile)
    return f"gpu-{parent_minor}-mig-{compact}-{gpu_instance}-{compute_instance}"


_MIG_DEVICE_NAME = re.compile(r"gpu-(\d+)-mig-[a-z0-9]+-(\d+)-(\d+)")


def parse_mig_device_name(name: str) -> tuple[int, int, int] | None:
    """(parent minor, GPU instance, compute instance) of a static MIG device's name,
    or None for any other name (a dynamic placement's ends ``-at-<start>``)."""
    found = _MIG_DEVICE_NAME.fullmatch(name)
    if found is None:
        return None
    minor, gi, ci = found.groups()
    return int(minor), int(gi), int(ci)


def discover(
    lib: NvmlLibrary,
    *,
    node_name: str,
    mig_mode: str = "static",
    gpu_sharing: str = "exclusive",
) -> DiscoveryResult:
    """Every publishable device of the node behind ``lib``; see the module docstring.

    With ``gpu_sharing="consumable"`` whole GPUs outside any MIG layout are shareable,
    and in dynamic MIG mode the MIG placements of MIG-capable GPUs.

    Raises ``NvmlUnavailable`` when NVML cannot be initialised or answers no system
    query; per-device failures end up in ``skipped`` instead.
    """
    if mig_mode not in MIG_MODES:
        raise ValueError(f"mig_mode {mig_mode!r} is not one of {MIG_MODES}")
    if gpu_sharing not in GPU_SHARING:
        raise ValueError(f"gpu_sharing {gpu_sharing!r} is not one of {GPU_SHARING}")
    lib.init()
    try:
        return _discover(
            lib,
            node_name=node_name,
            dynamic=mig_mode == "dynamic",
            shareable=gpu_sharing == "consumable",
        )
    finally:
        try:
            lib.shutdown()
        except NvmlError as err:
            log.warning("nvmlShutdown failed: %s", err, extra={"node": node_name})


def _discover(
    lib: NvmlLibrary, *, node_name: str, dynamic: bool, shareable: bool
) -> DiscoveryResult:
    system = _system(lib)
    devices: list[Device] = []
    skipped: list[SkippedDevice] = []
    counter_sets: list[CounterSet] = []
    for index in range(system.device_count):
        found = _discover_gpu(
            lib, index=index, system=system, skipped=skipped, dynamic=dynamic, shareable=shareable
        )
        if isinstance(found, PartitionableGpu):
            counter_sets.append(found.counter_set)
            found = list(found.devices)
        devices.extend(found)
    devices = _unique_names(devices, skipped)
    for skip in skipped:
        log.warning(
            "skipping device: %s",
            skip.reason,
            extra={"node": node_name, "gpu_index": skip.index, "mig_index": skip.mig_index},
        )
    log.info("discovered %d devices", len(devices), extra={"node": node_name})
    return DiscoveryResult(
        devices=tuple(devices),
        skipped=tuple(skipped),
        driver_version=system.driver_version,
        cuda_driver_version=system.cuda_driver_version,
        counter_sets=tuple(counter_sets),
    )


def _system(lib: NvmlLibrary) -> _System:
    try:
        driver = lib.system_driver_version()
        cuda = lib.system_cuda_driver_version()
        count = lib.device_count()
        return _System(
            driver_version=Version(driver_version_semver(driver)),
            cuda_driver_version=Version(cuda_version_semver(cuda)),
            device_count=count,
        )
    except _DEVICE_ERRORS as err:
        raise NvmlUnavailable(
            f"NVML initialised but cannot describe the system ({err}): check that the "
            "NVIDIA driver is installed completely and matches its NVML library"
        ) from err


def _discover_gpu(
    lib: NvmlLibrary,
    *,
    index: int,
    system: _System,
    skipped: list[SkippedDevice],
    dynamic: bool,
    shareable: bool,
) -> list[Device] | PartitionableGpu:
    uuid: str | None = None
    try:
        handle = lib.device_handle_by_index(index)
        uuid = lib.device_uuid(handle)
        gpu = _read_gpu(lib, handle, index=index, uuid=uuid, system=system)
        mode = _mig_mode(lib, handle)
        if dynamic and mode is not None and _cuts_on_demand(gpu, mode):
            found = _partitionable(lib, handle, gpu, whole=not _resets_for_mig(gpu))
            if shareable:
                found = replace(found, devices=tuple(_shared_placement(d) for d in found.devices))
            skipped.extend(SkippedDevice(index=index, uuid=uuid, reason=r) for r in found.left_out)
            return found
        mig_slots = lib.device_max_mig_device_count(handle) if mode and mode.current else None
    except _DEVICE_ERRORS as err:
        skipped.append(SkippedDevice(index=index, uuid=uuid, reason=f"GPU {index}: {err}"))
        return []
    if mig_slots is None:
        return [_shared_gpu(gpu) if shareable else _full_gpu(gpu)]
    migs = _mig_devices(lib, handle, gpu=gpu, slots=mig_slots, skipped=skipped)
    if not migs and not any(s.index == index for s in skipped):
        reason = f"GPU {index}: MIG mode is enabled but no MIG devices are configured"
        skipped.append(SkippedDevice(index=index, uuid=uuid, reason=reason))
    return migs


def _read_gpu(
    lib: NvmlLibrary, handle: DeviceHandle, *, index: int, uuid: str, system: _System
) -> _Gpu:
    minor = lib.device_minor_number(handle)
    bus_id = normalize_pci_bus_id(lib.device_pci_bus_id(handle))
    major, cc_minor = lib.device_cuda_compute_capability(handle)
    pcie_root = lib.pcie_root(bus_id)
    attributes: dict[str, AttributeValue] = {
        "uuid": uuid,
        "productName": lib.device_name(handle),
        "brand": BRAND_NAMES.get(lib.device_brand(handle), "Unknown"),
        "architecture": ARCHITECTURE_NAMES.get(lib.device_architecture(handle), "Unknown"),
        "cudaComputeCapability": Version(f"{major}.{cc_minor}.0"),
        "driverVersion": system.driver_version,
        "cudaDriverVersion": system.cuda_driver_version,
        "index": index,
        "minor": minor,
        PCI_BUS_ID_ATTRIBUTE: bus_id,
    }
    if pcie_root is not None:
        attributes[PCIE_ROOT_ATTRIBUTE] = pcie_root
    numa_node = lib.device_numa_node(handle)
    # Only a known node: a GPU without NUMA affinity must not publish one, or it would
    # match every other device without affinity under matchAttribute.
    if numa_node is not None and numa_node >= 0:
        attributes[NUMA_NODE_ATTRIBUTE] = numa_node
    # As NVIDIA's driver publishes it: only where NVML has one; MIG devices inherit it.
    # A value newer than this code knows is left out (NVIDIA's driver fails the GPU).
    mode = lib.device_addressing_mode(handle)
    if mode is not None and mode in ADDRESSING_MODE_NAMES:
        attributes["addressingMode"] = ADDRESSING_MODE_NAMES[mode]
    elif mode is not None:
        log.warning(
            "GPU %d: addressing mode %d is unknown; no addressingMode attribute", index, mode
        )
    return _Gpu(
        index=index,
        uuid=uuid,
        minor=minor,
        memory=lib.device_memory_total(handle),
        attributes=attributes,
        device_nodes=lib.device_nodes(minor),
        numa_node=numa_node,
        pcie_root=pcie_root,
    )


def _mig_mode(lib: NvmlLibrary, handle: DeviceHandle) -> MigMode | None:
    """The GPU's MIG mode, or None when it has no MIG at all."""
    try:
        mode = lib.device_mig_mode(handle)
    except NvmlNotSupported:
        return None
    if mode.current != mode.pending:
        # The layout changes only after a GPU reset; publish what is in effect now.
        log.info("MIG mode change pending until the next GPU reset")
    return mode


def _resets_for_mig(gpu: _Gpu) -> bool:
    """Ampere GPUs (A100, A30) change MIG mode only at a GPU reset; later ones at once."""
    return gpu.attributes.get("architecture") == ARCHITECTURE_NAMES[ARCH_AMPERE]


def _cuts_on_demand(gpu: _Gpu, mode: MigMode) -> bool:
    """Whether a MIG-capable GPU is offered as placements in dynamic MIG mode.

    A GPU that needs a reset to turn MIG mode on is, only where MIG mode is already on
    (as NVIDIA's DRA driver does): drasil never resets a GPU. With MIG mode off it is
    published whole, and the log says how to change that.
    """
    if mode.current or not _resets_for_mig(gpu):
        return True
    log.info(
        "GPU %d needs a reset to turn MIG mode on; published whole. For MIG devices on "
        "demand, turn MIG mode on (nvidia-smi -i %s -mig 1) and reset the GPU",
        gpu.index,
        gpu.uuid,
    )
    return False


def _partitionable(
    lib: NvmlLibrary, handle: DeviceHandle, gpu: _Gpu, *, whole: bool
) -> PartitionableGpu:
    """Dynamic MIG mode: the GPU and its placements over one counter set.

    Without ``whole`` the GPU is offered only in parts: an Ampere GPU would need a
    reset to turn MIG mode off for a whole-GPU claim.
    """
    profiles = lib.gpu_instance_profiles(handle)
    placements = {p.profile_id: lib.gpu_instance_placements(handle, p.profile_id) for p in profiles}
    if not profiles:
        raise NvmlNotSupported(f"GPU {gpu.index}: MIG-capable but NVML lists no MIG profile")
    found = partition(_full_gpu(gpu), memory=gpu.memory, profiles=profiles, placements=placements)
    if whole:
        return found
    return replace(found, devices=found.devices[1:])


def _full_gpu(gpu: _Gpu) -> Device:
    return Device(
        name=f"gpu-{gpu.minor}",
        type=DeviceType.GPU,
        uuid=gpu.uuid,
        minor=gpu.minor,
        attributes={"type": DeviceType.GPU.value, **gpu.attributes},
        capacity={"memory": gpu.memory},
        device_nodes=gpu.device_nodes,
        numa_node=gpu.numa_node,
        pcie_root=gpu.pcie_root,
    )


def _mps_enforces_limits(gpu: _Gpu) -> bool:
    """Whether MPS holds a client to its memory and thread limits: compute capability
    7.0 (Volta) and newer."""
    version = gpu.attributes.get("cudaComputeCapability")
    if not isinstance(version, Version):
        return True
    major, _, rest = version.value.partition(".")
    return (int(major), int(rest.partition(".")[0] or 0)) >= (7, 0)


def memory_policy(memory: int) -> CapacityPolicy | None:
    """The memory request policy of a consumable GPU, None when it is too small to share.

    The maximum is the memory rounded down to a whole step: the API server rejects a
    maximum that is not ``min + n * step``, and NVML reports odd sizes (81559 MiB).
    The default is that maximum: a claim that names no amount (one through
    ``gpu.drasil.dev``, written for whole GPUs) gets the whole GPU's memory, never a
    surprise 1Gi share; shares say how much they need. The minimum keeps the number of
    shares that fit within what one MPS daemon serves (``MPS_CLIENT_LIMIT``): 2Gi on
    an 80 GB GPU, so at most 39 shares, not 79.
    """
    if memory < MEMORY_STEP * 2:
        return None
    maximum = memory // MEMORY_STEP * MEMORY_STEP
    steps = maximum // MEMORY_STEP
    minimum = -(-steps // MPS_CLIENT_LIMIT) * MEMORY_STEP
    return CapacityPolicy(default=maximum, minimum=minimum, step=MEMORY_STEP, maximum=maximum)


def _shared_gpu(gpu: _Gpu) -> Device:
    device = _full_gpu(gpu)
    if not _mps_enforces_limits(gpu):
        # MPS before Volta ignores the memory and thread limits a share is kept to.
        log.info(
            "GPU %d is older than Volta: MPS cannot hold shares; it stays exclusive", gpu.index
        )
        return device
    memory = memory_policy(gpu.memory)
    if memory is None:
        log.info("GPU %d has too little memory to share; it stays exclusive", gpu.index)
        return device
    return replace(
        device,
        capacity={**device.capacity, COMPUTE_PERCENT: 100},
        allow_multiple_allocations=True,
        capacity_policies={"memory": memory, COMPUTE_PERCENT: COMPUTE_POLICY},
    )


ENGINES_PER_SHARE = CapacityPolicy(default=0, minimum=0, maximum=0)
"""The request policy of a shared placement's engine capacities: a share takes none and
may ask for none, so engine counts never keep a second share off the placement."""


def _shared_placement(device: Device) -> Device:
    """A dynamic MIG placement several claims may share by memory (consumable sharing);
    the full GPU and a placement too small to share are returned as they are."""
    if device.mig_placement is None:
        return device
    memory = memory_policy(device.capacity.get("memory", 0))
    if memory is None:
        return device
    policies = {name: ENGINES_PER_SHARE for name in device.capacity if name != "memory"}
    return replace(
        device,
        capacity={**device.capacity, COMPUTE_PERCENT: 100},
        allow_multiple_allocations=True,
        capacity_policies={**policies, "memory": memory, COMPUTE_PERCENT: COMPUTE_POLICY},
    )


def _mig_devices(
    lib: NvmlLibrary,
    handle: DeviceHandle,
    *,
    gpu: _Gpu,
    slots: int,
    skipped: list[SkippedDevice],
) -> list[Device]:
    devices: list[Device] = []
    instances = _gpu_instances(lib, handle)
    for slot in range(slots):
        try:
            mig = lib.device_mig_device_handle_by_index(handle, slot)
        except NvmlNotFound:
            continue  # an empty slot, not an error
        except NvmlQueryError as err:
            skipped.append(_skipped_mig(gpu, slot, err))
            continue
        try:
            devices.append(_mig_device(lib, mig, gpu=gpu, instances=instances))
        except _DEVICE_ERRORS as err:
            skipped.append(_skipped_mig(gpu, slot, err))
    return devices


def _skipped_mig(gpu: _Gpu, slot: int, err: Exception) -> SkippedDevice:
    return SkippedDevice(
        index=gpu.index, mig_index=slot, reason=f"GPU {gpu.index} MIG device {slot}: {err}"
    )


@dataclass(frozen=True)
class _Instance:
    """A GPU instance as NVML lists it, with its profile's name (None: not listed)."""

    instance: GpuInstance
    profile_name: str | None


def _gpu_instances(lib: NvmlLibrary, handle: DeviceHandle) -> dict[int, _Instance]:
    """GPU instance id → the instance and its profile's name as NVML names it.

    The name made from a MIG device's attributes cannot tell ``1g.10gb+me`` from
    ``1g.10gb``; the profile NVML created the instance with can. The placement is
    the device's site on the GPU (``MigSite``). Empty where NVML does not say (the
    attributes' name is used then, and the device has no site).
    """
    try:
        profiles = {p.profile_id: p.name for p in lib.gpu_instance_profiles(handle)}
        instances = lib.gpu_instances(handle)
    except NvmlError as err:
        log.info("MIG profile names from attributes", extra={"why": str(err)})
        return {}
    return {gi.gpu_instance_id: _Instance(gi, profiles.get(gi.profile_id)) for gi in instances}


def _mig_device(
    lib: NvmlLibrary, handle: DeviceHandle, *, gpu: _Gpu, instances: Mapping[int, _Instance]
) -> Device:
    uuid = lib.device_uuid(handle)
    gi = lib.device_gpu_instance_id(handle)
    ci = lib.device_compute_instance_id(handle)
    facts = lib.device_attributes(handle)
    found = instances.get(gi)
    profile = _static_profile(facts, gpu=gpu, named=found.profile_name if found else None)
    name = mig_device_name(
        parent_minor=gpu.minor, profile=profile, gpu_instance=gi, compute_instance=ci
    )
    return Device(
        name=name,
        type=DeviceType.MIG,
        uuid=uuid,
        minor=gpu.minor,
        attributes={
            **gpu.attributes,
            "type": DeviceType.MIG.value,
            "uuid": uuid,
            "parentUUID": gpu.uuid,
            "profile": profile,
        },
        capacity=_mig_capacity(facts),
        parent_uuid=gpu.uuid,
        device_nodes=gpu.device_nodes,
        # Without its capability nodes a container cannot open the MIG device.
        char_devices=lib.mig_device_nodes(gpu.minor, gi, ci),
        numa_node=gpu.numa_node,
        pcie_root=gpu.pcie_root,
        mig_site=_site(gpu.uuid, found.instance, ci) if found else None,
    )


def _site(parent_uuid: str, instance: GpuInstance, compute_instance: int) -> MigSite:
    return MigSite(
        parent_uuid=parent_uuid,
        profile_id=instance.profile_id,
        gpu_instance_id=instance.gpu_instance_id,
        compute_instance_id=compute_instance,
        start=instance.placement.start,
        size=instance.placement.size,
    )


def _static_profile(facts: DeviceAttributes, *, gpu: _Gpu, named: str | None) -> str:
    """The profile of a MIG device: NVML's name of its GPU instance's profile, with the
    compute instance's share where it is smaller (``1c.3g.20gb``)."""
    derived = mig_profile_name(facts, parent_memory=gpu.memory)
    if named is None or facts.compute_instance_slice_count != facts.gpu_instance_slice_count:
        return derived
    return named


def _mig_capacity(facts: DeviceAttributes) -> dict[str, int]:
    return {
        "memory": facts.memory_size_mib * MiB,
        "multiprocessors": facts.multiprocessor_count,
        "copyEngines": facts.copy_engine_count,
        "decoders": facts.decoder_count,
        "encoders": facts.encoder_count,
        "jpegEngines": facts.jpeg_count,
        "ofaEngines": facts.ofa_count,
    }


def _unique_names(devices: list[Device], skipped: list[SkippedDevice]) -> list[Device]:
    # Two GPUs with one minor number would be a driver bug; keep the first, report the rest.
    seen: dict[str, Device] = {}
    for device in devices:
        if device.name in seen:
            reason = f"device name {device.name} already used by {seen[device.name].uuid}"
            index = device.attributes.get("index")
            skipped.append(
                SkippedDevice(
                    index=index if isinstance(index, int) else -1, uuid=device.uuid, reason=reason
                )
            )
            continue
        seen[device.name] = device
    return list(seen.values())

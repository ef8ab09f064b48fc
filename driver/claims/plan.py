"""A claim's prepare worked out before anything is done: the prepare plan.

``plan_prepare`` reads a ResourceClaim (its API JSON) against the driver's devices on
this node and decides everything a prepare does: which allocated devices are ours,
the opaque config of each (``deviceconfigs``), the settings its CDI edits carry
(``sharing``), the CDI device IDs kubelet hands the runtime and the spec
they come from (``drasil.driver.cdi.claimspecs``), the devices the checkpoint
records and kubelet gets back (request names included), and, with a metadata
directory, each request's KEP-5304 metadata (``drasil.driver.cdi.metadata``): the
devices' attributes as published, their capacities as int attributes (a share's:
what it consumed) and a share's ``shareID``; the first device of each request
carries the CDI ID of its metadata mount. It has no side effect: no
file, no API call, no checkpoint; the same claim gives an equal plan every time.

``check_not_held`` is the one decision that needs the checkpoint: given its records,
whether another claim holds one of the plan's devices.

``drasil.kubeletplugin.dra.prepare`` carries a plan out (checkpoint PrepareStarted,
CDI spec, checkpoint PrepareCompleted) and is its only user.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from drasil.api.checkpoint import (
    ClaimRecord,
    PartitionRecord,
    PreparedDevice,
    StaticMigRecord,
    VfioRecord,
)
from drasil.driver.cdi.claimspecs import (
    ClaimDevice,
    ClaimSpecRequest,
    cdi_device_id,
    metadata_cdi_device_id,
)
from drasil.driver.cdi.metadata import (
    POD_CLAIM_NAME_ANNOTATION,
    ClaimMetadata,
    MetadataDevice,
    MetadataMount,
    RequestMetadata,
    metadata_mounts,
)
from drasil.driver.cdi.spec import ContainerEdits
from drasil.driver.claims.deviceconfigs import (
    AllocatedDevice,
    ResolvedConfig,
    parse_allocation,
    resolve_configs,
)
from drasil.driver.claims.sharing import (
    MPS,
    ShareLimits,
    SharingConflict,
    admin_settings,
    share_limits,
    sharing_mode,
    sharing_settings,
    whole_device_key_problem,
    whole_device_limits,
)
from drasil.driver.devices import AttributeValue, Device, DeviceType, Vendor
from drasil.driver.objects import meta


class PlanError(ValueError):
    """A claim this node cannot prepare; the message goes to kubelet and the user."""


POOL_SETTING = "POOL"
"""``DRASIL_DEVICE_<NAME>_POOL``: the DevicePool a prepared pool device came from."""


@dataclass(frozen=True)
class ClaimRef:
    """What kubelet says about a claim: enough to find it, and its UID to be sure."""

    namespace: str
    name: str
    uid: str

    def log_fields(self) -> dict[str, str]:
        return {"claim": f"{self.namespace}/{self.name}", "claimUID": self.uid}


@dataclass(frozen=True)
class NodePool:
    """What claims are prepared with: one driver's devices on this node (its pool)."""

    driver: str
    pool: str
    devices: Mapping[str, Device]
    # The spec-wide edits of the node's driver: NVIDIA's files, hooks and control
    # nodes. They go only into specs of claims with a device of ``common_edits_vendor``:
    # an AMD GPU needs its device nodes alone (ROCm's user space is in the image).
    common_edits: ContainerEdits = field(default_factory=ContainerEdits)
    common_edits_vendor: Vendor = Vendor.NVIDIA
    # Where the claims' KEP-5304 metadata files go on the host; None: no metadata.
    metadata_root: Path | None = None
    # The claim's DevicePool devices by (pool, name), resolved and checked for this
    # node by ``drasil.driver.claims.pooldevices`` (they are not the node's own).
    pool_devices: Mapping[tuple[str, str], Device] = field(default_factory=dict)


@dataclass(frozen=True)
class DevicePlan:
    """One allocated device of the claim and what prepare makes of it."""

    result: AllocatedDevice
    config: ResolvedConfig
    cdi: ClaimDevice  # the device and its settings, as its CDI edits carry them
    prepared: PreparedDevice  # what the checkpoint records and kubelet gets back

    @property
    def share_limits(self) -> ShareLimits | None:
        """The MPS limits of the device's daemon clients, or None when it is not MPS:
        a share's from what it consumed, a device allocated whole from its config."""
        if self.prepared.sharing != MPS:
            return None
        if self.result.share_id is None:
            return whole_device_limits(self.cdi.device, self.config.config)
        return share_limits(self.cdi.device, self.result.consumed_capacity, self.config.config)

    @property
    def mps_multiuser(self) -> bool:
        """Whether the device's config asks its MPS daemon to serve every user."""
        mps = self.config.config.sharing.mps
        return self.prepared.sharing == MPS and mps is not None and bool(mps.multi_user)


@dataclass(frozen=True)
class PreparePlan:
    """Everything one claim's prepare does, in the claim's result order."""

    claim: ClaimRef
    devices: tuple[DevicePlan, ...]
    spec: ClaimSpecRequest
    metadata: ClaimMetadata | None = None  # written before the spec that mounts it

    @property
    def prepared(self) -> tuple[PreparedDevice, ...]:
        """The checkpoint's devices of the claim, and the answer to kubelet."""
        return tuple(d.prepared for d in self.devices)


def _common_edits(node: NodePool, devices: Sequence[DevicePlan]) -> ContainerEdits:
    # A GPU passed through to a VM needs none of its driver's files: the VM runs its own.
    if any(
        d.cdi.device.vendor is node.common_edits_vendor and d.cdi.device.passthrough is None
        for d in devices
    ):
        return node.common_edits
    return ContainerEdits()


def plan_prepare(claim: Mapping[str, Any], *, ref: ClaimRef, node: NodePool) -> PreparePlan:
    """The plan of ``ref``'s prepare from its claim ``claim`` (read from the API).

    Raises ``AllocationError`` for an allocation that cannot be read, ``PlanError``
    for a device that is not one of ``node``'s, and ``ConfigResolutionError`` for
    configs that cannot be applied, in that order.
    """
    allocation = parse_allocation(claim, driver=node.driver)
    known = _claim_devices(allocation.devices, node)
    configs = resolve_configs(allocation, devices=known)
    devices = tuple(
        _device_plan(ref, result, configs[result.device], node, known[result.device])
        for result in allocation.devices
    )
    _check_one_mode_per_gpu(devices)
    _check_whole_mps(devices)
    devices = _with_pci_env(devices, driver=node.driver)
    metadata: ClaimMetadata | None = None
    mounts: tuple[MetadataMount, ...] = ()
    if node.metadata_root is not None:
        metadata = claim_metadata(claim, ref, devices)
        mounts = metadata_mounts(metadata, driver=node.driver, root=node.metadata_root)
        devices = _with_metadata_ids(devices, ref, driver=node.driver)
    spec = ClaimSpecRequest(
        claim_uid=ref.uid,
        namespace=ref.namespace,
        name=ref.name,
        devices=tuple(d.cdi for d in devices),
        common_edits=_common_edits(node, devices),
        metadata=mounts,
    )
    return PreparePlan(claim=ref, devices=devices, spec=spec, metadata=metadata)


# --- device metadata (KEP-5304) ------------------------------------------------------


def claim_metadata(
    claim: Mapping[str, Any], ref: ClaimRef, devices: Sequence[DevicePlan]
) -> ClaimMetadata:
    """What the claim's metadata files say, one request after another in result order."""
    by_request: dict[str, list[MetadataDevice]] = {}
    for plan in devices:
        by_request.setdefault(plan.result.request, []).append(_metadata_device(plan))
    pod_claim_name = meta(claim).annotations.get(POD_CLAIM_NAME_ANNOTATION)
    return ClaimMetadata(
        claim_uid=ref.uid,
        namespace=ref.namespace,
        name=ref.name,
        pod_claim_name=pod_claim_name if isinstance(pod_claim_name, str) else None,
        requests=tuple(RequestMetadata(r, tuple(d)) for r, d in by_request.items()),
    )


def _metadata_device(plan: DevicePlan) -> MetadataDevice:
    return MetadataDevice(
        pool=plan.result.pool, name=plan.result.device, attributes=metadata_attributes(plan)
    )


def metadata_attributes(plan: DevicePlan) -> dict[str, AttributeValue]:
    """The published attributes, then the capacities the claim gets as int attributes.

    The metadata schema has attributes only, and a workload wants to know its memory:
    a whole device's capacities as published, a share's as it consumed them (its
    ``shareID`` beside them). An attribute wins over a capacity of the same name.
    """
    device = plan.cdi.device
    attributes: dict[str, AttributeValue] = dict(device.attributes)
    capacity: Mapping[str, int] = device.capacity
    if plan.result.share_id is not None:
        attributes["shareID"] = plan.result.share_id
        capacity = plan.result.consumed_capacity
    for name, value in capacity.items():
        attributes.setdefault(name, value)
    return attributes


def _with_metadata_ids(
    devices: tuple[DevicePlan, ...], ref: ClaimRef, *, driver: str
) -> tuple[DevicePlan, ...]:
    """The first device of each request also hands out its request's metadata mount.

    Once per request: a container naming the request gets that device, and a CDI ID
    listed twice would mount the file twice.
    """
    seen: set[str] = set()
    out = []
    for plan in devices:
        request = plan.result.base_request
        if request in seen:
            out.append(plan)
            continue
        seen.add(request)
        extra = metadata_cdi_device_id(driver=driver, claim_uid=ref.uid, request=request)
        ids = (*plan.prepared.cdi_device_ids, extra)
        out.append(replace(plan, prepared=plan.prepared.model_copy(update={"cdi_device_ids": ids})))
    return tuple(out)


def _claim_devices(results: Sequence[AllocatedDevice], node: NodePool) -> dict[str, Device]:
    """The claim's devices by name: the node's own and its DevicePool devices.

    Devices are named after themselves in the CDI spec, its variables and the configs,
    so one claim cannot hold two devices of one name from two pools.
    """
    if not results:
        raise PlanError(f"the claim's allocation has no device of driver {node.driver}")
    found: dict[str, tuple[str, Device]] = {}
    for result in results:
        if result.pool == node.pool:
            device = node.devices.get(result.device)
        else:
            device = node.pool_devices.get((result.pool, result.device))
        if device is None:
            raise PlanError(
                f'request "{result.request}": device "{result.device}" of pool '
                f'"{result.pool}" is not a device of driver {node.driver} on node '
                f'"{node.pool}" (known: {", ".join(sorted(node.devices)) or "none"})'
            )
        pool, _ = found.setdefault(result.device, (result.pool, device))
        if pool != result.pool:
            raise PlanError(
                f'request "{result.request}": devices "{result.device}" of pools "{pool}" and '
                f'"{result.pool}": one claim cannot hold two devices of one name (the CDI '
                "spec and the DRASIL_DEVICE_* variables name devices by name)"
            )
    return {name: device for name, (_, device) in found.items()}


def _device_plan(
    ref: ClaimRef, result: AllocatedDevice, config: ResolvedConfig, node: NodePool, device: Device
) -> DevicePlan:
    # A DevicePool device is on no GPU of this node: nothing to share, partition or
    # cut; its container gets its identity (``DRASIL_DEVICE_<NAME>``, ``…_POOL``).
    local = result.pool == node.pool
    prepared = PreparedDevice(
        request_names=(result.base_request,),
        pool_name=result.pool,
        device_name=result.device,
        cdi_device_ids=(
            cdi_device_id(
                driver=node.driver,
                claim_uid=ref.uid,
                device_name=result.device,
                share_id=result.share_id,
            ),
        ),
        share_id=result.share_id,
        admin_access=result.admin_access,
        sharing=_sharing(result, config, device) if local else None,
        partition=None if result.admin_access or not local else _partition_record(device),
        static_mig=_static_mig_record(device) if local else None,
        vfio=_vfio_record(device) if local and not result.admin_access else None,
    )
    if result.admin_access:
        settings = admin_settings()
    else:
        settings = sharing_settings(config.config, mode=prepared.sharing)
    if not local:
        settings = {**settings, POOL_SETTING: result.pool}
    cdi = ClaimDevice(device=device, settings=settings, share_id=result.share_id)
    return DevicePlan(result=result, config=config, cdi=cdi, prepared=prepared)


def _check_one_mode_per_gpu(devices: Sequence[DevicePlan]) -> None:
    """AMD dynamic partitions of one GPU in two modes: no GPU can hold both at once."""
    modes: dict[str, tuple[str, str]] = {}
    for plan in devices:
        record = plan.prepared.partition
        if record is None:
            continue
        mode, other = modes.setdefault(record.parent_uuid, (record.mode, plan.result.device))
        if mode != record.mode:
            raise PlanError(
                f'devices "{other}" ({mode}) and "{plan.result.device}" ({record.mode}) are '
                f"partitions of GPU {record.parent_bus_id} in two modes; a GPU is in one "
                "compute partition mode at a time, so one claim cannot hold both"
            )


def _check_whole_mps(devices: Sequence[DevicePlan]) -> None:
    """MPS on devices allocated whole: one such device per claim, its config's keys its own.

    Each device gets an MPS daemon of its own, and a container reads one
    ``CUDA_MPS_PIPE_DIRECTORY``: a container given two such devices could reach one
    daemon only, and the other GPU, held in EXCLUSIVE_PROCESS by its daemon, not at all.
    """
    whole = [d for d in devices if d.prepared.sharing == MPS and d.result.share_id is None]
    if len(whole) > 1:
        names = ", ".join(f'"{d.result.device}"' for d in whole)
        raise PlanError(
            f"sharing.strategy: MPS on devices allocated whole ({names}): a claim may hold "
            "one, since each runs an MPS daemon of its own and a container reaches one "
            "daemon; ask for each MPS device in a claim of its own"
        )
    for plan in whole:
        problem = whole_device_key_problem(plan.cdi.device, plan.config.config)
        if problem is not None:
            entry = plan.config.entry
            where = entry.describe() if entry is not None else "the default config"
            raise PlanError(f'{where} for device "{plan.result.device}": {problem}')


def _partition_record(device: Device) -> PartitionRecord | None:
    """The mode an AMD dynamic partition holds its GPU in, recorded with the claim."""
    return device.compute_partition  # the device's slot is the record


def _vfio_record(device: Device) -> VfioRecord | None:
    if device.passthrough is None:
        return None
    return VfioRecord(bus_id=device.passthrough.bus_id, iommu_group=device.passthrough.iommu_group)


NVIDIA_VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"


def pci_resource_env(driver: str, request: str) -> str:
    """``PCI_RESOURCE_<DRIVER>_<REQUEST>``: the variable KubeVirt's device plugins set to
    a resource's PCI addresses (``PCI_RESOURCE_NVIDIA_COM_GH100``), here per request."""
    name = re.sub(r"[^A-Z0-9]", "_", f"{driver}_{request}".upper())
    return f"PCI_RESOURCE_{name}"


def _with_pci_env(devices: tuple[DevicePlan, ...], *, driver: str) -> tuple[DevicePlan, ...]:
    """Each passthrough device carries its request's PCI addresses, comma-separated as
    KubeVirt's device plugins give them: every device of the request sets the variable
    to the same value, so a container of the request gets one value."""
    by_request: dict[str, list[str]] = {}
    for plan in devices:
        if (passthrough := plan.cdi.device.passthrough) is not None:
            by_request.setdefault(plan.result.base_request, []).append(passthrough.bus_id)
    if not by_request:
        return devices
    out = []
    for plan in devices:
        if plan.cdi.device.passthrough is None:
            out.append(plan)
            continue
        request = plan.result.base_request
        env = {pci_resource_env(driver, request): ",".join(by_request[request])}
        if plan.cdi.device.vendor is Vendor.NVIDIA:
            # As in every NVIDIA spec: NVIDIA's runtime, where it runs, adds no GPU.
            env[NVIDIA_VISIBLE_DEVICES] = "void"
        out.append(replace(plan, cdi=replace(plan.cdi, edits=ContainerEdits(env=env))))
    return tuple(out)


def _static_mig_record(device: Device) -> StaticMigRecord | None:
    """The instance a static MIG device is, recorded with the claim: a plugin started
    later in ``--mig-mode dynamic`` keeps it and cuts nothing over it while the claim
    holds it. Admin access too: its container uses the instance as well."""
    site = device.mig_site
    if site is None:
        return None
    return StaticMigRecord(
        parent_uuid=site.parent_uuid,
        profile_id=site.profile_id,
        placement_start=site.start,
        placement_size=site.size,
        gpu_instance_id=site.gpu_instance_id,
        compute_instance_id=site.compute_instance_id,
        uuid=device.uuid,
    )


def _sharing(result: AllocatedDevice, config: ResolvedConfig, device: Device) -> str | None:
    """How the claim uses a GPU or MIG device (``sharing_mode``): MPS, a time slice,
    or nothing; admin access changes nothing on the device."""
    share = result.share_id is not None and device.allow_multiple_allocations
    mig = device.type == DeviceType.MIG
    if result.admin_access or device.type not in _SHARED_TYPES:
        return None
    try:
        return sharing_mode(config.config, share=share, defaulted=config.entry is None, mig=mig)
    except SharingConflict as err:
        raise PlanError(f'request "{result.request}": device "{result.device}": {err}') from None


_SHARED_TYPES = frozenset({DeviceType.GPU, DeviceType.MIG})


def check_not_held(
    plan: PreparePlan,
    records: Mapping[str, ClaimRecord],
    *,
    devices: Mapping[str, Device] | None = None,
) -> None:
    """Refuse a device another recorded claim holds (the checkpoint is the truth).

    Admin access and consumable-capacity shares (both sides with a shareID) may sit on
    a device another claim holds; a share of one MIG placement still may not overlap
    another placement's instance. With ``devices`` (the node's), parts of one
    partitionable GPU are checked too: a MIG placement overlapping another claim's,
    or the whole GPU while a part of it is held (``--mig-mode dynamic``); an AMD
    partition overlapping another's, or of another mode than the GPU is held in
    (``--amd-partition-mode dynamic``). Raises ``PlanError`` naming the holder.
    """
    ref = plan.claim
    for uid, record in records.items():
        if uid == ref.uid:
            continue
        for held in record.devices:
            for mine in plan.devices:
                result = mine.result
                if _shares(result, held) and held.device_name == result.device:
                    _check_same_sharing(mine, held, record, plan.claim)
                if result.admin_access or held.admin_access:
                    continue
                if held.pool_name != result.pool:
                    continue
                if _shares(result, held) and held.device_name == result.device:
                    continue  # shares of one device; other devices may overlap it
                if held.device_name == result.device:
                    what = f'device "{result.device}" is already prepared'
                elif (conflict := _conflict(result.device, held, devices or {})) is not None:
                    what = conflict
                else:
                    continue
                raise PlanError(
                    f"{what} for claim {record.namespace}/{record.name} ({uid}); it cannot "
                    f"be used by {ref.namespace}/{ref.name} until that claim is unprepared"
                )


def _check_same_sharing(
    mine: DevicePlan, held: PreparedDevice, holder: ClaimRecord, ref: ClaimRef
) -> None:
    """Shares of one GPU must use it the same way: MPS, or one time-slice interval."""
    if held.sharing is None or mine.prepared.sharing == held.sharing:
        return
    entry = mine.config.entry
    source = entry.describe() if entry is not None else "the default config"
    raise PlanError(
        f'device "{held.device_name}" is shared with {held.sharing} by claim '
        f"{holder.namespace}/{holder.name}; {ref.namespace}/{ref.name} asks "
        f"{mine.prepared.sharing} ({source}); shares of one GPU must use the same "
        "sharing, so this claim waits until that one is unprepared"
    )


_WHOLE_GPU = frozenset(range(64))  # more memory slices than any GPU has
_SLICES = "GPU memory slices"
_DIES = "compute dies (XCDs)"


@dataclass(frozen=True)
class _Footprint:
    """What a part of a partitionable GPU occupies: the GPU, the units (MIG memory
    slices or AMD compute dies) and, for AMD partitions, the mode the GPU must be in."""

    gpu: str
    units: frozenset[int]
    noun: str
    mode: str | None = None


def _footprint(
    name: str, held: PreparedDevice | None, devices: Mapping[str, Device]
) -> _Footprint | None:
    """Where a device of a partitionable GPU sits (as recorded, if ``held``), else None.

    The record wins over the device of that name: after a change of ``--mig-mode``
    the node publishes other devices, and a held MIG instance is where its record says.
    """
    if held is not None and (mig := held.mig or held.static_mig) is not None:
        start, size = mig.placement_start, mig.placement_size
        return _Footprint(mig.parent_uuid, frozenset(range(start, start + size)), _SLICES)
    if held is not None and held.partition is not None:
        part = held.partition
        units = frozenset(range(part.start, part.start + part.size))
        return _Footprint(part.parent_uuid, units, _DIES, part.mode)
    device = devices.get(name)
    return None if device is None else _device_footprint(device)


def _device_footprint(device: Device) -> _Footprint | None:
    if (placement := device.mig_placement) is not None:
        slices = frozenset(range(placement.start, placement.start + placement.size))
        return _Footprint(placement.parent_uuid, slices, _SLICES)
    if (site := device.mig_site) is not None:
        # A static MIG device: what it occupies, so that a dynamic MIG instance a
        # claim prepared before a change to static mode is not handed out again.
        slices = frozenset(range(site.start, site.start + site.size))
        return _Footprint(site.parent_uuid, slices, _SLICES)
    if (slot := device.compute_partition) is not None:
        units = frozenset(range(slot.start, slot.start + slot.size))
        return _Footprint(slot.parent_uuid, units, _DIES, slot.mode)
    if device.consumes_counters or (device.type == DeviceType.GPU and device.uuid):
        # A whole NVIDIA GPU holds every memory slice, in either MIG mode: a claim of
        # it prepared under the other mode keeps MIG instances off it, and back.
        return _Footprint(device.uuid, _WHOLE_GPU, _SLICES)
    return None


def _conflict(name: str, held: PreparedDevice, devices: Mapping[str, Device]) -> str | None:
    """Why ``name`` cannot be prepared beside ``held`` on one GPU, or None."""
    mine = _footprint(name, None, devices)
    theirs = _footprint(held.device_name, held, devices)
    if mine is None or theirs is None or mine.gpu != theirs.gpu:
        return None
    if mine.units & theirs.units:
        return f'device "{name}" shares {mine.noun} with "{held.device_name}", prepared'
    if mine.mode is not None and theirs.mode is not None and mine.mode != theirs.mode:
        # A compute partition mode is the whole GPU's: amdgpu switches it only while
        # nothing uses the GPU, so one claim in another mode keeps it where it is.
        return (
            f'device "{name}" needs its GPU in {mine.mode} mode, and the GPU is held in '
            f'{theirs.mode} mode by "{held.device_name}", prepared'
        )
    return None


def _shares(a: AllocatedDevice, b: PreparedDevice) -> bool:
    # Consumable-capacity allocations carry a shareID; they may sit on one device.
    return a.share_id is not None and b.share_id is not None

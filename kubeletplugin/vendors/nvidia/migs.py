"""MIG instances cut on demand (``--mig-mode dynamic``): create, destroy, reconcile.

Prepare asks ``MigInstances.ensure`` for the instance of an allocated placement and
unprepare asks ``destroy`` to remove it; both are idempotent, so a repeated call after
a crash finishes what the crashed one began:

- ``ensure`` adopts a GPU instance that already sits at the placement with the
  profile (a crash after NVML created it, before the checkpoint said so) and a
  compute instance already inside it; otherwise it creates them. MIG mode is switched
  on first if it is off.
- ``destroy`` removes the compute instances and then the GPU instance, but only an
  instance that still has the recorded placement and profile: instance ids are reused
  by NVML, and an id alone could name another claim's instance by now.

Every NVML change runs under one lock (threads, and a ``FileLock`` in the state dir
for a second plugin instance during a rolling update), because NVML's placement
decisions depend on what else exists on the GPU at that moment.

Instances of claims prepared under ``--mig-mode static`` (a ``staticMig`` record,
the operator's instances) are kept by ``reconcile`` and never destroyed: a change of
``migMode`` leaves running workloads their MIG devices. ``static_records`` fills in
that record for claims an earlier drasil prepared without it.

Crash points (see ``drasil.driver.files``): ``mig-after-gi``, ``mig-after-ci``,
``mig-destroy-after-ci``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace
from pathlib import Path

from drasil.api.checkpoint import (
    ClaimRecord,
    MigRecord,
    MigState,
    PreparedDevice,
    StaticMigRecord,
)
from drasil.driver.devices import CharDevice, Device, HardwareError, MigPlacement
from drasil.driver.files import FileLock, crash_point
from drasil.driver.migrecords import mig_holders
from drasil.driver.nvidia.nodedevices import parse_mig_device_name
from drasil.driver.nvidia.nvml import (
    DeviceHandle,
    GpuInstance,
    MigMode,
    NvmlError,
    NvmlInsufficientResources,
    NvmlInUse,
    NvmlLibrary,
    NvmlNotFound,
    NvmlResetRequired,
    Placement,
    nvml_session,
)

log = logging.getLogger(__name__)

MIG_LOCK_TIMEOUT = 30.0  # below kubelet's 45 s call timeout, like the checkpoint lock


class MigError(HardwareError):
    """A MIG instance that cannot be made or removed; the message goes to the claim."""


@dataclass(frozen=True)
class MigInstance:
    """A MIG device that exists: where it is, its ids, UUID and device nodes."""

    placement: MigPlacement
    gpu_instance_id: int
    compute_instance_id: int
    uuid: str
    char_devices: tuple[CharDevice, ...]

    def record(self) -> MigRecord:
        return MigRecord(
            parent_uuid=self.placement.parent_uuid,
            profile=self.placement.profile,
            profile_id=self.placement.profile_id,
            placement_start=self.placement.start,
            placement_size=self.placement.size,
            state=MigState.CREATED,
            gpu_instance_id=self.gpu_instance_id,
            compute_instance_id=self.compute_instance_id,
            uuid=self.uuid,
        )

    def device(self, planned: Device) -> Device:
        """The placement device as a container gets it: its UUID and device nodes."""
        attributes = {**planned.attributes, "uuid": self.uuid}
        return replace(
            planned, uuid=self.uuid, char_devices=self.char_devices, attributes=attributes
        )


@dataclass(frozen=True)
class ReconcileReport:
    """What ``reconcile`` did at start, for the log and a Node Event."""

    destroyed: tuple[str, ...] = ()  # orphans: "<gpu uuid> gi=<id> <profile> at <start>"
    missing: tuple[str, ...] = ()  # claim UIDs whose recorded instance is gone
    kept: tuple[str, ...] = ()  # static MIG instances claims hold: "<claim>: <where>"

    @property
    def message(self) -> str:
        parts = []
        if self.kept:
            parts.append(
                f"kept {len(self.kept)} MIG instance(s) of claims prepared in static MIG "
                "mode until they are unprepared: " + "; ".join(self.kept)
            )
        if self.destroyed:
            parts.append(
                f"destroyed {len(self.destroyed)} MIG instance(s) no prepared claim holds: "
                + "; ".join(self.destroyed)
            )
        if self.missing:
            parts.append(
                f"{len(self.missing)} prepared claim(s) lost their MIG instance and are "
                "prepared again at the next NodePrepareResources: " + ", ".join(self.missing)
            )
        return ". ".join(parts)


class MigInstances:
    """The node's dynamic MIG instances, changed through NVML under one lock."""

    def __init__(self, lib: NvmlLibrary, *, state_dir: Path) -> None:
        self.lib = lib
        self._thread_lock = threading.Lock()
        self._file_lock = state_dir / "mig.lock"
        self._handles: dict[str, DeviceHandle] = {}

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with (
            self._thread_lock,
            FileLock(self._file_lock, timeout=MIG_LOCK_TIMEOUT),
            nvml_session(self.lib),
        ):
            yield

    def _handle(self, gpu_uuid: str) -> DeviceHandle:
        handle = self._handles.get(gpu_uuid)
        if handle is not None:
            return handle
        for index in range(self.lib.device_count()):
            candidate = self.lib.device_handle_by_index(index)
            self._handles[self.lib.device_uuid(candidate)] = candidate
        if gpu_uuid not in self._handles:
            raise MigError(f"GPU {gpu_uuid} is not on this node any more")
        return self._handles[gpu_uuid]

    # ---- prepare ----------------------------------------------------------------------

    def ensure(self, placement: MigPlacement) -> MigInstance:
        """The instance at ``placement``, created if it does not exist (idempotent)."""
        try:
            with self._locked():
                return self._ensure(placement)
        except NvmlError as err:
            raise MigError(f"{_where(placement)}: NVML: {err}") from err

    def _ensure(self, placement: MigPlacement) -> MigInstance:
        handle = self._handle(placement.parent_uuid)
        self._mig_mode_on(handle, placement)
        gpu_instance = self._gpu_instance(handle, placement)
        crash_point("mig-after-gi")
        gi = gpu_instance.gpu_instance_id
        computes = self.lib.compute_instances(handle, gi)
        compute = computes[0] if computes else self.lib.create_compute_instance(handle, gi)
        crash_point("mig-after-ci")
        ci = compute.compute_instance_id
        return MigInstance(
            placement=placement,
            gpu_instance_id=gi,
            compute_instance_id=ci,
            uuid=self._mig_uuid(handle, gi, ci),
            char_devices=self.lib.mig_device_nodes(placement.parent_minor, gi, ci),
        )

    def _mig_mode_on(self, handle: DeviceHandle, placement: MigPlacement) -> None:
        if self.lib.device_mig_mode(handle).current:
            return
        mode = self._set_mig_mode(handle, True)
        if not mode.current:
            raise MigError(
                f"{_where(placement)}: MIG mode is enabled but pending until the GPU is "
                "reset (nvidia-smi -r, or a reboot); the claim is prepared after that"
            )
        log.info("MIG mode enabled", extra={"gpu": placement.parent_uuid})

    def _set_mig_mode(self, handle: DeviceHandle, enabled: bool) -> MigMode:
        """Switch MIG mode now, or leave it as it was and say why not.

        NVML accepts a change it cannot make now and keeps it pending: until a reset
        on Ampere, until its processes end on a GPU in use. A pending change would
        flip the GPU under other claims at the next reset, so it is taken back.
        Handles taken before may not survive a switch (the driver may reset the GPU),
        so they are looked up again next time.
        """
        word = "on" if enabled else "off"
        try:
            return self.lib.device_set_mig_mode(handle, enabled)
        except NvmlResetRequired as err:
            self._cancel_pending(handle)
            raise MigError(
                f"MIG mode cannot be turned {word} on this GPU without a GPU reset (Ampere); "
                "drasil does not reset GPUs: set it with nvidia-smi -mig and reset the GPU "
                f"({err})"
            ) from err
        except NvmlInUse as err:
            self._cancel_pending(handle)
            raise MigError(
                f"MIG mode cannot be turned {word} while the GPU is in use "
                f"(processes or MIG instances on it) ({err})"
            ) from err
        finally:
            self._handles.clear()

    def _cancel_pending(self, handle: DeviceHandle) -> None:
        with suppress(NvmlError):
            mode = self.lib.device_mig_mode(handle)
            if mode.pending != mode.current:
                with suppress(NvmlResetRequired, NvmlInUse):
                    self.lib.device_set_mig_mode(handle, mode.current)

    def _gpu_instance(self, handle: DeviceHandle, placement: MigPlacement) -> GpuInstance:
        wanted = Placement(start=placement.start, size=placement.size)
        for existing in self.lib.gpu_instances(handle):
            if existing.placement == wanted and existing.profile_id == placement.profile_id:
                return existing  # created before a crash: adopt it
        try:
            return self.lib.create_gpu_instance(handle, placement.profile_id, wanted)
        except NvmlInsufficientResources as err:
            holders = [
                f"{self._profile_name(handle, g)} at {g.placement.start} (gi {g.gpu_instance_id})"
                for g in self.lib.gpu_instances(handle)
                if set(g.placement.slices) & set(wanted.slices)
            ]
            raise MigError(
                f"{_where(placement)}: the placement is taken on the GPU by "
                f"{', '.join(holders) or 'instances NVML did not list'} ({err})"
            ) from err

    def _instances(self, handle: DeviceHandle) -> tuple[GpuInstance, ...]:
        """The GPU instances that exist; none while MIG mode is off (NVML then refuses
        the query)."""
        if not self.lib.device_mig_mode(handle).current:
            return ()
        return self.lib.gpu_instances(handle)

    def _mig_uuid(self, handle: DeviceHandle, gi: int, ci: int) -> str:
        for index in range(self.lib.device_max_mig_device_count(handle)):
            try:
                mig = self.lib.device_mig_device_handle_by_index(handle, index)
            except NvmlNotFound:
                continue
            if (
                self.lib.device_gpu_instance_id(mig) == gi
                and self.lib.device_compute_instance_id(mig) == ci
            ):
                return self.lib.device_uuid(mig)
        raise MigError(f"MIG device gi={gi} ci={ci} was created but NVML does not list it")

    def whole_gpu(self, gpu_uuid: str) -> None:
        """Make a partitionable GPU usable whole: MIG mode off (there must be no instance)."""
        try:
            with self._locked():
                handle = self._handle(gpu_uuid)
                if not self.lib.device_mig_mode(handle).current:
                    return
                instances = self._instances(handle)
                if instances:
                    held = ", ".join(
                        f"{self._profile_name(handle, g)} at {g.placement.start}" for g in instances
                    )
                    raise MigError(f"GPU {gpu_uuid} still has MIG instances ({held})")
                mode = self._set_mig_mode(handle, False)
                if mode.current:
                    raise MigError(
                        f"GPU {gpu_uuid}: MIG mode is disabled but pending until the GPU "
                        "is reset (nvidia-smi -r, or a reboot)"
                    )
                log.info("MIG mode disabled", extra={"gpu": gpu_uuid})
        except NvmlError as err:
            raise MigError(f"GPU {gpu_uuid}: NVML: {err}") from err

    # ---- unprepare --------------------------------------------------------------------

    def destroy(self, record: MigRecord) -> None:
        """Remove the recorded instance if it is still there (idempotent)."""
        try:
            with self._locked():
                self._destroy(record)
        except NvmlError as err:
            raise MigError(f"{_record_where(record)}: NVML: {err}") from err

    def _destroy(self, record: MigRecord) -> None:
        try:
            handle = self._handle(record.parent_uuid)
        except MigError:
            return  # the GPU is gone, and its instances with it
        target = _find(self._instances(handle), record)
        if target is None:
            return
        self._destroy_instance(handle, target)
        log.info("MIG instance destroyed", extra={"mig": _record_where(record)})

    def _destroy_instance(self, handle: DeviceHandle, instance: GpuInstance) -> None:
        # NOT_FOUND means an earlier, interrupted call got that far already.
        gi = instance.gpu_instance_id
        for compute in self.lib.compute_instances(handle, gi):
            with suppress(NvmlNotFound):
                self.lib.destroy_compute_instance(handle, gi, compute.compute_instance_id)
        crash_point("mig-destroy-after-ci")
        with suppress(NvmlNotFound):
            self.lib.destroy_gpu_instance(handle, gi)

    # ---- start ------------------------------------------------------------------------

    def reconcile(
        self, gpus: Iterable[Device], records: Mapping[str, ClaimRecord]
    ) -> ReconcileReport:
        """Destroy instances no record holds; name claims whose instance is gone.

        ``gpus`` are the node's partitionable devices: its placements, and the full
        GPUs where those are offered too; the GPUs they sit on are reconciled.
        Instances on other GPUs (static MIG) are never touched, and neither are those
        claims prepared in static MIG mode hold (``staticMig``): the operator made them.
        """
        held, kept = mig_holders(records), _kept(records)
        destroyed: list[str] = []
        spared: list[str] = []
        present: set[tuple[str, int, int]] = set()
        with self._locked():
            for gpu_uuid, gpu_name in partitionable_gpus(gpus).items():
                handle = self._handle(gpu_uuid)
                for instance in self._instances(handle):
                    key = (gpu_uuid, instance.profile_id, instance.placement.start)
                    where = (
                        f"{gpu_name} gi={instance.gpu_instance_id} "
                        f"{self._profile_name(handle, instance)} at {instance.placement.start}"
                    )
                    if key in held:
                        present.add(key)
                    elif key in kept:
                        spared.append(f"{kept[key]}: {where}")
                    else:
                        self._destroy_instance(handle, instance)
                        destroyed.append(where)
        missing = sorted({uid for key, uid in held.items() if key not in present and uid})
        return ReconcileReport(
            destroyed=tuple(destroyed), missing=tuple(missing), kept=tuple(spared)
        )

    def static_records(
        self, records: Mapping[str, ClaimRecord]
    ) -> dict[str, tuple[PreparedDevice, ...]]:
        """The devices of claims an earlier drasil prepared on static MIG devices
        without a ``staticMig`` record, with the record filled in from NVML; claim UID
        → its devices. Their names say the GPU (minor) and the instance ids.

        Instances that are gone (the operator destroyed them) get no record: there is
        nothing left to keep.
        """
        found: dict[str, tuple[PreparedDevice, ...]] = {}
        with self._locked():
            for uid, record in records.items():
                devices = tuple(self._with_static_record(d) for d in record.devices)
                if devices != record.devices:
                    found[uid] = devices
        return found

    def _with_static_record(self, device: PreparedDevice) -> PreparedDevice:
        parsed = parse_mig_device_name(device.device_name)
        if parsed is None or device.mig is not None or device.static_mig is not None:
            return device
        minor, gi, ci = parsed
        static = self._static_record(minor, gi, ci)
        return device if static is None else device.model_copy(update={"static_mig": static})

    def _static_record(self, minor: int, gi: int, ci: int) -> StaticMigRecord | None:
        handle = self._handle_by_minor(minor)
        if handle is None:
            return None
        parent = self.lib.device_uuid(handle)
        for instance in self._instances(handle):
            if instance.gpu_instance_id != gi:
                continue
            try:
                uuid = self._mig_uuid(handle, gi, ci)
            except MigError:
                return None  # the compute instance is gone: no MIG device to keep
            return StaticMigRecord(
                parent_uuid=parent,
                profile_id=instance.profile_id,
                placement_start=instance.placement.start,
                placement_size=instance.placement.size,
                gpu_instance_id=gi,
                compute_instance_id=ci,
                uuid=uuid,
            )
        return None

    def _handle_by_minor(self, minor: int) -> DeviceHandle | None:
        for index in range(self.lib.device_count()):
            handle = self.lib.device_handle_by_index(index)
            if self.lib.device_minor_number(handle) == minor:
                return handle
        return None

    def _profile_name(self, handle: DeviceHandle, instance: GpuInstance) -> str:
        for profile in self.lib.gpu_instance_profiles(handle):
            if profile.profile_id == instance.profile_id:
                return profile.name
        return f"profile {instance.profile_id}"


def partitionable_gpus(devices: Iterable[Device]) -> dict[str, str]:
    """UUID → ``gpu-<minor>`` of every GPU that placement devices sit on."""
    return {
        d.mig_placement.parent_uuid: f"gpu-{d.mig_placement.parent_minor}"
        for d in devices
        if d.mig_placement is not None
    }


def _kept(records: Mapping[str, ClaimRecord]) -> dict[tuple[str, int, int], str]:
    """(GPU, profile id, start) of every static MIG instance a claim holds → the
    claim (``namespace/name``). Never "missing": re-preparing cannot make one."""
    kept: dict[tuple[str, int, int], str] = {}
    for record in records.values():
        for device in record.devices:
            if (static := device.static_mig) is not None:
                key = (static.parent_uuid, static.profile_id, static.placement_start)
                kept[key] = f"{record.namespace}/{record.name}"
    return kept


def _find(instances: Iterable[GpuInstance], record: MigRecord) -> GpuInstance | None:
    for instance in instances:
        if (
            instance.profile_id == record.profile_id
            and instance.placement.start == record.placement_start
            and instance.placement.size == record.placement_size
        ):
            return instance
    return None


def _where(placement: MigPlacement) -> str:
    return f"MIG {placement.profile} at {placement.start} on GPU {placement.parent_uuid}"


def _record_where(record: MigRecord) -> str:
    return f"MIG {record.profile} at {record.placement_start} on GPU {record.parent_uuid}"

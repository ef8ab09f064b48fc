"""``PynvmlLibrary``: the ``NvmlLibrary`` over nvidia-ml-py for real GPUs, whole.

Loading the library, its error mapping and the device queries and events are
inherited from ``drasil.driver.nvidia.nvmldevices.PynvmlDevices``; this module adds
what changes a GPU: MIG mode and GPU/compute instance management (with the MIG
devices' ``/dev/nvidia-caps`` nodes), the compute time slice (through
``nvidia-smi``, see ``drasil.driver.nvidia.nvmlhost``) and the compute mode.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from drasil.driver.devices import CharDevice
from drasil.driver.nvidia.nvml import (
    COMPUTE_MODE_NAMES,
    MAX_INSTANCES,
    MAX_PLACEMENTS,
    NVML_DEVICE_MIG_DISABLE,
    NVML_DEVICE_MIG_ENABLE,
    NVML_ERROR_IN_USE,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NO_PERMISSION,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_RESET_REQUIRED,
    TIME_SLICE_DEFAULT,
    ComputeInstance,
    DeviceHandle,
    GpuInstance,
    GpuInstanceProfile,
    MigMode,
    NvmlNotFound,
    NvmlNotSupported,
    NvmlQueryError,
    Placement,
    check_compute_mode,
    check_time_slice,
    error_for_code,
    mig_profile_label,
)
from drasil.driver.nvidia.nvmldevices import PynvmlDevices, nvml_text
from drasil.driver.nvidia.nvmlhost import (
    caps_major,
    compute_policy,
    parse_time_slice,
    read_access_minor,
    read_mig_minors,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

# What nvmlDeviceSetMigMode's activationStatus means when it is not SUCCESS.
_ACTIVATION_STATUS = {
    NVML_ERROR_IN_USE: "the GPU is in use (processes or MIG instances); the change is pending",
    NVML_ERROR_RESET_REQUIRED: "the change takes effect at the next GPU reset",
}


def _gpu_instance_profile(info: Any, *, name: str | None = None) -> GpuInstanceProfile:
    if name is None:
        name = nvml_text(getattr(info, "name", b"")).removeprefix("MIG ").strip()
    return GpuInstanceProfile(
        profile_id=int(info.id),
        name=name,
        slice_count=int(info.sliceCount),
        instance_count=int(info.instanceCount),
        multiprocessors=int(info.multiprocessorCount),
        copy_engines=int(info.copyEngineCount),
        decoders=int(info.decoderCount),
        encoders=int(info.encoderCount),
        jpeg_engines=int(info.jpegCount),
        ofa_engines=int(info.ofaCount),
        memory_mib=int(info.memorySizeMB),
    )


class PynvmlLibrary(PynvmlDevices):
    """``NvmlLibrary`` over nvidia-ml-py, mapping ``NVMLError`` to our exceptions.

    ``pcie_root`` is injectable so tests (and odd hosts) need no real sysfs; device
    nodes are ``<dev_root>/nvidia<minor>`` (host paths; ``dev_root_local`` is where this
    process sees them), MIG access nodes ``/dev/nvidia-caps/nvidia-cap<n>`` with ``n``
    and the major read from the driver's entries under ``proc_root``.

    GPU and compute instance handles are NVML's and stay inside: the Protocol names
    instances by their ids, which survive a plugin restart where handles do not.

    NVML has no call for the compute time slice, so the time slice methods run
    ``nvidia_smi compute-policy`` (the binary is injectable for tests and hosts that
    keep the driver's tools elsewhere) and wait at most ``nvmlhost.NVIDIA_SMI_TIMEOUT``.
    """

    # -- MIG management -------------------------------------------------------------------

    def device_set_mig_mode(self, handle: DeviceHandle, enabled: bool) -> MigMode:
        mode = NVML_DEVICE_MIG_ENABLE if enabled else NVML_DEVICE_MIG_DISABLE
        what = f"nvmlDeviceSetMigMode({mode})"
        status = self._call(what, self._nvml.nvmlDeviceSetMigMode, handle, mode)
        if status:  # the call succeeded; activationStatus says the change did not
            said = _ACTIVATION_STATUS.get(int(status), f"NVML code {status}")
            raise error_for_code(f"{what}: activation status: {said}", int(status))
        return self.device_mig_mode(handle)

    def gpu_instance_profiles(self, handle: DeviceHandle) -> tuple[GpuInstanceProfile, ...]:
        # nvmlDeviceGetGpuInstanceProfileInfoV takes the profile *index* (the
        # NVML_GPU_INSTANCE_PROFILE_* enum) and answers the profile *id* (-lgip's ID).
        count = int(getattr(self._nvml, "NVML_GPU_INSTANCE_PROFILE_COUNT", 0))
        # Asked once, and only where a profile's name must be made from its counts.
        memory = functools.cache(lambda: self.device_memory_total(handle))
        found = (self._gpu_instance_profile(handle, index, memory) for index in range(count))
        return tuple(profile for profile in found if profile is not None)

    def _gpu_instance_profile(
        self, handle: DeviceHandle, index: int, parent_memory: Callable[[], int]
    ) -> GpuInstanceProfile | None:
        """The profile at ``index``, whatever the GPU's MIG mode.

        The versioned call names the profile but answers NOT_SUPPORTED while MIG mode
        is off; the unversioned one (what NVIDIA's DRA driver calls) answers then, so a
        GPU in dynamic mode with MIG off still publishes its placements. Its struct has
        no name: the name is made from the counts, as go-nvlib makes it.
        """
        fn = self._nvml.nvmlDeviceGetGpuInstanceProfileInfo
        what = f"nvmlDeviceGetGpuInstanceProfileInfoV({index})"
        try:
            info = self._call(what, fn, handle, index)
        except NvmlQueryError as err:
            if err.code == NVML_ERROR_INVALID_ARGUMENT:
                return None
            if err.code != NVML_ERROR_NOT_SUPPORTED:
                raise
            what = f"nvmlDeviceGetGpuInstanceProfileInfo({index})"
            info = self._supported(what, fn, handle, index, 1)
            if info is None:
                return None
            name = mig_profile_label(
                slices=int(info.sliceCount),
                memory_mib=int(info.memorySizeMB),
                parent_memory=parent_memory(),
                profile_index=index,
            )
            return _gpu_instance_profile(info, name=name)
        return _gpu_instance_profile(info)

    def gpu_instance_placements(
        self, handle: DeviceHandle, profile_id: int
    ) -> tuple[Placement, ...]:
        array = (self._nvml.c_nvmlGpuInstancePlacement_t * MAX_PLACEMENTS)()
        count = ctypes.c_uint(MAX_PLACEMENTS)
        fn = self._nvml.nvmlDeviceGetGpuInstancePossiblePlacements
        what = f"nvmlDeviceGetGpuInstancePossiblePlacements_v2({profile_id})"
        self._call(what, fn, handle, profile_id, array, ctypes.byref(count))
        return tuple(Placement(int(p.start), int(p.size)) for p in array[: count.value])

    def gpu_instances(self, handle: DeviceHandle) -> tuple[GpuInstance, ...]:
        found = [
            self._gpu_instance_info(gi)
            for profile in self.gpu_instance_profiles(handle)
            for gi in self._gpu_instance_handles(handle, profile.profile_id)
        ]
        return tuple(sorted(found, key=lambda gi: gi.gpu_instance_id))

    def create_gpu_instance(
        self, handle: DeviceHandle, profile_id: int, placement: Placement
    ) -> GpuInstance:
        raw = self._nvml.c_nvmlGpuInstancePlacement_t()
        raw.start, raw.size = placement.start, placement.size
        where = f"{placement.start}:{placement.size}"
        what = f"nvmlDeviceCreateGpuInstanceWithPlacement({profile_id}, {where})"
        fn = self._nvml.nvmlDeviceCreateGpuInstanceWithPlacement
        gi = self._call(what, fn, handle, profile_id, ctypes.byref(raw))
        return self._gpu_instance_info(gi)

    def destroy_gpu_instance(self, handle: DeviceHandle, gpu_instance_id: int) -> None:
        gi = self._gpu_instance(handle, gpu_instance_id)
        self._call(
            f"nvmlGpuInstanceDestroy({gpu_instance_id})", self._nvml.nvmlGpuInstanceDestroy, gi
        )

    def compute_instances(
        self, handle: DeviceHandle, gpu_instance_id: int
    ) -> tuple[ComputeInstance, ...]:
        gi = self._gpu_instance(handle, gpu_instance_id)
        found = [
            self._compute_instance_info(ci)
            for info in self._compute_profiles(gi)
            for ci in self._compute_instance_handles(gi, int(info.id))
        ]
        return tuple(sorted(found, key=lambda ci: ci.compute_instance_id))

    def create_compute_instance(
        self, handle: DeviceHandle, gpu_instance_id: int
    ) -> ComputeInstance:
        gi = self._gpu_instance(handle, gpu_instance_id)
        # The largest compute instance profile a GPU instance supports spans all of it.
        profiles = self._compute_profiles(gi)
        if not profiles:
            raise NvmlNotSupported(f"GPU instance {gpu_instance_id}: no compute instance profile")
        widest = max(profiles, key=lambda info: int(info.sliceCount))
        fn = self._nvml.nvmlGpuInstanceCreateComputeInstance
        ci = self._call("nvmlGpuInstanceCreateComputeInstance", fn, gi, int(widest.id))
        return self._compute_instance_info(ci)

    def destroy_compute_instance(
        self, handle: DeviceHandle, gpu_instance_id: int, compute_instance_id: int
    ) -> None:
        gi = self._gpu_instance(handle, gpu_instance_id)
        what = f"nvmlGpuInstanceGetComputeInstanceById({compute_instance_id})"
        fn = self._nvml.nvmlGpuInstanceGetComputeInstanceById
        ci = self._call(what, fn, gi, compute_instance_id)
        self._call("nvmlComputeInstanceDestroy", self._nvml.nvmlComputeInstanceDestroy, ci)

    def device_processes(self, handle: DeviceHandle) -> tuple[int, ...]:
        pids: list[int] = []
        for name in (
            "nvmlDeviceGetComputeRunningProcesses",
            "nvmlDeviceGetGraphicsRunningProcesses",
        ):
            found = self._call(name, getattr(self._nvml, name), handle)
            pids += [int(p.pid) for p in found or ()]
        return tuple(dict.fromkeys(pids))

    def device_time_slice(self, handle: DeviceHandle) -> int:
        uuid = self.device_uuid(handle)
        listing = compute_policy(self._nvidia_smi, uuid, "--list")
        interval = parse_time_slice(listing)
        if interval is None:
            # nvidia-smi documents --list but not its layout. A listing we cannot read
            # is taken as the default: the time slice is only read to be restored,
            # and the default is the safe value to restore to.
            log.warning(
                "nvidia-smi compute-policy --list shows no time slice; taking the default",
                extra={"gpu": uuid, "output": listing[:200]},
            )
            return TIME_SLICE_DEFAULT
        return interval

    def device_set_time_slice(self, handle: DeviceHandle, interval: int) -> None:
        check_time_slice(interval)
        compute_policy(self._nvidia_smi, self.device_uuid(handle), f"--set-timeslice={interval}")

    def device_compute_mode(self, handle: DeviceHandle) -> int:
        fn = self._nvml.nvmlDeviceGetComputeMode
        return int(self._call("nvmlDeviceGetComputeMode", fn, handle))

    def device_set_compute_mode(self, handle: DeviceHandle, mode: int) -> None:
        check_compute_mode(mode)
        what = f"nvmlDeviceSetComputeMode({mode}, {COMPUTE_MODE_NAMES[mode]})"
        try:
            self._call(what, self._nvml.nvmlDeviceSetComputeMode, handle, mode)
        except NvmlQueryError as err:
            if err.code != NVML_ERROR_NO_PERMISSION:
                raise
            raise error_for_code(
                f"{err}: changing a GPU's compute mode needs root in the plugin's container",
                err.code,
            ) from err

    def mig_device_nodes(
        self, minor: int, gpu_instance_id: int, compute_instance_id: int
    ) -> tuple[CharDevice, ...]:
        gi = f"gi{gpu_instance_id}"
        numbers = (
            self._cap_minor(minor, gi),
            self._cap_minor(minor, f"{gi}/ci{compute_instance_id}"),
        )
        major = caps_major(self._proc_root / "devices")
        return tuple(
            CharDevice(
                path=f"/dev/nvidia-caps/nvidia-cap{number}",
                host_path=f"{self._dev_root}/nvidia-caps/nvidia-cap{number}",
                major=major,
                minor=number,
            )
            for number in numbers
        )

    def _cap_minor(self, minor: int, instance: str) -> int:
        """The capability minor of ``gi<g>`` or ``gi<g>/ci<c>`` on GPU ``minor``: the
        driver's ``capabilities/.../access`` file (what NVIDIA's DRA driver reads), else
        its ``mig-minors`` list."""
        access = self._proc_root / f"driver/nvidia/capabilities/gpu{minor}/mig/{instance}/access"
        number = read_access_minor(access)
        if number is not None:
            return number
        key = f"gpu{minor}/{instance}/access"
        listed = read_mig_minors(self._mig_minors).get(key)
        if listed is None:
            raise NvmlNotFound(
                f"no capability minor for {key} in {access} or {self._mig_minors}: the "
                "NVIDIA driver lists none for this MIG instance (is the instance gone, or "
                "the driver older than MIG capabilities? see nvidia-smi mig -lgi)"
            )
        return listed

    # -- MIG helpers: NVML's instance handles, which never leave this class --------------

    def _supported(self, what: str, fn: Callable[..., T], *args: object) -> T | None:
        """``fn(*args)``, or None where NVML says this profile does not exist here."""
        try:
            return self._call(what, fn, *args)
        except NvmlQueryError as err:
            if err.code in (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_INVALID_ARGUMENT):
                return None
            raise

    def _gpu_instance(self, handle: DeviceHandle, gpu_instance_id: int) -> object:
        what = f"nvmlDeviceGetGpuInstanceById({gpu_instance_id})"
        return self._call(what, self._nvml.nvmlDeviceGetGpuInstanceById, handle, gpu_instance_id)

    def _gpu_instance_handles(self, handle: DeviceHandle, profile_id: int) -> list[object]:
        array = (self._nvml.c_nvmlGpuInstance_t * MAX_INSTANCES)()
        count = ctypes.c_uint(MAX_INSTANCES)
        fn = self._nvml.nvmlDeviceGetGpuInstances
        self._call(
            f"nvmlDeviceGetGpuInstances({profile_id})",
            fn,
            handle,
            profile_id,
            array,
            ctypes.byref(count),
        )
        return list(array[: count.value])

    def _gpu_instance_info(self, gi: object) -> GpuInstance:
        info = self._call("nvmlGpuInstanceGetInfo", self._nvml.nvmlGpuInstanceGetInfo, gi)
        return GpuInstance(
            gpu_instance_id=int(info.id),
            profile_id=int(info.profileId),
            placement=Placement(int(info.placement.start), int(info.placement.size)),
        )

    def _compute_profiles(self, gi: object) -> list[Any]:
        count = int(getattr(self._nvml, "NVML_COMPUTE_INSTANCE_PROFILE_COUNT", 0))
        shared = int(getattr(self._nvml, "NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED", 0))
        fn = self._nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo
        what = "nvmlGpuInstanceGetComputeInstanceProfileInfoV"
        infos = (self._supported(what, fn, gi, index, shared) for index in range(count))
        return [info for info in infos if info is not None]

    def _compute_instance_handles(self, gi: object, profile_id: int) -> list[object]:
        array = (self._nvml.c_nvmlComputeInstance_t * MAX_INSTANCES)()
        count = ctypes.c_uint(MAX_INSTANCES)
        fn = self._nvml.nvmlGpuInstanceGetComputeInstances
        what = f"nvmlGpuInstanceGetComputeInstances({profile_id})"
        self._call(what, fn, gi, profile_id, array, ctypes.byref(count))
        return list(array[: count.value])

    def _compute_instance_info(self, ci: object) -> ComputeInstance:
        info = self._call("nvmlComputeInstanceGetInfo", self._nvml.nvmlComputeInstanceGetInfo, ci)
        return ComputeInstance(compute_instance_id=int(info.id), profile_id=int(info.profileId))

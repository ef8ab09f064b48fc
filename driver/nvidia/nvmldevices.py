"""The pynvml adapter's core: loading nvidia-ml-py, its errors, device queries, events.

``PynvmlDevices`` is the part of ``drasil.driver.nvidia.nvmladapter.PynvmlLibrary``
that only reads: it imports ``pynvml``, maps ``NVMLError`` to our exceptions (with
advice when ``nvmlInit`` fails), answers the system and per-device queries discovery
makes, waits for events (health's XIDs) and names device nodes. ``PynvmlLibrary``
adds what changes a GPU: MIG instances, the time slice and the compute mode.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from drasil.driver.nvidia.nvml import (
    NVML_DEVICE_MIG_ENABLE,
    NVML_ERROR_DRIVER_NOT_LOADED,
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH,
    NVML_ERROR_LIBRARY_NOT_FOUND,
    NVML_ERROR_NO_PERMISSION,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_TIMEOUT,
    DeviceAttributes,
    DeviceHandle,
    EventData,
    EventSet,
    MigMode,
    NvmlNotFound,
    NvmlQueryError,
    NvmlUnavailable,
    error_for_code,
)
from drasil.driver.nvidia.nvmlhost import MIG_MINORS, sysfs_pcie_root

_INIT_ADVICE = {
    NVML_ERROR_LIBRARY_NOT_FOUND: (
        "the NVML library libnvidia-ml.so.1 was not found: install the NVIDIA driver on "
        "the node and make its libraries visible to the plugin (driver root mount or "
        "NVIDIA Container Toolkit), or use the simulated backend on nodes without GPUs"
    ),
    NVML_ERROR_DRIVER_NOT_LOADED: (
        "the NVIDIA kernel driver is not loaded: load it (modprobe nvidia, see dmesg) or "
        "do not run the NVML backend on nodes without NVIDIA GPUs"
    ),
    NVML_ERROR_LIB_RM_VERSION_MISMATCH: (
        "the NVML library and the loaded kernel driver are different versions (usually a "
        "driver upgrade without reboot): reboot the node or reload the nvidia modules"
    ),
    NVML_ERROR_NO_PERMISSION: (
        "no permission to open the NVIDIA device nodes (/dev/nvidiactl, /dev/nvidia*): "
        "run the plugin with access to them"
    ),
}

T = TypeVar("T")


def _code(err: BaseException) -> int | None:
    value = getattr(err, "value", None)
    return value if isinstance(value, int) else None


def nvml_text(value: object) -> str:
    # pynvml returns str on Python 3 for most calls, but raw ctypes fields are bytes.
    return value.decode() if isinstance(value, bytes) else str(value)


def _query_error(what: str, err: BaseException) -> NvmlQueryError:
    return error_for_code(f"{what}: {err}", _code(err))


class PynvmlDevices:
    """The reading half of ``PynvmlLibrary`` (see there for the arguments)."""

    def __init__(
        self,
        *,
        pcie_root: Callable[[str], str | None] = sysfs_pcie_root,
        dev_root: str = "/dev",
        dev_root_local: Path | None = None,
        proc_root: Path = Path("/proc"),
        mig_minors: Path | None = None,
        nvidia_smi: str = "nvidia-smi",
    ) -> None:
        try:
            self._nvml: Any = importlib.import_module("pynvml")
        except ImportError as err:
            raise NvmlUnavailable(
                "the Python module pynvml is missing: install the nvidia-ml-py package"
            ) from err
        self._pcie_root = pcie_root
        self._dev_root = dev_root
        self._dev_root_local = dev_root_local or Path(dev_root)
        self._proc_root = proc_root
        self._mig_minors = mig_minors or proc_root / MIG_MINORS.relative_to("/proc")
        self._nvidia_smi = nvidia_smi

    def _call(self, what: str, fn: Callable[..., T], *args: object) -> T:
        try:
            return fn(*args)
        except self._nvml.NVMLError as err:
            raise _query_error(what, err) from err

    def init(self) -> None:
        try:
            self._nvml.nvmlInit()
        except self._nvml.NVMLError as err:
            advice = _INIT_ADVICE.get(_code(err) or 0, "see the NVIDIA driver's logs (dmesg)")
            raise NvmlUnavailable(f"NVML is unavailable ({err}): {advice}") from err

    def shutdown(self) -> None:
        self._call("nvmlShutdown", self._nvml.nvmlShutdown)

    def system_driver_version(self) -> str:
        return nvml_text(
            self._call("nvmlSystemGetDriverVersion", self._nvml.nvmlSystemGetDriverVersion)
        )

    def system_cuda_driver_version(self) -> int:
        fn = self._nvml.nvmlSystemGetCudaDriverVersion
        return int(self._call("nvmlSystemGetCudaDriverVersion", fn))

    def device_count(self) -> int:
        return int(self._call("nvmlDeviceGetCount", self._nvml.nvmlDeviceGetCount))

    def device_handle_by_index(self, index: int) -> DeviceHandle:
        fn = self._nvml.nvmlDeviceGetHandleByIndex
        return self._call(f"nvmlDeviceGetHandleByIndex({index})", fn, index)

    def device_name(self, handle: DeviceHandle) -> str:
        return nvml_text(self._call("nvmlDeviceGetName", self._nvml.nvmlDeviceGetName, handle))

    def device_uuid(self, handle: DeviceHandle) -> str:
        return nvml_text(self._call("nvmlDeviceGetUUID", self._nvml.nvmlDeviceGetUUID, handle))

    def device_minor_number(self, handle: DeviceHandle) -> int:
        fn = self._nvml.nvmlDeviceGetMinorNumber
        return int(self._call("nvmlDeviceGetMinorNumber", fn, handle))

    def device_memory_total(self, handle: DeviceHandle) -> int:
        info = self._call("nvmlDeviceGetMemoryInfo", self._nvml.nvmlDeviceGetMemoryInfo, handle)
        return int(info.total)

    def device_pci_bus_id(self, handle: DeviceHandle) -> str:
        info = self._call("nvmlDeviceGetPciInfo", self._nvml.nvmlDeviceGetPciInfo, handle)
        return nvml_text(info.busId)

    def device_cuda_compute_capability(self, handle: DeviceHandle) -> tuple[int, int]:
        fn = self._nvml.nvmlDeviceGetCudaComputeCapability
        major, minor = self._call("nvmlDeviceGetCudaComputeCapability", fn, handle)
        return int(major), int(minor)

    def device_brand(self, handle: DeviceHandle) -> int:
        return int(self._call("nvmlDeviceGetBrand", self._nvml.nvmlDeviceGetBrand, handle))

    def device_architecture(self, handle: DeviceHandle) -> int:
        fn = self._nvml.nvmlDeviceGetArchitecture
        return int(self._call("nvmlDeviceGetArchitecture", fn, handle))

    def device_numa_node(self, handle: DeviceHandle) -> int | None:
        fn = getattr(self._nvml, "nvmlDeviceGetNumaNodeId", None)
        if fn is None:  # older nvidia-ml-py
            return None
        try:
            node = int(self._call("nvmlDeviceGetNumaNodeId", fn, handle))
        except NvmlQueryError as err:
            if err.code in (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_FUNCTION_NOT_FOUND):
                return None
            raise
        return node if node >= 0 else None

    def device_addressing_mode(self, handle: DeviceHandle) -> int | None:
        fn = getattr(self._nvml, "nvmlDeviceGetAddressingMode", None)
        if fn is None:  # nvidia-ml-py older than NVML 12.8
            return None
        try:
            return int(self._call("nvmlDeviceGetAddressingMode", fn, handle))
        except NvmlQueryError as err:
            # NOT_SUPPORTED: the platform has no addressing mode (go-nvlib's ""); a
            # driver older than 570 lacks the function.
            if err.code in (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_FUNCTION_NOT_FOUND):
                return None
            raise

    def device_mig_mode(self, handle: DeviceHandle) -> MigMode:
        current, pending = self._call(
            "nvmlDeviceGetMigMode", self._nvml.nvmlDeviceGetMigMode, handle
        )
        return MigMode(
            current=current == NVML_DEVICE_MIG_ENABLE, pending=pending == NVML_DEVICE_MIG_ENABLE
        )

    def device_max_mig_device_count(self, handle: DeviceHandle) -> int:
        fn = self._nvml.nvmlDeviceGetMaxMigDeviceCount
        return int(self._call("nvmlDeviceGetMaxMigDeviceCount", fn, handle))

    def device_mig_device_handle_by_index(self, handle: DeviceHandle, index: int) -> DeviceHandle:
        what = f"nvmlDeviceGetMigDeviceHandleByIndex({index})"
        try:
            return self._call(what, self._nvml.nvmlDeviceGetMigDeviceHandleByIndex, handle, index)
        except NvmlQueryError as err:
            # An empty slot answers NOT_FOUND or INVALID_ARGUMENT depending on the driver.
            if err.code == NVML_ERROR_INVALID_ARGUMENT:
                raise NvmlNotFound(str(err), code=err.code) from err
            raise

    def device_gpu_instance_id(self, handle: DeviceHandle) -> int:
        fn = self._nvml.nvmlDeviceGetGpuInstanceId
        return int(self._call("nvmlDeviceGetGpuInstanceId", fn, handle))

    def device_compute_instance_id(self, handle: DeviceHandle) -> int:
        fn = self._nvml.nvmlDeviceGetComputeInstanceId
        return int(self._call("nvmlDeviceGetComputeInstanceId", fn, handle))

    def device_attributes(self, handle: DeviceHandle) -> DeviceAttributes:
        raw = self._call("nvmlDeviceGetAttributes", self._nvml.nvmlDeviceGetAttributes, handle)
        return DeviceAttributes(
            multiprocessor_count=int(raw.multiprocessorCount),
            copy_engine_count=int(raw.sharedCopyEngineCount),
            decoder_count=int(raw.sharedDecoderCount),
            encoder_count=int(raw.sharedEncoderCount),
            jpeg_count=int(raw.sharedJpegCount),
            ofa_count=int(raw.sharedOfaCount),
            gpu_instance_slice_count=int(raw.gpuInstanceSliceCount),
            compute_instance_slice_count=int(raw.computeInstanceSliceCount),
            memory_size_mib=int(raw.memorySizeMB),
        )

    def device_parent_handle(self, handle: DeviceHandle) -> DeviceHandle:
        fn = self._nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle
        return self._call("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", fn, handle)

    def event_set_create(self) -> EventSet:
        return self._call("nvmlEventSetCreate", self._nvml.nvmlEventSetCreate)

    def device_register_events(
        self, handle: DeviceHandle, event_types: int, event_set: EventSet
    ) -> None:
        fn = self._nvml.nvmlDeviceRegisterEvents
        self._call("nvmlDeviceRegisterEvents", fn, handle, event_types, event_set)

    def event_set_wait(self, event_set: EventSet, timeout_ms: int) -> EventData | None:
        try:
            raw = self._call("nvmlEventSetWait", self._nvml.nvmlEventSetWait, event_set, timeout_ms)
        except NvmlQueryError as err:
            if err.code == NVML_ERROR_TIMEOUT:
                return None
            raise
        return EventData(
            device=raw.device,
            event_type=int(raw.eventType),
            event_data=int(raw.eventData),
            gpu_instance_id=int(raw.gpuInstanceId),
            compute_instance_id=int(raw.computeInstanceId),
        )

    def event_set_free(self, event_set: EventSet) -> None:
        self._call("nvmlEventSetFree", self._nvml.nvmlEventSetFree, event_set)

    def pcie_root(self, pci_bus_id: str) -> str | None:
        return self._pcie_root(pci_bus_id)

    def device_nodes(self, minor: int) -> tuple[str, ...]:
        return (f"{self._dev_root}/nvidia{minor}",)

    def control_device_nodes(self) -> tuple[str, ...]:
        names = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
        present = (n for n in names if (self._dev_root_local / n).exists())
        return tuple(f"{self._dev_root}/{n}" for n in present)

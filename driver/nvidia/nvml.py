"""The NVML surface drasil uses, as a Protocol of our own, with its records and errors.

Discovery and health talk to ``NvmlLibrary`` only. Two classes implement it: the
``PynvmlLibrary`` adapter over nvidia-ml-py (module ``pynvml``, in
``drasil.driver.nvidia.nvmladapter``) for real GPUs, and the fake in
``drasil.driver.simulated.nvml`` for demos and tests. Keeping the Protocol small and
typed (our own dataclasses, our own exceptions) is what lets the simulated backend run
the very same discovery code path as real hardware. This module holds that shared
vocabulary: the Protocol, its records, NVML's return codes and their exceptions, the
enum spellings (brands, architectures, MIG profile names, compute modes, time slices)
both implementations answer in, and ``nvml_session``.

Handles are opaque: a library hands them out and takes back only its own.

Two methods are not NVML calls but host facts discovery needs next to NVML:
``pcie_root`` (the PCIe root complex of a bus id, from sysfs on real hardware) and
``device_nodes`` (the ``/dev`` nodes of a GPU; the simulated backend has none); the
adapter reads them with ``drasil.driver.nvidia.nvmlhost``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from fractions import Fraction
from typing import Protocol, TypeAlias

from drasil.driver.devices import CharDevice

DeviceHandle: TypeAlias = object
"""An opaque handle of a full GPU or a MIG device, only valid for its own library."""

EventSet: TypeAlias = object
"""An opaque NVML event set, only valid for its own library."""

# NVML return codes (nvml.h). They are ABI, so matching on them works for every
# nvidia-ml-py version and for test doubles that only carry ``.value``.
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_IN_USE = 19
NVML_ERROR_INSUFFICIENT_RESOURCES = 23

NVML_DEVICE_MIG_DISABLE = 0
NVML_DEVICE_MIG_ENABLE = 1

# Room for the answers of NVML's list calls: a GPU has 8 memory slices, so at most 8
# placements of a profile and 8 instances; the arrays are generous.
MAX_PLACEMENTS = 32
MAX_INSTANCES = 32

# Event types (nvmlEventType*). Health registers for the XID ones.
EVENT_TYPE_XID_CRITICAL_ERROR = 0x8

NO_INSTANCE = 0xFFFFFFFF
"""The GPU/compute instance id NVML reports in events that are not about a MIG device."""

# nvmlBrandType_t and nvmlDeviceArchitecture_t, spelled as go-nvlib spells them so
# CEL selectors written for NVIDIA's own DRA driver keep working.
BRAND_NAMES: dict[int, str] = {
    0: "Unknown",
    1: "Quadro",
    2: "Tesla",
    3: "NVS",
    4: "Grid",
    5: "GeForce",
    6: "Titan",
    7: "NvidiaVApps",
    8: "NvidiaVPC",
    9: "NvidiaVCS",
    10: "NvidiaVWS",
    11: "NvidiaCloudGaming",
    12: "QuadroRTX",
    13: "NvidiaRTX",
    14: "Nvidia",
    15: "GeForceRTX",
    16: "TitanRTX",
}
BRAND_NVIDIA = 14

ARCHITECTURE_NAMES: dict[int, str] = {
    2: "Kepler",
    3: "Maxwell",
    4: "Pascal",
    5: "Volta",
    6: "Turing",
    7: "Ampere",
    8: "Ada Lovelace",
    9: "Hopper",
    10: "Blackwell",
    0xFFFFFFFF: "Unknown",
}
ARCH_AMPERE = 7
ARCH_ADA = 8
ARCH_HOPPER = 9
ARCH_BLACKWELL = 10

# nvmlDeviceAddressingModeType_t (NVML 12.8, driver 570 and newer), as go-nvlib's
# GetAddressingModeAsString spells it: how the GPU reaches system memory. A GPU whose
# platform has no addressing mode at all (NOT_SUPPORTED) publishes no attribute.
NVML_DEVICE_ADDRESSING_MODE_NONE = 0
NVML_DEVICE_ADDRESSING_MODE_HMM = 1
NVML_DEVICE_ADDRESSING_MODE_ATS = 2
ADDRESSING_MODE_NAMES: dict[int, str] = {
    NVML_DEVICE_ADDRESSING_MODE_NONE: "None",
    NVML_DEVICE_ADDRESSING_MODE_HMM: "HMM",
    NVML_DEVICE_ADDRESSING_MODE_ATS: "ATS",
}


class NvmlError(Exception):
    """Base of every error the NVML layer raises."""


class NvmlUnavailable(NvmlError):
    """NVML cannot be used on this host at all; the message says what to do."""


class NvmlQueryError(NvmlError):
    """One NVML query failed (usually for one device); ``code`` is NVML's return code."""

    def __init__(self, message: str, *, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class NvmlNotSupported(NvmlQueryError):
    """The query is not supported by this device (e.g. MIG mode on an L4)."""


class NvmlNotFound(NvmlQueryError):
    """The thing asked for does not exist (e.g. an empty MIG device slot)."""


class NvmlInUse(NvmlQueryError):
    """The GPU or instance is busy (processes, or compute instances inside a GPU instance)."""


class NvmlResetRequired(NvmlQueryError):
    """A MIG mode change NVML accepted that takes effect only after a GPU reset."""


class NvmlInsufficientResources(NvmlQueryError):
    """A MIG instance does not fit: its placement overlaps another, or none are left."""


class NvmlInvalidArgument(NvmlQueryError, ValueError):
    """An argument NVML would refuse with INVALID_ARGUMENT, caught before the call (a
    ``ValueError`` too: it is the caller's mistake, not the GPU's)."""


@dataclass(frozen=True)
class GpuInstanceProfile:
    """``nvmlDeviceGetGpuInstanceProfileInfoV``: one MIG profile a GPU supports.

    ``profile_id`` is NVML's id (``nvidia-smi mig -lgip``'s ID, e.g. 9 for 3g.40gb);
    ``name`` is without the ``MIG `` prefix; ``slice_count`` counts compute slices
    and ``instance_count`` is how many of this profile the GPU holds at most.
    """

    profile_id: int
    name: str
    slice_count: int
    instance_count: int
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpeg_engines: int
    ofa_engines: int
    memory_mib: int


@dataclass(frozen=True)
class Placement:
    """``nvmlGpuInstancePlacement_t``: a GPU instance's memory slices, start and size."""

    start: int
    size: int

    @property
    def slices(self) -> range:
        return range(self.start, self.start + self.size)


@dataclass(frozen=True)
class GpuInstance:
    """``nvmlGpuInstanceGetInfo``: a GPU instance that exists on a GPU."""

    gpu_instance_id: int
    profile_id: int
    placement: Placement


@dataclass(frozen=True)
class ComputeInstance:
    """``nvmlComputeInstanceGetInfo``: a compute instance inside a GPU instance."""

    compute_instance_id: int
    profile_id: int


@dataclass(frozen=True)
class MigMode:
    """``nvmlDeviceGetMigMode``: the mode in effect and the one after the next reset."""

    current: bool
    pending: bool


@dataclass(frozen=True)
class DeviceAttributes:
    """``nvmlDeviceGetAttributes`` of a MIG device (engine counts are shared counts)."""

    multiprocessor_count: int
    copy_engine_count: int
    decoder_count: int
    encoder_count: int
    jpeg_count: int
    ofa_count: int
    gpu_instance_slice_count: int
    compute_instance_slice_count: int
    memory_size_mib: int


@dataclass(frozen=True)
class EventData:
    """One event from ``nvmlEventSetWait``; ``device`` is the full GPU's handle.

    For events about a MIG device, ``gpu_instance_id``/``compute_instance_id`` name it;
    otherwise they are ``NO_INSTANCE``.
    """

    device: DeviceHandle
    event_type: int
    event_data: int
    gpu_instance_id: int = NO_INSTANCE
    compute_instance_id: int = NO_INSTANCE


class NvmlLibrary(Protocol):
    """The NVML calls discovery and health need; every call may raise ``NvmlError``."""

    def init(self) -> None:
        """``nvmlInit``; raises ``NvmlUnavailable`` with advice when NVML is unusable."""

    def shutdown(self) -> None:
        """``nvmlShutdown`` (NVML counts init/shutdown pairs)."""

    def system_driver_version(self) -> str:
        """The kernel driver version as NVML prints it, e.g. ``580.95.05``."""

    def system_cuda_driver_version(self) -> int:
        """The CUDA driver API version as NVML encodes it, e.g. ``13000`` for 13.0."""

    def device_count(self) -> int: ...

    def device_handle_by_index(self, index: int) -> DeviceHandle: ...

    def device_name(self, handle: DeviceHandle) -> str: ...

    def device_uuid(self, handle: DeviceHandle) -> str: ...

    def device_minor_number(self, handle: DeviceHandle) -> int: ...

    def device_memory_total(self, handle: DeviceHandle) -> int:
        """Total framebuffer memory in bytes."""

    def device_pci_bus_id(self, handle: DeviceHandle) -> str:
        """NVML's bus id, e.g. ``00000000:3B:00.0`` (discovery normalises it)."""

    def device_cuda_compute_capability(self, handle: DeviceHandle) -> tuple[int, int]: ...

    def device_brand(self, handle: DeviceHandle) -> int:
        """An ``nvmlBrandType_t`` value; see ``BRAND_NAMES``."""

    def device_architecture(self, handle: DeviceHandle) -> int:
        """An ``nvmlDeviceArchitecture_t`` value; see ``ARCHITECTURE_NAMES``."""

    def device_numa_node(self, handle: DeviceHandle) -> int | None:
        """The NUMA node closest to the GPU, or None where NVML does not know one."""

    def device_addressing_mode(self, handle: DeviceHandle) -> int | None:
        """An ``nvmlDeviceAddressingModeType_t`` value (see ``ADDRESSING_MODE_NAMES``), or
        None where the platform or the driver has none (NOT_SUPPORTED, or an NVML older
        than ``nvmlDeviceGetAddressingMode``)."""

    def device_mig_mode(self, handle: DeviceHandle) -> MigMode:
        """Raises ``NvmlNotSupported`` on GPUs without MIG."""

    def device_max_mig_device_count(self, handle: DeviceHandle) -> int: ...

    def device_mig_device_handle_by_index(self, handle: DeviceHandle, index: int) -> DeviceHandle:
        """Raises ``NvmlNotFound`` for a slot without a MIG device."""

    def device_gpu_instance_id(self, handle: DeviceHandle) -> int: ...

    def device_compute_instance_id(self, handle: DeviceHandle) -> int: ...

    def device_attributes(self, handle: DeviceHandle) -> DeviceAttributes: ...

    def device_parent_handle(self, handle: DeviceHandle) -> DeviceHandle:
        """The full GPU a MIG device belongs to."""

    # -- MIG management (``--mig-mode dynamic``); every call takes a full GPU's handle.

    def device_set_mig_mode(self, handle: DeviceHandle, enabled: bool) -> MigMode:
        """``nvmlDeviceSetMigMode``; the mode afterwards.

        NVML answers SUCCESS and says in ``activationStatus`` whether the change took
        effect: this raises ``NvmlInUse`` when the GPU is in use (the change is then
        pending) and ``NvmlResetRequired`` when it applies only at the next GPU reset
        (Ampere); either way ``device_mig_mode`` shows the pending mode."""

    def gpu_instance_profiles(self, handle: DeviceHandle) -> tuple[GpuInstanceProfile, ...]:
        """Every GPU instance profile this GPU supports (NOT_SUPPORTED ones left out),
        whatever its MIG mode; ``NvmlNotSupported`` on GPUs without MIG."""

    def gpu_instance_placements(
        self, handle: DeviceHandle, profile_id: int
    ) -> tuple[Placement, ...]:
        """``nvmlDeviceGetGpuInstancePossiblePlacements_v2``: every placement of the
        profile on an empty GPU, in NVML's order."""

    def gpu_instances(self, handle: DeviceHandle) -> tuple[GpuInstance, ...]:
        """The GPU instances that exist now, of every profile, by instance id;
        ``NvmlNotSupported`` while MIG mode is off (as NVML answers)."""

    def create_gpu_instance(
        self, handle: DeviceHandle, profile_id: int, placement: Placement
    ) -> GpuInstance:
        """``nvmlDeviceCreateGpuInstanceWithPlacement``. Raises
        ``NvmlInsufficientResources`` when the placement overlaps an instance or the
        profile's instances are used up, ``NvmlQueryError`` (INVALID_ARGUMENT) for a
        placement the profile does not have, and NOT_SUPPORTED-style errors when MIG
        mode is off."""

    def destroy_gpu_instance(self, handle: DeviceHandle, gpu_instance_id: int) -> None:
        """``nvmlGpuInstanceDestroy``. Raises ``NvmlInUse`` while it holds compute
        instances, ``NvmlNotFound`` when there is no such instance."""

    def compute_instances(
        self, handle: DeviceHandle, gpu_instance_id: int
    ) -> tuple[ComputeInstance, ...]:
        """The compute instances inside a GPU instance (``NvmlNotFound`` if no GI)."""

    def create_compute_instance(
        self, handle: DeviceHandle, gpu_instance_id: int
    ) -> ComputeInstance:
        """``nvmlGpuInstanceCreateComputeInstance`` with the compute instance profile
        that spans the whole GPU instance. Raises ``NvmlInsufficientResources`` when
        the GPU instance already holds one."""

    def destroy_compute_instance(
        self, handle: DeviceHandle, gpu_instance_id: int, compute_instance_id: int
    ) -> None:
        """``nvmlComputeInstanceDestroy``; ``NvmlNotFound`` when there is none."""

    def device_processes(self, handle: DeviceHandle) -> tuple[int, ...]:
        """``nvmlDeviceGetComputeRunningProcesses`` and ``…GraphicsRunningProcesses``: the
        PIDs of the processes using the GPU (host PIDs; an MPS server for its clients)."""

    def device_time_slice(self, handle: DeviceHandle) -> int:
        """Not NVML: the GPU's compute time slice as ``nvidia-smi compute-policy`` sets
        it (0 default, 1 short, 2 medium, 3 long)."""

    def device_set_time_slice(self, handle: DeviceHandle, interval: int) -> None:
        """Not NVML: ``nvidia-smi compute-policy -i <uuid> --set-timeslice=<interval>``;
        raises ``NvmlQueryError`` when the tool is missing or refuses."""

    def device_compute_mode(self, handle: DeviceHandle) -> int:
        """``nvmlDeviceGetComputeMode``: an ``nvmlComputeMode_t`` value (see
        ``COMPUTE_MODE_NAMES``). Whole GPUs only: ``NvmlNotSupported`` for a MIG device."""

    def device_set_compute_mode(self, handle: DeviceHandle, mode: int) -> None:
        """``nvmlDeviceSetComputeMode``; takes effect at once and lasts until the next
        reboot (Linux). ``NvmlInvalidArgument`` for a mode that is not one of
        ``COMPUTE_MODE_NAMES`` (nothing is called), ``NvmlNotSupported`` for a MIG
        device, ``NvmlQueryError`` with ``NVML_ERROR_NO_PERMISSION`` without root."""

    def mig_device_nodes(
        self, minor: int, gpu_instance_id: int, compute_instance_id: int
    ) -> tuple[CharDevice, ...]:
        """Not NVML: the ``/dev/nvidia-caps`` nodes that give access to one MIG device,
        the GPU instance's then the compute instance's, with the numbers the driver's
        ``/proc`` gives them (``NvmlNotFound`` where it does not); the simulated backend
        has none."""

    def event_set_create(self) -> EventSet: ...

    def device_register_events(
        self, handle: DeviceHandle, event_types: int, event_set: EventSet
    ) -> None: ...

    def event_set_wait(self, event_set: EventSet, timeout_ms: int) -> EventData | None:
        """The next event, or None when ``timeout_ms`` passed without one."""

    def event_set_free(self, event_set: EventSet) -> None: ...

    def pcie_root(self, pci_bus_id: str) -> str | None:
        """Not NVML: the root complex (``pci0000:3a``) of a normalised bus id, if known."""

    def device_nodes(self, minor: int) -> tuple[str, ...]:
        """Not NVML: the host device nodes of the GPU with this minor number."""

    def control_device_nodes(self) -> tuple[str, ...]:
        """Not NVML: the driver's own device nodes every GPU container needs
        (``/dev/nvidiactl``, ``/dev/nvidia-uvm``, ``/dev/nvidia-uvm-tools``), those present."""


@contextmanager
def nvml_session(lib: NvmlLibrary) -> Iterator[None]:
    """A reference on NVML for the calls inside.

    NVML counts ``nvmlInit``/``nvmlShutdown`` pairs and answers every call with
    UNINITIALIZED after the last shutdown, so each user of the library holds its own
    reference while it works instead of relying on another one's (discovery shuts its
    reference down when it is done). While the daemon holds one for its lifetime, an
    init here is only a counter increment. Raises ``NvmlUnavailable`` like ``init``.
    """
    lib.init()
    try:
        yield
    finally:
        with suppress(NvmlError):
            lib.shutdown()


# The suffix NVIDIA gives the profiles of NVML_GPU_INSTANCE_PROFILE_<n>_SLICE_REV1
# (media extensions), _GFX, _NO_ME and _ALL_ME, by profile index (nvml.h).
_PROFILE_SUFFIXES = {
    0x7: "+me",
    0x8: "+me",
    0xA: "+gfx",
    0xB: "+gfx",
    0xC: "+gfx",
    0xD: "-me",
    0xE: "-me",
    0xF: "+me.all",
    0x10: "+me.all",
    0x11: "+gfx",
}


def mig_memory_gb(memory_mib: int, *, parent_memory: int) -> int:
    """A MIG device's memory in a profile name (``5`` of ``1g.5gb``), as go-nvlib has it:
    its share of the parent rounded up to eighths, scaled to the parent's whole GiB, so
    4864 MiB of a 40 GiB A100 is 5."""
    share = Fraction(memory_mib * 2**20, parent_memory)
    eighths = Fraction(math.ceil(share * 8), 8)
    parent_gb = -(-parent_memory // 2**30)
    return math.floor(eighths * parent_gb + Fraction(1, 2))


def mig_profile_label(
    *, slices: int, memory_mib: int, parent_memory: int, profile_index: int
) -> str:
    """``1g.10gb+me``: the name of the GPU instance profile at ``profile_index``."""
    gb = mig_memory_gb(memory_mib, parent_memory=parent_memory)
    return f"{slices}g.{gb}gb{_PROFILE_SUFFIXES.get(profile_index, '')}"


_ERRORS_BY_CODE: dict[int, type[NvmlQueryError]] = {
    NVML_ERROR_NOT_SUPPORTED: NvmlNotSupported,
    NVML_ERROR_NOT_FOUND: NvmlNotFound,
    NVML_ERROR_IN_USE: NvmlInUse,
    NVML_ERROR_RESET_REQUIRED: NvmlResetRequired,
    NVML_ERROR_INSUFFICIENT_RESOURCES: NvmlInsufficientResources,
}


def error_for_code(message: str, code: int | None) -> NvmlQueryError:
    """The exception for an NVML return code: the adapter and the fake raise the same."""
    cls = _ERRORS_BY_CODE.get(code, NvmlQueryError) if code is not None else NvmlQueryError
    return cls(message, code=code)


# ``nvidia-smi compute-policy --set-timeslice``'s values (its help text:
# 0=DEFAULT, 1=SHORT, 2=MEDIUM, 3=LONG); the GPU scheduler's slice per context.
TIME_SLICE_DEFAULT = 0
TIME_SLICE_NAMES: dict[str, int] = {"default": 0, "short": 1, "medium": 2, "long": 3}


def check_time_slice(interval: int) -> None:
    """NvmlQueryError (INVALID_ARGUMENT) unless ``interval`` is one nvidia-smi takes."""
    if interval not in TIME_SLICE_NAMES.values():
        raise error_for_code(
            f"time slice {interval}: must be 0 (default), 1 (short), 2 (medium) or 3 (long)",
            NVML_ERROR_INVALID_ARGUMENT,
        )


# nvmlComputeMode_t (nvml.h): who may hold CUDA contexts on a GPU. MPS wants
# EXCLUSIVE_PROCESS, so that only its server opens a context and clients go through it.
COMPUTE_MODE_DEFAULT = 0
COMPUTE_MODE_EXCLUSIVE_THREAD = 1  # deprecated: NVML no longer supports it
COMPUTE_MODE_PROHIBITED = 2
COMPUTE_MODE_EXCLUSIVE_PROCESS = 3
COMPUTE_MODE_NAMES: dict[int, str] = {
    COMPUTE_MODE_DEFAULT: "Default",
    COMPUTE_MODE_EXCLUSIVE_THREAD: "Exclusive_Thread",
    COMPUTE_MODE_PROHIBITED: "Prohibited",
    COMPUTE_MODE_EXCLUSIVE_PROCESS: "Exclusive_Process",
}
"""Every ``nvmlComputeMode_t`` value, spelled as ``nvidia-smi -q`` prints it."""


def check_compute_mode(mode: int) -> None:
    """``NvmlInvalidArgument`` (a ValueError, code INVALID_ARGUMENT) unless ``mode`` is
    an ``nvmlComputeMode_t`` value."""
    if isinstance(mode, bool) or not isinstance(mode, int) or mode not in COMPUTE_MODE_NAMES:
        allowed = ", ".join(f"{value} ({name})" for value, name in COMPUTE_MODE_NAMES.items())
        raise NvmlInvalidArgument(
            f"compute mode {mode!r}: must be one of {allowed}", code=NVML_ERROR_INVALID_ARGUMENT
        )

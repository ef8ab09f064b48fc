"""The NVML surface drasil uses, as a Protocol of our own, and its pynvml adapter.

Discovery and health talk to ``NvmlLibrary`` only. Two classes implement it: the
``PynvmlLibrary`` adapter over nvidia-ml-py (module ``pynvml``) for real GPUs, and the
fake in ``drasil.driver.nvidia.simulated`` for demos and tests. Keeping the Protocol small and
typed (our own dataclasses, our own exceptions) is what lets the simulated backend run
the very same discovery code path as real hardware.

Handles are opaque: a library hands them out and takes back only its own.

Two methods are not NVML calls but host facts discovery needs next to NVML:
``pcie_root`` (the PCIe root complex of a bus id, from sysfs on real hardware) and
``device_nodes`` (the ``/dev`` nodes of a GPU; the simulated backend has none).
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import logging
import math
import re
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Protocol, TypeAlias, TypeVar

from drasil.driver.devices import CharDevice

log = logging.getLogger(__name__)

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


_PCI_ROOT = re.compile(r"pci[0-9a-f]{4,}:[0-9a-f]{2}")


def sysfs_pcie_root(pci_bus_id: str, *, sysfs: Path = Path("/sys")) -> str | None:
    """The PCIe root complex of a device, read from where its sysfs node really lives.

    ``/sys/bus/pci/devices/0000:3b:00.0`` links to
    ``/sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0``; the ``pci…`` component is
    the root (the same rule as Kubernetes' ``deviceattribute`` helper).
    """
    try:
        target = (sysfs / "bus" / "pci" / "devices" / pci_bus_id).resolve(strict=True)
    except OSError:
        return None
    return next((part for part in target.parts if _PCI_ROOT.fullmatch(part)), None)


MIG_MINORS = Path("/proc/driver/nvidia-caps/mig-minors")


def read_mig_minors(path: Path) -> dict[str, int]:
    """``mig-minors``: ``gpu0/gi1/access 12`` lines → ``{"gpu0/gi1/access": 12}``.

    The driver lists the capability minor of every GPU instance and compute instance
    that could exist; ``/dev/nvidia-caps/nvidia-cap<minor>`` opens it. A missing file
    (driver without MIG) reads as empty.
    """
    try:
        text = path.read_text(encoding="ascii", errors="replace")
    except FileNotFoundError:
        return {}
    minors: dict[str, int] = {}
    for line in text.splitlines():
        name, _, number = line.strip().partition(" ")
        if number.strip().isdigit():
            minors[name] = int(number)
    return minors


def read_access_minor(path: Path) -> int | None:
    """``DeviceFileMinor`` of a driver capability's ``access`` file, None without one.

    The file reads ``DeviceFileMinor: 21`` / ``DeviceFileMode: 292`` /
    ``DeviceFileModify: 1``.
    """
    try:
        text = path.read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "DeviceFileMinor" and value.strip().isdigit():
            return int(value.strip())
    return None


def caps_major(devices: Path) -> int:
    """The character major of ``nvidia-caps`` in ``/proc/devices``; NvmlNotFound when the
    driver registered none (no MIG support loaded)."""
    try:
        text = devices.read_text(encoding="ascii", errors="replace")
    except OSError as err:
        raise NvmlNotFound(f"{devices}: {err}") from err
    section = text.partition("Character devices:")[2].partition("Block devices:")[0]
    for line in section.splitlines():
        number, _, name = line.strip().partition(" ")
        if name.strip() == "nvidia-caps" and number.isdigit():
            return int(number)
    raise NvmlNotFound(
        f"{devices}: no nvidia-caps character device: the NVIDIA driver loaded has no MIG "
        "capabilities; MIG devices cannot be given to containers until it does"
    )


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


def _gpu_instance_profile(info: Any, *, name: str | None = None) -> GpuInstanceProfile:
    if name is None:
        name = _text(getattr(info, "name", b"")).removeprefix("MIG ").strip()
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

# What nvmlDeviceSetMigMode's activationStatus means when it is not SUCCESS.
_ACTIVATION_STATUS = {
    NVML_ERROR_IN_USE: "the GPU is in use (processes or MIG instances); the change is pending",
    NVML_ERROR_RESET_REQUIRED: "the change takes effect at the next GPU reset",
}


def _code(err: BaseException) -> int | None:
    value = getattr(err, "value", None)
    return value if isinstance(value, int) else None


def _text(value: object) -> str:
    # pynvml returns str on Python 3 for most calls, but raw ctypes fields are bytes.
    return value.decode() if isinstance(value, bytes) else str(value)


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


def _query_error(what: str, err: BaseException) -> NvmlQueryError:
    return error_for_code(f"{what}: {err}", _code(err))


# ``nvidia-smi compute-policy --set-timeslice``'s values (its help text:
# 0=DEFAULT, 1=SHORT, 2=MEDIUM, 3=LONG); the GPU scheduler's slice per context.
TIME_SLICE_DEFAULT = 0
TIME_SLICE_NAMES: dict[str, int] = {"default": 0, "short": 1, "medium": 2, "long": 3}
NVIDIA_SMI_TIMEOUT = 10.0
_TIME_SLICE_WORD = re.compile(r"time[ _-]?slice")


def check_time_slice(interval: int) -> None:
    """NvmlQueryError (INVALID_ARGUMENT) unless ``interval`` is one nvidia-smi takes."""
    if interval not in TIME_SLICE_NAMES.values():
        raise error_for_code(
            f"time slice {interval}: must be 0 (default), 1 (short), 2 (medium) or 3 (long)",
            NVML_ERROR_INVALID_ARGUMENT,
        )


def parse_time_slice(listing: str) -> int | None:
    """The time slice in ``nvidia-smi compute-policy --list`` output, or None.

    The layout is undocumented, so this reads the first line naming the time slice
    and takes the first level name or 0-3 digit after that word (a GPU index may come
    before it in a table row).
    """
    for line in listing.splitlines():
        parts = _TIME_SLICE_WORD.split(line.lower(), maxsplit=1)
        if len(parts) < 2:
            continue
        rest = parts[1]
        for token in re.findall(r"[a-z]+|\d+", rest):
            if token in TIME_SLICE_NAMES:
                return TIME_SLICE_NAMES[token]
            if token.isdigit() and int(token) in TIME_SLICE_NAMES.values():
                return int(token)
    return None


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


class PynvmlLibrary:
    """``NvmlLibrary`` over nvidia-ml-py, mapping ``NVMLError`` to our exceptions.

    ``pcie_root`` is injectable so tests (and odd hosts) need no real sysfs; device
    nodes are ``<dev_root>/nvidia<minor>`` (host paths; ``dev_root_local`` is where this
    process sees them), MIG access nodes ``/dev/nvidia-caps/nvidia-cap<n>`` with ``n``
    and the major read from the driver's entries under ``proc_root``.

    GPU and compute instance handles are NVML's and stay inside: the Protocol names
    instances by their ids, which survive a plugin restart where handles do not.

    NVML has no call for the compute time slice, so the time slice methods run
    ``nvidia_smi compute-policy`` (the binary is injectable for tests and hosts that
    keep the driver's tools elsewhere) and wait at most ``NVIDIA_SMI_TIMEOUT``.
    """

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
        return _text(
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
        return _text(self._call("nvmlDeviceGetName", self._nvml.nvmlDeviceGetName, handle))

    def device_uuid(self, handle: DeviceHandle) -> str:
        return _text(self._call("nvmlDeviceGetUUID", self._nvml.nvmlDeviceGetUUID, handle))

    def device_minor_number(self, handle: DeviceHandle) -> int:
        fn = self._nvml.nvmlDeviceGetMinorNumber
        return int(self._call("nvmlDeviceGetMinorNumber", fn, handle))

    def device_memory_total(self, handle: DeviceHandle) -> int:
        info = self._call("nvmlDeviceGetMemoryInfo", self._nvml.nvmlDeviceGetMemoryInfo, handle)
        return int(info.total)

    def device_pci_bus_id(self, handle: DeviceHandle) -> str:
        info = self._call("nvmlDeviceGetPciInfo", self._nvml.nvmlDeviceGetPciInfo, handle)
        return _text(info.busId)

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

    def device_time_slice(self, handle: DeviceHandle) -> int:
        uuid = self.device_uuid(handle)
        listing = self._compute_policy(uuid, "--list")
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
        self._compute_policy(self.device_uuid(handle), f"--set-timeslice={interval}")

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

    def _compute_policy(self, uuid: str, option: str) -> str:
        """``nvidia-smi compute-policy -i <uuid> <option>``'s output, or NvmlQueryError
        with what the tool said."""
        command = [self._nvidia_smi, "compute-policy", "-i", uuid, option]
        what = f"nvidia-smi compute-policy -i {uuid} {option}"
        try:
            done = subprocess.run(
                command,
                capture_output=True,
                text=True,
                timeout=NVIDIA_SMI_TIMEOUT,
                stdin=subprocess.DEVNULL,
                check=False,
            )
        except FileNotFoundError as err:
            raise NvmlQueryError(f"{what}: {self._nvidia_smi} not found") from err
        except subprocess.TimeoutExpired as err:
            raise NvmlQueryError(f"{what}: no answer in {NVIDIA_SMI_TIMEOUT:g}s") from err
        except OSError as err:
            raise NvmlQueryError(f"{what}: {err}") from err
        if done.returncode != 0:
            # nvidia-smi prints some refusals on stdout, so fall back to it.
            said = (done.stderr.strip() or done.stdout.strip())[:500]
            raise NvmlQueryError(f"{what}: exit status {done.returncode}: {said}")
        return done.stdout

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

"""The simulated backend: a fake NVML library fed by GPU profiles.

The fake implements ``NvmlLibrary``, so a simulated node goes through the same
``discover()`` as a real one; only the numbers come from
``drasil.driver.discovery.gpucatalog``. Profile specs are ``name:count`` entries, comma
separated: ``h100-80gb:8``, ``a100-40gb-mig:2``, ``h100-80gb:4,l4:2`` (a bare name
means one GPU). GPUs are numbered across entries in order.

Everything is a pure function of the spec and the node name: UUIDs (``GPU-…``,
``MIG-…``) are name-based UUIDs of node, index and instance ids; PCI bus ids follow a
DGX-like layout (two GPUs per root complex, eight per PCI domain); the first half of
the GPUs sits on NUMA node 0, the rest on node 1. Simulated GPUs have no device nodes.

Fault injection for tests and demos: ``fail_init``, ``fail_device`` (one call of one
GPU or MIG device raises) and ``inject_xid`` (delivers an XID event to event sets
registered for the device).
"""

from __future__ import annotations

import queue
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from drasil.driver.discovery.gpucatalog import PROFILES, GpuModel, MigInstance
from drasil.driver.discovery.nvml import (
    EVENT_TYPE_XID_CRITICAL_ERROR,
    NO_INSTANCE,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    ComputeInstance,
    DeviceAttributes,
    DeviceHandle,
    EventData,
    EventSet,
    GpuInstance,
    GpuInstanceProfile,
    MigMode,
    NvmlLibrary,
    NvmlNotFound,
    NvmlNotSupported,
    NvmlQueryError,
    NvmlUnavailable,
    Placement,
)

MAX_SIMULATED_GPUS = 64
DRIVER_VERSION = "580.95.05"
CUDA_DRIVER_VERSION = 13000  # CUDA 13.0, as nvmlSystemGetCudaDriverVersion encodes it

# A fixed namespace makes the UUIDs stable across releases, not only across runs.
_UUID_NAMESPACE = uuid.UUID("5f1d3a52-8a0e-4c8f-9a57-64726173696c")
# DGX-like bus numbers: pairs of GPUs behind one root complex.
_BUSES = (0x19, 0x1B, 0x3B, 0x3D, 0x99, 0x9B, 0xBB, 0xBD)
_ROOTS = (0x18, 0x18, 0x3A, 0x3A, 0x98, 0x98, 0xBA, 0xBA)


class ProfileSpecError(ValueError):
    """A ``--profile`` spec that names no known profile or a bad count."""


@dataclass(frozen=True)
class FakeMig:
    """One MIG device of a simulated GPU."""

    instance: MigInstance
    uuid: str


@dataclass(frozen=True)
class FakeGpu:
    """One simulated GPU and everything NVML would report about it."""

    index: int
    model: GpuModel
    uuid: str
    minor: int
    pci_bus_id: str  # NVML's spelling: 00000000:3B:00.0
    pcie_root: str
    numa_node: int
    migs: tuple[FakeMig, ...] = ()


@dataclass(frozen=True)
class _Handle:
    gpu: int
    mig: int | None = None


@dataclass
class _EventSet:
    registered: dict[int, int] = field(default_factory=dict)  # gpu index → event mask
    events: queue.Queue[EventData] = field(default_factory=queue.Queue)


def _spec_entry(text: str) -> tuple[str, int]:
    name, sep, count_text = text.partition(":")
    name = name.strip()
    if name not in PROFILES:
        available = ", ".join(sorted(PROFILES))
        raise ProfileSpecError(f'unknown profile "{name}"; available: {available}')
    if not sep:
        return name, 1
    try:
        count = int(count_text.strip())
    except ValueError:
        raise ProfileSpecError(
            f'bad count "{count_text}" for profile "{name}": expected a whole number'
        ) from None
    if not 1 <= count <= MAX_SIMULATED_GPUS:
        raise ProfileSpecError(
            f'bad count {count} for profile "{name}": must be 1 to {MAX_SIMULATED_GPUS}'
        )
    return name, count


def parse_profile_spec(spec: str) -> list[tuple[str, int]]:
    """``h100-80gb:4,l4:2`` → ``[("h100-80gb", 4), ("l4", 2)]``, or ProfileSpecError."""
    entries = [part for part in spec.split(",") if part.strip()]
    if not entries:
        available = ", ".join(sorted(PROFILES))
        raise ProfileSpecError(f"empty profile spec; use name:count with one of: {available}")
    parsed = [_spec_entry(part) for part in entries]
    total = sum(count for _, count in parsed)
    if total > MAX_SIMULATED_GPUS:
        raise ProfileSpecError(
            f"profile spec {spec!r} asks for {total} GPUs; at most {MAX_SIMULATED_GPUS}"
        )
    return parsed


def _uuid(prefix: str, *parts: object) -> str:
    return f"{prefix}-{uuid.uuid5(_UUID_NAMESPACE, '/'.join(str(p) for p in parts))}"


def _fake_gpu(*, node_name: str, index: int, total: int, model: GpuModel) -> FakeGpu:
    domain, slot = divmod(index, len(_BUSES))
    migs = tuple(
        FakeMig(m, _uuid("MIG", node_name, index, m.gpu_instance_id, m.compute_instance_id))
        for m in model.mig_layout
    )
    return FakeGpu(
        index=index,
        model=model,
        uuid=_uuid("GPU", node_name, index),
        minor=index,
        pci_bus_id=f"{domain:08X}:{_BUSES[slot]:02X}:00.0",
        pcie_root=f"pci{domain:04x}:{_ROOTS[slot]:02x}",
        numa_node=0 if index < (total + 1) // 2 else 1,
        migs=migs,
    )


def simulated_gpus(profile_spec: str, *, node_name: str) -> list[FakeGpu]:
    """The GPUs of a profile spec on one node (see the module docstring)."""
    models = [
        PROFILES[name] for name, count in parse_profile_spec(profile_spec) for _ in range(count)
    ]
    return [
        _fake_gpu(node_name=node_name, index=i, total=len(models), model=model)
        for i, model in enumerate(models)
    ]


def simulated_library(
    profile_spec: str, *, node_name: str, state_file: Path | None = None
) -> FakeNvml:
    """A fake NVML library for the GPUs of ``profile_spec`` (an ``NvmlLibrary``)."""
    del state_file  # TODO(issue 15): MIG state kept in this file
    return FakeNvml(simulated_gpus(profile_spec, node_name=node_name))


class FakeNvml:
    """An ``NvmlLibrary`` answering from ``FakeGpu`` records, with fault injection."""

    def __init__(
        self,
        gpus: Sequence[FakeGpu],
        *,
        driver_version: str = DRIVER_VERSION,
        cuda_driver_version: int = CUDA_DRIVER_VERSION,
    ) -> None:
        self.gpus = tuple(gpus)
        self.driver_version = driver_version
        self.cuda_driver_version = cuda_driver_version
        self.initialized = 0
        self._init_failure: str | None = None
        self._faults: dict[tuple[int, int | None, str], str] = {}
        self._event_sets: list[_EventSet] = []
        self._lock = threading.Lock()

    # -- fault injection ------------------------------------------------------------

    def fail_init(self, message: str = "NVML Shared Library Not Found") -> None:
        """Make ``init`` raise NvmlUnavailable, as on a host without a usable driver."""
        self._init_failure = message

    def fail_device(
        self,
        index: int,
        *,
        call: str = "device_uuid",
        mig: int | None = None,
        message: str = "GPU is lost",
    ) -> None:
        """Make one call (a method name) of GPU ``index`` or of its MIG slot ``mig`` fail."""
        if not callable(getattr(NvmlLibrary, call, None)):
            raise ValueError(f"{call!r} is not an NvmlLibrary method")
        self._faults[(index, mig, call)] = message

    def clear_faults(self) -> None:
        self._init_failure = None
        self._faults.clear()

    def inject_xid(self, index: int, xid: int, *, mig: int | None = None) -> int:
        """Deliver an XID event for a GPU (or its MIG slot); returns how many sets got it."""
        gpu = self._gpu(_Handle(index))
        gi = ci = NO_INSTANCE
        if mig is not None:
            instance = gpu.migs[mig].instance
            gi, ci = instance.gpu_instance_id, instance.compute_instance_id
        event = EventData(
            device=_Handle(index),
            event_type=EVENT_TYPE_XID_CRITICAL_ERROR,
            event_data=xid,
            gpu_instance_id=gi,
            compute_instance_id=ci,
        )
        with self._lock:
            targets = [
                s
                for s in self._event_sets
                if s.registered.get(index, 0) & EVENT_TYPE_XID_CRITICAL_ERROR
            ]
        for event_set in targets:
            event_set.events.put(event)
        return len(targets)

    # -- helpers ----------------------------------------------------------------------

    def _check(self, handle: _Handle, call: str) -> None:
        message = self._faults.get((handle.gpu, handle.mig, call))
        if message is not None:
            raise NvmlQueryError(f"{call}: {message}", code=NVML_ERROR_GPU_IS_LOST)

    def _handle(self, handle: DeviceHandle, call: str) -> _Handle:
        if not isinstance(handle, _Handle) or not 0 <= handle.gpu < len(self.gpus):
            raise NvmlQueryError(f"{call}: not a handle of this library")
        self._check(handle, call)
        return handle

    def _gpu(self, handle: _Handle) -> FakeGpu:
        return self.gpus[handle.gpu]

    def _mig(self, handle: DeviceHandle, call: str) -> FakeMig:
        h = self._handle(handle, call)
        if h.mig is None:
            raise NvmlQueryError(f"{call}: not a MIG device handle")
        return self._gpu(h).migs[h.mig]

    def _full(self, handle: DeviceHandle, call: str) -> FakeGpu:
        return self._gpu(self._handle(handle, call))

    # -- NvmlLibrary --------------------------------------------------------------------

    def init(self) -> None:
        if self._init_failure is not None:
            raise NvmlUnavailable(f"NVML is unavailable (simulated): {self._init_failure}")
        self.initialized += 1

    def shutdown(self) -> None:
        self.initialized = max(0, self.initialized - 1)

    def system_driver_version(self) -> str:
        return self.driver_version

    def system_cuda_driver_version(self) -> int:
        return self.cuda_driver_version

    def device_count(self) -> int:
        return len(self.gpus)

    def device_handle_by_index(self, index: int) -> DeviceHandle:
        return self._handle(_Handle(index), "device_handle_by_index")

    def device_name(self, handle: DeviceHandle) -> str:
        return self._full(handle, "device_name").model.product_name

    def device_uuid(self, handle: DeviceHandle) -> str:
        h = self._handle(handle, "device_uuid")
        gpu = self._gpu(h)
        return gpu.uuid if h.mig is None else gpu.migs[h.mig].uuid

    def device_minor_number(self, handle: DeviceHandle) -> int:
        return self._full(handle, "device_minor_number").minor

    def device_memory_total(self, handle: DeviceHandle) -> int:
        h = self._handle(handle, "device_memory_total")
        gpu = self._gpu(h)
        mib = gpu.model.memory_mib if h.mig is None else gpu.migs[h.mig].instance.profile.memory_mib
        return mib * 2**20

    def device_pci_bus_id(self, handle: DeviceHandle) -> str:
        return self._full(handle, "device_pci_bus_id").pci_bus_id

    def device_cuda_compute_capability(self, handle: DeviceHandle) -> tuple[int, int]:
        return self._full(handle, "device_cuda_compute_capability").model.compute_capability

    def device_brand(self, handle: DeviceHandle) -> int:
        return self._full(handle, "device_brand").model.brand

    def device_architecture(self, handle: DeviceHandle) -> int:
        return self._full(handle, "device_architecture").model.architecture

    def device_numa_node(self, handle: DeviceHandle) -> int | None:
        return self._full(handle, "device_numa_node").numa_node

    def device_mig_mode(self, handle: DeviceHandle) -> MigMode:
        model = self._full(handle, "device_mig_mode").model
        if not model.mig_capable:
            raise NvmlNotSupported("device_mig_mode: Not Supported", code=NVML_ERROR_NOT_SUPPORTED)
        return MigMode(current=model.mig_enabled, pending=model.mig_enabled)

    def device_max_mig_device_count(self, handle: DeviceHandle) -> int:
        return self._full(handle, "device_max_mig_device_count").model.max_mig_devices

    def device_mig_device_handle_by_index(self, handle: DeviceHandle, index: int) -> DeviceHandle:
        gpu = self._full(handle, "device_mig_device_handle_by_index")
        if not 0 <= index < len(gpu.migs):
            raise NvmlNotFound(
                f"device_mig_device_handle_by_index({index}): Not Found", code=NVML_ERROR_NOT_FOUND
            )
        return self._handle(_Handle(gpu.index, index), "device_mig_device_handle_by_index")

    def device_gpu_instance_id(self, handle: DeviceHandle) -> int:
        return self._mig(handle, "device_gpu_instance_id").instance.gpu_instance_id

    def device_compute_instance_id(self, handle: DeviceHandle) -> int:
        return self._mig(handle, "device_compute_instance_id").instance.compute_instance_id

    def device_attributes(self, handle: DeviceHandle) -> DeviceAttributes:
        profile = self._mig(handle, "device_attributes").instance.profile
        return DeviceAttributes(
            multiprocessor_count=profile.multiprocessors,
            copy_engine_count=profile.copy_engines,
            decoder_count=profile.decoders,
            encoder_count=profile.encoders,
            jpeg_count=profile.jpeg_engines,
            ofa_count=profile.ofa_engines,
            gpu_instance_slice_count=profile.gpu_slices,
            compute_instance_slice_count=profile.gpu_slices,
            memory_size_mib=profile.memory_mib,
        )

    def device_parent_handle(self, handle: DeviceHandle) -> DeviceHandle:
        h = self._handle(handle, "device_parent_handle")
        if h.mig is None:
            raise NvmlQueryError("device_parent_handle: not a MIG device handle")
        return _Handle(h.gpu)

    # -- MIG management: placeholders until issue 15's implementation lands -------------

    def device_set_mig_mode(self, handle: DeviceHandle, enabled: bool) -> MigMode:
        raise NvmlNotSupported("device_set_mig_mode: not implemented yet")

    def gpu_instance_profiles(self, handle: DeviceHandle) -> tuple[GpuInstanceProfile, ...]:
        raise NvmlNotSupported("gpu_instance_profiles: not implemented yet")

    def gpu_instance_placements(
        self, handle: DeviceHandle, profile_id: int
    ) -> tuple[Placement, ...]:
        raise NvmlNotSupported("gpu_instance_placements: not implemented yet")

    def gpu_instances(self, handle: DeviceHandle) -> tuple[GpuInstance, ...]:
        raise NvmlNotSupported("gpu_instances: not implemented yet")

    def create_gpu_instance(
        self, handle: DeviceHandle, profile_id: int, placement: Placement
    ) -> GpuInstance:
        raise NvmlNotSupported("create_gpu_instance: not implemented yet")

    def destroy_gpu_instance(self, handle: DeviceHandle, gpu_instance_id: int) -> None:
        raise NvmlNotSupported("destroy_gpu_instance: not implemented yet")

    def compute_instances(
        self, handle: DeviceHandle, gpu_instance_id: int
    ) -> tuple[ComputeInstance, ...]:
        raise NvmlNotSupported("compute_instances: not implemented yet")

    def create_compute_instance(
        self, handle: DeviceHandle, gpu_instance_id: int
    ) -> ComputeInstance:
        raise NvmlNotSupported("create_compute_instance: not implemented yet")

    def destroy_compute_instance(
        self, handle: DeviceHandle, gpu_instance_id: int, compute_instance_id: int
    ) -> None:
        raise NvmlNotSupported("destroy_compute_instance: not implemented yet")

    def mig_device_nodes(
        self, minor: int, gpu_instance_id: int, compute_instance_id: int
    ) -> tuple[str, ...]:
        return ()

    def event_set_create(self) -> EventSet:
        event_set = _EventSet()
        with self._lock:
            self._event_sets.append(event_set)
        return event_set

    def device_register_events(
        self, handle: DeviceHandle, event_types: int, event_set: EventSet
    ) -> None:
        h = self._handle(handle, "device_register_events")
        target = self._event_set(event_set, "device_register_events")
        with self._lock:
            target.registered[h.gpu] = target.registered.get(h.gpu, 0) | event_types

    def event_set_wait(self, event_set: EventSet, timeout_ms: int) -> EventData | None:
        target = self._event_set(event_set, "event_set_wait")
        try:
            return target.events.get(timeout=max(timeout_ms, 0) / 1000)
        except queue.Empty:
            return None

    def event_set_free(self, event_set: EventSet) -> None:
        target = self._event_set(event_set, "event_set_free")
        with self._lock:
            self._event_sets = [s for s in self._event_sets if s is not target]

    def _event_set(self, event_set: EventSet, call: str) -> _EventSet:
        if not isinstance(event_set, _EventSet):
            raise NvmlQueryError(f"{call}: not an event set of this library")
        return event_set

    def pcie_root(self, pci_bus_id: str) -> str | None:
        for gpu in self.gpus:
            domain, bus, rest = gpu.pci_bus_id.split(":")
            if f"{int(domain, 16):04x}:{bus.lower()}:{rest.lower()}" == pci_bus_id:
                return gpu.pcie_root
        return None

    def device_nodes(self, minor: int) -> tuple[str, ...]:
        return ()

    def control_device_nodes(self) -> tuple[str, ...]:
        return ()

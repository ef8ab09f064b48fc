"""The simulated backend: a fake NVML library fed by GPU profiles.

The fake implements ``NvmlLibrary``, so a simulated node goes through the same
``discover()`` as a real one; only the numbers come from
``drasil.driver.nvidia.gpucatalog``. Profile specs are ``name:count`` entries, comma
separated: ``h100-80gb:8``, ``a100-40gb-mig:2``, ``h100-80gb:4,l4:2`` (a bare name
means one GPU). GPUs are numbered across entries in order.

Everything is a pure function of the spec and the node name: UUIDs (``GPU-…``,
``MIG-…``) are name-based UUIDs of node, index and instance ids; PCI bus ids follow a
DGX-like layout (two GPUs per root complex, eight per PCI domain); the first half of
the GPUs sits on NUMA node 0, the rest on node 1. Simulated GPUs have no device nodes.

MIG is simulated as NVML does it, from the catalogue's profile and placement tables
alone: MIG mode can be switched, GPU instances created at a placement and destroyed,
one compute instance spanning each GPU instance created and destroyed, and the MIG
devices NVML enumerates are the compute instances that exist. ``create_gpu_instance``
fails with INSUFFICIENT_RESOURCES when the placement overlaps an instance's memory
slices, the profile's instances are used up or the compute slices are; with
INVALID_ARGUMENT for a profile or placement the GPU does not have; NOT_SUPPORTED with
MIG mode off. Destroying a GPU instance that holds a compute instance, or turning MIG
mode off while instances exist, is IN_USE. GPU instance ids are NVML's
(``gpucatalog.gpu_instance_id_at``), compute instance ids 0. ``*-mig`` profiles start
with their fixed layout.

Time slice. Every GPU has the compute time slice ``nvidia-smi compute-policy
--set-timeslice`` sets on hardware (0 default, 1 short, 2 medium, 3 long), 0 at start;
``device_set_time_slice`` changes it and ``device_time_slice`` reads it back, so tests
see what a claim's TimeSlicing config did to the GPU. MIG devices have none of their
own (NOT_SUPPORTED).

Compute mode. Every GPU has the ``nvmlComputeMode_t`` ``nvmlDeviceSetComputeMode`` sets
(0 default, 1 exclusive thread, 2 prohibited, 3 exclusive process), 0 at start;
``device_set_compute_mode`` changes it and ``device_compute_mode`` reads it back. Like
the time slice it belongs to the whole GPU: a MIG device's handle is NOT_SUPPORTED.

State file. With ``state_file``, MIG mode, instances, time slices and compute modes live
in a JSON file that outlives the process, as a real GPU's state outlives the plugin:
every change is written (``write_atomic``) under a ``FileLock`` on ``<file>.lock`` after
re-reading the file, and every query re-reads it when it changed, so the plugin and
``drasil discover`` share one GPU (and so does the mock NVML of ``e2e/mocknvml``). The
file::

    {"version": 1, "bootId": "<boot id>",
     "gpus": {"GPU-<uuid>": {"migEnabled": true,
                             "gpuInstances": [{"id": 2, "profileId": 9, "start": 4,
                                               "size": 4, "computeInstances": [0]}],
                             "timeSlice": 2, "computeMode": 3}}}

MIG-capable GPUs always have an entry; other GPUs only while their time slice or compute
mode is not the default, and ``timeSlice`` and ``computeMode`` are left out when they
are 0 (files of earlier versions read the same). A file from another boot (the node
rebooted) keeps MIG mode and loses the instances, time slices and compute modes, as a
GPU loses its compute policy and compute mode at a reboot.
A damaged file is logged and ignored: the GPUs start as if there were none (the
profile's own MIG mode and layout).

Fault injection for tests and demos: ``fail_init``, ``fail_device`` (one call of one
GPU or MIG device raises), ``fail_next`` (the next call of a MIG management method
raises an NVML code, before or after taking effect; the time slice and compute mode
calls too) and ``inject_xid`` (delivers an XID event to event sets registered for the
device).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from drasil.driver.checkpoint import read_boot_id
from drasil.driver.devices import CharDevice
from drasil.driver.files import FileLock, write_atomic
from drasil.driver.nvidia.gpucatalog import (
    PROFILES,
    GpuModel,
    MigLayoutEntry,
    MigProfile,
    gpu_instance_id_at,
)
from drasil.driver.nvidia.nvml import (
    ARCH_AMPERE,
    COMPUTE_MODE_DEFAULT,
    COMPUTE_MODE_NAMES,
    EVENT_TYPE_XID_CRITICAL_ERROR,
    NO_INSTANCE,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_IN_USE,
    NVML_ERROR_INSUFFICIENT_RESOURCES,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_RESET_REQUIRED,
    NVML_ERROR_UNINITIALIZED,
    TIME_SLICE_DEFAULT,
    TIME_SLICE_NAMES,
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
    check_compute_mode,
    check_time_slice,
    error_for_code,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

MAX_SIMULATED_GPUS = 64
DRIVER_VERSION = "580.95.05"
CUDA_DRIVER_VERSION = 13000  # CUDA 13.0, as nvmlSystemGetCudaDriverVersion encodes it
STATE_VERSION = 1

MIG_CALLS = frozenset(
    {
        "device_set_mig_mode",
        "gpu_instance_profiles",
        "gpu_instance_placements",
        "gpu_instances",
        "create_gpu_instance",
        "destroy_gpu_instance",
        "compute_instances",
        "create_compute_instance",
        "destroy_compute_instance",
        "mig_device_nodes",
    }
)
"""The MIG management methods ``fail_next`` can make fail."""

TIME_SLICE_CALLS = frozenset({"device_time_slice", "device_set_time_slice"})
"""The time slice methods ``fail_next`` can make fail too."""

COMPUTE_MODE_CALLS = frozenset({"device_compute_mode", "device_set_compute_mode"})
"""The compute mode methods ``fail_next`` can make fail too."""

_FAILABLE_CALLS = MIG_CALLS | TIME_SLICE_CALLS | COMPUTE_MODE_CALLS

# NVML's compute instance profile id of the profile spanning a GPU instance of this
# many compute slices (NVML_COMPUTE_INSTANCE_PROFILE_<n>_SLICE; -cci prints it).
_COMPUTE_PROFILE_IDS = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4, 8: 5, 6: 6}

# A fixed namespace makes the UUIDs stable across releases, not only across runs.
_UUID_NAMESPACE = uuid.UUID("5f1d3a52-8a0e-4c8f-9a57-64726173696c")
# DGX-like bus numbers: pairs of GPUs behind one root complex.
_BUSES = (0x19, 0x1B, 0x3B, 0x3D, 0x99, 0x9B, 0xBB, 0xBD)
_ROOTS = (0x18, 0x18, 0x3A, 0x3A, 0x98, 0x98, 0xBA, 0xBA)


class ProfileSpecError(ValueError):
    """A ``--profile`` spec that names no known profile or a bad count."""


@dataclass(frozen=True)
class FakeMig:
    """One MIG device of a simulated GPU's initial layout."""

    instance: MigLayoutEntry
    uuid: str


@dataclass(frozen=True)
class FakeGpu:
    """One simulated GPU and everything NVML would report about it.

    ``migs`` is the layout it starts with; ``FakeNvml`` keeps the MIG state that
    changes.
    """

    index: int
    model: GpuModel
    uuid: str
    minor: int
    pci_bus_id: str  # NVML's spelling: 00000000:3B:00.0
    pcie_root: str
    numa_node: int
    migs: tuple[FakeMig, ...] = ()
    node_name: str = ""


@dataclass(frozen=True)
class _Handle:
    """A GPU (``mig`` None) or a MIG device: the slot it was found at, and its ids."""

    gpu: int
    mig: int | None = None
    instance: tuple[int, int] | None = None  # (GPU instance id, compute instance id)


@dataclass
class _EventSet:
    registered: dict[int, int] = field(default_factory=dict)  # gpu index → event mask
    events: queue.Queue[EventData] = field(default_factory=queue.Queue)


@dataclass
class _GpuInstance:
    profile_id: int
    placement: Placement
    compute_instances: set[int] = field(default_factory=set)


@dataclass
class _MigState:
    """One GPU's MIG mode, instances, time slice and compute mode: what survives the
    plugin on real hardware."""

    enabled: bool
    instances: dict[int, _GpuInstance] = field(default_factory=dict)  # by GI id
    time_slice: int = TIME_SLICE_DEFAULT
    compute_mode: int = COMPUTE_MODE_DEFAULT
    # An Ampere GPU's MIG mode after the next reset, when it differs from ``enabled``.
    pending: bool | None = None

    @property
    def mode(self) -> MigMode:
        pending = self.enabled if self.pending is None else self.pending
        return MigMode(current=self.enabled, pending=pending)


@dataclass(frozen=True)
class _Failure:
    code: int
    after: bool
    message: str


class StateFileError(ValueError):
    """A state file that is not what ``FakeNvml`` writes."""


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


def mig_uuid(node_name: str, index: int, gpu_instance_id: int, compute_instance_id: int) -> str:
    """The UUID of a simulated MIG device: the same whenever these ids are recreated."""
    return _uuid("MIG", node_name, index, gpu_instance_id, compute_instance_id)


def _fake_gpu(*, node_name: str, index: int, total: int, model: GpuModel) -> FakeGpu:
    domain, slot = divmod(index, len(_BUSES))
    migs = tuple(
        FakeMig(m, mig_uuid(node_name, index, m.gpu_instance_id, m.compute_instance_id))
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
        node_name=node_name,
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
    """A fake NVML library for the GPUs of ``profile_spec`` (an ``NvmlLibrary``);
    with ``state_file`` its MIG state persists there (see the module docstring)."""
    gpus = simulated_gpus(profile_spec, node_name=node_name)
    return FakeNvml(gpus, state_file=state_file, strict_init=True)


# -- MIG rules: what NVML allows, from the profile tables alone --------------------------


def _fail(call: str, message: str, code: int) -> NvmlQueryError:
    return error_for_code(f"{call}: {message}", code)


def _initial_state(gpu: FakeGpu) -> _MigState:
    instances = {
        m.instance.gpu_instance_id: _GpuInstance(
            m.instance.profile.profile_id,
            m.instance.placement,
            {m.instance.compute_instance_id},
        )
        for m in gpu.migs
    }
    return _MigState(enabled=gpu.model.mig_enabled, instances=instances)


def _profile(gpu: FakeGpu, profile_id: int, call: str) -> MigProfile:
    profile = gpu.model.mig_profile(profile_id)
    if profile is None:
        raise _fail(call, f"no GPU instance profile {profile_id}", NVML_ERROR_INVALID_ARGUMENT)
    return profile


def _check_room(
    gpu: FakeGpu, state: _MigState, profile: MigProfile, placement: Placement, call: str
) -> None:
    """INSUFFICIENT_RESOURCES unless an instance of ``profile`` fits at ``placement``."""
    mine = [gi for gi in state.instances.values() if gi.profile_id == profile.profile_id]
    if len(mine) >= profile.instance_count:
        message = f"all {profile.instance_count} {profile.name} instances exist"
        raise _fail(call, message, NVML_ERROR_INSUFFICIENT_RESOURCES)
    used = {s for gi in state.instances.values() for s in gi.placement.slices}
    if used & set(placement.slices):
        message = f"memory slices {placement.start}:{placement.size} overlap an instance"
        raise _fail(call, message, NVML_ERROR_INSUFFICIENT_RESOURCES)
    compute = sum(_profile(gpu, gi.profile_id, call).gpu_slices for gi in state.instances.values())
    full = gpu.model.full_profile
    if full is not None and compute + profile.gpu_slices > full.gpu_slices:
        raise _fail(call, "no compute slices left", NVML_ERROR_INSUFFICIENT_RESOURCES)


def _gpu_instance_profile(profile: MigProfile) -> GpuInstanceProfile:
    return GpuInstanceProfile(
        profile_id=profile.profile_id,
        name=profile.name,
        slice_count=profile.gpu_slices,
        instance_count=profile.instance_count,
        multiprocessors=profile.multiprocessors,
        copy_engines=profile.copy_engines,
        decoders=profile.decoders,
        encoders=profile.encoders,
        jpeg_engines=profile.jpeg_engines,
        ofa_engines=profile.ofa_engines,
        memory_mib=profile.memory_mib,
    )


# -- the state file -------------------------------------------------------------------------


def _state_json(boot_id: str, gpus: Sequence[FakeGpu], states: Mapping[int, _MigState]) -> bytes:
    doc = {
        "version": STATE_VERSION,
        "bootId": boot_id,
        "gpus": {
            gpu.uuid: _gpu_json(states[gpu.index])
            for gpu in gpus
            if gpu.model.mig_capable or _has_policy(states[gpu.index])
        },
    }
    return json.dumps(doc, indent=2, sort_keys=True).encode() + b"\n"


def _has_policy(state: _MigState) -> bool:
    """Whether a GPU's time slice or compute mode is not the default (what a GPU
    without MIG needs a state file entry for)."""
    return state.time_slice != TIME_SLICE_DEFAULT or state.compute_mode != COMPUTE_MODE_DEFAULT


def _gpu_json(state: _MigState) -> dict[str, Any]:
    entry = _mig_json(state)
    if state.time_slice != TIME_SLICE_DEFAULT:
        entry["timeSlice"] = state.time_slice
    if state.compute_mode != COMPUTE_MODE_DEFAULT:
        entry["computeMode"] = state.compute_mode
    return entry


def _mig_json(state: _MigState) -> dict[str, Any]:
    pending = {} if state.pending is None else {"migPending": state.pending}
    return {
        **pending,
        "migEnabled": state.enabled,
        "gpuInstances": [
            {
                "id": gi_id,
                "profileId": gi.profile_id,
                "start": gi.placement.start,
                "size": gi.placement.size,
                "computeInstances": sorted(gi.compute_instances),
            }
            for gi_id, gi in sorted(state.instances.items())
        ],
    }


def _parse_state(raw: bytes, gpus: Sequence[FakeGpu]) -> tuple[str, dict[int, _MigState]]:
    """The boot id and MIG state of a state file; StateFileError if it is not ours."""
    try:
        doc = json.loads(raw)
        if doc["version"] != STATE_VERSION or not isinstance(doc["bootId"], str):
            raise StateFileError(f"unknown version {doc['version']!r} or boot id")
        entries = doc["gpus"]
        states = {
            gpu.index: _parse_gpu(entries[gpu.uuid], gpu) if gpu.uuid in entries else None
            for gpu in gpus
        }
    except (ValueError, KeyError, TypeError) as err:
        raise StateFileError(str(err) or type(err).__name__) from err
    return doc["bootId"], {i: s if s else _initial_state(gpus[i]) for i, s in states.items()}


def _parse_gpu(entry: Mapping[str, Any], gpu: FakeGpu) -> _MigState:
    time_slice = entry.get("timeSlice", TIME_SLICE_DEFAULT)
    if type(time_slice) is not int or time_slice not in TIME_SLICE_NAMES.values():
        raise StateFileError(f"time slice {time_slice!r}: not 0 to 3")
    compute_mode = entry.get("computeMode", COMPUTE_MODE_DEFAULT)
    if type(compute_mode) is not int or compute_mode not in COMPUTE_MODE_NAMES:
        raise StateFileError(
            f"compute mode {compute_mode!r}: not one of {sorted(COMPUTE_MODE_NAMES)}"
        )
    pending = entry.get("migPending")
    state = _MigState(
        enabled=bool(entry["migEnabled"]),
        time_slice=time_slice,
        compute_mode=compute_mode,
        pending=None if pending is None else bool(pending),
    )
    for item in entry["gpuInstances"]:
        placement = Placement(int(item["start"]), int(item["size"]))
        profile = _profile(gpu, int(item["profileId"]), "state file")
        if placement not in profile.placements or item["id"] != gpu_instance_id_at(placement):
            raise StateFileError(f"GPU instance {item['id']}: not a placement of {profile.name}")
        cis = {int(ci) for ci in item["computeInstances"]}
        state.instances[int(item["id"])] = _GpuInstance(profile.profile_id, placement, cis)
    return state


class FakeNvml:
    """An ``NvmlLibrary`` answering from ``FakeGpu`` records, with fault injection.

    ``boot_id`` is injectable so tests can reboot a node (see the module docstring).
    """

    def __init__(
        self,
        gpus: Sequence[FakeGpu],
        *,
        driver_version: str = DRIVER_VERSION,
        cuda_driver_version: int = CUDA_DRIVER_VERSION,
        state_file: Path | None = None,
        boot_id: Callable[[], str] = read_boot_id,
        strict_init: bool = False,
    ) -> None:
        self.gpus = tuple(gpus)
        self.strict_init = strict_init
        self.driver_version = driver_version
        self.cuda_driver_version = cuda_driver_version
        self.state_file = state_file
        self.initialized = 0
        self._boot_id = boot_id
        self._init_failure: str | None = None
        self._faults: dict[tuple[int, int | None, str], str] = {}
        self._next_failures: dict[str, deque[_Failure]] = {}
        self._event_sets: list[_EventSet] = []
        self._lock = threading.RLock()
        self._states = {gpu.index: _initial_state(gpu) for gpu in self.gpus}
        self._seen: tuple[int, int, int] | None = None  # the state file we last read

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

    def fail_next(
        self,
        call: str,
        code: int = NVML_ERROR_GPU_IS_LOST,
        *,
        after: bool = False,
        message: str = "injected failure",
    ) -> None:
        """Make the next ``call`` (one of ``MIG_CALLS``, ``TIME_SLICE_CALLS`` or
        ``COMPUTE_MODE_CALLS``, on any GPU) raise NVML ``code``.

        With ``after`` the call takes effect first and then raises, like an NVML call
        that did its work but whose caller crashed or timed out before hearing so.
        Several failures of one call queue up in order.
        """
        if call not in _FAILABLE_CALLS:
            raise ValueError(f"{call!r} is not one of {sorted(_FAILABLE_CALLS)}")
        with self._lock:
            self._next_failures.setdefault(call, deque()).append(_Failure(code, after, message))

    def clear_faults(self) -> None:
        self._init_failure = None
        self._faults.clear()
        with self._lock:
            self._next_failures.clear()

    def inject_xid(self, index: int, xid: int, *, mig: int | None = None) -> int:
        """Deliver an XID event for a GPU (or its MIG slot); returns how many sets got it."""
        self._gpu(_Handle(index))
        gi = ci = NO_INSTANCE
        if mig is not None:
            gi, ci = self._slots(index)[mig]
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

    def reset_gpu(self, index: int) -> None:
        """What ``nvidia-smi -r`` does to GPU ``index``: a pending MIG mode takes effect
        and its MIG instances are gone, and so are its time slice and compute mode
        (tests reset an Ampere GPU with this)."""
        gpu = self.gpus[index]
        with self._lock, self._file_lock():
            self._refresh()
            self._states[index] = _MigState(enabled=self._states[index].mode.pending)
            self._save()
        log.info("simulated GPU reset", extra={"gpu": gpu.uuid})

    # -- helpers ----------------------------------------------------------------------

    def _check(self, handle: _Handle, call: str) -> None:
        message = self._faults.get((handle.gpu, handle.mig, call))
        if message is not None:
            raise NvmlQueryError(f"{call}: {message}", code=NVML_ERROR_GPU_IS_LOST)

    def _live(self, call: str) -> None:
        """NVML answers UNINITIALIZED after the last ``nvmlShutdown``; so does a
        strict fake, which is what the plugin and the CLI run on."""
        if self.strict_init and self.initialized <= 0:
            raise NvmlQueryError(f"{call}: Uninitialized", code=NVML_ERROR_UNINITIALIZED)

    def _handle(self, handle: DeviceHandle, call: str) -> _Handle:
        self._live(call)
        if not isinstance(handle, _Handle) or not 0 <= handle.gpu < len(self.gpus):
            raise NvmlQueryError(f"{call}: not a handle of this library")
        self._check(handle, call)
        return handle

    def _gpu(self, handle: _Handle) -> FakeGpu:
        return self.gpus[handle.gpu]

    def _mig(self, handle: DeviceHandle, call: str) -> tuple[FakeGpu, int, int, MigProfile]:
        """The GPU, ids and profile of a MIG device that still exists."""
        h = self._handle(handle, call)
        if h.instance is None:
            raise NvmlQueryError(f"{call}: not a MIG device handle")
        gpu = self._gpu(h)
        gi_id, ci_id = h.instance
        with self._lock:
            self._refresh()
            gi = self._states[gpu.index].instances.get(gi_id)
            if gi is None or ci_id not in gi.compute_instances:
                raise NvmlNotFound(
                    f"{call}: MIG device {gi_id}/{ci_id} is gone", code=NVML_ERROR_NOT_FOUND
                )
            return gpu, gi_id, ci_id, _profile(gpu, gi.profile_id, call)

    def _full(self, handle: DeviceHandle, call: str) -> FakeGpu:
        return self._gpu(self._handle(handle, call))

    def _mig_gpu(self, handle: DeviceHandle, call: str) -> FakeGpu:
        """A full GPU that has MIG at all (NOT_SUPPORTED otherwise, as NVML answers)."""
        gpu = self._full(handle, call)
        if not gpu.model.mig_capable:
            raise NvmlNotSupported(f"{call}: Not Supported", code=NVML_ERROR_NOT_SUPPORTED)
        return gpu

    def _mig_on(self, gpu: FakeGpu, call: str) -> _MigState:
        """The GPU's MIG state; NOT_SUPPORTED when MIG mode is off, which is what nvml.h
        documents for instance calls on a GPU without MIG mode enabled."""
        state = self._states[gpu.index]
        if not state.enabled:
            raise _fail(call, "MIG mode is disabled", NVML_ERROR_NOT_SUPPORTED)
        return state

    def _gpu_instance(self, gpu: FakeGpu, gpu_instance_id: int, call: str) -> _GpuInstance:
        gi = self._mig_on(gpu, call).instances.get(gpu_instance_id)
        if gi is None:
            raise _fail(call, f"no GPU instance {gpu_instance_id}", NVML_ERROR_NOT_FOUND)
        return gi

    def _slots(self, index: int) -> list[tuple[int, int]]:
        """The MIG devices NVML enumerates: compute instances, by GI then CI id."""
        with self._lock:
            self._refresh()
            state = self._states[index]
            if not state.enabled:
                return []
            return sorted(
                (gi_id, ci_id)
                for gi_id, gi in state.instances.items()
                for ci_id in gi.compute_instances
            )

    def _mig_uuid(self, gpu: FakeGpu, gi: int, ci: int) -> str:
        for mig in gpu.migs:  # the initial layout may carry UUIDs of its own
            if (mig.instance.gpu_instance_id, mig.instance.compute_instance_id) == (gi, ci):
                return mig.uuid
        return mig_uuid(gpu.node_name, gpu.index, gi, ci)

    # -- MIG state: calls, injected failures, the state file ---------------------------

    def _injected(self, call: str, *, after: bool) -> None:
        with self._lock:
            pending = self._next_failures.get(call)
            if not pending or pending[0].after != after:
                return
            failure = pending.popleft()
        raise _fail(call, failure.message, failure.code)

    def _query(self, call: str, answer: Callable[[], T]) -> T:
        """A MIG query on fresh state, with its injected failures."""
        self._injected(call, after=False)
        with self._lock:
            self._refresh()
            result = answer()
        self._injected(call, after=True)
        return result

    def _change(self, call: str, change: Callable[[], T]) -> T:
        """A MIG change: read-modify-write of the state file under its lock."""
        self._injected(call, after=False)
        with self._lock, self._file_lock():
            self._refresh()
            result = change()
            self._save()
        self._injected(call, after=True)
        return result

    def _file_lock(self) -> FileLock | nullcontext[None]:
        if self.state_file is None:
            return nullcontext()
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        return FileLock(self.state_file.with_name(f"{self.state_file.name}.lock"))

    def _refresh(self) -> None:
        """Re-read the state file when it changed since we last read or wrote it."""
        if self.state_file is None:
            return
        try:
            st = self.state_file.stat()
        except FileNotFoundError:
            signature = None
        else:
            signature = (st.st_ino, st.st_mtime_ns, st.st_size)
        if signature == self._seen:
            return
        self._seen = signature
        if signature is None:
            self._states = {gpu.index: _initial_state(gpu) for gpu in self.gpus}
            return
        self._states = self._load(self.state_file)

    def _load(self, path: Path) -> dict[int, _MigState]:
        try:
            boot_id, states = _parse_state(path.read_bytes(), self.gpus)
        except (OSError, StateFileError) as err:
            log.error(
                "simulated GPU state file is damaged; starting without its MIG state",
                extra={"path": str(path), "error": str(err)},
            )
            return {gpu.index: _initial_state(gpu) for gpu in self.gpus}
        if boot_id != self._boot_id():
            # A reboot: GPU instances, time slices and compute modes are gone, the MIG
            # mode setting is not.
            log.info(
                "simulated GPUs rebooted: MIG instances, time slices and compute modes dropped",
                extra={"path": str(path)},
            )
            # A reset applies a pending mode (Ampere).
            return {i: _MigState(enabled=s.mode.pending) for i, s in states.items()}
        return states

    def _save(self) -> None:
        if self.state_file is None:
            return
        data = _state_json(self._boot_id(), self.gpus, self._states)
        # Not durable: a real GPU loses its instances on power loss too, and the boot
        # id in the file makes the next boot drop them anyway.
        write_atomic(self.state_file, data, crash_tag="simulated-gpus", durable=False)
        st = self.state_file.stat()
        self._seen = (st.st_ino, st.st_mtime_ns, st.st_size)

    # -- NvmlLibrary --------------------------------------------------------------------

    def init(self) -> None:
        if self._init_failure is not None:
            raise NvmlUnavailable(f"NVML is unavailable (simulated): {self._init_failure}")
        self.initialized += 1

    def shutdown(self) -> None:
        self.initialized = max(0, self.initialized - 1)

    def system_driver_version(self) -> str:
        self._live("system_driver_version")
        return self.driver_version

    def system_cuda_driver_version(self) -> int:
        self._live("system_cuda_driver_version")
        return self.cuda_driver_version

    def device_count(self) -> int:
        self._live("device_count")
        return len(self.gpus)

    def device_handle_by_index(self, index: int) -> DeviceHandle:
        return self._handle(_Handle(index), "device_handle_by_index")

    def device_name(self, handle: DeviceHandle) -> str:
        return self._full(handle, "device_name").model.product_name

    def device_uuid(self, handle: DeviceHandle) -> str:
        h = self._handle(handle, "device_uuid")
        if h.instance is None:
            return self._gpu(h).uuid
        gpu, gi, ci, _ = self._mig(handle, "device_uuid")
        return self._mig_uuid(gpu, gi, ci)

    def device_minor_number(self, handle: DeviceHandle) -> int:
        return self._full(handle, "device_minor_number").minor

    def device_memory_total(self, handle: DeviceHandle) -> int:
        h = self._handle(handle, "device_memory_total")
        if h.instance is None:
            return self._gpu(h).model.memory_mib * 2**20
        return self._mig(handle, "device_memory_total")[3].memory_mib * 2**20

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
        gpu = self._mig_gpu(handle, "device_mig_mode")
        with self._lock:
            self._refresh()
            return self._states[gpu.index].mode

    def device_max_mig_device_count(self, handle: DeviceHandle) -> int:
        return self._full(handle, "device_max_mig_device_count").model.max_mig_devices

    def device_mig_device_handle_by_index(self, handle: DeviceHandle, index: int) -> DeviceHandle:
        gpu = self._full(handle, "device_mig_device_handle_by_index")
        slots = self._slots(gpu.index)
        if not 0 <= index < len(slots):
            raise NvmlNotFound(
                f"device_mig_device_handle_by_index({index}): Not Found", code=NVML_ERROR_NOT_FOUND
            )
        mig = _Handle(gpu.index, index, slots[index])
        return self._handle(mig, "device_mig_device_handle_by_index")

    def device_gpu_instance_id(self, handle: DeviceHandle) -> int:
        return self._mig(handle, "device_gpu_instance_id")[1]

    def device_compute_instance_id(self, handle: DeviceHandle) -> int:
        return self._mig(handle, "device_compute_instance_id")[2]

    def device_attributes(self, handle: DeviceHandle) -> DeviceAttributes:
        profile = self._mig(handle, "device_attributes")[3]
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
        if h.instance is None:
            raise NvmlQueryError("device_parent_handle: not a MIG device handle")
        return _Handle(h.gpu)

    # -- MIG management -------------------------------------------------------------------

    def device_set_mig_mode(self, handle: DeviceHandle, enabled: bool) -> MigMode:
        gpu = self._mig_gpu(handle, "device_set_mig_mode")

        def change() -> MigMode:
            state = self._states[gpu.index]
            if not enabled and state.instances:
                message = "GPU instances exist; destroy them first"
                raise _fail("device_set_mig_mode", message, NVML_ERROR_IN_USE)
            if gpu.model.architecture == ARCH_AMPERE:
                # Ampere changes MIG mode only at a GPU reset; NVML keeps it pending.
                state.pending = None if enabled == state.enabled else enabled
            else:
                state.enabled, state.pending = enabled, None
            return state.mode

        mode = self._change("device_set_mig_mode", change)
        if mode.current != enabled:  # NVML's activationStatus, which the adapter raises
            message = "the change takes effect at the next GPU reset"
            raise _fail("device_set_mig_mode", message, NVML_ERROR_RESET_REQUIRED)
        return mode

    def gpu_instance_profiles(self, handle: DeviceHandle) -> tuple[GpuInstanceProfile, ...]:
        gpu = self._mig_gpu(handle, "gpu_instance_profiles")
        profiles = tuple(_gpu_instance_profile(p) for p in gpu.model.mig_profiles)
        return self._query("gpu_instance_profiles", lambda: profiles)

    def gpu_instance_placements(
        self, handle: DeviceHandle, profile_id: int
    ) -> tuple[Placement, ...]:
        call = "gpu_instance_placements"
        gpu = self._mig_gpu(handle, call)
        return self._query(call, lambda: _profile(gpu, profile_id, call).placements)

    def gpu_instances(self, handle: DeviceHandle) -> tuple[GpuInstance, ...]:
        gpu = self._mig_gpu(handle, "gpu_instances")

        def answer() -> tuple[GpuInstance, ...]:
            state = self._mig_on(gpu, "gpu_instances")
            return tuple(
                GpuInstance(gi_id, gi.profile_id, gi.placement)
                for gi_id, gi in sorted(state.instances.items())
            )

        return self._query("gpu_instances", answer)

    def create_gpu_instance(
        self, handle: DeviceHandle, profile_id: int, placement: Placement
    ) -> GpuInstance:
        call = "create_gpu_instance"
        gpu = self._mig_gpu(handle, call)

        def change() -> GpuInstance:
            state = self._mig_on(gpu, call)
            profile = _profile(gpu, profile_id, call)
            if placement not in profile.placements:
                message = f"{profile.name} has no placement {placement.start}:{placement.size}"
                raise _fail(call, message, NVML_ERROR_INVALID_ARGUMENT)
            _check_room(gpu, state, profile, placement, call)
            gi_id = gpu_instance_id_at(placement)
            state.instances[gi_id] = _GpuInstance(profile_id, placement)
            return GpuInstance(gi_id, profile_id, placement)

        return self._change(call, change)

    def destroy_gpu_instance(self, handle: DeviceHandle, gpu_instance_id: int) -> None:
        call = "destroy_gpu_instance"
        gpu = self._mig_gpu(handle, call)

        def change() -> None:
            gi = self._gpu_instance(gpu, gpu_instance_id, call)
            if gi.compute_instances:
                message = f"GPU instance {gpu_instance_id} holds compute instances"
                raise _fail(call, message, NVML_ERROR_IN_USE)
            del self._states[gpu.index].instances[gpu_instance_id]

        self._change(call, change)

    def compute_instances(
        self, handle: DeviceHandle, gpu_instance_id: int
    ) -> tuple[ComputeInstance, ...]:
        call = "compute_instances"
        gpu = self._mig_gpu(handle, call)

        def answer() -> tuple[ComputeInstance, ...]:
            gi = self._gpu_instance(gpu, gpu_instance_id, call)
            profile_id = _COMPUTE_PROFILE_IDS[_profile(gpu, gi.profile_id, call).gpu_slices]
            return tuple(ComputeInstance(ci, profile_id) for ci in sorted(gi.compute_instances))

        return self._query(call, answer)

    def create_compute_instance(
        self, handle: DeviceHandle, gpu_instance_id: int
    ) -> ComputeInstance:
        call = "create_compute_instance"
        gpu = self._mig_gpu(handle, call)

        def change() -> ComputeInstance:
            gi = self._gpu_instance(gpu, gpu_instance_id, call)
            if gi.compute_instances:
                message = f"GPU instance {gpu_instance_id} is used up by a compute instance"
                raise _fail(call, message, NVML_ERROR_INSUFFICIENT_RESOURCES)
            gi.compute_instances.add(0)
            profile_id = _COMPUTE_PROFILE_IDS[_profile(gpu, gi.profile_id, call).gpu_slices]
            return ComputeInstance(0, profile_id)

        return self._change(call, change)

    def destroy_compute_instance(
        self, handle: DeviceHandle, gpu_instance_id: int, compute_instance_id: int
    ) -> None:
        call = "destroy_compute_instance"
        gpu = self._mig_gpu(handle, call)

        def change() -> None:
            gi = self._gpu_instance(gpu, gpu_instance_id, call)
            if compute_instance_id not in gi.compute_instances:
                message = f"no compute instance {compute_instance_id} in GI {gpu_instance_id}"
                raise _fail(call, message, NVML_ERROR_NOT_FOUND)
            gi.compute_instances.discard(compute_instance_id)

        self._change(call, change)

    def device_time_slice(self, handle: DeviceHandle) -> int:
        gpu = self._whole_gpu(handle, "device_time_slice")
        return self._query("device_time_slice", lambda: self._states[gpu.index].time_slice)

    def device_set_time_slice(self, handle: DeviceHandle, interval: int) -> None:
        gpu = self._whole_gpu(handle, "device_set_time_slice")
        check_time_slice(interval)

        def change() -> None:
            self._states[gpu.index].time_slice = interval

        self._change("device_set_time_slice", change)

    def device_compute_mode(self, handle: DeviceHandle) -> int:
        gpu = self._whole_gpu(handle, "device_compute_mode")
        return self._query("device_compute_mode", lambda: self._states[gpu.index].compute_mode)

    def device_set_compute_mode(self, handle: DeviceHandle, mode: int) -> None:
        gpu = self._whole_gpu(handle, "device_set_compute_mode")
        check_compute_mode(mode)

        def change() -> None:
            self._states[gpu.index].compute_mode = int(mode)

        self._change("device_set_compute_mode", change)

    def _whole_gpu(self, handle: DeviceHandle, call: str) -> FakeGpu:
        """A full GPU: the compute policy and compute mode belong to the GPU, not to a
        MIG device."""
        h = self._handle(handle, call)
        if h.instance is not None:
            raise NvmlNotSupported(f"{call}: not a full GPU", code=NVML_ERROR_NOT_SUPPORTED)
        return self._gpu(h)

    def mig_device_nodes(
        self, minor: int, gpu_instance_id: int, compute_instance_id: int
    ) -> tuple[CharDevice, ...]:
        return self._query("mig_device_nodes", tuple)

    def event_set_create(self) -> EventSet:
        self._live("event_set_create")
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

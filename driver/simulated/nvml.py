"""The simulated backend: a fake NVML library fed by GPU profiles.

The fake implements ``NvmlLibrary``, so a simulated node goes through the same
``discover()`` as a real one; only the numbers come from
``drasil.driver.simulated.gpucatalog``, through the profile specs and ``FakeGpu`` records of
``drasil.driver.simulated.gpus``. The fake's state (MIG, time slice, compute mode) and
its state file are ``drasil.driver.simulated.gpustate``'s; its handles, locking and fault
injection ``drasil.driver.simulated.nvmlcore``'s. This module holds the NVML answers.

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
"""

from __future__ import annotations

import queue
from pathlib import Path

from drasil.driver.devices import CharDevice
from drasil.driver.nvidia.nvml import (
    ARCH_AMPERE,
    NVML_DEVICE_ADDRESSING_MODE_NONE,
    NVML_ERROR_IN_USE,
    NVML_ERROR_INSUFFICIENT_RESOURCES,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_RESET_REQUIRED,
    ComputeInstance,
    DeviceAttributes,
    DeviceHandle,
    EventData,
    EventSet,
    GpuInstance,
    GpuInstanceProfile,
    MigMode,
    NvmlNotFound,
    NvmlQueryError,
    NvmlUnavailable,
    Placement,
    check_compute_mode,
    check_time_slice,
)
from drasil.driver.simulated.gpucatalog import gpu_instance_id_at
from drasil.driver.simulated.gpus import simulated_gpus
from drasil.driver.simulated.gpustate import (
    COMPUTE_PROFILE_IDS,
    SimGpuInstance,
    check_room,
    gpu_instance_profile,
    mig_profile,
    nvml_fail,
)
from drasil.driver.simulated.nvmlcore import FakeEventSet, FakeHandle, FakeNvmlCore


def simulated_library(
    profile_spec: str, *, node_name: str, state_file: Path | None = None
) -> FakeNvml:
    """A fake NVML library for the GPUs of ``profile_spec`` (an ``NvmlLibrary``);
    with ``state_file`` its MIG state persists there (see ``simstate``)."""
    gpus = simulated_gpus(profile_spec, node_name=node_name)
    return FakeNvml(gpus, state_file=state_file, strict_init=True)


class FakeNvml(FakeNvmlCore):
    """An ``NvmlLibrary`` answering from ``FakeGpu`` records, with fault injection
    (``FakeNvmlCore``)."""

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
        return self._handle(FakeHandle(index), "device_handle_by_index")

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

    def device_addressing_mode(self, handle: DeviceHandle) -> int | None:
        # What NVML of the simulated driver (580) says of a discrete GPU on a host
        # without HMM or ATS (nvidia-smi -q: "Addressing Mode: None"); the mock NVML too.
        self._full(handle, "device_addressing_mode")
        return NVML_DEVICE_ADDRESSING_MODE_NONE

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
        mig = FakeHandle(gpu.index, index, slots[index])
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
        return FakeHandle(h.gpu)

    # -- MIG management -------------------------------------------------------------------

    def device_set_mig_mode(self, handle: DeviceHandle, enabled: bool) -> MigMode:
        gpu = self._mig_gpu(handle, "device_set_mig_mode")

        def change() -> MigMode:
            state = self._states[gpu.index]
            if not enabled and state.instances:
                message = "GPU instances exist; destroy them first"
                raise nvml_fail("device_set_mig_mode", message, NVML_ERROR_IN_USE)
            if gpu.model.architecture == ARCH_AMPERE:
                # Ampere changes MIG mode only at a GPU reset; NVML keeps it pending.
                state.pending = None if enabled == state.enabled else enabled
            else:
                state.enabled, state.pending = enabled, None
            return state.mode

        mode = self._change("device_set_mig_mode", change)
        if mode.current != enabled:  # NVML's activationStatus, which the adapter raises
            message = "the change takes effect at the next GPU reset"
            raise nvml_fail("device_set_mig_mode", message, NVML_ERROR_RESET_REQUIRED)
        return mode

    def gpu_instance_profiles(self, handle: DeviceHandle) -> tuple[GpuInstanceProfile, ...]:
        gpu = self._mig_gpu(handle, "gpu_instance_profiles")
        profiles = tuple(gpu_instance_profile(p) for p in gpu.model.mig_profiles)
        return self._query("gpu_instance_profiles", lambda: profiles)

    def gpu_instance_placements(
        self, handle: DeviceHandle, profile_id: int
    ) -> tuple[Placement, ...]:
        call = "gpu_instance_placements"
        gpu = self._mig_gpu(handle, call)
        return self._query(call, lambda: mig_profile(gpu, profile_id, call).placements)

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
            profile = mig_profile(gpu, profile_id, call)
            if placement not in profile.placements:
                message = f"{profile.name} has no placement {placement.start}:{placement.size}"
                raise nvml_fail(call, message, NVML_ERROR_INVALID_ARGUMENT)
            check_room(gpu, state, profile, placement, call)
            gi_id = gpu_instance_id_at(placement)
            state.instances[gi_id] = SimGpuInstance(profile_id, placement)
            return GpuInstance(gi_id, profile_id, placement)

        return self._change(call, change)

    def destroy_gpu_instance(self, handle: DeviceHandle, gpu_instance_id: int) -> None:
        call = "destroy_gpu_instance"
        gpu = self._mig_gpu(handle, call)

        def change() -> None:
            gi = self._gpu_instance(gpu, gpu_instance_id, call)
            if gi.compute_instances:
                message = f"GPU instance {gpu_instance_id} holds compute instances"
                raise nvml_fail(call, message, NVML_ERROR_IN_USE)
            del self._states[gpu.index].instances[gpu_instance_id]

        self._change(call, change)

    def compute_instances(
        self, handle: DeviceHandle, gpu_instance_id: int
    ) -> tuple[ComputeInstance, ...]:
        call = "compute_instances"
        gpu = self._mig_gpu(handle, call)

        def answer() -> tuple[ComputeInstance, ...]:
            gi = self._gpu_instance(gpu, gpu_instance_id, call)
            profile_id = COMPUTE_PROFILE_IDS[mig_profile(gpu, gi.profile_id, call).gpu_slices]
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
                raise nvml_fail(call, message, NVML_ERROR_INSUFFICIENT_RESOURCES)
            gi.compute_instances.add(0)
            profile_id = COMPUTE_PROFILE_IDS[mig_profile(gpu, gi.profile_id, call).gpu_slices]
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
                raise nvml_fail(call, message, NVML_ERROR_NOT_FOUND)
            gi.compute_instances.discard(compute_instance_id)

        self._change(call, change)

    def device_processes(self, handle: DeviceHandle) -> tuple[int, ...]:
        # The simulated GPUs run no process of their own: a test's holder is a process
        # with the GPU's node open, which the /proc walk finds (drasil.driver.vfio.holders).
        self._whole_gpu(handle, "device_processes")
        return ()

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

    def mig_device_nodes(
        self, minor: int, gpu_instance_id: int, compute_instance_id: int
    ) -> tuple[CharDevice, ...]:
        return self._query("mig_device_nodes", tuple)

    def event_set_create(self) -> EventSet:
        self._live("event_set_create")
        event_set = FakeEventSet()
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

"""The simulated NVML's machinery: handles, fault injection, locking, the state file.

``FakeNvmlCore`` is the part of ``drasil.driver.simulated.nvml.FakeNvml`` that is
not an NVML answer: it checks handles, keeps the GPUs' ``MigState`` fresh from the
state file and writes it back (``_query``, ``_change``), and injects faults.

Fault injection for tests and demos: ``fail_init``, ``fail_device`` (one call of one
GPU or MIG device raises), ``fail_next`` (the next call of a MIG management method
raises an NVML code, before or after taking effect; the time slice and compute mode
calls too) and ``inject_xid`` (delivers an XID event to event sets registered for the
device).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from drasil.driver.checkpoint import read_boot_id
from drasil.driver.files import FileLock, read_regular, write_atomic
from drasil.driver.nvidia.nvml import (
    EVENT_TYPE_XID_CRITICAL_ERROR,
    NO_INSTANCE,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_UNINITIALIZED,
    DeviceHandle,
    EventData,
    EventSet,
    NvmlLibrary,
    NvmlNotFound,
    NvmlNotSupported,
    NvmlQueryError,
)
from drasil.driver.simulated.gpucatalog import MigProfile
from drasil.driver.simulated.gpus import CUDA_DRIVER_VERSION, DRIVER_VERSION, FakeGpu, mig_uuid
from drasil.driver.simulated.gpustate import (
    MigState,
    SimGpuInstance,
    StateFileError,
    initial_state,
    mig_profile,
    nvml_fail,
    parse_state,
    state_json,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

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


@dataclass(frozen=True)
class FakeHandle:
    """A GPU (``mig`` None) or a MIG device: the slot it was found at, and its ids."""

    gpu: int
    mig: int | None = None
    instance: tuple[int, int] | None = None  # (GPU instance id, compute instance id)


@dataclass
class FakeEventSet:
    registered: dict[int, int] = field(default_factory=dict)  # gpu index → event mask
    events: queue.Queue[EventData] = field(default_factory=queue.Queue)


@dataclass(frozen=True)
class _Failure:
    code: int
    after: bool
    message: str


class FakeNvmlCore:
    """What ``FakeNvml`` answers with: its GPUs, their state and the faults to inject.

    ``boot_id`` is injectable so tests can reboot a node (see ``simstate``).
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
        self._event_sets: list[FakeEventSet] = []
        self._lock = threading.RLock()
        self._states = {gpu.index: initial_state(gpu) for gpu in self.gpus}
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
        self._gpu(FakeHandle(index))
        gi = ci = NO_INSTANCE
        if mig is not None:
            gi, ci = self._slots(index)[mig]
        event = EventData(
            device=FakeHandle(index),
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
            self._states[index] = MigState(enabled=self._states[index].mode.pending)
            self._save()
        log.info("simulated GPU reset", extra={"gpu": gpu.uuid})

    # -- helpers ----------------------------------------------------------------------

    def _check(self, handle: FakeHandle, call: str) -> None:
        message = self._faults.get((handle.gpu, handle.mig, call))
        if message is not None:
            raise NvmlQueryError(f"{call}: {message}", code=NVML_ERROR_GPU_IS_LOST)

    def _live(self, call: str) -> None:
        """NVML answers UNINITIALIZED after the last ``nvmlShutdown``; so does a
        strict fake, which is what the plugin and the CLI run on."""
        if self.strict_init and self.initialized <= 0:
            raise NvmlQueryError(f"{call}: Uninitialized", code=NVML_ERROR_UNINITIALIZED)

    def _handle(self, handle: DeviceHandle, call: str) -> FakeHandle:
        self._live(call)
        if not isinstance(handle, FakeHandle) or not 0 <= handle.gpu < len(self.gpus):
            raise NvmlQueryError(f"{call}: not a handle of this library")
        self._check(handle, call)
        return handle

    def _gpu(self, handle: FakeHandle) -> FakeGpu:
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
            return gpu, gi_id, ci_id, mig_profile(gpu, gi.profile_id, call)

    def _full(self, handle: DeviceHandle, call: str) -> FakeGpu:
        return self._gpu(self._handle(handle, call))

    def _mig_gpu(self, handle: DeviceHandle, call: str) -> FakeGpu:
        """A full GPU that has MIG at all (NOT_SUPPORTED otherwise, as NVML answers)."""
        gpu = self._full(handle, call)
        if not gpu.model.mig_capable:
            raise NvmlNotSupported(f"{call}: Not Supported", code=NVML_ERROR_NOT_SUPPORTED)
        return gpu

    def _mig_on(self, gpu: FakeGpu, call: str) -> MigState:
        """The GPU's MIG state; NOT_SUPPORTED when MIG mode is off, which is what nvml.h
        documents for instance calls on a GPU without MIG mode enabled."""
        state = self._states[gpu.index]
        if not state.enabled:
            raise nvml_fail(call, "MIG mode is disabled", NVML_ERROR_NOT_SUPPORTED)
        return state

    def _gpu_instance(self, gpu: FakeGpu, gpu_instance_id: int, call: str) -> SimGpuInstance:
        gi = self._mig_on(gpu, call).instances.get(gpu_instance_id)
        if gi is None:
            raise nvml_fail(call, f"no GPU instance {gpu_instance_id}", NVML_ERROR_NOT_FOUND)
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
        raise nvml_fail(call, failure.message, failure.code)

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
            self._states = {gpu.index: initial_state(gpu) for gpu in self.gpus}
            return
        self._states = self._load(self.state_file)

    def _load(self, path: Path) -> dict[int, MigState]:
        try:
            # read_regular: a FIFO there would hang a plain read; it, a directory or a
            # symlink (NotRegularFile, an OSError) counts as damaged.
            boot_id, states = parse_state(read_regular(path), self.gpus)
        except (OSError, StateFileError) as err:
            log.error(
                "simulated GPU state file is damaged; starting without its MIG state",
                extra={"path": str(path), "error": str(err)},
            )
            return {gpu.index: initial_state(gpu) for gpu in self.gpus}
        if boot_id != self._boot_id():
            # A reboot: GPU instances, time slices and compute modes are gone, the MIG
            # mode setting is not.
            log.info(
                "simulated GPUs rebooted: MIG instances, time slices and compute modes dropped",
                extra={"path": str(path)},
            )
            # A reset applies a pending mode (Ampere).
            return {i: MigState(enabled=s.mode.pending) for i, s in states.items()}
        return states

    def _save(self) -> None:
        if self.state_file is None:
            return
        data = state_json(self._boot_id(), self.gpus, self._states)
        # Not durable: a real GPU loses its instances on power loss too, and the boot
        # id in the file makes the next boot drop them anyway.
        write_atomic(self.state_file, data, crash_tag="simulated-gpus", durable=False)
        st = self.state_file.stat()
        self._seen = (st.st_ino, st.st_mtime_ns, st.st_size)

    def _whole_gpu(self, handle: DeviceHandle, call: str) -> FakeGpu:
        """A full GPU: the compute policy and compute mode belong to the GPU, not to a
        MIG device."""
        h = self._handle(handle, call)
        if h.instance is not None:
            raise NvmlNotSupported(f"{call}: not a full GPU", code=NVML_ERROR_NOT_SUPPORTED)
        return self._gpu(h)

    def _event_set(self, event_set: EventSet, call: str) -> FakeEventSet:
        if not isinstance(event_set, FakeEventSet):
            raise NvmlQueryError(f"{call}: not an event set of this library")
        return event_set

"""What prepared claims change on whole GPUs: MPS daemons of shared GPUs, time slices.

A share of a consumable GPU (``--gpu-sharing consumable``) is enforced by MPS: the GPU
gets one MPS control daemon (``drasil.kubeletplugin.dra.mps``), started with its first
share, and each share's CDI device carries its own limits (pinned memory, active
threads) and the daemon's pipe and log directories. A claim whose config asks for
time-slicing has its interval applied to the GPU.

Both are node state that outlives a claim, so the checkpoint records them per GPU
(``gpus`` in ``api/checkpoint.py``), and ``settle`` undoes whatever no prepared claim
needs any more: it stops a daemon after the last share, puts back the time slice the
GPU had before the first time-sliced claim. It runs after every unprepare and at
start, so a crash anywhere in between is settled by the next call or start.

Order in prepare (after the claim is recorded ``PrepareStarted``, so its devices
are held): the time slice is recorded as it was, then set, then recorded as set;
the daemon is started (or found running), then recorded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import replace

from drasil.api.checkpoint import GpuRecord, MpsDaemonRecord
from drasil.driver.cdi.spec import ContainerEdits
from drasil.driver.checkpoint import CheckpointStore
from drasil.driver.claims.plan import DevicePlan, PreparePlan
from drasil.driver.claims.sharing import MPS, time_slice_of
from drasil.driver.devices import Device
from drasil.driver.discovery.nvml import DeviceHandle, NvmlError, NvmlLibrary, nvml_session
from drasil.driver.files import crash_point
from drasil.kubeletplugin.dra.mps import MpsDaemon, MpsDaemons, MpsError, share_edits

log = logging.getLogger(__name__)


class ShareError(Exception):
    """A GPU change a claim needs that could not be made; the claim's error."""


class GpuEffects:
    """Applies and settles the per-GPU state of prepared claims."""

    def __init__(
        self,
        lib: NvmlLibrary,
        daemons: MpsDaemons,
        *,
        store: CheckpointStore,
        state_lock: Callable[[], AbstractContextManager[None]],
        devices: Mapping[str, Device],
    ) -> None:
        self.lib = lib
        self.daemons = daemons
        self.store = store
        self.state_lock = state_lock
        self.devices = devices
        self._handles: dict[str, DeviceHandle] = {}

    # ---- prepare ----------------------------------------------------------------------

    def apply(self, plan: PreparePlan) -> PreparePlan:
        """Make the GPU changes the plan's devices need; the plan with share edits."""
        devices = list(plan.devices)
        for index, device in enumerate(devices):
            gpu = device.cdi.device.uuid
            time_slice = time_slice_of(device.prepared.sharing)
            if time_slice is not None:
                self._set_time_slice(gpu, time_slice)
            limits = device.share_limits
            if limits is not None:
                daemon = self._daemon(gpu)
                edits = share_edits(
                    daemon,
                    memory_limit_bytes=limits.memory_bytes,
                    thread_percentage=limits.thread_percentage,
                    gpu_uuid=gpu,
                )
                devices[index] = _with_edits(device, edits)
        if devices == list(plan.devices):
            return plan
        crash_point("prepare-after-share")
        spec = replace(plan.spec, devices=tuple(d.cdi for d in devices))
        return replace(plan, devices=tuple(devices), spec=spec)

    def _daemon(self, gpu: str) -> MpsDaemon:
        try:
            daemon = self.daemons.ensure(gpu)
        except (OSError, MpsError) as err:
            raise ShareError(f"GPU {gpu}: the MPS control daemon did not start: {err}") from err
        record = MpsDaemonRecord(
            pid=daemon.pid,
            start_time=daemon.start_time,
            pipe_dir=str(daemon.pipe_dir),
            log_dir=str(daemon.log_dir),
        )
        with self.state_lock():
            current = self.store.gpus().get(gpu) or GpuRecord()
            if current.mps != record:
                self.store.set_gpu(gpu, current.model_copy(update={"mps": record}))
        return daemon

    def _set_time_slice(self, gpu: str, interval: int) -> None:
        with self.state_lock():
            current = self.store.gpus().get(gpu) or GpuRecord()
            if current.time_slice == interval:
                return
            if current.previous_time_slice is None:
                before = self._read_time_slice(gpu)
                current = current.model_copy(update={"previous_time_slice": before})
                self.store.set_gpu(gpu, current)
        self._write_time_slice(gpu, interval)
        with self.state_lock():
            current = self.store.gpus().get(gpu) or GpuRecord()
            self.store.set_gpu(gpu, current.model_copy(update={"time_slice": interval}))
        log.info("time slice set", extra={"gpu": gpu, "timeSlice": interval})

    # ---- unprepare and start ----------------------------------------------------------

    def resume(self) -> None:
        """At start: daemons of GPUs with prepared MPS shares run again (a node restart
        or an OOM kill may have taken them), then ``settle``."""
        for gpu in sorted(self._needed()[0]):
            try:
                self._daemon(gpu)
            except ShareError as err:
                log.error("MPS daemon not restarted", extra={"gpu": gpu, "error": str(err)})
        self.settle()

    def settle(self) -> list[str]:
        """Undo what no prepared claim needs any more; returns what was undone."""
        mps_needed, slices_needed = self._needed()
        done: list[str] = []
        for gpu, record in dict(self.store.gpus()).items():
            updated = record
            if record.mps is not None and gpu not in mps_needed:
                self.daemons.stop(gpu)
                crash_point("settle-after-stop")
                updated = updated.model_copy(update={"mps": None})
                done.append(f"stopped the MPS daemon of GPU {gpu}")
            if record.time_slice is not None and gpu not in slices_needed:
                previous = record.previous_time_slice or 0
                self._write_time_slice(gpu, previous)
                updated = updated.model_copy(
                    update={"time_slice": None, "previous_time_slice": None}
                )
                done.append(f"restored time slice {previous} of GPU {gpu}")
            if updated != record:
                with self.state_lock():
                    self.store.set_gpu(gpu, updated)
        # A daemon started just before a crash was never recorded: nobody needs it.
        for gpu in self.daemons.sweep(keep=mps_needed):
            done.append(f"stopped an unrecorded MPS daemon of GPU {gpu}")
        for what in done:
            log.info(what)
        return done

    def _needed(self) -> tuple[set[str], set[str]]:
        """GPUs that prepared claims need an MPS daemon on, and a time slice on."""
        mps: set[str] = set()
        slices: set[str] = set()
        with self.state_lock():
            records = dict(self.store.claims())
        for record in records.values():
            for held in record.devices:
                device = self.devices.get(held.device_name)
                if device is None or held.sharing is None:
                    continue
                if held.sharing == MPS:
                    mps.add(device.uuid)
                elif time_slice_of(held.sharing) is not None:
                    slices.add(device.uuid)
        return mps, slices

    def _read_time_slice(self, gpu: str) -> int:
        try:
            with nvml_session(self.lib):
                return self.lib.device_time_slice(self._handle(gpu))
        except NvmlError as err:
            raise ShareError(f"GPU {gpu}: reading its time slice: {err}") from err

    def _write_time_slice(self, gpu: str, interval: int) -> None:
        try:
            with nvml_session(self.lib):
                self.lib.device_set_time_slice(self._handle(gpu), interval)
        except NvmlError as err:
            raise ShareError(f"GPU {gpu}: setting time slice {interval}: {err}") from err

    def _handle(self, gpu: str) -> DeviceHandle:
        if gpu not in self._handles:
            for index in range(self.lib.device_count()):
                handle = self.lib.device_handle_by_index(index)
                self._handles[self.lib.device_uuid(handle)] = handle
        if gpu not in self._handles:
            raise ShareError(f"GPU {gpu} is not on this node any more")
        return self._handles[gpu]


def _with_edits(device: DevicePlan, edits: ContainerEdits) -> DevicePlan:
    cdi = replace(device.cdi, edits=edits)
    return replace(device, cdi=cdi)

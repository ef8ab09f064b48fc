"""AMD compute partition modes switched at prepare (``--amd-partition-mode dynamic``).

A dynamic partition (``drasil.driver.amd.partitions``) exists once its GPU is in the
partition's mode. Prepare asks ``PartitionModes.switch`` for the claim's partitions:

- the claim is already recorded ``PrepareStarted`` with a ``partition`` record per
  device (the mode it holds its GPU in); ``check_not_held`` refused it before that if
  another claim holds the GPU in another mode, so a switch never pulls a GPU from
  under a claim;
- per GPU, the mode it had before the first claim is recorded
  (``previousComputePartition``), then amdgpu is asked to switch (a sysfs write), then
  the mode is recorded (``computePartition``);
- the tree is read again, and each partition comes back with its UUID and device nodes.

``settle`` (after an unprepare, and at start) puts a GPU that no claim records a
partition of back into its previous mode and forgets its record; a crash anywhere in
between is settled by the next unprepare or start. One lock (threads, and a
``FileLock`` in the state dir for a second plugin instance during a rolling update)
covers every switch and settle, so a settle never switches a GPU under a prepare.

Crash points (``drasil.driver.files``): ``partition-after-previous``,
``partition-after-switch``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from drasil.api.checkpoint import GpuRecord
from drasil.driver.amd.devices import gpu_uuid
from drasil.driver.amd.partitions import (
    ModeWriter,
    PartitionSwitchError,
    mode_of,
    realize,
    switch_mode,
    write_mode,
)
from drasil.driver.amd.sysfs import AmdSysfs, read_sysfs
from drasil.driver.checkpoint import CheckpointStore
from drasil.driver.devices import Device
from drasil.driver.files import FileLock, crash_point

log = logging.getLogger(__name__)

PARTITION_LOCK_TIMEOUT = 30.0  # below kubelet's 45 s call timeout, like the MIG lock


class PartitionModes:
    """Switches AMD GPUs' compute partition modes for prepared claims, and back."""

    def __init__(
        self,
        sysfs_root: Path,
        *,
        store: CheckpointStore,
        state_lock: Callable[[], AbstractContextManager[None]],
        state_dir: Path,
        write: ModeWriter = write_mode,
    ) -> None:
        self.root = sysfs_root
        # How a mode is written: amdgpu's sysfs file, or the simulated tree's answer.
        self.write = write
        self.store = store
        self.state_lock = state_lock
        self._thread_lock = threading.Lock()
        self._file_lock = state_dir / "amd-partition.lock"

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with self._thread_lock, FileLock(self._file_lock, timeout=PARTITION_LOCK_TIMEOUT):
            yield

    # ---- prepare ------------------------------------------------------------------------

    def switch(self, devices: Sequence[Device]) -> dict[str, Device]:
        """Put each device's GPU in the device's mode; the devices as they exist then.

        Raises ``PartitionSwitchError`` when amdgpu refuses a switch or a partition is
        not there after it.
        """
        wanted = _modes_by_gpu(devices)
        with self._locked():
            snapshot = read_sysfs(self.root)
            switched = [
                self._switch(uuid, bdf, mode, now=mode_of(snapshot, bdf))
                for (uuid, bdf), mode in sorted(wanted.items())
            ]
            if any(switched):  # the switch rebuilt the topology: read it again
                snapshot = read_sysfs(self.root)
        return {d.name: realize(d, snapshot) for d in devices}

    def _switch(self, uuid: str, bdf: str, mode: str, *, now: str) -> bool:
        """Put one GPU in ``mode`` (it is in ``now``); whether it had to switch."""
        with self.state_lock():
            record = self.store.gpus().get(uuid) or GpuRecord()
            if record.previous_compute_partition is None:
                record = record.model_copy(update={"previous_compute_partition": now})
                self.store.set_gpu(uuid, record)
        crash_point("partition-after-previous")
        if now != mode:
            switch_mode(self.root, bdf, mode, write=self.write)
            log.info("compute partition mode switched", extra={"gpu": bdf, "mode": mode})
        crash_point("partition-after-switch")
        with self.state_lock():
            record = self.store.gpus().get(uuid) or GpuRecord()
            if record.compute_partition != mode:
                self.store.set_gpu(uuid, record.model_copy(update={"compute_partition": mode}))
        return now != mode

    # ---- unprepare and start ------------------------------------------------------------

    def settle(self) -> list[str]:
        """Put GPUs no prepared claim holds back in their previous mode; what was done.

        A switch amdgpu refuses (a process still on the GPU) is logged and kept for
        the next settle; the other GPUs are settled anyway.
        """
        done: list[str] = []
        with self._locked():
            with self.state_lock():
                gpus = dict(self.store.gpus())
                held = self._held()
            switched = {u: r for u, r in gpus.items() if _switched(r) and u not in held}
            if not switched:
                return done
            snapshot = read_sysfs(self.root)
            bus_ids = {gpu_uuid(g.unique_id): g.bdf for g in snapshot.gpus}
            for uuid, record in sorted(switched.items()):
                try:
                    done += self._restore(uuid, bus_ids.get(uuid), record, snapshot)
                except PartitionSwitchError as err:
                    log.error("compute partition mode not restored", extra={"error": str(err)})
        for what in done:
            log.info(what)
        return done

    def _restore(
        self, uuid: str, bdf: str | None, record: GpuRecord, snapshot: AmdSysfs
    ) -> list[str]:
        previous = record.previous_compute_partition
        done = []
        if bdf is None:
            done.append(f"forgot the partition mode of GPU {uuid}, which is not here any more")
        elif previous is not None and mode_of(snapshot, bdf) != previous:
            switch_mode(self.root, bdf, previous, write=self.write)
            done.append(f"restored compute partition mode {previous} of GPU {bdf}")
        with self.state_lock():
            current = self.store.gpus().get(uuid) or GpuRecord()
            cleared = {"compute_partition": None, "previous_compute_partition": None}
            self.store.set_gpu(uuid, current.model_copy(update=cleared))
        return done

    def _held(self) -> set[str]:
        """GPUs (UUIDs) that recorded claims hold in a partition mode."""
        return {
            device.partition.parent_uuid
            for record in self.store.claims().values()
            for device in record.devices
            if device.partition is not None
        }


def _switched(record: GpuRecord) -> bool:
    return record.compute_partition is not None or record.previous_compute_partition is not None


def _modes_by_gpu(devices: Sequence[Device]) -> Mapping[tuple[str, str], str]:
    """(GPU UUID, PCI address) → the mode the devices want it in (one per GPU: the
    plan refused a claim wanting two, ``drasil.driver.claims.plan``)."""
    wanted: dict[tuple[str, str], str] = {}
    for device in devices:
        slot = device.compute_partition
        assert slot is not None
        wanted[(slot.parent_uuid, slot.parent_bus_id)] = slot.mode
    return wanted

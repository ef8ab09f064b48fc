"""NVIDIA device health: NVML's XID critical-error events, and time to recover.

Benign XIDs (13, 31, 43, 45, 68, 109: application faults and the like) are ignored.
A device hit by another XID recovers when it has had no critical XID for
``recovery_after`` seconds and still answers NVML, so a transient fault does not need
a plugin restart (the Go drivers' mistake). The watcher reports to the node's
``HealthTracker`` under the source ``xid``.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Final

from drasil.driver.devices import Device, DeviceType
from drasil.driver.health import HealthTracker
from drasil.driver.nvidia.nvml import (
    EVENT_TYPE_XID_CRITICAL_ERROR,
    NO_INSTANCE,
    NVML_ERROR_GPU_IS_LOST,
    DeviceHandle,
    EventData,
    EventSet,
    NvmlError,
    NvmlLibrary,
    NvmlQueryError,
)

log = logging.getLogger(__name__)

BENIGN_XIDS = frozenset({13, 31, 43, 45, 68, 109})

SOURCE: Final = "xid"  # the health source name (docs/design.md#health)


def _is_lost(lib: NvmlLibrary, handle: DeviceHandle) -> bool:
    try:
        lib.device_uuid(handle)
    except NvmlQueryError as err:
        return err.code == NVML_ERROR_GPU_IS_LOST
    except NvmlError:
        return False
    return False


class XidWatcher:
    """Turns critical XID events into unhealthy devices, and time into recovery."""

    def __init__(
        self,
        lib: NvmlLibrary,
        devices: Sequence[Device],
        tracker: HealthTracker,
        *,
        recovery_after: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.lib = lib
        self.devices = devices
        self.tracker = tracker
        self.recovery_after = recovery_after
        self._clock = clock
        self._hit: dict[str, tuple[float, str]] = {}  # device -> (last XID time, why)

    def handle(self, event: EventData) -> None:
        if event.event_type != EVENT_TYPE_XID_CRITICAL_ERROR or event.event_data in BENIGN_XIDS:
            return
        why = f"XID {event.event_data}"
        for name in self._affected(event):
            self._hit[name] = (self._clock(), why)
        self._report()

    def _affected(self, event: EventData) -> list[str]:
        try:
            uuid = self.lib.device_uuid(event.device)
        except NvmlError:
            return []
        gpu = [d for d in self.devices if uuid in (d.uuid, d.parent_uuid)]
        if event.gpu_instance_id == NO_INSTANCE:
            return [d.name for d in gpu]  # a whole-GPU error hits its MIG devices too
        # Static MIG devices are named ...-<gi>-<ci>. NVML may name the GPU instance
        # but not the compute instance: then every device of that GPU instance.
        ci = event.compute_instance_id
        ci_pattern = r"\d+" if ci == NO_INSTANCE else str(ci)
        suffix = re.compile(rf"-{event.gpu_instance_id}-{ci_pattern}$")
        static = [d.name for d in gpu if d.type == DeviceType.MIG and suffix.search(d.name)]
        return static or self._dynamic_affected(event, gpu)

    def lost(self, handles: Mapping[str, DeviceHandle]) -> None:
        """``nvmlEventSetWait`` said a GPU is lost (fallen off the bus): the GPUs that
        answer GPU_IS_LOST now are unhealthy, or every GPU when none says so."""
        gone = [uuid for uuid, handle in handles.items() if _is_lost(self.lib, handle)]
        hit = [d for d in self.devices if not gone or {d.uuid, d.parent_uuid} & set(gone)]
        for device in hit:
            self._hit[device.name] = (self._clock(), "GPU is lost (NVML)")
        self._report()

    def _dynamic_affected(self, event: EventData, gpu: Sequence[Device]) -> list[str]:
        """A dynamic MIG device is named by its placement, not its ids: NVML says
        which placement the event's GPU instance has."""
        placed = [d for d in gpu if d.mig_placement is not None]
        if not placed:
            return []
        try:
            instances = self.lib.gpu_instances(event.device)
        except NvmlError:
            return []
        hit = [i for i in instances if i.gpu_instance_id == event.gpu_instance_id]
        return [
            d.name
            for d in placed
            for i in hit
            if d.mig_placement is not None
            and (d.mig_placement.profile_id, d.mig_placement.start)
            == (i.profile_id, i.placement.start)
        ]

    def recover(self) -> None:
        now = self._clock()
        quiet = [n for n, (t, _) in self._hit.items() if now - t >= self.recovery_after]
        for name in quiet:
            if self._answers(name):
                del self._hit[name]
        if quiet:
            self._report()

    def _answers(self, name: str) -> bool:
        device = next(d for d in self.devices if d.name == name)
        index = device.attributes.get("index")
        if not isinstance(index, int):
            return True
        try:
            self.lib.device_handle_by_index(index)
        except NvmlError:
            return False
        return True

    def _report(self) -> None:
        self.tracker.report(SOURCE, {n: why for n, (_, why) in self._hit.items()})

    def run(self, stop: threading.Event) -> None:
        """Wait for events until ``stop``; any NVML failure disables XID watching only.

        NVML is reference-counted and discovery shut its reference down, so this
        thread holds its own for as long as it watches.
        """
        try:
            self.lib.init()
        except NvmlError as err:
            log.error("XID events unavailable; NVML health disabled", extra={"error": str(err)})
            return
        try:
            self._watch(stop)
        finally:
            self.lib.shutdown()

    def _register(self, event_set: EventSet) -> dict[str, DeviceHandle]:
        """Register every GPU that can report XIDs; one that cannot is logged and left
        unwatched, the others still are (NVIDIA's DRA driver does the same)."""
        watched: dict[str, DeviceHandle] = {}
        for index in range(self.lib.device_count()):
            try:
                handle = self.lib.device_handle_by_index(index)
                uuid = self.lib.device_uuid(handle)
                self.lib.device_register_events(handle, EVENT_TYPE_XID_CRITICAL_ERROR, event_set)
            except NvmlError as err:
                why = {"gpu_index": index, "error": str(err)}
                log.warning("GPU not watched for XID events", extra=why)
                continue
            watched[uuid] = handle
        return watched

    def _watch(self, stop: threading.Event) -> None:
        try:
            event_set = self.lib.event_set_create()
        except NvmlError as err:
            log.error(
                "XID events unavailable; health from NVML disabled", extra={"error": str(err)}
            )
            return
        try:
            try:
                watched = self._register(event_set)
            except NvmlError as err:
                watched = {}
                log.error("listing GPUs for XID events failed", extra={"error": str(err)})
            if not watched:
                log.error("no GPU of this node reports XID events; health from NVML disabled")
                return
            while not stop.is_set():
                try:
                    event = self.lib.event_set_wait(event_set, 500)
                except NvmlError as err:
                    if isinstance(err, NvmlQueryError) and err.code == NVML_ERROR_GPU_IS_LOST:
                        log.error("NVML: a GPU is lost", extra={"error": str(err)})
                        self.lost(watched)
                    else:
                        log.warning("XID wait failed", extra={"error": str(err)})
                    stop.wait(1.0)
                    continue
                if event is not None:
                    self.handle(event)
                self.recover()
        finally:
            self.lib.event_set_free(event_set)

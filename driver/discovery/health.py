"""Device health: what makes a device unhealthy, and when it is healthy again.

Sources report the complete set of devices they consider unhealthy; a device is
unhealthy while any source says so. Two sources exist:

- ``xid``: NVML XID critical-error events on real GPUs (or the fake NVML's injected
  ones). Benign XIDs (13, 31, 43, 45, 68, 109: application faults and the like) are
  ignored. A device hit by another XID recovers when it has had no critical XID for
  ``recovery_after`` seconds and still answers NVML, so a transient fault does not
  need a plugin restart (the Go drivers' mistake).
- ``faults``: a JSON file of injected faults (``drasil fault inject gpu-3``) for the
  simulated backend, so tests and demos can break and mend devices.

Consumers (the slice publisher, the kubelet health stream) wait on ``version``.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from drasil.driver.devices import Device, DeviceType
from drasil.driver.discovery.nvml import (
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
from drasil.driver.files import write_atomic

log = logging.getLogger(__name__)

BENIGN_XIDS = frozenset({13, 31, 43, 45, 68, 109})
FAULT_FILE = "simulated-faults.json"


@dataclass(frozen=True)
class DeviceHealth:
    healthy: bool
    message: str
    since: float  # time.time() of the last change


class HealthTracker:
    """The health of every device of the node, merged over sources."""

    def __init__(self, devices: Iterable[Device], *, clock: Callable[[], float] = time.time):
        self._clock = clock
        now = clock()
        self._devices = {d.name: DeviceHealth(True, "", now) for d in devices}
        self._sources: dict[str, dict[str, str]] = {}
        self._changed = threading.Condition()
        self.version = 0

    def report(self, source: str, unhealthy: Mapping[str, str]) -> bool:
        """Set the devices ``source`` considers unhealthy (name -> why); True on change."""
        with self._changed:
            self._sources[source] = {k: v for k, v in unhealthy.items() if k in self._devices}
            changed = self._recompute()
            if changed:
                self.version += 1
                self._changed.notify_all()
            return changed

    def _recompute(self) -> bool:
        changed = False
        now = self._clock()
        for name, old in self._devices.items():
            reasons = [f"{src}: {r[name]}" for src, r in sorted(self._sources.items()) if name in r]
            healthy, message = not reasons, "; ".join(reasons)
            if (healthy, message) != (old.healthy, old.message):
                self._devices[name] = DeviceHealth(healthy, message, now)
                log.warning(
                    "device health changed",
                    extra={"device": name, "healthy": healthy, "why": message or "recovered"},
                )
                changed = True
        return changed

    def snapshot(self) -> dict[str, DeviceHealth]:
        with self._changed:
            return dict(self._devices)

    def unhealthy(self) -> dict[str, str]:
        return {n: h.message for n, h in self.snapshot().items() if not h.healthy}

    def wait_for_change(self, seen: int, timeout: float) -> int:
        """Block until ``version`` differs from ``seen`` or ``timeout`` passes."""
        with self._changed:
            self._changed.wait_for(lambda: self.version != seen, timeout=timeout)
            return self.version


# ---- the fault file ------------------------------------------------------------------


def read_faults(path: Path) -> dict[str, str]:
    """Injected faults (device -> message); a missing or broken file means none."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        log.warning("ignoring unreadable fault file", extra={"path": str(path), "error": str(err)})
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): str(v) for k, v in data.items()}


def write_faults(path: Path, faults: Mapping[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(dict(sorted(faults.items())), indent=2).encode())


class FaultFileWatcher:
    """Polls the fault file; cheap (one stat) while it does not change."""

    def __init__(self, path: Path, tracker: HealthTracker, *, interval: float = 0.25) -> None:
        self.path = path
        self.tracker = tracker
        self.interval = interval
        self._seen: tuple[int, int] | None = (-1, -1)

    def poll(self) -> None:
        try:
            st = self.path.stat()
            signature: tuple[int, int] | None = (st.st_ino, st.st_mtime_ns)
        except FileNotFoundError:
            signature = None
        if signature != self._seen:
            self._seen = signature
            self.tracker.report("faults", read_faults(self.path))

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.poll()
            stop.wait(self.interval)


# ---- NVML XID events -----------------------------------------------------------------


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
        self.tracker.report("xid", {n: why for n, (_, why) in self._hit.items()})

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

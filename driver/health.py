"""Device health: what makes a device unhealthy, and when it is healthy again.

Sources report the complete set of devices they consider unhealthy; a device is
unhealthy while any source says so. The sources:

- ``xid``: NVML XID critical-error events of NVIDIA GPUs (``drasil.driver.nvidia.xid``);
- ``amd``: amdgpu's RAS error counters and GPU resets (``drasil.driver.amd.health``);
- ``faults``: a JSON file of injected faults (``drasil fault inject gpu-3``), vendor
  neutral, so tests and demos can break and mend devices and an operator can take a
  device out of scheduling by hand;
- ``mps``: the devices of claims whose MPS daemon died under them
  (``drasil.kubeletplugin.vendors.nvidia.mps.watch``). The GPU itself is sound and a
  new claim gets a new daemon, so this source reports without tainting: its devices
  are unhealthy in the Pods' status, not kept from the scheduler.

Consumers (the slice publisher, the kubelet health stream) wait on ``version``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from drasil.driver.devices import Device
from drasil.driver.files import write_atomic

log = logging.getLogger(__name__)

FAULT_FILE = "simulated-faults.json"
FAULTS_SOURCE: Final = "faults"  # the fault file's health source name


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
        self._untainted: set[str] = set()  # sources whose devices stay schedulable
        self._changed = threading.Condition()
        self.version = 0

    def report(self, source: str, unhealthy: Mapping[str, str], *, taint: bool = True) -> bool:
        """Set the devices ``source`` considers unhealthy (name -> why); True on change.
        ``taint`` False: the devices are unhealthy for the Pods that hold them, but
        stay schedulable (not in ``tainted``)."""
        with self._changed:
            if taint:
                self._untainted.discard(source)
            else:
                self._untainted.add(source)
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

    def tainted(self) -> set[str]:
        """The devices a tainting source considers unhealthy: kept from new claims."""
        with self._changed:
            return {
                name
                for source, found in self._sources.items()
                if source not in self._untainted
                for name in found
            }

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
            self.tracker.report(FAULTS_SOURCE, read_faults(self.path))

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.poll()
            stop.wait(self.interval)

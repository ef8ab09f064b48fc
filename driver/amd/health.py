"""AMD GPU health from sysfs counters: RAS uncorrectable errors and GPU resets.

What is real and what is drasil's:

- RAS: amdgpu keeps per-IP-block error counts in ``<gpu dir>/ras/<block>_err_count``
  (``umc``, ``gfx``, ``sdma``, ``mmhub``, ``xgmi_wafl``, ...), lines ``ue: N`` and
  ``ce: N`` (newer kernels add ``de: N``, deferred). Real, on RAS-capable GPUs.
- resets: the kernel has no reset counter in sysfs (a reset shows in the kernel log,
  a uevent and debugfs). drasil reads ``<gpu dir>/gpu_reset_count`` (one number) when
  it exists: the simulated tree's convention, for ``drasil fault`` and tests. On a
  real node the file is absent and only RAS counts are watched.

Semantics mirror the NVIDIA XID watcher (``drasil.driver.nvidia.xid``): a
device (a GPU and all its partitions) whose uncorrectable count rose since the watcher
started, or whose GPU was reset, is reported unhealthy under source ``amd``; it
recovers once ``recovery_after`` seconds pass without a new error and its GPU is still
bound to amdgpu. A GPU that vanished from the driver is unhealthy until it is back.
Correctable errors are corrected by hardware and are not a health problem.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

from drasil.driver.amd.sysfs import SysfsError, amdgpu_driver_dir, read_text
from drasil.driver.devices import PCI_BUS_ID_ATTRIBUTE, Device
from drasil.driver.discovery.health import HealthTracker

log = logging.getLogger(__name__)

SOURCE: Final = "amd"
RESET_COUNT_FILE: Final = "gpu_reset_count"
MAX_RAS_BLOCKS: Final = 32
_UE_LINE: Final = re.compile(r"^ue:\s*(\d+)\s*$", re.MULTILINE)

Counters = dict[str, int]
"""Per GPU: RAS block → uncorrectable count, and ``reset`` → reset count."""


def read_counters(gpu_dir: Path) -> Counters:
    """The uncorrectable RAS counts and the reset count of a GPU; unreadable files
    (``Query currently inaccessible`` during a reset, say) are left out."""
    counters: Counters = {}
    ras = gpu_dir / "ras"
    files = sorted(ras.glob("*_err_count"))[:MAX_RAS_BLOCKS] if ras.is_dir() else []
    for path in files:
        try:
            match = _UE_LINE.search(read_text(path))
        except SysfsError:
            continue
        if match:
            counters[path.name.removesuffix("_err_count")] = int(match[1])
    with contextlib.suppress(SysfsError, ValueError):  # no file: a real node
        counters["reset"] = int(read_text(gpu_dir / RESET_COUNT_FILE))
    return counters


def _rises(before: Counters, now: Counters) -> list[str]:
    """Why a GPU is unhealthy now, from its counters then and now."""
    reasons = []
    for name, count in sorted(now.items()):
        rise = count - before.get(name, count)
        if rise <= 0:
            continue
        if name == "reset":
            reasons.append(f"GPU reset ({rise} since last check)")
        else:
            reasons.append(f"RAS uncorrectable errors in {name}: {rise}")
    return reasons


class AmdHealthWatcher:
    """Polls the GPUs' counters; reports rises to ``tracker`` and time into recovery."""

    def __init__(
        self,
        sysfs_root: Path,
        devices: Sequence[Device],
        tracker: HealthTracker,
        *,
        interval: float = 5.0,
        recovery_after: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tracker = tracker
        self.interval = interval
        self.recovery_after = recovery_after
        self._clock = clock
        self._driver = amdgpu_driver_dir(sysfs_root)
        self._by_bdf: dict[str, list[str]] = {}
        for device in devices:
            bdf = device.attributes.get(PCI_BUS_ID_ATTRIBUTE)
            if isinstance(bdf, str):
                self._by_bdf.setdefault(bdf, []).append(device.name)
        # Counts at start are the baseline: errors from before the plugin ran are
        # history (they may be years old), only new ones mark a device.
        self._seen = {bdf: self._read(bdf) or {} for bdf in self._by_bdf}
        self._hit: dict[str, tuple[float, str]] = {}  # device -> (last error time, why)

    def _read(self, bdf: str) -> Counters | None:
        """The GPU's counters, None when it is no longer bound to amdgpu."""
        link = self._driver / bdf
        return read_counters(link) if link.exists() else None

    def poll(self) -> None:
        """Read every GPU's counters once, mark new errors, recover quiet devices."""
        now = self._clock()
        for bdf, names in self._by_bdf.items():
            counters = self._read(bdf)
            if counters is None:
                reasons = [f"GPU {bdf} is no longer bound to amdgpu"]
            else:
                reasons = _rises(self._seen[bdf], counters)
                self._seen[bdf] = self._seen[bdf] | counters
            if reasons:
                for name in names:
                    self._hit[name] = (now, "; ".join(reasons))
        self._recover(now)
        self.tracker.report(SOURCE, {n: why for n, (_, why) in self._hit.items()})

    def _recover(self, now: float) -> None:
        quiet = [n for n, (t, _) in self._hit.items() if now - t >= self.recovery_after]
        for name in quiet:
            del self._hit[name]

    def run(self, stop: threading.Event) -> None:
        """Poll every ``interval`` seconds until ``stop``; a failed poll is logged."""
        while not stop.is_set():
            try:
                self.poll()
            except OSError as err:
                log.warning("AMD health poll failed", extra={"error": str(err)})
            stop.wait(self.interval)

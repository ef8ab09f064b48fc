"""AMD GPU health from sysfs counters: RAS uncorrectable errors and GPU resets.

What is real and what is drasil's:

- RAS: amdgpu keeps per-IP-block error counts in ``<gpu dir>/ras/<block>_err_count``
  (``umc``, ``gfx``, ``sdma``, ``mmhub``, ``xgmi_wafl``, ...), lines ``ue: N`` and
  ``ce: N`` (newer kernels add ``de: N``, deferred). Real, on RAS-capable GPUs.
- resets: the kernel has no reset counter in sysfs, but amdgpu writes a device core
  dump when it resets a GPU (``amdgpu_coredump``, with ``CONFIG_DEV_COREDUMP``, which
  distribution kernels set): ``<root>/class/devcoredump/devcd<N>``, whose
  ``failing_device`` link names the GPU's PCI device. The kernel numbers dumps from a
  counter that only grows and removes each after five minutes (or once read), so a
  name not seen before is a new reset; polling every few seconds misses none. Dumps
  present when the watcher starts are history. Resets amdgpu makes without a dump
  (SR-IOV, some RAS-triggered ones) show as RAS counts, or not at all.

Semantics mirror the NVIDIA XID watcher (``drasil.driver.nvidia.xid``): a
device (a GPU and all its partitions) whose uncorrectable count rose since the watcher
started, or whose GPU was reset, is reported unhealthy under source ``amd``; it
recovers once ``recovery_after`` seconds pass without a new error and its GPU is still
bound to amdgpu. A GPU that vanished from the driver is unhealthy until it is back.
Correctable errors are corrected by hardware and are not a health problem.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

from drasil.driver.amd.sysfs import SysfsError, amdgpu_driver_dir, read_text
from drasil.driver.devices import PCI_BUS_ID_ATTRIBUTE, Device
from drasil.driver.health import HealthTracker

log = logging.getLogger(__name__)

SOURCE: Final = "amd"
MAX_RAS_BLOCKS: Final = 32
MAX_CORE_DUMPS: Final = 256  # the kernel keeps a dump five minutes; a few exist at once
_UE_LINE: Final = re.compile(r"^ue:\s*(\d+)\s*$", re.MULTILINE)

Counters = dict[str, int]
"""Per GPU: RAS block → uncorrectable count."""


def core_dump_dir(root: Path) -> Path:
    return root / "class" / "devcoredump"


def read_core_dumps(root: Path) -> dict[str, str]:
    """The device core dumps there are now: name → the failing device's PCI address."""
    base = core_dump_dir(root)
    if not base.is_dir():
        return {}
    dumps = {}
    for entry in itertools.islice(base.iterdir(), MAX_CORE_DUMPS):
        with contextlib.suppress(OSError):  # removed meanwhile, or not a dump
            dumps[entry.name] = Path(os.readlink(entry / "failing_device")).name
    return dumps


def read_counters(gpu_dir: Path) -> Counters:
    """The uncorrectable RAS counts of a GPU; unreadable files (``Query currently
    inaccessible`` during a reset, say) are left out."""
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
    return counters


def _rises(before: Counters, now: Counters) -> list[str]:
    """Why a GPU is unhealthy now, from its counters then and now."""
    reasons = []
    for name, count in sorted(now.items()):
        rise = count - before.get(name, count)
        if rise > 0:
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
        self._root = sysfs_root
        self._driver = amdgpu_driver_dir(sysfs_root)
        self._by_bdf: dict[str, list[str]] = {}
        for device in devices:
            bdf = device.attributes.get(PCI_BUS_ID_ATTRIBUTE)
            if isinstance(bdf, str):
                self._by_bdf.setdefault(bdf, []).append(device.name)
        # Counts at start are the baseline: errors from before the plugin ran are
        # history (they may be years old), only new ones mark a device.
        self._seen = {bdf: self._read(bdf) or {} for bdf in self._by_bdf}
        self._dumps = set(read_core_dumps(sysfs_root))
        self._hit: dict[str, tuple[float, str]] = {}  # device -> (last error time, why)

    def _read(self, bdf: str) -> Counters | None:
        """The GPU's counters, None when it is no longer bound to amdgpu."""
        link = self._driver / bdf
        return read_counters(link) if link.exists() else None

    def poll(self) -> None:
        """Read every GPU's counters once, mark new errors, recover quiet devices."""
        now = self._clock()
        resets = self._new_resets()
        for bdf, names in self._by_bdf.items():
            counters = self._read(bdf)
            if counters is None:
                reasons = [f"GPU {bdf} is no longer bound to amdgpu"]
            else:
                reasons = _rises(self._seen[bdf], counters)
                self._seen[bdf] = self._seen[bdf] | counters
            reasons += [f"GPU reset (amdgpu core dump {d})" for d in resets.get(bdf, ())]
            if reasons:
                for name in names:
                    self._hit[name] = (now, "; ".join(reasons))
        self._recover(now)
        self.tracker.report(SOURCE, {n: why for n, (_, why) in self._hit.items()})

    def _new_resets(self) -> dict[str, list[str]]:
        """PCI address → the core dumps written for it since the last poll."""
        dumps = read_core_dumps(self._root)
        resets: dict[str, list[str]] = {}
        for name, bdf in sorted(dumps.items()):
            if name not in self._dumps:
                resets.setdefault(bdf, []).append(name)
        self._dumps = set(dumps)  # the kernel never reuses a name within a boot
        return resets

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

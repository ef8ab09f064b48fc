"""The AMD health watcher: RAS counters and reset core dumps into HealthTracker, and recovery."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

from amdtrees import tree

from drasil.driver.amd.devices import discover_amd
from drasil.driver.amd.health import AmdHealthWatcher, read_counters
from drasil.driver.health import HealthTracker
from drasil.driver.simulated.amdsysfs import bump_ras_errors, layout, record_reset


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _setup(tmp_path: Path) -> tuple[Path, list[str], AmdHealthWatcher, HealthTracker, Clock]:
    entries = [("mi300x-cpx", 1), ("mi210", 1)]
    root = tree(tmp_path, *entries)
    bdfs = [g.bdf for g in layout(entries, "node-a")]
    devices = discover_amd(root).devices
    clock = Clock()
    tracker = HealthTracker(devices, clock=clock)
    watcher = AmdHealthWatcher(root, devices, tracker, recovery_after=60.0, clock=clock)
    return root, bdfs, watcher, tracker, clock


def test_old_errors_are_history(tmp_path: Path) -> None:
    root = tree(tmp_path, ("mi210", 1))
    bdf = layout([("mi210", 1)], "node-a")[0].bdf
    bump_ras_errors(root, bdf, uncorrectable=7)  # before the watcher starts
    devices = discover_amd(root).devices
    tracker = HealthTracker(devices)
    AmdHealthWatcher(root, devices, tracker).poll()
    assert tracker.unhealthy() == {}


def test_ras_errors_mark_gpu_and_partitions_then_recover(tmp_path: Path) -> None:
    root, bdfs, watcher, tracker, clock = _setup(tmp_path)
    watcher.poll()
    assert tracker.unhealthy() == {}
    bump_ras_errors(root, bdfs[0], "umc", uncorrectable=3)
    bump_ras_errors(root, bdfs[1], "gfx", uncorrectable=0, correctable=9)  # corrected
    watcher.poll()
    unhealthy = tracker.unhealthy()
    assert sorted(unhealthy) == [f"amdgpu-1-cpx-{i}" for i in range(8)]
    assert unhealthy["amdgpu-1-cpx-5"] == "amd: RAS uncorrectable errors in umc: 3"
    clock.now += 59
    watcher.poll()
    assert len(tracker.unhealthy()) == 8
    clock.now += 1
    watcher.poll()
    assert tracker.unhealthy() == {}


def test_new_errors_restart_the_recovery_time(tmp_path: Path) -> None:
    root, bdfs, watcher, tracker, clock = _setup(tmp_path)
    bump_ras_errors(root, bdfs[1], "umc")
    watcher.poll()
    clock.now += 50
    bump_ras_errors(root, bdfs[1], "sdma", uncorrectable=2)
    watcher.poll()
    assert tracker.unhealthy() == {"amdgpu-9": "amd: RAS uncorrectable errors in sdma: 2"}
    clock.now += 50
    watcher.poll()
    assert "amdgpu-9" in tracker.unhealthy()
    clock.now += 10
    watcher.poll()
    assert tracker.unhealthy() == {}


def test_reset_marks_the_gpu(tmp_path: Path) -> None:
    root, bdfs, watcher, tracker, _ = _setup(tmp_path)
    name = record_reset(root, bdfs[1])
    watcher.poll()
    assert tracker.unhealthy() == {"amdgpu-9": f"amd: GPU reset (amdgpu core dump {name})"}


def test_core_dumps_from_before_the_start_and_of_other_devices_mark_nothing(
    tmp_path: Path,
) -> None:
    root, bdfs, _, _, _ = _setup(tmp_path)
    old = record_reset(root, bdfs[0])  # before the watcher below starts: history
    other = root / "class/devcoredump/devcd90"  # a dump of a device that is no GPU of ours
    other.mkdir(parents=True)
    (other / "failing_device").symlink_to("../../../devices/pci0000:00/0000:00:14.3")
    devices = discover_amd(root).devices
    clock = Clock()
    tracker = HealthTracker(devices, clock=clock)
    watcher = AmdHealthWatcher(root, devices, tracker, recovery_after=60.0, clock=clock)
    watcher.poll()
    assert tracker.unhealthy() == {}
    # The kernel removes a dump after five minutes; a later one has a new number.
    shutil.rmtree(root / "class/devcoredump" / old)
    record_reset(root, bdfs[1])
    watcher.poll()
    assert list(tracker.unhealthy()) == ["amdgpu-9"]
    clock.now += 60
    watcher.poll()
    assert tracker.unhealthy() == {}


def test_unbound_gpu_stays_unhealthy(tmp_path: Path) -> None:
    root, bdfs, watcher, tracker, clock = _setup(tmp_path)
    link = root / "bus/pci/drivers/amdgpu" / bdfs[1]
    target = link.readlink()
    link.unlink()
    watcher.poll()
    clock.now += 600
    watcher.poll()
    assert tracker.unhealthy() == {"amdgpu-9": f"amd: GPU {bdfs[1]} is no longer bound to amdgpu"}
    link.symlink_to(target)
    clock.now += 60
    watcher.poll()
    assert tracker.unhealthy() == {}


def test_read_counters_formats(tmp_path: Path) -> None:
    ras = tmp_path / "ras"
    ras.mkdir()
    (ras / "umc_err_count").write_text("ue: 4\nce: 1\nde: 2\n")
    (ras / "gfx_err_count").write_text("Query currently inaccessible\n")
    (ras / "features").write_text("feature mask: 0x3fff\n")
    assert read_counters(tmp_path) == {"umc": 4}


def test_run_stops(tmp_path: Path) -> None:
    _, _, watcher, tracker, _ = _setup(tmp_path)
    stop = threading.Event()
    stop.set()
    watcher.run(stop)  # returns at once; no poll needed
    thread = threading.Thread(target=watcher.run, args=(stop,))
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert tracker.unhealthy() == {}

"""Device health: the tracker, the fault file, and XID events from the simulated NVML."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from drasil.driver.devices import Device, DeviceType
from drasil.driver.health import (
    FaultFileWatcher,
    HealthTracker,
    read_faults,
    write_faults,
)
from drasil.driver.nvidia.nodedevices import discover
from drasil.driver.nvidia.nvml import (
    EVENT_TYPE_XID_CRITICAL_ERROR,
    NO_INSTANCE,
    EventData,
    Placement,
)
from drasil.driver.nvidia.xid import BENIGN_XIDS, XidWatcher
from drasil.driver.simulated.nvml import FakeNvml, simulated_library

NODE = "n1"
DEADLINE = 20.0


def wait_until(condition: Callable[[], object], *, what: str) -> None:
    end = time.monotonic() + DEADLINE
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def node(profile: str = "h100-80gb:4") -> tuple[FakeNvml, list[Device]]:
    lib = simulated_library(profile, node_name=NODE)
    lib.init()
    return lib, list(discover(lib, node_name=NODE).devices)


def xid_event(
    lib: FakeNvml, index: int, xid: int, *, gi: int = NO_INSTANCE, ci: int = NO_INSTANCE
) -> EventData:
    return EventData(
        device=lib.device_handle_by_index(index),
        event_type=EVENT_TYPE_XID_CRITICAL_ERROR,
        event_data=xid,
        gpu_instance_id=gi,
        compute_instance_id=ci,
    )


# ---- HealthTracker --------------------------------------------------------------------


def test_tracker_starts_healthy() -> None:
    _, devices = node()
    tracker = HealthTracker(devices, clock=Clock())
    assert tracker.version == 0
    assert tracker.unhealthy() == {}
    snapshot = tracker.snapshot()
    assert sorted(snapshot) == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
    assert all(h.healthy and h.message == "" and h.since == 1000.0 for h in snapshot.values())


def test_report_marks_unhealthy_and_bumps_version_only_on_change() -> None:
    _, devices = node()
    clock = Clock()
    tracker = HealthTracker(devices, clock=clock)
    clock.now = 1005.0
    assert tracker.report("xid", {"gpu-1": "XID 79"}) is True
    assert tracker.version == 1
    assert tracker.unhealthy() == {"gpu-1": "xid: XID 79"}
    health = tracker.snapshot()["gpu-1"]
    assert (health.healthy, health.since) == (False, 1005.0)
    assert tracker.snapshot()["gpu-0"].since == 1000.0

    # The same report again, or one about a device the node does not have: no change.
    assert tracker.report("xid", {"gpu-1": "XID 79"}) is False
    assert tracker.report("faults", {"gpu-99": "not ours"}) is False
    assert tracker.version == 1
    assert tracker.unhealthy() == {"gpu-1": "xid: XID 79"}


def test_sources_merge_and_clear_independently() -> None:
    _, devices = node()
    tracker = HealthTracker(devices, clock=Clock())
    tracker.report("xid", {"gpu-2": "XID 79"})
    tracker.report("faults", {"gpu-2": "injected", "gpu-3": "fan"})
    # Every source's reason, in source order.
    assert tracker.unhealthy() == {"gpu-2": "faults: injected; xid: XID 79", "gpu-3": "faults: fan"}

    assert tracker.report("faults", {}) is True
    assert tracker.unhealthy() == {"gpu-2": "xid: XID 79"}
    assert tracker.report("xid", {}) is True
    assert tracker.unhealthy() == {}
    assert tracker.version == 4


def test_a_source_that_does_not_taint_leaves_its_devices_schedulable() -> None:
    _, devices = node()
    tracker = HealthTracker(devices, clock=Clock())
    tracker.report("mps", {"gpu-0": "its MPS daemon died"}, taint=False)
    tracker.report("xid", {"gpu-1": "XID 79"})
    assert set(tracker.unhealthy()) == {"gpu-0", "gpu-1"}  # both unhealthy for their Pods
    assert tracker.tainted() == {"gpu-1"}  # only the XID keeps the scheduler away
    tracker.report("xid", {"gpu-0": "XID 79"})
    assert tracker.tainted() == {"gpu-0"}


def test_wait_for_change_wakes_a_waiting_thread() -> None:
    _, devices = node()
    tracker = HealthTracker(devices)
    # Nothing changes: the wait ends at its timeout with the version it was given.
    assert tracker.wait_for_change(0, timeout=0.01) == 0

    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(tracker.wait_for_change(0, timeout=60)))
    waiter.start()
    tracker.report("faults", {"gpu-0": "injected"})
    waiter.join(timeout=DEADLINE)
    assert got == [1]
    # A version already different returns at once.
    assert tracker.wait_for_change(0, timeout=60) == 1


# ---- the fault file -------------------------------------------------------------------


def test_fault_file_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "faults.json"
    assert read_faults(path) == {}
    write_faults(path, {"gpu-3": "b", "gpu-1": "a"})
    assert read_faults(path) == {"gpu-1": "a", "gpu-3": "b"}
    assert list(json.loads(path.read_text())) == ["gpu-1", "gpu-3"]  # sorted
    assert not list(path.parent.glob("*.tmp"))


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '"gpu-0"', ""])
def test_unusable_fault_file_means_no_faults(tmp_path: Path, content: str) -> None:
    path = tmp_path / "faults.json"
    path.write_text(content)
    assert read_faults(path) == {}


def test_fault_file_watcher_follows_the_file(tmp_path: Path) -> None:
    _, devices = node()
    tracker = HealthTracker(devices)
    path = tmp_path / "faults.json"
    watcher = FaultFileWatcher(path, tracker)

    watcher.poll()  # no file: no faults
    assert tracker.unhealthy() == {}

    write_faults(path, {"gpu-2": "injected by test", "gpu-9": "unknown device"})
    watcher.poll()
    assert tracker.unhealthy() == {"gpu-2": "faults: injected by test"}

    write_faults(path, {"gpu-0": "other"})
    watcher.poll()
    assert tracker.unhealthy() == {"gpu-0": "faults: other"}

    path.unlink()
    watcher.poll()
    assert tracker.unhealthy() == {}


def test_fault_file_watcher_runs_until_stopped(tmp_path: Path) -> None:
    _, devices = node()
    tracker = HealthTracker(devices)
    path = tmp_path / "faults.json"
    stop = threading.Event()
    thread = threading.Thread(
        target=FaultFileWatcher(path, tracker, interval=0.01).run, args=(stop,)
    )
    thread.start()
    try:
        write_faults(path, {"gpu-1": "broken"})
        wait_until(lambda: tracker.unhealthy() == {"gpu-1": "faults: broken"}, what="fault")
        write_faults(path, {})
        wait_until(lambda: tracker.unhealthy() == {}, what="recovery")
    finally:
        stop.set()
        thread.join(timeout=DEADLINE)
    assert not thread.is_alive()


# ---- XID events -----------------------------------------------------------------------


@pytest.mark.parametrize("xid", sorted(BENIGN_XIDS))
def test_benign_xids_are_ignored(xid: int) -> None:
    lib, devices = node()
    tracker = HealthTracker(devices)
    XidWatcher(lib, devices, tracker).handle(xid_event(lib, 1, xid))
    assert tracker.unhealthy() == {}
    assert tracker.version == 0


def test_benign_xid_list_is_the_documented_one() -> None:
    assert frozenset({13, 31, 43, 45, 68, 109}) == BENIGN_XIDS


def test_critical_xid_makes_its_gpu_unhealthy() -> None:
    lib, devices = node()
    tracker = HealthTracker(devices)
    watcher = XidWatcher(lib, devices, tracker)
    watcher.handle(xid_event(lib, 2, 79))
    assert tracker.unhealthy() == {"gpu-2": "xid: XID 79"}


def test_events_other_than_xid_are_ignored() -> None:
    lib, devices = node()
    tracker = HealthTracker(devices)
    event = EventData(device=lib.device_handle_by_index(0), event_type=0, event_data=79)
    XidWatcher(lib, devices, tracker).handle(event)
    assert tracker.unhealthy() == {}


def test_event_for_a_gpu_nvml_cannot_name_is_dropped() -> None:
    lib, devices = node()
    tracker = HealthTracker(devices)
    lib.fail_device(0, call="device_uuid")
    XidWatcher(lib, devices, tracker).handle(xid_event(lib, 0, 79))
    assert tracker.unhealthy() == {}


def mig_node() -> tuple[FakeNvml, list[Device]]:
    lib, devices = node("a100-40gb-mig:1,h100-80gb:1")
    assert any(d.type == DeviceType.MIG for d in devices)
    return lib, devices


def test_mig_xid_hits_only_the_mig_device_it_names() -> None:
    lib, devices = mig_node()
    tracker = HealthTracker(devices)
    watcher = XidWatcher(lib, devices, tracker)
    mig = lib.gpus[0].migs[2].instance
    target = next(
        d.name
        for d in devices
        if d.type == DeviceType.MIG
        and d.name.endswith(f"-{mig.gpu_instance_id}-{mig.compute_instance_id}")
    )
    watcher.handle(xid_event(lib, 0, 94, gi=mig.gpu_instance_id, ci=mig.compute_instance_id))
    assert tracker.unhealthy() == {target: "xid: XID 94"}


def test_whole_gpu_xid_hits_every_mig_device_of_that_gpu() -> None:
    lib, devices = mig_node()
    tracker = HealthTracker(devices)
    XidWatcher(lib, devices, tracker).handle(xid_event(lib, 0, 79))
    parent = lib.gpus[0].uuid
    expected = {d.name for d in devices if d.parent_uuid == parent}
    assert len(expected) == len(lib.gpus[0].migs)
    assert set(tracker.unhealthy()) == expected  # and not gpu-1


def test_recovery_after_a_quiet_period() -> None:
    lib, devices = node()
    tracker = HealthTracker(devices)
    clock = Clock(0.0)
    watcher = XidWatcher(lib, devices, tracker, recovery_after=300.0, clock=clock)
    watcher.handle(xid_event(lib, 1, 79))

    clock.now = 299.0
    watcher.recover()
    assert tracker.unhealthy() == {"gpu-1": "xid: XID 79"}

    # Another XID restarts the quiet period.
    watcher.handle(xid_event(lib, 1, 48))
    clock.now = 500.0
    watcher.recover()
    assert tracker.unhealthy() == {"gpu-1": "xid: XID 48"}

    clock.now = 599.0
    watcher.recover()
    assert tracker.unhealthy() == {}


def test_no_recovery_while_the_gpu_does_not_answer() -> None:
    lib, devices = node()
    tracker = HealthTracker(devices)
    clock = Clock(0.0)
    watcher = XidWatcher(lib, devices, tracker, recovery_after=10.0, clock=clock)
    watcher.handle(xid_event(lib, 3, 79))
    lib.fail_device(3, call="device_handle_by_index")
    clock.now = 100.0
    watcher.recover()
    assert tracker.unhealthy() == {"gpu-3": "xid: XID 79"}

    lib.clear_faults()
    watcher.recover()
    assert tracker.unhealthy() == {}


def test_run_watches_injected_xids_until_stopped() -> None:
    lib, devices = node()
    tracker = HealthTracker(devices)
    watcher = XidWatcher(lib, devices, tracker)
    stop = threading.Event()
    thread = threading.Thread(target=watcher.run, args=(stop,))
    thread.start()
    try:
        # inject_xid reaches only registered event sets: the first delivery is also
        # the sign that the watcher is listening.
        wait_until(lambda: lib.inject_xid(0, 13) == 1, what="the XID event registration")
        assert lib.inject_xid(2, 79) == 1
        # Events arrive in order, so the benign one was handled before this one.
        wait_until(lambda: tracker.unhealthy() == {"gpu-2": "xid: XID 79"}, what="XID 79")
    finally:
        stop.set()
        thread.join(timeout=DEADLINE)
    assert not thread.is_alive()
    assert lib.inject_xid(1, 79) == 0  # the event set was freed


def test_run_delivers_mig_events() -> None:
    lib, devices = mig_node()
    tracker = HealthTracker(devices)
    stop = threading.Event()
    thread = threading.Thread(target=XidWatcher(lib, devices, tracker).run, args=(stop,))
    thread.start()
    try:
        wait_until(lambda: lib.inject_xid(0, 13) == 1, what="the XID event registration")
        lib.inject_xid(0, 94, mig=1)
        mig = lib.gpus[0].migs[1]
        target = next(d.name for d in devices if d.uuid == mig.uuid)
        wait_until(lambda: tracker.unhealthy() == {target: "xid: XID 94"}, what="MIG XID")
    finally:
        stop.set()
        thread.join(timeout=DEADLINE)


def test_a_gpu_without_xid_events_leaves_the_others_watched() -> None:
    lib, devices = node()
    tracker = HealthTracker(devices)
    lib.fail_device(1, call="device_register_events")
    stop = threading.Event()
    thread = threading.Thread(target=XidWatcher(lib, devices, tracker).run, args=(stop,))
    thread.start()
    try:
        # GPUs register in order: the last one's delivery means all are done.
        wait_until(lambda: lib.inject_xid(3, 13) == 1, what="the XID event registration")
        assert lib.inject_xid(1, 79) == 0  # not registered
        assert lib.inject_xid(2, 79) == 1
        wait_until(lambda: tracker.unhealthy() == {"gpu-2": "xid: XID 79"}, what="XID 79")
    finally:
        stop.set()
        thread.join(timeout=DEADLINE)


def test_no_gpu_with_xid_events_disables_only_xid_health() -> None:
    lib, devices = node("h100-80gb:1")
    tracker = HealthTracker(devices)
    lib.fail_device(0, call="device_register_events")
    stop = threading.Event()
    thread = threading.Thread(target=XidWatcher(lib, devices, tracker).run, args=(stop,))
    thread.start()
    thread.join(timeout=DEADLINE)  # returns on its own, without stop
    assert not thread.is_alive()
    assert tracker.unhealthy() == {}


def test_an_xid_naming_only_the_gpu_instance_hits_its_static_mig_devices() -> None:
    lib, devices = mig_node()
    tracker = HealthTracker(devices)
    watcher = XidWatcher(lib, devices, tracker)
    mig = next(d for d in devices if d.type == DeviceType.MIG)
    gi = int(mig.name.rsplit("-", 2)[1])
    watcher.handle(xid_event(lib, 0, 79, gi=gi))  # the compute instance is NO_INSTANCE
    assert mig.name in tracker.unhealthy()
    assert all(n.endswith(f"-{gi}-0") for n in tracker.unhealthy())


def test_a_lost_gpu_is_unhealthy() -> None:
    lib, devices = node("h100-80gb:2")
    tracker = HealthTracker(devices)
    watcher = XidWatcher(lib, devices, tracker)
    handles = {lib.device_uuid(h): h for h in map(lib.device_handle_by_index, range(2))}
    lib.fail_device(1, call="device_uuid")  # answers GPU_IS_LOST now
    watcher.lost(handles)
    assert set(tracker.unhealthy()) == {"gpu-1"}


def test_xid_watcher_holds_nvml_initialized_while_it_watches() -> None:
    # Discovery shut its NVML reference down; real NVML refuses event calls then.
    lib = simulated_library("h100-80gb:2", node_name="n1")
    devices = list(discover(lib, node_name="n1").devices)
    assert lib.initialized == 0
    stop = threading.Event()
    watcher = XidWatcher(lib, devices, HealthTracker(devices))
    thread = threading.Thread(target=watcher.run, args=(stop,))
    thread.start()
    try:
        end = time.monotonic() + 20
        while lib.inject_xid(0, 13) == 0:  # until the event set is registered
            assert time.monotonic() < end
            time.sleep(0.01)
        assert lib.initialized == 1
    finally:
        stop.set()
        thread.join(20)
    assert lib.initialized == 0


def test_a_dynamic_mig_xid_hits_the_placement_its_instance_sits_at() -> None:
    lib = simulated_library("h100-80gb:1", node_name="n1")
    lib.init()
    devices = list(discover(lib, node_name="n1", mig_mode="dynamic").devices)
    handle = lib.device_handle_by_index(0)
    lib.device_set_mig_mode(handle, True)
    gi = lib.create_gpu_instance(handle, 9, Placement(start=4, size=4)).gpu_instance_id
    lib.create_compute_instance(handle, gi)
    tracker = HealthTracker(devices)
    watcher = XidWatcher(lib, devices, tracker)
    watcher.handle(
        EventData(
            device=handle,
            event_type=EVENT_TYPE_XID_CRITICAL_ERROR,
            event_data=79,
            gpu_instance_id=gi,
            compute_instance_id=0,
        )
    )
    assert tracker.unhealthy() == {"gpu-0-mig-3g40gb-at-4": "xid: XID 79"}

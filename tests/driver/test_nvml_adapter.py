"""The NVML adapter's defects that only a real library shows, found against the mock.

Each test runs drasil's pynvml adapter over the C mock (``e2e/harness/mocknvml``), which keeps
NVML's rules where the simulated backend once did not: the reference-counted init,
``activationStatus``, Ampere's reset, the ``V`` profile call's NOT_SUPPORTED while MIG
mode is off, per-device event registration, the capability nodes in ``/proc``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from mocknvml_fixture import MockNodeFactory, mock_node, mock_nvml_lib

from drasil.driver.devices import Device, DeviceType, MigPlacement
from drasil.driver.health import HealthTracker
from drasil.driver.nvidia.nodedevices import discover
from drasil.driver.nvidia.nvml import (
    COMPUTE_MODE_DEFAULT,
    COMPUTE_MODE_EXCLUSIVE_PROCESS,
    COMPUTE_MODE_PROHIBITED,
    NO_INSTANCE,
    NVML_ERROR_INVALID_ARGUMENT,
    NvmlNotSupported,
    NvmlQueryError,
    Placement,
)
from drasil.driver.nvidia.nvmladapter import PynvmlLibrary
from drasil.driver.nvidia.xid import XidWatcher
from drasil.driver.simulated.nvml import FakeNvml
from drasil.kubeletplugin.vendors.nvidia.migs import MigError, MigInstances
from e2e.harness import mocknvml
from e2e.harness.mocknvml import MockNode

__all__ = ["mock_node", "mock_nvml_lib"]  # fixtures, imported for pytest

NODE = "node-a"
DEADLINE = 10.0


def adapter(node: MockNode) -> PynvmlLibrary:
    return PynvmlLibrary(dev_root=str(node.dev_root), proc_root=node.proc_root)


def fake(node: MockNode) -> FakeNvml:
    return FakeNvml(node.gpus, state_file=node.state_file, boot_id=node.boot_id)


def placement(lib: PynvmlLibrary, name: str) -> MigPlacement:
    found = {d.name: d for d in discover(lib, node_name=NODE, mig_mode="dynamic").devices}
    where = found[name].mig_placement
    assert where is not None
    return where


def mig_mode(lib: PynvmlLibrary, index: int = 0) -> tuple[bool, bool]:
    lib.init()
    try:
        mode = lib.device_mig_mode(lib.device_handle_by_index(index))
    finally:
        lib.shutdown()
    return mode.current, mode.pending


def wait_until(check: Callable[[], bool], what: str) -> None:
    end = time.monotonic() + DEADLINE
    while not check():
        if time.monotonic() > end:
            raise AssertionError(f"no {what} within {DEADLINE}s")
        time.sleep(0.02)


def inject_until(inject: Callable[[], None], check: Callable[[], bool], what: str) -> None:
    """Inject again until it shows: an event set gets only the events appended after the
    watcher made it, and the test cannot see when that was."""

    def again() -> bool:
        inject()
        return check()

    wait_until(again, what)


# ---- NVML's reference count ------------------------------------------------------------


def test_mig_changes_hold_their_own_nvml_reference(
    mock_node: MockNodeFactory, tmp_path: Path
) -> None:
    # Discovery shut NVML down; the MIG code ran on NVML's UNINITIALIZED before.
    lib = adapter(mock_node("h100-80gb:1", node_name=NODE))
    half = placement(lib, "gpu-0-mig-3g40gb-at-4")
    migs = MigInstances(lib, state_dir=tmp_path)
    instance = migs.ensure(half)
    assert instance.uuid.startswith("MIG-")
    assert migs.reconcile([], {}).destroyed == ()
    migs.destroy(instance.record())
    assert mig_mode(lib) == (True, True)


# ---- device nodes ------------------------------------------------------------------------


def test_static_mig_devices_carry_their_capability_nodes(mock_node: MockNodeFactory) -> None:
    node = mock_node("a100-40gb-mig:1", node_name=NODE)
    migs = [d for d in discover(adapter(node), node_name=NODE).devices if d.type == DeviceType.MIG]
    assert migs
    for device in migs:
        gi, ci = (int(part) for part in device.name.rsplit("-", 2)[1:])
        numbers = [mocknvml.mig_cap_minor(0, gi, None), mocknvml.mig_cap_minor(0, gi, ci)]
        assert [(c.path, c.major, c.minor) for c in device.char_devices] == [
            (f"/dev/nvidia-caps/nvidia-cap{n}", mocknvml.CAPS_MAJOR, n) for n in numbers
        ]
        assert device.device_nodes == (f"{node.dev_root}/nvidia0",)


def test_dynamic_mig_devices_carry_their_capability_nodes(
    mock_node: MockNodeFactory, tmp_path: Path
) -> None:
    lib = adapter(mock_node("h100-80gb:1", node_name=NODE))
    instance = MigInstances(lib, state_dir=tmp_path).ensure(placement(lib, "gpu-0-mig-1g10gb-at-3"))
    gi = instance.gpu_instance_id
    assert [c.minor for c in instance.char_devices] == [
        mocknvml.mig_cap_minor(0, gi, None),
        mocknvml.mig_cap_minor(0, gi, instance.compute_instance_id),
    ]
    assert {c.major for c in instance.char_devices} == {mocknvml.CAPS_MAJOR}


# ---- MIG mode ----------------------------------------------------------------------------


def test_a_gpu_in_use_keeps_its_mig_mode_and_says_why(
    mock_node: MockNodeFactory, tmp_path: Path
) -> None:
    lib = adapter(mock_node("h100-80gb:1", node_name=NODE, busy=[0]))
    half = placement(lib, "gpu-0-mig-3g40gb-at-0")
    with pytest.raises(MigError, match="in use"):
        MigInstances(lib, state_dir=tmp_path).ensure(half)
    assert mig_mode(lib) == (False, False)  # nothing left pending for the next reset


def test_ampere_is_published_whole_while_mig_mode_is_off(mock_node: MockNodeFactory) -> None:
    lib = adapter(mock_node("a100-40gb:1,h100-80gb:1", node_name=NODE))
    names = [d.name for d in discover(lib, node_name=NODE, mig_mode="dynamic").devices]
    assert "gpu-0" in names
    assert not [n for n in names if n.startswith("gpu-0-mig-")]
    assert "gpu-1-mig-3g40gb-at-4" in names


def test_ampere_is_never_switched_and_left_pending(
    mock_node: MockNodeFactory, tmp_path: Path
) -> None:
    node = mock_node("a100-40gb:1", node_name=NODE)
    lib = adapter(node)
    fake_placement = MigPlacement(
        parent_uuid=node.gpus[0].uuid,
        parent_minor=0,
        profile="3g.20gb",
        profile_id=9,
        start=4,
        size=4,
    )
    with pytest.raises(MigError, match="reset"):
        MigInstances(lib, state_dir=tmp_path).ensure(fake_placement)
    assert mig_mode(lib) == (False, False)


def test_placements_are_published_while_mig_mode_is_off(mock_node: MockNodeFactory) -> None:
    # nvmlDeviceGetGpuInstanceProfileInfoV answers NOT_SUPPORTED then; a fresh H100 in
    # dynamic mode published nothing.
    node = mock_node("h100-80gb:1,b200:1", node_name=NODE)
    got = discover(adapter(node), node_name=NODE, mig_mode="dynamic")
    want = discover(fake(node), node_name=NODE, mig_mode="dynamic")
    assert sorted(d.name for d in got.devices) == sorted(d.name for d in want.devices)
    assert got.counter_sets == want.counter_sets
    assert mig_mode(adapter(node)) == (False, False)


def test_static_mig_names_keep_the_media_extensions(mock_node: MockNodeFactory) -> None:
    lib = adapter(mock_node("h100-80gb:1", node_name=NODE))
    lib.init()
    try:
        gpu = lib.device_handle_by_index(0)
        lib.device_set_mig_mode(gpu, True)
        made = lib.create_gpu_instance(gpu, 20, Placement(start=2, size=1))  # 1g.10gb+me
        lib.create_compute_instance(gpu, made.gpu_instance_id)
    finally:
        lib.shutdown()
    (mig,) = [d for d in discover(lib, node_name=NODE).devices if d.type == DeviceType.MIG]
    assert mig.attributes["profile"] == "1g.10gb+me"
    assert mig.name == f"gpu-0-mig-1g10gbme-{made.gpu_instance_id}-0"


# ---- compute mode ------------------------------------------------------------------------


def test_the_compute_mode_is_set_and_read_back(mock_node: MockNodeFactory) -> None:
    node = mock_node("h100-80gb:2", node_name=NODE)
    lib = adapter(node)
    lib.init()
    try:
        first, second = lib.device_handle_by_index(0), lib.device_handle_by_index(1)
        assert lib.device_compute_mode(first) == COMPUTE_MODE_DEFAULT
        lib.device_set_compute_mode(first, COMPUTE_MODE_EXCLUSIVE_PROCESS)
        assert lib.device_compute_mode(first) == COMPUTE_MODE_EXCLUSIVE_PROCESS
        assert lib.device_compute_mode(second) == COMPUTE_MODE_DEFAULT
        with pytest.raises(ValueError, match="must be one of") as bad:
            lib.device_set_compute_mode(first, 4)
        assert isinstance(bad.value, NvmlQueryError)
        assert bad.value.code == NVML_ERROR_INVALID_ARGUMENT
        assert lib.device_compute_mode(first) == COMPUTE_MODE_EXCLUSIVE_PROCESS
    finally:
        lib.shutdown()
    entry = json.loads(node.state_file.read_text())["gpus"][node.gpus[0].uuid]
    assert entry["computeMode"] == COMPUTE_MODE_EXCLUSIVE_PROCESS


def test_a_mig_device_has_no_compute_mode_of_its_own(mock_node: MockNodeFactory) -> None:
    lib = adapter(mock_node("a100-40gb-mig:1", node_name=NODE))
    lib.init()
    try:
        gpu = lib.device_handle_by_index(0)
        mig = lib.device_mig_device_handle_by_index(gpu, 0)
        with pytest.raises(NvmlNotSupported):
            lib.device_compute_mode(mig)
        with pytest.raises(NvmlNotSupported):
            lib.device_set_compute_mode(mig, COMPUTE_MODE_EXCLUSIVE_PROCESS)
        # The GPU's own is there, and a MIG-enabled GPU keeps its instances.
        lib.device_set_compute_mode(gpu, COMPUTE_MODE_PROHIBITED)
        assert lib.device_compute_mode(gpu) == COMPUTE_MODE_PROHIBITED
        assert len(lib.gpu_instances(gpu)) == 4
    finally:
        lib.shutdown()


def test_the_simulated_backend_and_the_mock_share_the_compute_mode(
    mock_node: MockNodeFactory,
) -> None:
    # An L4 has no MIG: its state file entry exists only for its compute policy.
    node = mock_node("h100-80gb:1,l4:1", node_name=NODE)
    simulated, lib = fake(node), adapter(node)
    l4 = simulated.device_handle_by_index(1)
    simulated.device_set_compute_mode(l4, COMPUTE_MODE_EXCLUSIVE_PROCESS)
    simulated.device_set_time_slice(l4, 1)
    lib.init()
    try:
        assert lib.device_compute_mode(lib.device_handle_by_index(1)) == 3
        assert lib.device_compute_mode(lib.device_handle_by_index(0)) == 0
        lib.device_set_compute_mode(lib.device_handle_by_index(0), COMPUTE_MODE_PROHIBITED)
    finally:
        lib.shutdown()
    assert simulated.device_compute_mode(simulated.device_handle_by_index(0)) == 2
    # What the mock wrote keeps the L4's entry readable, and what it does not manage.
    assert simulated.device_compute_mode(l4) == COMPUTE_MODE_EXCLUSIVE_PROCESS
    assert simulated.device_time_slice(l4) == 1
    simulated.device_set_compute_mode(l4, COMPUTE_MODE_DEFAULT)
    lib.init()
    try:
        assert lib.device_compute_mode(lib.device_handle_by_index(1)) == 0
    finally:
        lib.shutdown()


# A plugin process on the mock: reads GPU 0's compute mode, then restores the default.
RESTORE = """import ctypes, sys
ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
from drasil.driver.nvidia.nvmladapter import PynvmlLibrary
lib = PynvmlLibrary()
lib.init()
gpu = lib.device_handle_by_index(0)
print(lib.device_compute_mode(gpu))
lib.device_set_compute_mode(gpu, 0)
lib.shutdown()
"""


def test_a_plugin_on_the_mock_sees_what_the_simulated_backend_set(
    mock_node: MockNodeFactory,
) -> None:
    node = mock_node("l4:2", node_name=NODE)
    # The simulated backend as a plugin runs it (strict init), in this process.
    simulated = FakeNvml(
        node.gpus, state_file=node.state_file, boot_id=node.boot_id, strict_init=True
    )
    simulated.init()
    try:
        gpu = simulated.device_handle_by_index(0)
        simulated.device_set_compute_mode(gpu, COMPUTE_MODE_EXCLUSIVE_PROCESS)
        done = subprocess.run(
            [sys.executable, "-c", RESTORE, str(mocknvml.compiled_mock())],
            env={**os.environ, **node.env()},
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert done.stdout.strip() == str(COMPUTE_MODE_EXCLUSIVE_PROCESS)
        assert simulated.device_compute_mode(gpu) == COMPUTE_MODE_DEFAULT
    finally:
        simulated.shutdown()


def test_a_reboot_resets_the_compute_mode_on_the_mock(mock_node: MockNodeFactory) -> None:
    node = mock_node("h100-80gb:1", node_name=NODE)
    lib = adapter(node)
    lib.init()
    try:
        lib.device_set_compute_mode(lib.device_handle_by_index(0), COMPUTE_MODE_EXCLUSIVE_PROCESS)
    finally:
        lib.shutdown()
    mocknvml.reboot(node)
    lib.init()
    try:
        assert lib.device_compute_mode(lib.device_handle_by_index(0)) == COMPUTE_MODE_DEFAULT
    finally:
        lib.shutdown()
    simulated = fake(node)
    assert simulated.device_compute_mode(simulated.device_handle_by_index(0)) == 0
    assert "computeMode" not in json.loads(node.state_file.read_text())["gpus"][node.gpus[0].uuid]


def test_a_bad_compute_mode_in_the_state_file_is_damage_to_the_mock(
    mock_node: MockNodeFactory,
) -> None:
    node = mock_node("a100-40gb-mig:1", node_name=NODE)
    lib = adapter(node)
    lib.init()
    try:
        gpu = lib.device_handle_by_index(0)
        lib.device_set_compute_mode(gpu, COMPUTE_MODE_EXCLUSIVE_PROCESS)
        lib.destroy_compute_instance(gpu, 2, 0)
        doc = json.loads(node.state_file.read_text())
        doc["gpus"][node.gpus[0].uuid]["computeMode"] = 9
        node.state_file.write_text(json.dumps(doc))
        # Damaged: the GPU starts from its profile, as the simulated backend does.
        assert lib.device_compute_mode(gpu) == COMPUTE_MODE_DEFAULT
        assert len(lib.compute_instances(gpu, 2)) == 1
    finally:
        lib.shutdown()
    simulated = fake(node)
    assert simulated.device_compute_mode(simulated.device_handle_by_index(0)) == 0


# ---- XID events --------------------------------------------------------------------------


Watched = tuple[HealthTracker, threading.Event, threading.Thread, list[Device]]


def watch(lib: PynvmlLibrary) -> Watched:
    devices = list(discover(lib, node_name=NODE).devices)
    tracker = HealthTracker(devices)
    stop = threading.Event()
    thread = threading.Thread(target=XidWatcher(lib, devices, tracker).run, args=(stop,))
    thread.start()
    return tracker, stop, thread, devices


def test_a_gpu_without_xid_events_leaves_the_others_watched(mock_node: MockNodeFactory) -> None:
    node = mock_node("h100-80gb:2", node_name=NODE, events_unsupported=[0])
    tracker, stop, thread, _ = watch(adapter(node))
    try:
        inject_until(
            lambda: mocknvml.inject_xid(node.events_file, node.gpus[1].uuid, 79),
            lambda: tracker.unhealthy() == {"gpu-1": "xid: XID 79"},
            "XID 79 on gpu-1",
        )
    finally:
        stop.set()
        thread.join(timeout=DEADLINE)
    assert not thread.is_alive()


def test_an_xid_naming_only_the_gpu_instance_hits_its_static_device(
    mock_node: MockNodeFactory,
) -> None:
    node = mock_node("a100-40gb-mig:1", node_name=NODE)
    lib = adapter(node)
    tracker, stop, thread, devices = watch(lib)
    mig = next(d for d in devices if d.type == DeviceType.MIG)
    gi = int(mig.name.rsplit("-", 2)[1])
    try:
        inject_until(
            lambda: mocknvml.inject_xid(node.events_file, node.gpus[0].uuid, 79, gi, NO_INSTANCE),
            lambda: mig.name in tracker.unhealthy(),
            f"XID 79 on {mig.name}",
        )
    finally:
        stop.set()
        thread.join(timeout=DEADLINE)


def test_a_lost_gpu_is_unhealthy(mock_node: MockNodeFactory) -> None:
    node = mock_node("h100-80gb:3", node_name=NODE)
    tracker, stop, thread, _ = watch(adapter(node))
    try:
        # GPUs register in order: an XID seen on the last means all are watched.
        inject_until(
            lambda: mocknvml.inject_xid(node.events_file, node.gpus[2].uuid, 79),
            lambda: "gpu-2" in tracker.unhealthy(),
            "XID 79 on gpu-2",
        )
        mocknvml.lose_gpu(node.events_file, node.gpus[1].uuid)
        wait_until(lambda: "gpu-1" in tracker.unhealthy(), "gpu-1 lost")
        assert "gpu-0" not in tracker.unhealthy()
    finally:
        stop.set()
        thread.join(timeout=DEADLINE)


def test_a_gpu_lists_its_running_processes(mock_node: MockNodeFactory) -> None:
    node = mock_node("h100-80gb:1", node_name=NODE)
    lib = adapter(node)
    lib.init()
    try:
        assert lib.device_processes(lib.device_handle_by_index(0)) == ()
    finally:
        lib.shutdown()

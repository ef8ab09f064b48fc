"""Shares of a MIG placement (``--mig-mode dynamic`` with ``--gpu-sharing consumable``).

The Preparer runs with MIG instances and GPU effects over the simulated NVML (state in
a file) and the MPS stand-in daemon, as the plugin runs them: the first share of a
placement cuts its instance and starts one MPS daemon on it (``CUDA_VISIBLE_DEVICES``
the MIG device), later shares adopt both, and the last share's unprepare stops the
daemon and destroys the instance. Crash tests kill a child process at each step of
that last unprepare.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubelet_client import (
    DRIVER,
    NODE,
    FileClaims,
    claim_json,
    crash_in_child,
    ref_of,
    result,
    spec_file,
)
from test_shares import gpu_records, spec_env

from drasil.driver.checkpoint import CHECKPOINT_DIR, CheckpointStore
from drasil.driver.devices import Device
from drasil.driver.nvidia.nodedevices import discover
from drasil.driver.nvidia.nvml import NvmlLibrary
from drasil.driver.simulated import mpsstandin
from drasil.driver.simulated.nvml import simulated_library
from drasil.kubeletplugin.dra.prepare import Preparer
from drasil.kubeletplugin.vendors.nvidia.migs import MigInstances
from drasil.kubeletplugin.vendors.nvidia.mps.daemons import (
    DaemonProgram,
    MpsDaemons,
    process_start_time,
)
from drasil.kubeletplugin.vendors.nvidia.mps.shares import GpuEffects

CONFIG_API = "resource.drasil.dev/v1beta1"
SMALL_0 = "gpu-0-mig-1g10gb-at-0"  # 9984 MiB
WIDE_0 = "gpu-0-mig-2g20gb-at-0"  # overlaps SMALL_0
UID_A = "aaaaaaaa-0000-4000-8000-0000000000a1"
UID_B = "bbbbbbbb-0000-4000-8000-0000000000b2"
UID_C = "cccccccc-0000-4000-8000-0000000000c3"


def library(root: Path) -> NvmlLibrary:
    return simulated_library("h100-80gb:1", node_name=NODE, state_file=root / "gpus.json")


def devices(root: Path) -> dict[str, Device]:
    found = discover(library(root), node_name=NODE, mig_mode="dynamic", gpu_sharing="consumable")
    return {d.name: d for d in found.devices}


def preparer(root: Path) -> Preparer:
    state, cdi = root / "state", root / "cdi"
    state.mkdir(parents=True, exist_ok=True)
    cdi.mkdir(parents=True, exist_ok=True)
    store = CheckpointStore(state / CHECKPOINT_DIR)
    store.load()
    lib = library(root)
    p = Preparer(
        driver=DRIVER,
        pool=NODE,
        devices=devices(root),
        claims=FileClaims(root / "claims"),
        store=store,
        cdi_root=cdi,
        state_dir=state,
        migs=MigInstances(lib, state_dir=state),
    )
    p.effects = GpuEffects(
        lib,
        MpsDaemons(state, program=DaemonProgram.for_backend("simulated")),
        store=store,
        state_lock=p.state_lock,
        devices=p.devices,
    )
    return p


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    MpsDaemons(tmp_path / "state", program=DaemonProgram.for_backend("simulated")).sweep(keep=())


def share(
    root: Path, uid: str, memory: str, *, device: str = SMALL_0, configs: tuple[Any, ...] = ()
) -> Any:
    entry = result(device, share_id=f"share-{uid[:4]}")
    entry["consumedCapacity"] = {"memory": memory}
    claim = claim_json(uid, entry, name=f"c-{uid[:4]}", namespace="ml", config=configs)
    FileClaims(root / "claims").put(claim)
    return ref_of(claim)


def mig_config(strategy: str) -> dict[str, Any]:
    parameters = {
        "apiVersion": CONFIG_API,
        "kind": "MigDeviceConfig",
        "sharing": {"strategy": strategy},
    }
    opaque = {"driver": DRIVER, "parameters": parameters}
    return {"source": "FromClaim", "requests": [], "opaque": opaque}


def instances(root: Path) -> list[tuple[int, int]]:
    """(start, size) of every GPU instance on the simulated GPU."""
    lib = library(root)
    lib.init()
    handle = lib.device_handle_by_index(0)
    if not lib.device_mig_mode(handle).current:
        return []
    return sorted((g.placement.start, g.placement.size) for g in lib.gpu_instances(handle))


def compute_mode(root: Path) -> int:
    lib = library(root)
    lib.init()
    return lib.device_compute_mode(lib.device_handle_by_index(0))


def daemons(root: Path) -> dict[str, int]:
    """The live stand-in daemons under the state dir: the UUID each serves → pid."""
    alive = {}
    for record in (root / "state" / "mps").glob("*/daemon.json"):
        doc = json.loads(record.read_text())
        if process_start_time(int(doc["pid"])) is not None:
            alive[str(doc["gpu"])] = int(doc["pid"])
    return alive


def spec_mounts(root: Path, uid: str) -> dict[str, str]:
    """The MPS daemon's folders a share's containers get."""
    spec = json.loads(spec_file(root, uid).read_text())
    mounts = [m for d in spec["devices"] for m in d["containerEdits"].get("mounts") or []]
    mps = ("/tmp/nvidia-mps", "/dev/shm")
    return {m["containerPath"]: m["hostPath"] for m in mounts if m["containerPath"] in mps}


def test_the_first_share_cuts_the_instance_and_the_last_destroys_it(root: Path) -> None:
    p = preparer(root)
    a, b = share(root, UID_A, "4Gi"), share(root, UID_B, "2Gi")
    assert p.prepare(a).error == ""
    assert instances(root) == [(0, 1)]
    mig = spec_env(root, UID_A)["DRASIL_DEVICE_GPU_0_MIG_1G10GB_AT_0"]
    assert mig.startswith("MIG-")
    assert p.prepare(b).error == ""
    assert instances(root) == [(0, 1)]  # adopted, not cut twice
    assert spec_env(root, UID_B)["DRASIL_DEVICE_GPU_0_MIG_1G10GB_AT_0"] == mig
    # One daemon, on the MIG device; each share has its own limits within the
    # instance's 9984 MiB (threads from the memory share: 4096/9984 -> 42 %).
    (pid,) = daemons(root).values()
    assert list(daemons(root)) == [mig]
    env_a, env_b = spec_env(root, UID_A), spec_env(root, UID_B)
    assert env_a["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"
    assert env_a["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "42"
    assert env_b["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=2048M"
    assert env_a["DRASIL_DEVICE_GPU_0_MIG_1G10GB_AT_0_SHARING_STRATEGY"] == "MPS"
    assert spec_mounts(root, UID_A) == spec_mounts(root, UID_B)
    assert gpu_records(root)[mig]["mps"]["memoryMib"] == 4096
    # Compute modes are a whole GPU's: a MIG share leaves its parent's alone.
    assert compute_mode(root) == 0
    assert "computeMode" not in gpu_records(root)[mig]
    mounts = spec_mounts(root, UID_B)
    pipe, shm = Path(mounts["/tmp/nvidia-mps"]), Path(mounts["/dev/shm"])
    with mpsstandin.connect_client(pipe, shm, pinned="0=2048M", threads="21") as client:
        assert client.memory == "2048M"

    assert p.unprepare(a) == ""
    assert instances(root) == [(0, 1)]
    assert daemons(root) == {mig: pid}
    assert p.unprepare(b) == ""
    assert instances(root) == []
    assert daemons(root) == {}
    assert gpu_records(root) == {}


def test_a_share_after_the_last_one_went_gets_a_new_instance(root: Path) -> None:
    p = preparer(root)
    a = share(root, UID_A, "4Gi")
    assert p.prepare(a).error == ""
    first = spec_env(root, UID_A)["DRASIL_DEVICE_GPU_0_MIG_1G10GB_AT_0"]
    assert p.unprepare(a) == ""
    b = share(root, UID_B, "4Gi")
    assert p.prepare(b).error == ""
    assert instances(root) == [(0, 1)]
    second = spec_env(root, UID_B)["DRASIL_DEVICE_GPU_0_MIG_1G10GB_AT_0"]
    assert list(daemons(root)) == [second]
    assert p.unprepare(b) == ""
    assert (instances(root), daemons(root)) == ([], {})
    assert first.startswith("MIG-")
    assert second.startswith("MIG-")


def test_an_overlapping_placement_is_refused_beside_a_share(root: Path) -> None:
    p = preparer(root)
    assert p.prepare(share(root, UID_A, "4Gi")).error == ""
    # The scheduler keeps them apart by counters; the node checks it too, share or not.
    error = p.prepare(share(root, UID_B, "4Gi", device=WIDE_0)).error
    assert f'device "{WIDE_0}" shares GPU memory slices with "{SMALL_0}"' in error
    assert "ml/c-aaaa" in error
    assert instances(root) == [(0, 1)]


def test_mps_configs_apply_and_other_strategies_are_refused(root: Path) -> None:
    p = preparer(root)
    assert p.prepare(share(root, UID_A, "4Gi", configs=(mig_config("MPS"),))).error == ""
    for uid, strategy in ((UID_B, "TimeSlicing"), (UID_C, "Exclusive")):
        error = p.prepare(share(root, uid, "2Gi", configs=(mig_config(strategy),))).error
        assert f"sharing.strategy: {strategy} cannot apply to a share of a MIG device" in error
        assert "the allowed value is MPS" in error
        assert p.unprepare(share(root, uid, "2Gi")) == ""
    assert instances(root) == [(0, 1)]
    assert len(daemons(root)) == 1


def test_a_restart_runs_the_daemon_of_a_prepared_instance_again(root: Path) -> None:
    p = preparer(root)
    a = share(root, UID_A, "4Gi")
    assert p.prepare(a).error == ""
    ((mig, pid),) = daemons(root).items()
    MpsDaemons(root / "state", program=DaemonProgram.for_backend("simulated")).stop(mig)
    assert daemons(root) == {}  # a node's OOM killer, say
    restarted = preparer(root)
    assert restarted.effects is not None
    restarted.effects.resume()
    assert list(daemons(root)) == [mig]
    assert compute_mode(root) == 0
    assert restarted.unprepare(a) == ""
    assert (instances(root), daemons(root), gpu_records(root)) == ([], {}, {})
    assert pid


@pytest.mark.parametrize(
    "point",
    [
        "unprepare-after-cdi",
        "mps-after-stop",
        "unprepare-after-mps-stop",
        "mig-destroy-after-ci",
        "unprepare-after-mig",
        "unprepare-after-removed",
    ],
)
def test_the_last_share_unprepared_after_a_crash_leaves_nothing(root: Path, point: str) -> None:
    a, b = share(root, UID_A, "4Gi"), share(root, UID_B, "4Gi")
    p = preparer(root)
    assert p.prepare(a).error == ""
    assert p.prepare(b).error == ""
    assert p.unprepare(a) == ""
    crash_in_child("test_mig_shares", root, "unprepare", b, point)
    restarted = preparer(root)
    assert restarted.effects is not None
    restarted.effects.resume()
    assert restarted.unprepare(b) == ""
    assert (instances(root), daemons(root), gpu_records(root)) == ([], {}, {})
    assert restarted.store.claims() == {}


def test_a_share_crashed_before_its_spec_is_prepared_again_on_the_same_instance(
    root: Path,
) -> None:
    p = preparer(root)
    assert p.prepare(share(root, UID_A, "4Gi")).error == ""
    b = share(root, UID_B, "4Gi")
    crash_in_child("test_mig_shares", root, "prepare", b, "prepare-after-mig")
    restarted = preparer(root)
    assert restarted.effects is not None
    restarted.effects.resume()
    assert restarted.prepare(b).error == ""
    assert instances(root) == [(0, 1)]
    assert len(daemons(root)) == 1
    assert restarted.unprepare(share(root, UID_A, "4Gi")) == ""
    assert restarted.unprepare(b) == ""
    assert (instances(root), daemons(root)) == ([], {})


# ---- a MIG device allocated whole, with MPS (a MigDeviceConfig) -------------------------


def whole_preparer(root: Path) -> Preparer:
    """Dynamic MIG with whole devices only (--gpu-sharing exclusive)."""
    p = preparer(root)
    found = discover(library(root), node_name=NODE, mig_mode="dynamic", gpu_sharing="exclusive")
    p.devices = {d.name: d for d in found.devices}
    assert p.effects is not None
    p.effects.devices = p.devices
    return p


def whole_mig(root: Path, uid: str) -> Any:
    claim = claim_json(
        uid, result(SMALL_0), name=f"w-{uid[:4]}", namespace="ml", config=[mig_config("MPS")]
    )
    FileClaims(root / "claims").put(claim)
    return ref_of(claim)


def test_a_whole_mig_device_with_mps_gets_a_daemon_on_its_instance(root: Path) -> None:
    p = whole_preparer(root)
    ref = whole_mig(root, UID_A)
    assert p.prepare(ref).error == ""
    assert instances(root) == [(0, 1)]
    ((mig, _),) = daemons(root).items()
    assert mig.startswith("MIG-")
    assert set(spec_mounts(root, UID_A)) == {"/tmp/nvidia-mps", "/dev/shm"}
    assert compute_mode(root) == 0  # compute modes are the whole GPU's, never set for MIG
    # The daemon's server holds the instance: unprepare stops it, then destroys it.
    assert p.unprepare(ref) == ""
    assert (instances(root), daemons(root), gpu_records(root)) == ([], {}, {})


@pytest.mark.parametrize(
    "point", ["unprepare-after-cdi", "mps-after-stop", "unprepare-after-mps-stop"]
)
def test_a_whole_mig_device_unprepared_after_a_crash_leaves_nothing(root: Path, point: str) -> None:
    ref = whole_mig(root, UID_A)
    assert whole_preparer(root).prepare(ref).error == ""
    crash_in_child("test_mig_shares", root, "unprepare", ref, point, factory="whole_preparer")
    restarted = whole_preparer(root)
    assert restarted.effects is not None
    restarted.effects.resume()
    assert restarted.unprepare(ref) == ""
    assert (instances(root), daemons(root), gpu_records(root)) == ([], {}, {})


@pytest.mark.parametrize(
    "point",
    ["prepare-after-started", "prepare-after-mig", "mps-after-start", "prepare-after-share"],
)
def test_a_whole_mig_device_prepared_after_a_crash_has_one_instance_and_daemon(
    root: Path, point: str
) -> None:
    ref = whole_mig(root, UID_A)
    crash_in_child("test_mig_shares", root, "prepare", ref, point, factory="whole_preparer")
    restarted = whole_preparer(root)
    assert restarted.effects is not None
    restarted.effects.resume()
    assert restarted.prepare(ref).error == ""
    assert instances(root) == [(0, 1)]
    assert len(daemons(root)) == 1
    assert restarted.unprepare(ref) == ""
    assert (instances(root), daemons(root), gpu_records(root)) == ([], {}, {})

"""Shares of a consumable GPU and time slices, prepared for real: MPS daemons, settle.

The Preparer runs with its GPU effects over the simulated NVML (state in a file) and
the MPS stand-in daemon, as the plugin runs them. Crash tests kill a child process at
each step and check that a restart (``resume``) and the repeated call leave exactly
one daemon while shares exist and none after the last, and the GPU's time slice as
it was.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Sequence
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

from drasil.api.checkpoint import PreparedDevice
from drasil.driver.checkpoint import CHECKPOINT_DIR, CheckpointStore
from drasil.driver.checkpointdisk import read_state
from drasil.driver.devices import CapacityPolicy, Device
from drasil.driver.nvidia.nodedevices import discover
from drasil.driver.nvidia.nvml import NvmlLibrary
from drasil.driver.simulated import mpsstandin
from drasil.driver.simulated.nvml import simulated_library
from drasil.kubeletplugin.dra.prepare import Preparer
from drasil.kubeletplugin.vendors.nvidia.mps.daemons import (
    DaemonProgram,
    MpsDaemons,
    process_start_time,
)
from drasil.kubeletplugin.vendors.nvidia.mps.shares import GpuEffects

GIB = 2**30
CONFIG_API = "resource.drasil.dev/v1beta1"
UID_A = "aaaaaaaa-0000-4000-8000-00000000000a"
UID_B = "bbbbbbbb-0000-4000-8000-00000000000b"


def library(root: Path) -> NvmlLibrary:
    return simulated_library("h100-80gb:2", node_name=NODE, state_file=root / "gpus.json")


def devices(root: Path) -> dict[str, Device]:
    """gpu-0 shareable (as --gpu-sharing consumable publishes it), gpu-1 exclusive."""
    found = {d.name: d for d in discover(library(root), node_name=NODE).devices}
    found["gpu-0"] = dataclasses.replace(
        found["gpu-0"],
        capacity={**found["gpu-0"].capacity, "computePercent": 100},
        allow_multiple_allocations=True,
        capacity_policies={
            "memory": CapacityPolicy(default=GIB, minimum=GIB, step=GIB),
            "computePercent": CapacityPolicy(default=0, minimum=0, step=1, maximum=100),
        },
    )
    return found


def preparer(root: Path) -> Preparer:
    state, cdi = root / "state", root / "cdi"
    state.mkdir(parents=True, exist_ok=True)
    cdi.mkdir(parents=True, exist_ok=True)
    store = CheckpointStore(state / CHECKPOINT_DIR)
    store.load()
    p = Preparer(
        driver=DRIVER,
        pool=NODE,
        devices=devices(root),
        claims=FileClaims(root / "claims"),
        store=store,
        cdi_root=cdi,
        state_dir=state,
    )
    p.effects = GpuEffects(
        library(root),
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


def share_claim(root: Path, uid: str, memory: str, *, configs: tuple[Any, ...] = ()) -> Any:
    entry = result("gpu-0", share_id=f"share-{uid[:4]}")
    entry["consumedCapacity"] = {"memory": memory}
    claim = claim_json(uid, entry, name=f"c-{uid[:4]}", namespace="ml", config=configs)
    FileClaims(root / "claims").put(claim)
    return ref_of(claim)


def time_slicing(interval: str) -> dict[str, Any]:
    parameters = {
        "apiVersion": CONFIG_API,
        "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": interval}},
    }
    return {
        "source": "FromClaim",
        "requests": [],
        "opaque": {"driver": DRIVER, "parameters": parameters},
    }


def daemon_pids(root: Path) -> list[int]:
    """Pids of stand-in daemons alive under the state dir (whatever the checkpoint says)."""
    pids = []
    for record in (root / "state" / "mps").glob("*/daemon.json"):
        pid = int(json.loads(record.read_text())["pid"])
        if process_start_time(pid) is not None:
            pids.append(pid)
    return pids


def compute_mode(root: Path, index: int) -> int:
    lib = library(root)
    lib.init()
    return lib.device_compute_mode(lib.device_handle_by_index(index))


def gpu_records(root: Path) -> dict[str, Any]:
    state = read_state(root / "state" / CHECKPOINT_DIR)
    return {} if state is None else {u: g.model_dump(mode="json") for u, g in state.gpus.items()}


def spec_env(root: Path, uid: str) -> dict[str, str]:
    spec = json.loads(spec_file(root, uid).read_text())
    env = [e for d in spec["devices"] for e in d["containerEdits"].get("env") or []]
    return dict(str(e).split("=", 1) for e in env)


def test_shares_run_one_daemon_with_their_own_limits_until_the_last_goes(root: Path) -> None:
    p = preparer(root)
    a, b = share_claim(root, UID_A, "20Gi"), share_claim(root, UID_B, "40Gi")
    assert p.prepare(a).error == ""
    assert p.prepare(b).error == ""
    (pid,) = daemon_pids(root)
    gpu = p.devices["gpu-0"].uuid
    assert gpu_records(root)[gpu]["mps"]["pid"] == pid
    env_a, env_b = spec_env(root, UID_A), spec_env(root, UID_B)
    assert env_a["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20480M"
    assert env_a["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert env_b["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    spec = json.loads(spec_file(root, UID_A).read_text())
    mounts = {m["containerPath"]: m for m in spec["devices"][0]["containerEdits"]["mounts"]}
    assert set(mounts) == {"/tmp/nvidia-mps", "/dev/shm"}
    # The daemon holds the larger share's limits; a client can only narrow them.
    record = gpu_records(root)[gpu]["mps"]
    assert (record["memoryMib"], record["threadPercentage"]) == (40960, 50)
    pipe, shm = Path(mounts["/tmp/nvidia-mps"]["hostPath"]), Path(mounts["/dev/shm"]["hostPath"])
    with mpsstandin.connect_client(pipe, shm, pinned="0=20480M", threads="25") as client:
        assert (client.memory, client.threads) == ("20480M", "25.0")
    with mpsstandin.connect_client(pipe, shm) as unset:
        assert (unset.memory, unset.threads) == ("40960M", "50.0")
    # EXCLUSIVE_PROCESS while the daemon runs, the GPU's own mode after.
    assert compute_mode(root, 0) == 3
    assert gpu_records(root)[gpu]["previousComputeMode"] == 0
    assert p.unprepare(a) == ""
    assert daemon_pids(root) == [pid]
    assert p.unprepare(b) == ""
    assert daemon_pids(root) == []
    assert gpu_records(root) == {}
    assert compute_mode(root, 0) == 0


def mps(percentage: int) -> dict[str, Any]:
    parameters = {
        "apiVersion": CONFIG_API,
        "kind": "GpuConfig",
        "sharing": {"strategy": "MPS", "mps": {"defaultActiveThreadPercentage": percentage}},
    }
    return {
        "source": "FromClaim",
        "requests": [],
        "opaque": {"driver": DRIVER, "parameters": parameters},
    }


def test_an_mps_config_is_applied_to_a_share_and_to_a_whole_gpu(root: Path) -> None:
    p = preparer(root)
    a = share_claim(root, UID_A, "20Gi", configs=(mps(40),))
    assert p.prepare(a).error == ""
    env = spec_env(root, UID_A)
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"  # the config's, applied
    assert env["DRASIL_DEVICE_GPU_0_SHARING_STRATEGY"] == "MPS"
    assert [n for n in env if n.startswith("DRASIL_") and "_MPS_" in n] == []
    assert len(daemon_pids(root)) == 1

    # gpu-1 is published whole: it gets a daemon of its own (tests/kubeletplugin/
    # test_whole_mps.py), beside gpu-0's.
    whole = claim_json(UID_B, result("gpu-1"), name="c-bbbb", namespace="ml", config=[mps(40)])
    FileClaims(root / "claims").put(whole)
    assert p.prepare(ref_of(whole)).error == ""
    assert spec_env(root, UID_B)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
    assert len(daemon_pids(root)) == 2
    assert p.unprepare(a) == ""
    assert p.unprepare(ref_of(whole)) == ""
    assert daemon_pids(root) == []


def test_a_share_without_a_config_says_it_is_mps(root: Path) -> None:
    p = preparer(root)
    assert p.prepare(share_claim(root, UID_A, "20Gi")).error == ""
    assert spec_env(root, UID_A)["DRASIL_DEVICE_GPU_0_SHARING_STRATEGY"] == "MPS"
    assert p.unprepare(share_claim(root, UID_A, "20Gi")) == ""


def test_a_time_slice_is_applied_and_put_back_after_the_claim(root: Path) -> None:
    p = preparer(root)
    claim = claim_json(
        UID_A, result("gpu-1"), name="sliced", namespace="ml", config=(time_slicing("Long"),)
    )
    FileClaims(root / "claims").put(claim)
    lib = library(root)
    lib.init()
    handle = lib.device_handle_by_index(1)
    lib.device_set_time_slice(handle, 1)  # what the operator had set
    assert p.prepare(ref_of(claim)).error == ""
    assert lib.device_time_slice(handle) == 3
    assert p.unprepare(ref_of(claim)) == ""
    assert lib.device_time_slice(handle) == 1
    assert gpu_records(root) == {}


def test_a_share_asking_another_sharing_is_refused_and_leaves_nothing(root: Path) -> None:
    p = preparer(root)
    assert p.prepare(share_claim(root, UID_A, "20Gi")).error == ""
    b = share_claim(root, UID_B, "20Gi", configs=(time_slicing("Long"),))
    error = p.prepare(b).error
    assert "shared with MPS by claim ml/c-aaaa" in error
    assert "ml/c-bbbb asks TimeSlicing/Long" in error
    assert p.unprepare(b) == ""  # what kubelet does with a claim it could not prepare
    assert UID_B not in p.store.claims()
    assert not spec_file(root, UID_B).exists()
    assert len(daemon_pids(root)) == 1  # the first share's daemon is untouched


# ---- crashes ---------------------------------------------------------------------------


def crashed(root: Path, operation: str, ref: Any, point: str) -> None:
    crash_in_child("test_shares", root, operation, ref, point)


def restarted(root: Path) -> Preparer:
    """The plugin after a crash: a new Preparer, and the start-up resume."""
    p = preparer(root)
    assert p.effects is not None
    p.effects.resume()
    return p


@pytest.mark.parametrize(
    "point", ["prepare-after-started", "mps-after-start", "prepare-after-share"]
)
def test_a_share_prepared_again_after_a_crash_has_exactly_one_daemon(
    root: Path, point: str
) -> None:
    ref = share_claim(root, UID_A, "20Gi")
    crashed(root, "prepare", ref, point)
    p = restarted(root)
    assert p.prepare(ref).error == ""
    (pid,) = daemon_pids(root)
    assert gpu_records(root)[p.devices["gpu-0"].uuid]["mps"]["pid"] == pid
    assert p.unprepare(ref) == ""
    assert daemon_pids(root) == []


@pytest.mark.parametrize("point", ["mps-after-start", "prepare-after-share"])
def test_a_crashed_share_unprepared_instead_leaves_no_daemon(root: Path, point: str) -> None:
    ref = share_claim(root, UID_A, "20Gi")
    crashed(root, "prepare", ref, point)
    p = restarted(root)
    assert p.unprepare(ref) == ""
    assert daemon_pids(root) == []
    assert gpu_records(root) == {}
    assert compute_mode(root, 0) == 0


@pytest.mark.parametrize(
    "point",
    ["unprepare-after-cdi", "unprepare-after-removed", "mps-after-stop", "settle-after-stop"],
)
def test_an_unprepare_after_a_crash_stops_the_daemon_once(root: Path, point: str) -> None:
    ref = share_claim(root, UID_A, "20Gi")
    assert preparer(root).prepare(ref).error == ""
    crashed(root, "unprepare", ref, point)
    p = restarted(root)
    assert p.unprepare(ref) == ""
    assert daemon_pids(root) == []
    assert gpu_records(root) == {}
    assert compute_mode(root, 0) == 0


def test_a_gpu_in_another_compute_mode_gets_it_back(root: Path) -> None:
    lib = library(root)
    lib.init()
    lib.device_set_compute_mode(lib.device_handle_by_index(0), 2)  # PROHIBITED, say
    p = preparer(root)
    ref = share_claim(root, UID_A, "20Gi")
    assert p.prepare(ref).error == ""
    assert compute_mode(root, 0) == 3
    assert p.unprepare(ref) == ""
    assert compute_mode(root, 0) == 2


def test_a_crash_between_compute_mode_and_daemon_is_put_back_at_start(root: Path) -> None:
    ref = share_claim(root, UID_A, "20Gi")
    crashed(root, "prepare", ref, "prepare-after-started")
    p = preparer(root)
    assert p.prepare(ref).error == ""
    assert p.unprepare(ref) == ""
    assert compute_mode(root, 0) == 0


class Pods:
    def __init__(self, pods: dict[str, Any]) -> None:
        self.pods = pods

    def get_pod(self, namespace: str, name: str) -> Any:
        return self.pods.get(f"{namespace}/{name}")


def pod_with(mounts: list[dict[str, str]]) -> dict[str, Any]:
    container = {"name": "c", "image": "x", "volumeMounts": mounts}
    return {"metadata": {"name": "p"}, "spec": {"containers": [container]}}


def test_a_pod_with_its_own_dev_shm_is_refused_by_name(root: Path) -> None:
    p = preparer(root)
    assert p.effects is not None
    ref = share_claim(root, UID_A, "20Gi")
    claim = json.loads(next((root / "claims").glob("*.json")).read_text())
    claim.setdefault("status", {})["reservedFor"] = [{"resource": "pods", "name": "p", "uid": "u"}]
    FileClaims(root / "claims").put(claim)
    p.effects.pods = Pods({"ml/p": pod_with([{"name": "dshm", "mountPath": "/dev/shm/"}])})
    error = p.prepare(ref).error
    assert 'Pod ml/p: container "c" mounts volume "dshm" at /dev/shm' in error
    assert "remove that volume mount" in error
    assert daemon_pids(root) == []
    assert gpu_records(root) == {}
    p.effects.pods = Pods({"ml/p": pod_with([{"name": "data", "mountPath": "/data"}])})
    assert p.prepare(ref).error == ""


def test_only_an_unprepare_that_may_leave_gpu_state_settles(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = preparer(root)
    assert p.effects is not None
    settled: list[str] = []
    real = p.effects.settle

    def counting(released: Sequence[PreparedDevice] | None = None) -> list[str]:
        settled.append("settle")
        return real(released)

    monkeypatch.setattr(p.effects, "settle", counting)
    whole = claim_json(UID_B, result("gpu-1"), name="whole", namespace="ml")
    FileClaims(root / "claims").put(whole)
    assert p.prepare(ref_of(whole)).error == ""
    assert p.unprepare(ref_of(whole)) == ""
    assert settled == []  # an exclusive whole GPU changed nothing on it
    share = share_claim(root, UID_A, "20Gi")
    assert p.prepare(share).error == ""
    assert p.unprepare(share) == ""
    assert settled == ["settle"]
    assert daemon_pids(root) == []

"""MPS on a GPU allocated whole (a GpuConfig with strategy MPS), prepared for real.

The claim's GPU gets an MPS control daemon of its own (the shares' machinery, over the
simulated NVML and the MPS stand-in): EXCLUSIVE_PROCESS while it runs, the config's
limits held by the daemon (not only in the client's environment), the pipe directory
and ``/dev/shm`` in the claim's CDI device, and all of it undone by unprepare. A crash
at every step leaves a state that the repeated call finishes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubelet_client import FileClaims, claim_json, crash_in_child, ref_of, result, spec_file
from test_shares import (
    CONFIG_API,
    DRIVER,
    UID_A,
    UID_B,
    compute_mode,
    daemon_pids,
    gpu_records,
    preparer,
    restarted,
    spec_env,
)

from drasil.driver.claims.plan import ClaimRef
from drasil.driver.simulated import mpsstandin
from drasil.kubeletplugin.vendors.nvidia.mps.daemons import DaemonProgram, MpsDaemons

GPU_1 = 1  # gpu-1 of test_shares' node is published whole
__all__ = ["preparer"]  # the crash child's: ``test_whole_mps.preparer(root)``


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    MpsDaemons(tmp_path / "state", program=DaemonProgram.for_backend("simulated")).sweep(keep=())


def mps_entry(mps: dict[str, Any] | None = None, *, requests: tuple[str, ...] = ()) -> Any:
    sharing: dict[str, Any] = {"strategy": "MPS"}
    if mps is not None:
        sharing["mps"] = mps
    parameters = {"apiVersion": CONFIG_API, "kind": "GpuConfig", "sharing": sharing}
    return {
        "source": "FromClaim",
        "requests": list(requests),
        "opaque": {"driver": DRIVER, "parameters": parameters},
    }


def whole_claim(root: Path, uid: str, *entries: Any, devices: tuple[str, ...] = ("gpu-1",)) -> Any:
    results = [result(name, request=f"r{i}") for i, name in enumerate(devices)]
    claim = claim_json(uid, *results, name=f"w-{uid[:4]}", namespace="ml", config=entries)
    FileClaims(root / "claims").put(claim)
    return ref_of(claim)


LIMITS = {"defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "10Gi"}


def mounts_of(root: Path, uid: str) -> dict[str, Path]:
    spec = json.loads(spec_file(root, uid).read_text())
    mounts = [m for d in spec["devices"] for m in d["containerEdits"].get("mounts") or []]
    return {m["containerPath"]: Path(m["hostPath"]) for m in mounts}


def test_a_whole_gpu_with_mps_gets_its_own_daemon_holding_the_configs_limits(root: Path) -> None:
    p = preparer(root)
    ref = whole_claim(root, UID_A, mps_entry(LIMITS))
    assert p.prepare(ref).error == ""
    (pid,) = daemon_pids(root)
    gpu = p.devices["gpu-1"].uuid
    record = gpu_records(root)[gpu]
    assert record["mps"]["pid"] == pid
    assert (record["mps"]["memoryMib"], record["mps"]["threadPercentage"]) == (10240, 50)
    env = spec_env(root, UID_A)
    assert env["DRASIL_DEVICE_GPU_1_SHARING_STRATEGY"] == "MPS"
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=10240M"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    mounts = mounts_of(root, UID_A)
    assert {"/tmp/nvidia-mps", "/dev/shm"} <= set(mounts)
    # The limits are the daemon's: a client that drops its variables still gets them.
    with mpsstandin.connect_client(mounts["/tmp/nvidia-mps"], mounts["/dev/shm"]) as client:
        assert (client.memory, client.threads) == ("10240M", "50.0")
    assert compute_mode(root, GPU_1) == 3  # EXCLUSIVE_PROCESS while the daemon runs
    assert compute_mode(root, 0) == 0  # the other GPU is untouched
    assert p.unprepare(ref) == ""
    assert daemon_pids(root) == []
    assert gpu_records(root) == {}
    assert compute_mode(root, GPU_1) == 0


def test_without_limits_the_daemon_gives_the_whole_gpu(root: Path) -> None:
    p = preparer(root)
    ref = whole_claim(root, UID_A, mps_entry())
    assert p.prepare(ref).error == ""
    memory_mib = p.devices["gpu-1"].capacity["memory"] // 2**20
    env = spec_env(root, UID_A)
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={memory_mib}M"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "100"
    assert p.unprepare(ref) == ""


def test_the_per_device_limit_of_the_device_wins_and_other_keys_are_refused(root: Path) -> None:
    p = preparer(root)
    gpu = p.devices["gpu-1"].uuid
    for key in ("0", gpu):
        per_device = {**LIMITS, "defaultPerDevicePinnedMemoryLimit": {key: "4Gi"}}
        ref = whole_claim(root, UID_A, mps_entry(per_device))
        assert p.prepare(ref).error == ""
        assert spec_env(root, UID_A)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"
        assert p.unprepare(ref) == ""
    wrong = whole_claim(root, UID_B, mps_entry({"defaultPerDevicePinnedMemoryLimit": {"1": "4Gi"}}))
    error = p.prepare(wrong).error
    assert error.endswith(
        'config[0] (FromClaim, all requests) for device "gpu-1": '
        "defaultPerDevicePinnedMemoryLimit: unknown device '1': the claim's MPS daemon "
        f'serves one device, gpu-1; allowed keys are "0", "{gpu}"'
    ), error
    assert daemon_pids(root) == []
    assert not spec_file(root, UID_B).exists()


def test_two_whole_gpus_with_mps_in_one_claim_are_refused(root: Path) -> None:
    p = preparer(root)
    # gpu-0 of this node is shareable; a result without a shareID is still whole.
    ref = whole_claim(root, UID_A, mps_entry(), devices=("gpu-1", "gpu-0"))
    error = p.prepare(ref).error
    assert 'MPS on devices allocated whole ("gpu-1", "gpu-0"): a claim may hold one' in error
    assert daemon_pids(root) == []
    # One MPS request beside a time-sliced one (NVIDIA's gpu-test5) is fine.
    ts = {**mps_entry(), "requests": ["r1"]}
    ts["opaque"]["parameters"]["sharing"] = {"strategy": "TimeSlicing"}
    both = whole_claim(root, UID_B, mps_entry(requests=("r0",)), ts, devices=("gpu-1", "gpu-0"))
    assert p.prepare(both).error == ""
    env = spec_env(root, UID_B)
    assert env["DRASIL_DEVICE_GPU_1_SHARING_STRATEGY"] == "MPS"
    assert env["DRASIL_DEVICE_GPU_0_SHARING_STRATEGY"] == "TimeSlicing"
    assert len(daemon_pids(root)) == 1
    assert p.unprepare(both) == ""
    assert daemon_pids(root) == []


def test_a_plugin_without_whole_device_mps_refuses_before_recording(root: Path) -> None:
    p = preparer(root)
    assert p.effects is not None
    p.effects.whole_devices = False
    ref = whole_claim(root, UID_A, mps_entry(LIMITS))
    error = p.prepare(ref).error
    assert "MPS on a device allocated whole needs MPS daemons" in error
    assert "mps.enabled=true" in error
    assert UID_A not in p.store.claims()
    assert daemon_pids(root) == []


def test_an_admin_access_request_with_mps_is_refused(root: Path) -> None:
    p = preparer(root)
    admin = {**result("gpu-1", request="r0"), "adminAccess": True}
    claim = claim_json(UID_A, admin, name="admin", namespace="ml", config=[mps_entry()])
    FileClaims(root / "claims").put(claim)
    error = p.prepare(ref_of(claim)).error
    assert 'unsupported value "MPS" for a device of an admin-access request' in error
    assert daemon_pids(root) == []


# ---- crashes ---------------------------------------------------------------------------


def crashed(root: Path, operation: str, ref: ClaimRef, point: str) -> None:
    crash_in_child("test_whole_mps", root, operation, ref, point)


@pytest.mark.parametrize(
    "point",
    ["prepare-after-started", "mps-after-start", "prepare-after-share", "prepare-after-cdi"],
)
def test_a_crashed_prepare_is_finished_by_the_repeated_call(root: Path, point: str) -> None:
    ref = whole_claim(root, UID_A, mps_entry(LIMITS))
    crashed(root, "prepare", ref, point)
    p = restarted(root)
    assert p.prepare(ref).error == ""
    (pid,) = daemon_pids(root)
    record = gpu_records(root)[p.devices["gpu-1"].uuid]["mps"]
    assert (record["pid"], record["memoryMib"], record["threadPercentage"]) == (pid, 10240, 50)
    assert compute_mode(root, GPU_1) == 3
    assert p.unprepare(ref) == ""
    assert daemon_pids(root) == []
    assert compute_mode(root, GPU_1) == 0


@pytest.mark.parametrize("point", ["mps-after-start", "prepare-after-share"])
def test_a_crashed_prepare_unprepared_instead_leaves_nothing(root: Path, point: str) -> None:
    ref = whole_claim(root, UID_A, mps_entry(LIMITS))
    crashed(root, "prepare", ref, point)
    p = restarted(root)
    assert p.unprepare(ref) == ""
    assert daemon_pids(root) == []
    assert gpu_records(root) == {}
    assert compute_mode(root, GPU_1) == 0


@pytest.mark.parametrize(
    "point",
    ["unprepare-after-cdi", "unprepare-after-removed", "mps-after-stop", "settle-after-stop"],
)
def test_a_crashed_unprepare_is_finished_by_the_repeated_call(root: Path, point: str) -> None:
    ref = whole_claim(root, UID_A, mps_entry(LIMITS))
    assert preparer(root).prepare(ref).error == ""
    crashed(root, "unprepare", ref, point)
    p = restarted(root)
    assert p.unprepare(ref) == ""
    assert daemon_pids(root) == []
    assert gpu_records(root) == {}
    assert compute_mode(root, GPU_1) == 0


def test_a_restarted_plugin_starts_a_dead_daemon_again_with_its_limits(root: Path) -> None:
    ref = whole_claim(root, UID_A, mps_entry(LIMITS))
    assert preparer(root).prepare(ref).error == ""
    (pid,) = daemon_pids(root)
    p = preparer(root)
    assert p.effects is not None
    p.effects.daemons.stop(p.devices["gpu-1"].uuid)  # the daemon died (a node OOM)
    assert daemon_pids(root) == []
    p = restarted(root)
    (again,) = daemon_pids(root)
    assert again != pid
    record = gpu_records(root)[p.devices["gpu-1"].uuid]["mps"]
    assert (record["memoryMib"], record["threadPercentage"]) == (10240, 50)
    assert p.unprepare(ref) == ""
    assert daemon_pids(root) == []

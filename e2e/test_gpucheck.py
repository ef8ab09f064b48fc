"""`make gpu-check` against the mock NVML (e2e/harness/mocknvml): every step, and a mismatch.

The fake driver root (e2e.harness.driverroot) carries the mock as its libnvidia-ml.so with the
node's config embedded and `e2e/harness/mocknvml/smi.py` as its nvidia-smi; the check runs as
`python -m drasil.kubeletplugin.gpucheck` in a subprocess, as on a GPU machine. Needs root
(mknod, ldconfig -r, the sandbox's namespaces and mounts).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from drasil.driver.simulated.nvml import simulated_library
from e2e.harness.containerkit import build_kit
from e2e.harness.mocknvml import smi

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mknod, namespaces)")

STEPS = (
    "NVML",
    "nvidia-smi vs NVML",
    "discovery vs nvidia-smi",
    "ResourceSlices",
    "prepare",
    "CDI spec",
    "nvidia-ctk",
    "sandbox probe",
    "container",
    "unprepare",
    "MPS share",
    "dynamic MIG",
)


@pytest.fixture(scope="module")
def kit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The container step's kit: the harness's containerd, runc, ctr, nvidia-cdi-hook
    and probe image, linked (the bundle carries a copy)."""
    return build_kit(tmp_path_factory.mktemp("kit") / "kit", link=True)


def check(root: smi.MockRoot, tmp: Path, *args: str, **env: str) -> tuple[int, str, dict[str, Any]]:
    report = tmp / "report.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "drasil.kubeletplugin.gpucheck",
            *root.check_args(),
            f"--json={report}",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, **env},
    )
    return done.returncode, done.stdout + done.stderr, json.loads(report.read_text())


def statuses(report: dict[str, Any]) -> dict[str, str]:
    return {s["name"]: s["status"] for s in report["steps"]}


def test_the_mock_node_passes_every_step(tmp_path: Path, kit: Path) -> None:
    root = smi.make_root(tmp_path / "node", profile="h100-80gb:2", node_name="mock-a")
    code, out, report = check(root, tmp_path, f"--container-kit={kit}")
    assert code == 0, out
    found = statuses(report)
    assert list(found) == list(STEPS)
    assert found["MPS share"] == "skipped"
    assert found["dynamic MIG"] == "skipped"
    assert "dynamic MIG:               skipped: MIG mode off" in out
    assert all(
        found[s] == "ok" for s in STEPS if s not in ("MPS share", "dynamic MIG", "nvidia-ctk")
    )
    probe = next(s for s in report["steps"] if s["name"] == "sandbox probe")["data"]["probe"]
    # Two GPUs on the node; the sandbox of the claim of gpu-0 sees only that one.
    assert probe["nvml"]["count"] == 1
    assert probe["nvml"]["uuids"] == [root.node.gpus[0].uuid]
    # The same claim under containerd (its CDI code), runc and the real nvidia-cdi-hook:
    # gpu-kernel saw the one GPU, and the fake libcuda ran its PTX kernel's values.
    ran = next(s for s in report["steps"] if s["name"] == "container")
    seen = ran["data"]["container"]
    assert seen["uuids"] == root.node.gpus[0].uuid
    assert (seen["cudaDevices"], seen["values"], seen["wrong"]) == (1, 4096, 0)
    hooks = "create-symlinks, create-symlinks, enable-cuda-compat, update-ldcache"
    assert f"hooks run by runc: {hooks}, disable-device-node-modification" in out
    assert "ctr run --device k8s.gpu.drasil.dev/claim=" in out


def test_the_container_step_says_what_the_kit_lacks(tmp_path: Path, kit: Path) -> None:
    broken = tmp_path / "kit"
    shutil.copytree(kit, broken, symlinks=True)
    (broken / "bin" / "ctr").unlink()
    root = smi.make_root(tmp_path / "node", profile="h100-80gb:1", node_name="mock-e")
    code, out, report = check(root, tmp_path, f"--container-kit={broken}")
    assert code != 0
    assert statuses(report)["container"] == "FAIL"
    assert f"the container kit {broken} lacks ctr" in out
    assert statuses(report)["unprepare"] == "ok"  # the claim is still cleaned up


REPO = Path(__file__).resolve().parents[1]


def test_make_gpu_check_mock_runs_the_bundle_with_its_container_kit(tmp_path: Path) -> None:
    """What a GPU machine gets: the bundle (built here, under 60 MiB: the build refuses
    more) run by the machine's python3, its run.py unpacking the wheels and the
    container kit and passing --container-kit itself."""
    bundle = tmp_path / "gpu-check"
    report = tmp_path / "report.json"
    done = subprocess.run(
        ["make", "gpu-check-mock", f"GPU_BUNDLE={bundle}", f"GPU_CHECK_ARGS=--json={report}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert (bundle / "containers" / "kit.json").is_file()
    found = statuses(json.loads(report.read_text()))
    assert found["container"] == "ok", done.stdout[-4000:]


def test_without_a_kit_the_container_step_is_skipped_saying_so(tmp_path: Path) -> None:
    root = smi.make_root(tmp_path / "node", profile="h100-80gb:1", node_name="mock-f")
    code, out, _ = check(root, tmp_path)
    assert code == 0, out
    assert "container:                 skipped: no container kit" in out


def test_a_wrong_uuid_from_nvidia_smi_fails_naming_it(tmp_path: Path) -> None:
    root = smi.make_root(tmp_path / "node", profile="h100-80gb:2", node_name="mock-b")
    code, out, report = check(root, tmp_path, **{smi.WRONG_UUID_ENV: "1"})
    assert code != 0
    assert statuses(report)["nvidia-smi vs NVML"] == "FAIL"
    assert f"GPU {smi.WRONG_UUID}: in nvidia-smi, not found by drasil (UUID mismatch?)" in out
    assert not report["passed"]


def free_instances(root: smi.MockRoot) -> int:
    """Destroy every MIG instance of the node (through the simulated backend, whose
    state file the mock shares); the number left, which must be 0."""
    lib = simulated_library(
        root.node.profile, node_name=root.node.node_name, state_file=root.node.state_file
    )
    lib.init()
    try:
        handle = lib.device_handle_by_index(1)
        for gi in lib.gpu_instances(handle):
            for ci in lib.compute_instances(handle, gi.gpu_instance_id):
                lib.destroy_compute_instance(handle, gi.gpu_instance_id, ci.compute_instance_id)
            lib.destroy_gpu_instance(handle, gi.gpu_instance_id)
        return len(lib.gpu_instances(handle))
    finally:
        lib.shutdown()


def test_dynamic_mig_leaves_existing_instances_alone(tmp_path: Path) -> None:
    # The MIG profile's layout holds all 7 slices: adopting one would destroy it.
    root = smi.make_root(tmp_path / "node", profile="l4:1,a100-40gb-mig:1", node_name="mock-c")
    code, out, _ = check(root, tmp_path)
    assert code == 0, out
    assert "dynamic MIG:               skipped: no free MIG placement" in out


def test_dynamic_mig_cuts_and_destroys_an_instance_where_mig_mode_is_on(tmp_path: Path) -> None:
    root = smi.make_root(tmp_path / "node", profile="l4:1,a100-40gb-mig:1", node_name="mock-d")
    assert free_instances(root) == 0
    code, out, report = check(root, tmp_path)
    assert code == 0, out
    assert statuses(report)["dynamic MIG"] == "ok", out
    assert "gpu-1-mig-1g5gb-at-" in out
    assert free_instances(root) == 0  # nothing left behind

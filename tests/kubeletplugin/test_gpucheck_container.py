"""The GPU check's container step, its parts that need no containerd: the kit, where it
cannot run, its containerd's config and the verdict on what gpu-kernel printed. The step
itself runs under a real containerd in e2e/test_gpucheck.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from drasil.kubeletplugin.gpucheck import container
from drasil.kubeletplugin.gpucheck.container import KitError, Run, kernel_problems

UUID = "GPU-91ab0b79-f842-531f-b6c8-197a689790ea"
OTHER = "GPU-bfbdab47-f964-5ac9-aaab-081615d3818b"
GOOD = {
    "uuids": UUID,
    "nvmlDevices": 1,
    "cuInit": 0,
    "cudaDevices": 1,
    "freeMiB": 81408,
    "totalMiB": 81920,
    "kernel": "drasil_fill",
    "values": 4096,
    "wrong": 0,
}


def _kit(root: Path, *, without: str = "") -> Path:
    (root / "bin").mkdir(parents=True)
    for name in (*container.BINARIES, "nvidia-cdi-hook"):
        if name != without:
            (root / "bin" / name).write_text("#!/bin/sh\n")
            (root / "bin" / name).chmod(0o755)
    (root / "image.oci.tar").write_bytes(b"")
    (root / "kit.json").write_text(json.dumps({"image": "i:1", "probe": "/p"}))
    return root


def test_a_kit_names_its_image_probe_and_hook(tmp_path: Path) -> None:
    kit = container.load_kit(_kit(tmp_path / "kit"))
    assert (kit.image, kit.probe) == ("i:1", "/p")
    assert kit.bin("ctr") == tmp_path / "kit" / "bin" / "ctr"
    assert container.kit_hook(tmp_path / "kit") == str(tmp_path / "kit/bin/nvidia-cdi-hook")
    assert container.kit_hook(None) is None


def test_a_kit_for_another_machine_is_skipped_saying_so(tmp_path: Path) -> None:
    root = _kit(tmp_path / "kit")
    (root / "kit.json").write_text(json.dumps({"image": "i", "probe": "/p", "machine": "m68k"}))
    step = container.container_step(
        root, cdi_dir=tmp_path, cdi_ids=(), expected=(), hooks=(), work=tmp_path / "w"
    )
    assert step.status == "skipped"
    assert step.summary.startswith("the container kit is for m68k, this is ")


def test_a_kit_without_a_binary_says_which(tmp_path: Path) -> None:
    with pytest.raises(KitError, match="lacks containerd-shim-runc-v2"):
        container.load_kit(_kit(tmp_path / "kit", without="containerd-shim-runc-v2"))
    with pytest.raises(KitError, match=r"kit\.json missing"):
        container.load_kit(tmp_path / "nothing")


def _proc(tmp_path: Path, mounts: str, filesystems: str) -> Path:
    (tmp_path / "mounts").write_text(mounts)
    (tmp_path / "filesystems").write_text(filesystems)
    return tmp_path


V2 = "cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid 0 0\n"
V1 = "cgroup /sys/fs/cgroup/memory cgroup rw,memory 0 0\ncgroup /sys/fs/cgroup/pids cgroup rw 0 0\n"
OVERLAY = "nodev\tproc\nnodev\toverlay\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="the step needs root first")
def test_where_containerd_cannot_run_the_reason_is_named(tmp_path: Path) -> None:
    assert container.why_not(proc_root=_proc(tmp_path, V2, OVERLAY)) is None
    assert container.why_not(proc_root=_proc(tmp_path, V1, OVERLAY)) is None
    no_cgroup = container.why_not(proc_root=_proc(tmp_path, "proc /proc proc rw 0 0\n", OVERLAY))
    assert no_cgroup is not None
    assert "no cgroup file system" in no_cgroup
    no_overlay = container.why_not(proc_root=_proc(tmp_path, V2, "nodev\tproc\n"))
    assert no_overlay is not None
    assert "no overlay" in no_overlay
    assert container.cgroup_mounts(V1) == [
        Path("/sys/fs/cgroup/memory"),
        Path("/sys/fs/cgroup/pids"),
    ]


def test_the_checks_containerd_is_its_own(tmp_path: Path) -> None:
    config = tomllib.loads(container.containerd_toml(tmp_path))
    assert config["version"] == 3
    for key in ("root", "state", "temp"):
        assert Path(config[key]).parent == tmp_path
    assert config["grpc"]["address"] == str(tmp_path / "containerd.sock")
    # No kubelet here: nothing of the CRI, which would want CNI and host paths.
    assert "io.containerd.grpc.v1.cri" in config["disabled_plugins"]
    assert "io.containerd.nri.v1.nri" in config["disabled_plugins"]


def _run(seen: dict[str, object] | None, rc: int | None = 0) -> Run:
    return Run(seen=seen, returncode=rc, failed_step="", log="")


def test_a_container_of_exactly_the_claimed_gpu_with_right_values_passes() -> None:
    assert kernel_problems(_run(GOOD), [UUID]) == []


def test_another_gpu_in_the_container_fails_naming_both() -> None:
    seen = {**GOOD, "uuids": f"{UUID},{OTHER}", "cudaDevices": 2}
    problems = kernel_problems(_run(seen), [UUID])
    assert f"NVML in the container sees ['{UUID}', '{OTHER}'], expected ['{UUID}']" in problems
    assert "CUDA sees 2 device(s), expected 1" in problems


def test_wrong_kernel_values_fail() -> None:
    assert kernel_problems(_run({**GOOD, "wrong": 7}), [UUID]) == ["kernel: 7 of 4096 values wrong"]


def test_a_probe_that_failed_says_where() -> None:
    seen = {"uuids": UUID, "cuInit": 0, "step": "cuModuleLoadData", "error": "returned 218"}
    problems = kernel_problems(_run(seen, rc=1), [UUID])
    assert problems == ["gpu-kernel failed at cuModuleLoadData: returned 218"]


def test_a_container_that_never_ran_shows_the_logs() -> None:
    run = Run(seen=None, returncode=None, failed_step="ctr images import", log="import.log: x")
    assert kernel_problems(run, [UUID]) == [
        "the container did not run: ctr images import",
        "import.log: x",
    ]


def test_under_a_share_more_memory_or_an_allocation_past_it_fails() -> None:
    within = {**GOOD, "freeMiB": 3951, "allocMiB": 4352, "allocResult": 2}
    assert kernel_problems(_run(within), [UUID], limit_mib=4096) == []
    over = {**GOOD, "freeMiB": 81408, "allocMiB": 4352, "allocResult": 0}
    assert kernel_problems(_run(over), [UUID], limit_mib=4096) == [
        "81408 MiB free, over the share's 4096 MiB",
        "an allocation of 4352 MiB was granted",
    ]


def test_the_checks_import_closure_has_no_kubernetes_grpc_or_kopf() -> None:
    """The bundle carries neither (docs/gpu-check.md): an import of one anywhere on the
    Preparer's path (the vendor seam's KubeApi once) breaks `make gpu-check` on a GPU
    machine, which the tests from a checkout, with the venv, would not see."""
    code = (
        "import sys; import drasil.kubeletplugin.gpucheck.main; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'kubernetes', 'grpc', 'kopf'}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"

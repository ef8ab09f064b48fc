"""mpsview's choice of view for a driver root: chrooted into it, or its program run in
place where the root holds no loader for it (a GKE-style ``/usr/local/nvidia``, seen on
an H100 node: ``bin``, ``lib64``, binaries for the node's own ``/lib64`` loader).
The chrooted daemon itself is tested in test_mps.py."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from drasil.driver.nvidia.ldcache import elf_interpreter
from drasil.kubeletplugin.vendors.nvidia.mps import view as mpsview

HOST_PROGRAM = Path(shutil.which("env") or "/usr/bin/env")  # dynamic, as the driver's are


def gke_root(tmp_path: Path) -> Path:
    """``bin`` and ``lib64`` and nothing to chroot with: no loader in it."""
    root = tmp_path / "nvidia"
    (root / "bin").mkdir(parents=True)
    (root / "lib64").mkdir()
    shutil.copy(HOST_PROGRAM, root / "bin/nvidia-cuda-mps-control")
    return root


def test_the_host_program_names_a_loader() -> None:
    assert elf_interpreter(HOST_PROGRAM) is not None


def test_a_root_without_the_programs_loader_runs_it_in_place(tmp_path: Path) -> None:
    root = gke_root(tmp_path)
    assert not mpsview.runs_chrooted(root, "/bin/nvidia-cuda-mps-control")
    loader = elf_interpreter(HOST_PROGRAM)
    assert loader is not None
    (root / loader.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
    (root / loader.lstrip("/")).write_bytes(b"")
    assert mpsview.runs_chrooted(root, "/bin/nvidia-cuda-mps-control")


def test_a_script_or_a_static_program_is_chrooted_into_its_root(tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin/tool").write_text("#!/bin/sh\n")
    assert mpsview.runs_chrooted(tmp_path, "/bin/tool")


def test_in_place_the_program_gets_our_directories_and_the_roots_libraries(
    tmp_path: Path,
) -> None:
    root = gke_root(tmp_path)
    pipe, log = tmp_path / "pipe", tmp_path / "log"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "drasil.kubeletplugin.vendors.nvidia.mps.view",
            f"--pipe={pipe}",
            f"--log={log}",
            f"--root={root}",
            "--",
            "/bin/nvidia-cuda-mps-control",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    env = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(pipe)
    assert env["CUDA_MPS_LOG_DIRECTORY"] == str(log)
    assert env["LD_LIBRARY_PATH"].split(":")[0] == str(root / "lib64")
    # The server is found beside the control program, in the root.
    assert env["PATH"].split(":")[0] == str(root / "bin")

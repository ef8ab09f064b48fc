"""Is this node ready to give containers a real GPU? The checks behind ``drasil doctor``
and the plugin's start-up report.

What a GPU container needs of the node, beside drasil itself: the driver's files under
the driver root, of the version the kernel driver (NVML) runs; ``nvidia-cdi-hook``,
which the container runtime runs for the SONAME links and the ld cache; and the device
nodes. Each check says what it found, and what to do when it failed.
"""

from __future__ import annotations

import os
import stat
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from drasil.driver.nvidia.driverfiles import (
    DriverFilesError,
    DriverRoot,
    find_driver_files,
    root_driver_version,
)

HOOK_TIMEOUT: Final = 10.0
# What NVIDIA's kernel module writes under /proc once it is loaded (--vendors auto).
KERNEL_VERSION_FILE: Final = "driver/nvidia/version"


def kernel_module_loaded(proc_root: Path) -> bool:
    """Whether NVIDIA's kernel module is loaded (its version file under ``proc_root``)."""
    return (proc_root / KERNEL_VERSION_FILE).is_file()


@dataclass(frozen=True)
class Check:
    """One finding: what was checked, whether it passed, and what was seen."""

    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'}  {self.name}: {self.detail}"


def check_driver(root: DriverRoot, *, nvml_version: str | None) -> list[Check]:
    """The root exists and holds the files of NVML's driver version."""
    if not root.local.is_dir():
        return [
            Check("driver root", False, f"{root.local} is not a directory (--nvidia-driver-root)")
        ]
    held = root_driver_version(root)
    version = nvml_version or held
    if version is None:
        detail = (
            f"{root.host} holds no libcuda.so.* or libnvidia-ml.so.*; is the driver installed "
            "there? (GPU Operator: /run/nvidia/driver; GKE: /home/kubernetes/bin/nvidia)"
        )
        return [Check("driver root", False, detail)]
    try:
        files = find_driver_files(root, version)
    except DriverFilesError as err:
        return [Check("driver files", False, str(err))]
    source = "NVML's" if nvml_version else "the root's"
    detail = (
        f"{root.host}: driver {version} ({source} version), {len(files.libraries)} "
        f"libraries in {', '.join(files.library_folders)}, {len(files.firmware)} firmware "
        f"files, {len(files.binaries)} utilities, {len(files.sockets)} sockets"
    )
    checks = [Check("driver files", True, detail)]
    if not any(p.endswith(f"libcuda.so.{version}") for p in files.libraries):
        checks.append(Check("libcuda", False, f"no libcuda.so.{version}: CUDA programs cannot run"))
    return checks


def check_hook(
    hook_path: str | None, *, enabled: bool, local: Callable[[str], Path | None]
) -> Check:
    """The hook the specs name exists and runs. ``local`` maps its host path to where
    this process can see it (``None``: it cannot)."""
    if not enabled:
        return Check("cdi hook", True, "disabled (--cdi-hooks disabled): no hooks in specs")
    if hook_path is None:
        detail = (
            "no nvidia-cdi-hook (none in the image, no --nvidia-cdi-hook-path): specs carry no "
            "hooks, so containers get no libcuda.so.1 link nor ld cache entries"
        )
        return Check("cdi hook", False, detail)
    path = local(hook_path)
    if path is None:
        return Check("cdi hook", True, f"{hook_path} (on the host; not visible here to run)")
    try:
        done = subprocess.run(
            [str(path), "--version"],
            check=False,
            capture_output=True,
            text=True,
            timeout=HOOK_TIMEOUT,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return Check("cdi hook", False, f"{hook_path} does not run: {err}")
    if done.returncode != 0:
        return Check("cdi hook", False, f"{hook_path} --version exited {done.returncode}")
    version = (done.stdout or done.stderr).strip().splitlines()[:1]
    return Check("cdi hook", True, f"{hook_path} runs ({' '.join(version) or 'no version'})")


def check_device_nodes(paths: Sequence[str]) -> Check:
    """The device nodes the specs name exist as character devices."""
    missing = [p for p in paths if not _is_char_device(p)]
    if not paths:
        return Check("device nodes", False, "no NVIDIA device nodes found (is the driver loaded?)")
    if missing:
        return Check("device nodes", False, f"missing: {', '.join(missing)}")
    more = "…" if len(paths) > 4 else ""
    return Check("device nodes", True, f"{len(paths)} present ({', '.join(paths[:4])}{more})")


def _is_char_device(path: str) -> bool:
    try:
        return stat.S_ISCHR(os.stat(path).st_mode)
    except OSError:
        return False


def report(checks: Sequence[Check]) -> str:
    """One line a check, failures first."""
    ordered = sorted(checks, key=lambda c: c.ok)
    return "\n".join(c.line() for c in ordered)

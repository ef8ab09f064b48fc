"""Choosing the NVML library behind discovery: the real one or the simulated one."""

from __future__ import annotations

from pathlib import Path

from drasil.driver.nvidia.nvml import NvmlLibrary, PynvmlLibrary
from drasil.driver.nvidia.simulated import simulated_library

BACKENDS = ("nvml", "simulated")


def open_backend(
    backend: str,
    *,
    profile: str,
    node_name: str,
    state_file: Path | None = None,
    dev_root: tuple[str, Path] = ("/dev", Path("/dev")),
    proc_root: Path = Path("/proc"),
) -> NvmlLibrary:
    """The NVML library for ``--backend``; both run the same discovery code path.

    ``state_file`` is where simulated GPUs keep their MIG state between processes;
    ``dev_root`` (host path, local path) and ``proc_root`` where real GPUs' device
    nodes and the driver's /proc entries are.
    """
    if backend == "nvml":
        host, local = dev_root
        return PynvmlLibrary(dev_root=host, dev_root_local=local, proc_root=proc_root)
    if backend == "simulated":
        return simulated_library(profile, node_name=node_name, state_file=state_file)
    raise ValueError(f"--backend: unsupported value {backend!r}; allowed values are {BACKENDS}")

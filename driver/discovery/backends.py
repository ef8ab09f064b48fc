"""Choosing the NVML library behind discovery: the real one or the simulated one."""

from __future__ import annotations

from drasil.driver.discovery.nvml import NvmlLibrary, PynvmlLibrary
from drasil.driver.discovery.simulated import simulated_library

BACKENDS = ("nvml", "simulated")


def open_backend(backend: str, *, profile: str, node_name: str) -> NvmlLibrary:
    """The NVML library for ``--backend``; both run the same discovery code path."""
    if backend == "nvml":
        return PynvmlLibrary()
    if backend == "simulated":
        return simulated_library(profile, node_name=node_name)
    raise ValueError(f"--backend: unsupported value {backend!r}; allowed values are {BACKENDS}")

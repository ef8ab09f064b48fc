"""The vendor backends of a node, real or simulated, and their devices together.

A node serves one or more GPU vendors (``--vendors``): NVIDIA's backend is NVML
(``drasil.driver.nvidia``), AMD's is amdgpu's sysfs tree (``drasil.driver.amd``). Each
vendor's discovery turns its hardware into ``Device`` objects with names and types of
its own (``gpu-0``, ``amdgpu-1``), and the node publishes them together in one pool.

Every node has an NVML library: where NVIDIA is not served it is one with no GPUs, so
the NVIDIA code paths (MIG, MPS, XIDs) run and find nothing instead of each asking
whether NVIDIA is there.

``--backend simulated`` takes its vendors from the profile: ``h100-80gb:2`` simulates
NVIDIA GPUs through the fake NVML, ``mi300x:8`` AMD GPUs through a fake sysfs tree
written once into the plugin's state dir (which keeps their partition modes and error
counters as a real GPU's sysfs would), ``h100-80gb:2,mi300x:2`` a mixed node.

A vendor backend provides (docs/design.md#vendor-backends): discovery from its source
to ``Device`` objects (types of its own, never another vendor's), a simulated source
for tests and demos, a health watcher reporting to ``HealthTracker``, and where its
containers need more than the devices' nodes, the spec-wide CDI edits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from drasil.driver.amd.devices import discover_amd
from drasil.driver.amd.devices import skipped_text as amd_skipped_text
from drasil.driver.amd.partitions import discover_dynamic
from drasil.driver.amd.sysfs import amdgpu_driver_dir, gpu_links
from drasil.driver.devices import CounterSet, Device, Vendor, VendorError
from drasil.driver.nvidia.nodecheck import kernel_module_loaded
from drasil.driver.nvidia.nodedevices import discover, driver_description, skipped_text
from drasil.driver.nvidia.nvml import NvmlLibrary
from drasil.driver.nvidia.nvmladapter import PynvmlLibrary
from drasil.driver.simulated.amdsysfs import (
    AMD_MODELS,
    is_amd_model,
    parse_amd_profile,
    write_simulated_tree,
)
from drasil.driver.simulated.gpus import ProfileSpecError
from drasil.driver.simulated.nvml import FakeNvml, simulated_library

BACKENDS = ("nvml", "simulated")
AUTO = "auto"


@dataclass(frozen=True)
class NodeBackends:
    """What a node's devices are read from, per vendor."""

    vendors: tuple[Vendor, ...]
    # NVIDIA's: a real or fake NVML; one without GPUs where NVIDIA is not served.
    nvml: NvmlLibrary
    # AMD's: the amdgpu sysfs tree (real, or the simulated one); None: AMD not served.
    amd_sysfs: Path | None = None


@dataclass(frozen=True)
class NodeDiscovery:
    """Every vendor's devices of a node, what could not be published and why, and the
    shared counters the devices consume."""

    devices: tuple[Device, ...]
    skipped: tuple[str, ...] = ()
    counter_sets: tuple[CounterSet, ...] = ()
    # The drivers behind the devices, for people: "NVIDIA driver 580.65.06, CUDA 13.0".
    drivers: tuple[str, ...] = ()


def no_nvidia_gpus() -> NvmlLibrary:
    """The NVML of a node NVIDIA is not served on: it answers, with no GPU."""
    return FakeNvml(())


def split_profile(profile: str) -> tuple[str, str]:
    """A simulated profile split by vendor: (NVIDIA's entries, AMD's entries)."""
    nvidia: list[str] = []
    amd: list[str] = []
    for entry in (part.strip() for part in profile.split(",") if part.strip()):
        (amd if is_amd_model(entry.partition(":")[0].strip()) else nvidia).append(entry)
    return ",".join(nvidia), ",".join(amd)


def detect_vendors(*, proc_root: Path, amd_sysfs_root: Path) -> tuple[Vendor, ...]:
    """The vendors whose kernel driver is loaded here with a GPU (``--vendors auto``).

    NVIDIA: the kernel module's ``/proc/driver/nvidia/version``; AMD: a PCI device
    bound to amdgpu. Neither: ``VendorError`` naming both places looked at.
    """
    found: list[Vendor] = []
    if kernel_module_loaded(proc_root):
        found.append(Vendor.NVIDIA)
    amd_dir = amdgpu_driver_dir(amd_sysfs_root)
    if any(gpu_links(amd_sysfs_root)):
        found.append(Vendor.AMD)
    if not found:
        raise VendorError(
            f"--vendors auto: no GPU driver found: no {proc_root}/driver/nvidia/version "
            f"(NVIDIA's kernel module) and no PCI device bound to amdgpu in {amd_dir}; "
            "install a driver, or name the vendors with --vendors"
        )
    return tuple(found)


def open_backends(
    backend: str,
    *,
    vendors: Sequence[str],
    profile: str,
    node_name: str,
    state_file: Path | None = None,
    simulated_amd_root: Path | None = None,
    amd_sysfs_root: Path = Path("/sys"),
    dev_root: tuple[str, Path] = ("/dev", Path("/dev")),
    proc_root: Path = Path("/proc"),
) -> NodeBackends:
    """The backends of ``--backend`` for ``--vendors`` (or the simulated profile).

    Raises ``ProfileSpecError`` for a simulated profile naming no known model, and
    ``VendorError`` when ``auto`` finds no vendor.
    """
    if backend == "simulated":
        return _simulated(profile, node_name, state_file, simulated_amd_root)
    if backend != "nvml":
        raise ValueError(f"--backend: unsupported value {backend!r}; allowed values are {BACKENDS}")
    found = (
        detect_vendors(proc_root=proc_root, amd_sysfs_root=amd_sysfs_root)
        if tuple(vendors) == (AUTO,)
        else tuple(Vendor(v) for v in vendors)
    )
    host, local = dev_root
    nvml = (
        PynvmlLibrary(dev_root=host, dev_root_local=local, proc_root=proc_root)
        if Vendor.NVIDIA in found
        else no_nvidia_gpus()
    )
    return NodeBackends(
        vendors=found, nvml=nvml, amd_sysfs=amd_sysfs_root if Vendor.AMD in found else None
    )


def _simulated(
    profile: str, node_name: str, state_file: Path | None, amd_root: Path | None
) -> NodeBackends:
    nvidia, amd = split_profile(profile)
    vendors: list[Vendor] = []
    nvml = no_nvidia_gpus()
    if nvidia or not amd:  # an empty profile gets NVIDIA's error, naming the models
        try:
            nvml = simulated_library(nvidia, node_name=node_name, state_file=state_file)
        except ProfileSpecError as err:
            raise ProfileSpecError(f"{err}; AMD models: {', '.join(AMD_MODELS)}") from None
        vendors.append(Vendor.NVIDIA)
    if not amd:
        return NodeBackends(vendors=tuple(vendors), nvml=nvml)
    if amd_root is None:
        raise ProfileSpecError(f"{amd!r}: simulated AMD GPUs need a directory for their tree")
    try:
        entries = parse_amd_profile(amd)
    except ValueError as err:
        raise ProfileSpecError(f"profile spec {profile!r}: {err}") from None
    write_simulated_tree(entries, amd_root, node_name=node_name)
    return NodeBackends(vendors=(*vendors, Vendor.AMD), nvml=nvml, amd_sysfs=amd_root)


def discover_node(
    nvml: NvmlLibrary,
    amd_sysfs: Path | None,
    *,
    node_name: str,
    mig_mode: str = "static",
    gpu_sharing: str = "exclusive",
    amd_partition_mode: str = "static",
) -> NodeDiscovery:
    """Every vendor's devices (``NodeBackends``' ``nvml`` and ``amd_sysfs``); raises
    ``NvmlUnavailable`` when NVIDIA is served and NVML cannot be used.

    ``mig_mode`` and ``amd_partition_mode`` ``dynamic``: partitionable GPUs publish
    the partitions prepare can make, with the shared counters they draw."""
    found = discover(nvml, node_name=node_name, mig_mode=mig_mode, gpu_sharing=gpu_sharing)
    devices = list(found.devices)
    counter_sets = list(found.counter_sets)
    skipped = [skipped_text(s) for s in found.skipped]
    drivers = [driver] if (driver := driver_description(found)) else []
    if amd_sysfs is not None:
        dynamic = amd_partition_mode == "dynamic"
        amd = discover_dynamic(amd_sysfs) if dynamic else discover_amd(amd_sysfs)
        devices.extend(amd.devices)
        counter_sets.extend(amd.counter_sets)
        skipped.extend(amd_skipped_text(s) for s in amd.skipped)
        drivers.append(amd.driver())
    return NodeDiscovery(
        devices=tuple(devices),
        skipped=tuple(skipped),
        counter_sets=tuple(counter_sets),
        drivers=tuple(drivers),
    )

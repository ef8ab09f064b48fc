"""A fake sysfs tree of AMD GPUs, read by the same code as a node's ``/sys``.

``write_simulated_tree`` lays out the GPUs of a profile (``mi300x:8``, ``mi250x:2``;
an MI250X count is cards, two GPUs each) the way amdgpu does:

- PCI devices under ``devices/pci<domain>:<root bus>/<port>/<bdf>``, one root complex
  per card (the two GCDs of an MI250X share theirs), spread over NUMA nodes 0 and 1,
  linked from ``bus/pci/drivers/amdgpu/<bdf>`` with relative links so the tree can move;
- DRM nodes ``card<N>``/``renderD<M>`` (cards from 1, card0 being the usual BMC VGA,
  renders from 128) with ``dev`` files ``226:<minor>``; every MI300-class GPU is
  followed by its seven spare ``amdgpu_xcp_<n>`` platform devices with their own DRM
  nodes, which amdgpu allocates at load whatever the mode (so the numbering is the
  real one: GPU card 1, its XCP cards 2..8, the next GPU card 9);
- the KFD topology: nodes 0 and 1 are the CPU nodes of the two NUMA nodes, then one
  node per compute partition of each GPU (one for an unpartitioned GPU), and
  ``class/kfd/kfd/dev`` ``235:0``;
- RAS counters ``ras/<block>_err_count`` (``ue: N`` / ``ce: N``, the kernel's format)
  and ``module/amdgpu/version`` (a DKMS driver's version); ``record_reset`` adds the
  device core dump amdgpu writes when it resets a GPU (``class/devcoredump/devcd<N>``).

The tree is the simulated GPUs' state, written once per node: writing it again keeps
the partition modes, RAS counters and core dumps that are there (only files that are
missing are created). Identities are deterministic for (profile, node name): unique
ids hash the node name and GPU index, so two simulated nodes never share a UUID.

``set_partition_mode`` changes a GPU's mode as amdgpu does: the mode files and the KFD
topology change, the XCP devices stay. The layout is recomputed from a small manifest,
``drasil-simulated.json`` at the tree's root, which a real ``/sys`` does not have.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from drasil.driver.amd.sysfs import SIMULATED_MANIFEST, amdgpu_driver_dir, kfd_dir, read_text
from drasil.driver.files import write_atomic
from drasil.driver.simulated.amdcatalog import MODELS, AmdModel

AMD_MODELS: Final = tuple(MODELS)
MANIFEST: Final = SIMULATED_MANIFEST
DRIVER_VERSION: Final = "6.10.5"
DRM_MAJOR: Final = 226
KFD_MAJOR: Final = 235
FIRST_CARD: Final = 1
FIRST_RENDER: Final = 128
XCP_SPARES: Final = 7  # amdgpu allocates MAX_XCP - 1 platform devices per MI300 GPU
RAS_BLOCKS: Final = ("umc", "sdma", "gfx", "mmhub", "xgmi_wafl")
# A GPU with this file refuses mode switches with EBUSY, as amdgpu does while a process
# holds the GPU through /dev/kfd (tests create it).
KFD_BUSY_FILE: Final = "drasil-kfd-busy"
CPU_NODES: Final = 2
MAX_SIMULATED_GPUS: Final = 64


def is_amd_model(name: str) -> bool:
    """Whether a profile entry's model is an AMD one (``mi300x``, ``mi250x``, ...)."""
    return name in MODELS


def parse_amd_profile(profile: str) -> tuple[tuple[str, int], ...]:
    """``mi300x:8,mi250x:2`` → ``(("mi300x", 8), ("mi250x", 2))``; ValueError says why."""
    entries = []
    for item in (p.strip() for p in profile.split(",")):
        name, _, count = item.partition(":")
        if not is_amd_model(name):
            raise ValueError(f"{name!r} is no AMD model (known: {', '.join(AMD_MODELS)})")
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"{item!r}: the count after ':' must be a positive number")
        entries.append((name, int(count)))
    return tuple(entries)


# ---- the layout ----------------------------------------------------------------------


@dataclass(frozen=True)
class SimXcp:
    """A spare ``amdgpu_xcp_<platform_id>`` device and its DRM nodes."""

    platform_id: int
    card: int
    render: int


@dataclass(frozen=True)
class SimGpu:
    """Where one simulated GPU lives in the tree; derived, never stored."""

    index: int
    model: AmdModel
    domain: int
    root_bus: int
    bus: int
    numa_node: int
    unique_id: int
    card: int
    render: int
    xcps: tuple[SimXcp, ...]

    @property
    def bdf(self) -> str:
        return f"{self.domain:04x}:{self.bus:02x}:00.0"

    @property
    def pci_path(self) -> str:
        """The device's directory relative to the sysfs root."""
        root = f"pci{self.domain:04x}:{self.root_bus:02x}"
        port = f"{self.domain:04x}:{self.root_bus:02x}:01.1"
        return f"devices/{root}/{port}/{self.bdf}"


def unique_id_for(node_name: str, index: int) -> int:
    """A GPU's 64-bit unique id: stable per node and index, different across nodes."""
    digest = hashlib.sha256(f"drasil-amd/{node_name}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") or 1


def layout(entries: Sequence[tuple[str, int]], node_name: str) -> tuple[SimGpu, ...]:
    """Every GPU of a profile, with its BDF, NUMA node, DRM and XCP numbers."""
    models = [MODELS[name] for name, count in entries for _ in range(count)]
    total = sum(m.gpus_per_card for m in models)
    if total > MAX_SIMULATED_GPUS:
        raise ValueError(f"{total} GPUs is more than {MAX_SIMULATED_GPUS}")
    gpus: list[SimGpu] = []
    card, render, xcp = FIRST_CARD, FIRST_RENDER, 0
    for slot, model in enumerate(models):
        for gcd in range(model.gpus_per_card):
            spares = XCP_SPARES if model.partitionable else 0
            xcps = tuple(SimXcp(xcp + k, card + 1 + k, render + 1 + k) for k in range(spares))
            root_bus = (slot % 8) * 0x20
            gpus.append(
                SimGpu(
                    index=len(gpus),
                    model=model,
                    domain=slot // 8,
                    root_bus=root_bus,
                    bus=root_bus + 3 + gcd,
                    numa_node=slot * 2 // len(models),
                    unique_id=unique_id_for(node_name, len(gpus)),
                    card=card,
                    render=render,
                    xcps=xcps,
                )
            )
            card, render, xcp = card + 1 + spares, render + 1 + spares, xcp + spares
    return tuple(gpus)


# ---- writing -------------------------------------------------------------------------


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, text.encode(), durable=False)


def _write_if_missing(path: Path, text: str) -> None:
    """State (modes, counters): written once, then only changed by its owner."""
    if not path.exists():
        _write(path, text)


def _link(link: Path, target: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    relative = os.path.relpath(target, link.parent)
    if link.is_symlink() and os.readlink(link) == relative:
        return
    link.unlink(missing_ok=True)
    link.symlink_to(relative)


def _write_drm(drm: Path, card: int, render: int) -> None:
    _write(drm / f"card{card}" / "dev", f"{DRM_MAJOR}:{card}\n")
    _write(drm / f"renderD{render}" / "dev", f"{DRM_MAJOR}:{render}\n")


def _write_gpu(root: Path, gpu: SimGpu) -> None:
    path = root / gpu.pci_path
    model = gpu.model
    _write(path / "vendor", "0x1002\n")
    _write(path / "device", f"{model.device_id:#06x}\n")
    _write(path / "numa_node", f"{gpu.numa_node}\n")
    _write(path / "product_name", f"{model.product_name}\n")
    _write(path / "unique_id", f"{gpu.unique_id:016x}\n")
    _write_drm(path / "drm", gpu.card, gpu.render)
    if model.partitionable:
        names = ", ".join(m.name for m in model.compute_modes)
        _write(path / "available_compute_partition", f"{names}\n")
        _write(path / "available_memory_partition", f"{', '.join(model.memory_modes)}\n")
        _write_if_missing(path / "current_compute_partition", f"{model.initial_compute}\n")
        _write_if_missing(path / "current_memory_partition", f"{model.initial_memory}\n")
    for block in RAS_BLOCKS:
        _write_if_missing(path / "ras" / f"{block}_err_count", "ue: 0\nce: 0\n")
    _link(amdgpu_driver_dir(root) / gpu.bdf, path)
    for xcp in gpu.xcps:
        platform = root / "devices" / "platform" / f"amdgpu_xcp_{xcp.platform_id}"
        _write_drm(platform / "drm", xcp.card, xcp.render)


def write_simulated_tree(entries: Sequence[tuple[str, int]], root: Path, *, node_name: str) -> None:
    """Write (or complete) the fake sysfs tree of a profile under ``root``.

    Files that describe the hardware are (re)written; state files that exist (partition
    modes, RAS counters, core dumps) are kept, so a mode a running plugin set
    survives. GPUs of an earlier, different profile lose their driver link.
    """
    gpus = layout(entries, node_name)
    root.mkdir(parents=True, exist_ok=True)
    manifest = {"node_name": node_name, "entries": [[n, c] for n, c in entries]}
    _write(root / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    for gpu in gpus:
        _write_gpu(root, gpu)
    keep = {g.bdf for g in gpus}
    for link in sorted(amdgpu_driver_dir(root).iterdir()):
        if link.is_symlink() and link.name not in keep:
            link.unlink()
    _write(kfd_dir(root) / "dev", f"{KFD_MAJOR}:0\n")
    _write(root / "module" / "amdgpu" / "version", f"{DRIVER_VERSION}\n")
    write_kfd_topology(root, gpus)


# ---- KFD topology --------------------------------------------------------------------


def _current_mode(root: Path, gpu: SimGpu) -> tuple[str, int]:
    """The GPU's compute mode in the tree and its partition count."""
    if not gpu.model.partitionable:
        return "SPX", 1
    name = read_text(root / gpu.pci_path / "current_compute_partition")
    return name, gpu.model.mode(name).partitions


def _properties(values: dict[str, int]) -> str:
    return "".join(f"{k} {v}\n" for k, v in values.items())


def _cpu_node(numa: int) -> str:
    return _properties(
        {
            "cpu_cores_count": 48,
            "simd_count": 0,
            "mem_banks_count": 1,
            "cpu_core_id_base": 64 * numa,
        }
        | {"gfx_target_version": 0, "vendor_id": 0, "device_id": 0, "location_id": 0}
        | {"domain": 0, "drm_render_minor": 0}
    )


def _gpu_node(gpu: SimGpu, partition: int, count: int) -> tuple[str, int]:
    """A partition's KFD properties and its memory in bytes."""
    model = gpu.model
    cus = model.compute_units // count
    render = gpu.render if partition == 0 else gpu.xcps[partition - 1].render
    props = {
        "cpu_cores_count": 0,
        "simd_count": cus * model.simd_per_cu,
        "mem_banks_count": 1,
        "simd_per_cu": model.simd_per_cu,
        "gfx_target_version": model.gfx_target_version,
        "vendor_id": 0x1002,
        "device_id": model.device_id,
        "location_id": gpu.bus << 8 | partition,  # amdgpu ORs the index in
        "domain": gpu.domain,
        "drm_render_minor": render,
        "unique_id": gpu.unique_id,
        "num_xcc": max(model.xcds // count, 1),
    }
    return _properties(props), model.memory_bytes // count


def write_kfd_topology(root: Path, gpus: Sequence[SimGpu]) -> None:
    """Rewrite the KFD topology from the GPUs' current modes, as a mode change does.

    The new nodes are written beside the old ones and swapped in with two renames, so
    a reader sees the old or the new topology except for the instant between them
    (the kernel, too, rebuilds the topology when a mode changes).
    """
    topology = kfd_dir(root) / "topology"
    fresh, old = topology / "nodes.new", topology / "nodes.old"
    for stale in (fresh, old):
        shutil.rmtree(stale, ignore_errors=True)
    for numa in range(CPU_NODES):
        _write(fresh / str(numa) / "properties", _cpu_node(numa))
    node = CPU_NODES
    for gpu in gpus:
        _, count = _current_mode(root, gpu)
        for partition in range(count):
            props, memory = _gpu_node(gpu, partition, count)
            _write(fresh / str(node) / "properties", props)
            bank = _properties({"heap_type": 1, "size_in_bytes": memory, "flags": 0})
            _write(fresh / str(node) / "mem_banks" / "0" / "properties", bank)
            node += 1
    nodes = topology / "nodes"
    if nodes.exists():
        nodes.rename(old)
    fresh.rename(nodes)
    shutil.rmtree(old, ignore_errors=True)


# ---- changing the state --------------------------------------------------------------


def _manifest_layout(root: Path) -> tuple[SimGpu, ...]:
    manifest = json.loads(read_text(root / MANIFEST))
    entries = [(str(n), int(c)) for n, c in manifest["entries"]]
    return layout(entries, str(manifest["node_name"]))


def _find(gpus: Sequence[SimGpu], bdf: str) -> SimGpu:
    for gpu in gpus:
        if gpu.bdf == bdf:
            return gpu
    raise ValueError(f"no simulated GPU {bdf} (there are {', '.join(g.bdf for g in gpus)})")


def write_mode(root: Path, bdf: str, mode: str) -> None:
    """The simulated tree's answer to amdgpu's mode file being written
    (``drasil.driver.amd.partitions.ModeWriter``): the switch, done as the kernel does
    it; amdgpu never changes the memory mode with the compute mode, so it is kept."""
    memory = read_text(amdgpu_driver_dir(root) / bdf / "current_memory_partition")
    set_partition_mode(root, bdf, mode, memory)


def set_partition_mode(root: Path, bdf: str, compute: str, memory: str | None = None) -> None:
    """Switch a simulated GPU to another compute (and memory) partition mode.

    As amdgpu: the mode files change and the KFD topology is rebuilt with one node per
    partition; the XCP devices stay. Without ``memory`` the current memory mode is kept
    when the new compute mode allows it, else the first one it allows. ValueError for
    a mode the model does not have or a combination it does not allow; OSError EBUSY
    while the GPU has ``KFD_BUSY_FILE``.
    """
    gpus = _manifest_layout(root)
    gpu = _find(gpus, bdf)
    mode = gpu.model.mode(compute.upper())
    path = root / gpu.pci_path
    if (path / KFD_BUSY_FILE).exists():
        raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(path / KFD_BUSY_FILE))
    current = read_text(path / "current_memory_partition")
    chosen = memory or (current if current in mode.memory_modes else mode.memory_modes[0])
    if chosen.upper() not in mode.memory_modes:
        raise ValueError(f"{mode.name} allows {', '.join(mode.memory_modes)}, not {chosen}")
    _write(path / "current_compute_partition", f"{mode.name}\n")
    _write(path / "current_memory_partition", f"{chosen.upper()}\n")
    write_kfd_topology(root, gpus)


def _gpu_dir(root: Path, bdf: str) -> Path:
    link = amdgpu_driver_dir(root) / bdf
    if not link.exists():
        raise ValueError(f"no GPU {bdf} bound to amdgpu under {root}")
    path: Path = link.resolve()
    return path


_COUNT_LINE: Final = re.compile(r"(\w+):\s*(\d+)")


def bump_ras_errors(
    root: Path, bdf: str, block: str = "umc", *, uncorrectable: int = 1, correctable: int = 0
) -> None:
    """Add errors to a GPU's RAS counter ``ras/<block>_err_count`` (created if absent)."""
    path = _gpu_dir(root, bdf) / "ras" / f"{block}_err_count"
    counts = {"ue": 0, "ce": 0}
    if path.exists():
        counts |= {k: int(v) for k, v in _COUNT_LINE.findall(read_text(path))}
    counts["ue"] += uncorrectable
    counts["ce"] += correctable
    _write(path, "".join(f"{k}: {v}\n" for k, v in counts.items()))


def record_reset(root: Path, bdf: str) -> str:
    """Reset a GPU as amdgpu reports it: a new device core dump whose
    ``failing_device`` links to the GPU (``class/devcoredump/devcd<N>``); its name."""
    device = _gpu_dir(root, bdf)
    dumps = root / "class" / "devcoredump"
    numbers = [int(p.name[5:]) for p in dumps.glob("devcd*") if p.name[5:].isdigit()]
    name = f"devcd{max(numbers, default=0) + 1}"
    _write(dumps / name / "data", f"AMDGPU Device Coredump\nreset of {bdf}\n")
    _link(dumps / name / "failing_device", device)
    return name

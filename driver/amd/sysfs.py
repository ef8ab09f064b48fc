"""Read AMD GPUs from a sysfs tree: the PCI, DRM and KFD files the amdgpu driver makes.

The same code reads a node's ``/sys`` and the fake trees of ``simulated``; nothing
here needs ROCm. Where things are (``<root>`` is the sysfs root):

- GPUs: the PCI devices bound to amdgpu, ``<root>/bus/pci/drivers/amdgpu/<bdf>``,
  each a link to ``<root>/devices/pci<dddd>:<bb>/.../<bdf>``; the ``pci…`` part of
  the resolved path is the PCIe root complex (as Kubernetes' ``pcieRoot``).
- per GPU: ``vendor``, ``device``, ``numa_node``, ``product_name``, ``unique_id``
  (16 hex digits), on GC 9.4.3+ (MI300) ``current_compute_partition``,
  ``available_compute_partition``, ``current_memory_partition``,
  ``available_memory_partition``; DRM nodes ``drm/card<N>`` and ``drm/renderD<M>``
  with a ``dev`` file ``226:<minor>``.
- KFD topology, ``<root>/class/kfd/kfd/topology/nodes/<n>/properties``: one node per
  compute partition (one for an unpartitioned GPU; CPU nodes have ``simd_count 0``),
  tied to its GPU by ``domain`` and ``location_id`` (``bus << 8 | devfn``; partitions
  OR their index into the function bits, so only bus and device are compared, and the
  ``unique_id``, the same for all partitions of a GPU, tells functions apart), and to
  its DRM render node by ``drm_render_minor``. Memory is ``mem_banks/<k>/properties``'
  ``size_in_bytes``.
- partitions: amdgpu gives partition 0 the GPU's own DRM nodes and every other one
  the nodes of an ``amdgpu_xcp_<n>`` platform device
  (``<root>/devices/platform/amdgpu_xcp_<n>/drm/{card<N>,renderD<M>}``; some kernels
  name them ``amdgpu_xcp.<n>``). Those platform devices exist whatever the mode (seven
  per MI300 GPU, allocated at load; those beyond the mode's count have no KFD node);
  which GPU a partition belongs to is known only from KFD, so a partition is found
  from its KFD node's render minor.
- ``/dev/kfd``'s numbers: ``<root>/class/kfd/kfd/dev``; the driver version:
  ``<root>/module/amdgpu/version`` (only the DKMS module has one).

A GPU whose files are missing or malformed becomes an ``AmdGpuError`` naming the GPU
and the file; the other GPUs are still read. Reads are bounded: at most
``MAX_FILE_BYTES`` per file, ``MAX_GPUS`` GPUs and ``MAX_PARTITIONS`` partitions each.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

MAX_FILE_BYTES: Final = 16 * 1024  # a KFD properties file is about 1.5 KiB
MAX_GPUS: Final = 64
MAX_PARTITIONS: Final = 8
MAX_KFD_NODES: Final = MAX_GPUS * MAX_PARTITIONS + 16  # and the CPU nodes
MAX_MEM_BANKS: Final = 8
MAX_XCP_DEVICES: Final = 64  # amdxcp's MAX_XCP_PLATFORM_DEVICE
# The file a tree the simulated backend wrote carries (drasil.driver.simulated.amdsysfs).
SIMULATED_MANIFEST: Final = "drasil-simulated.json"

AMD_VENDOR_ID: Final = 0x1002
COMPUTE_MODES: Final = ("SPX", "DPX", "QPX", "CPX")

_BDF: Final = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
_PCI_ROOT: Final = re.compile(r"pci[0-9a-f]{4,}:[0-9a-f]{2}")
_CARD: Final = re.compile(r"card(\d+)")
_RENDER: Final = re.compile(r"renderD(\d+)")


class SysfsError(Exception):
    """A file that is missing or says something unexpected; the message names it."""


@dataclass(frozen=True)
class DevNumbers:
    """A character device's ``major:minor``, as its sysfs ``dev`` file says."""

    major: int
    minor: int


@dataclass(frozen=True)
class DrmNode:
    """A DRM node: ``card<index>`` or ``renderD<index>``, with its device numbers."""

    index: int
    dev: DevNumbers


@dataclass(frozen=True)
class KfdNode:
    """One KFD topology GPU node: a whole GPU or one compute partition of it."""

    node: int
    simd_count: int
    simd_per_cu: int
    memory_bytes: int
    gfx_target_version: int
    render_minor: int
    domain: int
    location_id: int
    unique_id: int
    num_xcc: int

    @property
    def compute_units(self) -> int:
        return self.simd_count // self.simd_per_cu

    @property
    def gfx_target(self) -> str:
        return gfx_target_name(self.gfx_target_version)


@dataclass(frozen=True)
class AmdPartition:
    """A compute partition (XCP): its index on the GPU, DRM nodes and KFD node."""

    index: int
    card: DrmNode
    render: DrmNode
    kfd: KfdNode


@dataclass(frozen=True)
class AmdGpu:
    """One GPU (PCI device) bound to amdgpu.

    ``partitions`` has one entry per KFD node of the GPU: a single one (index 0, the
    GPU's own DRM nodes) in SPX or on GPUs without partitions. The partition mode
    fields are None where the GPU has no such files (MI200 series).
    """

    bdf: str
    path: Path
    vendor_id: int
    device_id: int
    product_name: str
    unique_id: int
    numa_node: int | None
    pcie_root: str | None
    card: DrmNode
    render: DrmNode
    compute_partition: str | None
    available_compute_partitions: tuple[str, ...]
    memory_partition: str | None
    available_memory_partitions: tuple[str, ...]
    partitions: tuple[AmdPartition, ...]

    @property
    def compute_units(self) -> int:
        return sum(p.kfd.compute_units for p in self.partitions)

    @property
    def simd_count(self) -> int:
        return sum(p.kfd.simd_count for p in self.partitions)

    @property
    def memory_bytes(self) -> int:
        return sum(p.kfd.memory_bytes for p in self.partitions)

    @property
    def gfx_target(self) -> str:
        return self.partitions[0].kfd.gfx_target


@dataclass(frozen=True)
class AmdGpuError:
    """A GPU that could not be read, and why (the message names the file)."""

    bdf: str
    reason: str


@dataclass(frozen=True)
class AmdSysfs:
    """Everything read from one sysfs tree."""

    gpus: tuple[AmdGpu, ...]
    errors: tuple[AmdGpuError, ...]
    kfd_dev: DevNumbers | None
    driver_version: str | None


def gfx_target_name(version: int) -> str:
    """KFD's ``gfx_target_version`` as an LLVM target: 90402 → gfx942, 90010 → gfx90a."""
    major, minor, stepping = version // 10000, (version // 100) % 100, version % 100
    return f"gfx{major}{minor:x}{stepping:x}"


def amdgpu_driver_dir(root: Path) -> Path:
    return root / "bus" / "pci" / "drivers" / "amdgpu"


def kfd_dir(root: Path) -> Path:
    return root / "class" / "kfd" / "kfd"


# ---- small readers -------------------------------------------------------------------


def read_text(path: Path) -> str:
    """A sysfs file's content, stripped; at most ``MAX_FILE_BYTES`` are read."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_FILE_BYTES)
    except FileNotFoundError:
        raise SysfsError(f"{path} is missing") from None
    except OSError as err:
        raise SysfsError(f"{path} cannot be read: {err.strerror}") from None
    return data.decode("utf-8", "replace").strip()


def read_optional(path: Path) -> str | None:
    """Like ``read_text``, None when the file does not exist."""
    try:
        return read_text(path)
    except SysfsError:
        if path.exists():
            raise
        return None


def parse_int(text: str, path: Path, *, base: int = 10) -> int:
    try:
        return int(text, base)
    except ValueError:
        raise SysfsError(f"{path} holds {text[:40]!r}, not a number") from None


def read_int(path: Path, *, base: int = 10) -> int:
    return parse_int(read_text(path), path, base=base)


def read_dev(path: Path) -> DevNumbers:
    """A ``dev`` file: ``226:128``."""
    text = read_text(path)
    major, sep, minor = text.partition(":")
    if not sep:
        raise SysfsError(f"{path} holds {text[:40]!r}, not major:minor")
    return DevNumbers(parse_int(major, path), parse_int(minor, path))


def read_properties(path: Path) -> dict[str, int]:
    """A KFD ``properties`` file: ``name value`` lines of integers."""
    props: dict[str, int] = {}
    for line in read_text(path).splitlines():
        name, _, value = line.partition(" ")
        if name:
            props[name] = parse_int(value.strip(), path)
    return props


def _mode_list(text: str | None) -> tuple[str, ...]:
    """``SPX, DPX, QPX, CPX`` → the names (the kernel joins them with ", ")."""
    return tuple(m for m in re.split(r"[,\s]+", text or "") if m)


def _sorted_entries(path: Path, limit: int) -> list[Path]:
    """A directory's entries, sorted, at most ``limit`` (a missing directory: none)."""
    try:
        names = sorted(p.name for p in path.iterdir())
    except OSError:
        return []
    return [path / n for n in names[:limit]]


# ---- DRM nodes -----------------------------------------------------------------------


def read_drm_nodes(drm: Path) -> tuple[DrmNode | None, DrmNode | None]:
    """The ``card<N>`` and ``renderD<M>`` nodes of a device's ``drm`` directory."""
    card = render = None
    for entry in _sorted_entries(drm, 16):
        if m := _CARD.fullmatch(entry.name):
            card = DrmNode(int(m[1]), read_dev(entry / "dev"))
        elif m := _RENDER.fullmatch(entry.name):
            render = DrmNode(int(m[1]), read_dev(entry / "dev"))
    return card, render


def read_xcp_nodes(root: Path) -> dict[int, tuple[DrmNode, DrmNode]]:
    """Render minor → (card, render) of every ``amdgpu_xcp`` platform device."""
    nodes: dict[int, tuple[DrmNode, DrmNode]] = {}
    platform = root / "devices" / "platform"
    entries = [p for p in _sorted_entries(platform, 4096) if p.name.startswith("amdgpu_xcp")]
    for entry in entries[:MAX_XCP_DEVICES]:
        try:
            card, render = read_drm_nodes(entry / "drm")
        except SysfsError:
            continue  # a broken spare XCP device matters only if a partition uses it
        if card is not None and render is not None:
            nodes[render.index] = (card, render)
    return nodes


# ---- KFD topology --------------------------------------------------------------------


def read_kfd_nodes(root: Path) -> tuple[list[KfdNode], list[str]]:
    """The GPU nodes of the KFD topology, and a message per node that cannot be read."""
    nodes_dir = kfd_dir(root) / "topology" / "nodes"
    entries = [p for p in _sorted_entries(nodes_dir, MAX_KFD_NODES) if p.name.isdigit()]
    gpus: list[KfdNode] = []
    broken: list[str] = []
    for entry in sorted(entries, key=lambda p: int(p.name)):
        try:
            node = _read_kfd_node(entry)
        except SysfsError as err:
            broken.append(str(err))
            continue
        if node is not None:
            gpus.append(node)
    return gpus, broken


def _read_kfd_node(path: Path) -> KfdNode | None:
    props = read_properties(path / "properties")
    if props.get("simd_count", 0) == 0:
        return None  # a CPU node
    try:
        return KfdNode(
            node=int(path.name),
            simd_count=props["simd_count"],
            simd_per_cu=props["simd_per_cu"] or 1,
            memory_bytes=_kfd_memory(path),
            gfx_target_version=props["gfx_target_version"],
            render_minor=props["drm_render_minor"],
            domain=props.get("domain", 0),
            location_id=props["location_id"],
            unique_id=props.get("unique_id", 0),
            num_xcc=props.get("num_xcc", 1),
        )
    except KeyError as err:
        raise SysfsError(f"{path / 'properties'} has no {err.args[0]}") from None


def _kfd_memory(node: Path) -> int:
    banks = _sorted_entries(node / "mem_banks", MAX_MEM_BANKS)
    return sum(read_properties(b / "properties").get("size_in_bytes", 0) for b in banks)


def location_of(bdf: str) -> tuple[int, int]:
    """A BDF as KFD's ``domain`` and ``location_id`` (``bus << 8 | device << 3 | fn``)."""
    domain, bus, devfn = bdf.split(":")
    device, fn = devfn.split(".")
    return int(domain, 16), int(bus, 16) << 8 | int(device, 16) << 3 | int(fn)


def slot_key(domain: int, location_id: int) -> tuple[int, int]:
    """Domain, bus and device of a KFD location: the function bits carry a partition's
    index (GC 9.4.3) and newer kernels may use the bits above the bus."""
    return domain, (location_id >> 3) & 0x1FFF


# ---- one GPU -------------------------------------------------------------------------


@dataclass(frozen=True)
class _Context:
    """What every GPU's read shares: the KFD nodes by location and the XCP nodes."""

    kfd_by_location: Mapping[tuple[int, int], list[KfdNode]]
    kfd_broken: tuple[str, ...]
    xcp_nodes: Mapping[int, tuple[DrmNode, DrmNode]]
    kfd_nodes_dir: Path
    gpu_unique_ids: frozenset[int]


def read_gpu(link: Path, ctx: _Context) -> AmdGpu:
    """One GPU from its driver link; SysfsError names what is missing or wrong."""
    path = link.resolve()
    vendor = read_int(path / "vendor", base=16)
    if vendor != AMD_VENDOR_ID:
        raise SysfsError(f"{path / 'vendor'} is {vendor:#06x}, not AMD's {AMD_VENDOR_ID:#06x}")
    card, render = read_drm_nodes(path / "drm")
    if card is None or render is None:
        raise SysfsError(f"{path / 'drm'} has no card and renderD node")
    slot = ctx.kfd_by_location.get(slot_key(*location_of(link.name)), [])
    unique_id = _unique_id(path, slot)
    # Two functions of one slot share bus and device: a node with another GPU's
    # unique id is that GPU's (a partition may have an id of its own).
    others = ctx.gpu_unique_ids - {unique_id}
    kfd = [n for n in slot if n.unique_id not in others]
    compute = read_optional(path / "current_compute_partition")
    return AmdGpu(
        bdf=link.name,
        path=path,
        vendor_id=vendor,
        device_id=read_int(path / "device", base=16),
        product_name=read_optional(path / "product_name") or "",
        unique_id=unique_id,
        numa_node=_numa_node(path),
        pcie_root=next((p for p in path.parts if _PCI_ROOT.fullmatch(p)), None),
        card=card,
        render=render,
        compute_partition=compute,
        available_compute_partitions=_mode_list(
            read_optional(path / "available_compute_partition")
        ),
        memory_partition=read_optional(path / "current_memory_partition"),
        available_memory_partitions=_mode_list(read_optional(path / "available_memory_partition")),
        partitions=_partitions(link.name, card, render, kfd, ctx),
    )


def _numa_node(path: Path) -> int | None:
    node = read_int(path / "numa_node")
    return node if node >= 0 else None  # -1: the platform does not say


def _unique_id(path: Path, kfd: list[KfdNode]) -> int:
    """The PCI device's ``unique_id`` (hex), else its KFD node's (decimal)."""
    text = read_optional(path / "unique_id")
    if text:
        return parse_int(text, path / "unique_id", base=16)
    if kfd and kfd[0].unique_id:
        return kfd[0].unique_id
    raise SysfsError(f"{path / 'unique_id'} is missing and KFD has no unique_id either")


def _partitions(
    bdf: str, card: DrmNode, render: DrmNode, kfd: list[KfdNode], ctx: _Context
) -> tuple[AmdPartition, ...]:
    if not kfd:
        domain, location = location_of(bdf)
        broken = f" (unreadable nodes: {'; '.join(ctx.kfd_broken)})" if ctx.kfd_broken else ""
        raise SysfsError(
            f"no KFD topology node under {ctx.kfd_nodes_dir} has domain {domain} and "
            f"location_id {location}{broken}"
        )
    partitions = []
    for index, node in enumerate(kfd[:MAX_PARTITIONS]):
        if node.render_minor == render.index:
            nodes = (card, render)
        elif node.render_minor in ctx.xcp_nodes:
            nodes = ctx.xcp_nodes[node.render_minor]
        else:
            raise SysfsError(
                f"KFD node {ctx.kfd_nodes_dir / str(node.node)} has drm_render_minor "
                f"{node.render_minor}, which is neither the GPU's nor an amdgpu_xcp device's"
            )
        partitions.append(AmdPartition(index, nodes[0], nodes[1], node))
    return tuple(partitions)


# ---- the whole tree ------------------------------------------------------------------


def gpu_links(root: Path) -> Iterator[Path]:
    """The amdgpu driver's device links (BDF names), sorted, at most ``MAX_GPUS``."""
    entries = _sorted_entries(amdgpu_driver_dir(root), 4096)
    yield from [p for p in entries if _BDF.fullmatch(p.name)][:MAX_GPUS]


def read_sysfs(root: Path) -> AmdSysfs:
    """Every AMD GPU of a sysfs tree (a node's ``/sys`` or a fake one)."""
    kfd_nodes, broken = read_kfd_nodes(root)
    by_location: dict[tuple[int, int], list[KfdNode]] = {}
    for node in kfd_nodes:
        by_location.setdefault(slot_key(node.domain, node.location_id), []).append(node)
    ctx = _Context(
        by_location,
        tuple(broken),
        read_xcp_nodes(root),
        kfd_dir(root) / "topology" / "nodes",
        _pci_unique_ids(root),
    )
    gpus: list[AmdGpu] = []
    errors: list[AmdGpuError] = []
    for link in gpu_links(root):
        try:
            gpus.append(read_gpu(link, ctx))
        except SysfsError as err:
            errors.append(AmdGpuError(link.name, str(err)))
    return AmdSysfs(tuple(gpus), tuple(errors), _kfd_dev(root), _driver_version(root))


def _pci_unique_ids(root: Path) -> frozenset[int]:
    """Every GPU's PCI ``unique_id`` that can be read (the rest: an error later)."""
    ids = set()
    for link in gpu_links(root):
        try:
            ids.add(read_int(link / "unique_id", base=16))
        except SysfsError:
            continue
    return frozenset(ids)


def _kfd_dev(root: Path) -> DevNumbers | None:
    try:
        return read_dev(kfd_dir(root) / "dev")
    except SysfsError:
        return None


def _driver_version(root: Path) -> str | None:
    try:
        return read_optional(root / "module" / "amdgpu" / "version") or None
    except SysfsError:
        return None

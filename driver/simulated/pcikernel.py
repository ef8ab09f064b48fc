"""The simulated backend's PCI functions: a sysfs tree and the kernel that answers its
writes (``drasil.driver.vfio.pcisysfs`` reads and writes it as it does ``/sys``).

``write_tree`` makes, per simulated GPU at ``<bdf>`` (function 0), that function and,
for NVIDIA's, its audio function (``<bdf>`` with function 1, as every NVIDIA
data-center GPU has), both in one IOMMU group and bound to their drivers (``nvidia``
or ``amdgpu``, ``snd_hda_intel``), with the driver directories, ``vfio-pci``'s among
them (the module loaded). In the simulated AMD tree it completes the functions
amdgpu's tree already describes (``drasil.driver.simulated.amdsysfs``). A function
already in the tree is left as it is: a GPU a claim bound to vfio-pci stays bound
across a plugin restart, as on a node.

``SimulatedKernel.write`` does what the kernel does with a write:

- ``driver_override``: stored (a bare newline clears it, shown as ``(null)``);
- ``drivers/<name>/unbind``: the function's ``driver`` link and the driver's link to it
  go (``ENODEV`` when it is not bound there); the last vfio-pci function of a group
  takes ``/dev/vfio/<group>`` and ``class/vfio/<group>`` with it, and each function its
  iommufd node (``vfio-dev/vfio<N>``, ``/dev/vfio/devices/vfio<N>``);
- ``drivers/<name>/bind``: ``EBUSY`` when the function has a driver, ``EINVAL`` when its
  ``driver_override`` names another driver; else the links are made, and binding to
  vfio-pci makes ``class/vfio/<group>/dev`` and ``<dev root>/vfio/<group>``, and the
  function's iommufd node (the simulated host has iommufd: ``class/misc/iommu``);
- ``drivers_probe``: binds an unbound function to its ``driver_override``, else to the
  driver the tree was written with; a driver that is not loaded (no directory) leaves
  it unbound, and the write succeeds, as the kernel's does.

A ``<dev root>/vfio/<group>`` here is a regular file (a test cannot make device nodes);
the CDI spec gives the nodes by number, so a runtime never looks for it.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

MANIFEST: Final = "drasil-simulated-pci.json"
VFIO_GROUP_MAJOR: Final = 511  # the major a vfio module gets on a typical kernel
VFIO_CDEV_MAJOR: Final = 234  # vfio-dev's (iommufd's per-device nodes)
IOMMU_MINOR: Final = 123
_NVIDIA: Final = 0x10DE


@dataclass(frozen=True)
class SimFunction:
    bdf: str
    device_id: int
    class_code: int
    driver: str
    group: int
    numa_node: int | None = None
    pcie_root: str = "pci0000:00"
    vendor_id: int = _NVIDIA


@dataclass(frozen=True)
class SimGpuModel:
    """What the simulated GPUs of one vendor are on the PCI bus."""

    vendor_id: int
    device_id: int
    class_code: int
    driver: str
    audio: bool  # a second function (HDMI/DP audio) in the GPU's IOMMU group


NVIDIA_GPU: Final = SimGpuModel(_NVIDIA, 0x2330, 0x030200, "nvidia", audio=True)
# An MI300X is a processing accelerator (class 0x12) with no audio function.
AMD_GPU: Final = SimGpuModel(0x1002, 0x74A1, 0x120000, "amdgpu", audio=False)


def gpu_functions(
    gpus: Sequence[tuple[str, str | None, int | None]],
    model: SimGpuModel = NVIDIA_GPU,
    *,
    first_group: int = 20,
) -> list[SimFunction]:
    """A GPU function (and its audio function, ``<bdf>`` with function 1) per
    ``(bdf, pcie root, numa node)`` of the simulated GPUs, each GPU in an IOMMU group
    of its own (numbered from ``first_group``, in BDF order)."""
    out = []
    for index, (bdf, root, numa) in enumerate(sorted(gpus)):
        group = first_group + index
        at = root or "pci0000:00"
        out.append(
            SimFunction(
                bdf,
                model.device_id,
                model.class_code,
                model.driver,
                group,
                numa,
                at,
                vendor_id=model.vendor_id,
            )
        )
        if model.audio:
            audio = bdf[:-1] + "1"
            out.append(SimFunction(audio, 0x22A3, 0x040300, "snd_hda_intel", group, numa, at))
    return out


def write_tree(root: Path, functions: Sequence[SimFunction]) -> None:
    """Write (or complete) the tree; functions already in it are left as they are."""
    root.mkdir(parents=True, exist_ok=True)
    native = {f.bdf: f.driver for f in functions}
    (root / MANIFEST).write_text(json.dumps({"native": native}, indent=2) + "\n")
    probe = root / "bus" / "pci" / "drivers_probe"
    probe.parent.mkdir(parents=True, exist_ok=True)
    if not probe.exists():
        probe.write_text("")
    for driver in sorted({f.driver for f in functions} | {"vfio-pci"}):
        folder = _drivers(root) / driver
        folder.mkdir(parents=True, exist_ok=True)
        for name in ("bind", "unbind"):
            if not (folder / name).exists():
                (folder / name).write_text("")
    for function in functions:
        _write_function(root, function)
    # The simulated host's kernel has iommufd (6.2+): /dev/iommu is a misc device.
    iommu = root / "class" / "misc" / "iommu"
    iommu.mkdir(parents=True, exist_ok=True)
    (iommu / "dev").write_text(f"10:{IOMMU_MINOR}\n")


def _drivers(root: Path) -> Path:
    return root / "bus" / "pci" / "drivers"


def _device_path(root: Path, function: SimFunction) -> Path:
    return root / "devices" / function.pcie_root / function.bdf


def _write_function(root: Path, function: SimFunction) -> None:
    path = _device_path(root, function)
    if (path / "driver_override").exists():
        return  # the node's hardware, as a test or the plugin left it
    # A function another simulated tree describes (amdgpu's) keeps what it says.
    path.mkdir(parents=True, exist_ok=True)
    numa = -1 if function.numa_node is None else function.numa_node
    for name, text in (
        ("vendor", f"0x{function.vendor_id:04x}"),
        ("device", f"0x{function.device_id:04x}"),
        ("class", f"0x{function.class_code:06x}"),
        ("numa_node", str(numa)),
    ):
        if not (path / name).exists():
            (path / name).write_text(f"{text}\n")
    _link(root / "bus" / "pci" / "devices" / function.bdf, path)
    group = root / "kernel" / "iommu_groups" / str(function.group)
    (group / "devices").mkdir(parents=True, exist_ok=True)
    _link(group / "devices" / function.bdf, path)
    _link(path / "iommu_group", group)
    (path / "driver_override").write_text("(null)\n")
    _bind_links(root, function.bdf, function.driver)


def _link(link: Path, target: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(os.path.relpath(target, link.parent))


def _bind_links(root: Path, bdf: str, driver: str) -> None:
    device = (root / "bus" / "pci" / "devices" / bdf).resolve()
    _link(_drivers(root) / driver / bdf, device)
    _link(device / "driver", _drivers(root) / driver)


class SimulatedKernel:
    """Answers writes to a tree ``write_tree`` made, as the kernel answers ``/sys``."""

    def __init__(self, root: Path, dev_root: Path) -> None:
        self.root = root
        self.dev_root = dev_root

    def write(self, path: Path, text: str) -> None:
        value = text.strip()
        if path.name == "driver_override":
            path.write_text(f"{value or '(null)'}\n")
        elif path.name == "unbind":
            self._unbind(value, path.parent.name)
        elif path.name == "bind":
            self._bind(value, path.parent.name)
        elif path.name == "drivers_probe":
            self._probe(value)
        else:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), str(path))

    def _device(self, bdf: str) -> Path:
        path = self.root / "bus" / "pci" / "devices" / bdf
        if not path.exists():
            raise OSError(errno.ENODEV, os.strerror(errno.ENODEV), bdf)
        return path.resolve()

    def _driver(self, bdf: str) -> str | None:
        link = self._device(bdf) / "driver"
        return Path(os.readlink(link)).name if link.is_symlink() else None

    def _unbind(self, bdf: str, driver: str) -> None:
        if self._driver(bdf) != driver:
            raise OSError(errno.ENODEV, os.strerror(errno.ENODEV), bdf)
        (_drivers(self.root) / driver / bdf).unlink()
        (self._device(bdf) / "driver").unlink()
        if driver == "vfio-pci":
            cdev = self._cdev_name(bdf)
            (self.dev_root / "vfio" / "devices" / cdev).unlink(missing_ok=True)
            (self._device(bdf) / "vfio-dev" / cdev / "dev").unlink(missing_ok=True)
            group = self._group(bdf)
            if not any(self._driver(m) == "vfio-pci" for m in self._members(group)):
                (self.dev_root / "vfio" / str(group)).unlink(missing_ok=True)
                (self.root / "class" / "vfio" / str(group) / "dev").unlink(missing_ok=True)

    def _bind(self, bdf: str, driver: str) -> None:
        if self._driver(bdf) is not None:
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), bdf)
        override = (self._device(bdf) / "driver_override").read_text().strip()
        if override not in ("(null)", driver):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), bdf)
        _bind_links(self.root, bdf, driver)
        if driver == "vfio-pci":
            group = self._group(bdf)
            dev = self.root / "class" / "vfio" / str(group)
            dev.mkdir(parents=True, exist_ok=True)
            (dev / "dev").write_text(f"{VFIO_GROUP_MAJOR}:{group}\n")
            (self.dev_root / "vfio").mkdir(parents=True, exist_ok=True)
            (self.dev_root / "vfio" / str(group)).write_text("")
            cdev, index = self._cdev_name(bdf), self._cdev_index(bdf)
            folder = self._device(bdf) / "vfio-dev" / cdev
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "dev").write_text(f"{VFIO_CDEV_MAJOR}:{index}\n")
            (self.dev_root / "vfio" / "devices").mkdir(exist_ok=True)
            (self.dev_root / "vfio" / "devices" / cdev).write_text("")

    def _probe(self, bdf: str) -> None:
        if self._driver(bdf) is not None:
            return
        override = (self._device(bdf) / "driver_override").read_text().strip()
        native = json.loads((self.root / MANIFEST).read_text())["native"].get(bdf)
        driver = native if override == "(null)" else override
        if driver and (_drivers(self.root) / driver).is_dir():  # else no driver takes it
            self._bind(bdf, driver)

    def _cdev_index(self, bdf: str) -> int:
        return self._group(bdf) * 8 + int(bdf[-1])

    def _cdev_name(self, bdf: str) -> str:
        return f"vfio{self._cdev_index(bdf)}"

    def _group(self, bdf: str) -> int:
        return int(Path(os.readlink(self._device(bdf) / "iommu_group")).name)

    def _members(self, group: int) -> list[str]:
        return sorted(os.listdir(self.root / "kernel" / "iommu_groups" / str(group) / "devices"))

"""PCI functions as the kernel's sysfs shows them, and the writes that move one
between drivers (``<root>`` is the sysfs root, ``/sys`` on a node)::

    <root>/bus/pci/devices/<bdf>            -> ../../../devices/pci<dddd>:<bb>/.../<bdf>
    <bdf>/vendor, device, class             "0x10de", "0x2330", "0x030200"
    <bdf>/numa_node                         "-1" where the platform has no NUMA
    <bdf>/driver                            -> .../bus/pci/drivers/<name>, absent unbound
    <bdf>/driver_override                   "(null)" when unset
    <bdf>/iommu_group                       -> .../kernel/iommu_groups/<n>; absent with
                                               the IOMMU off
    <root>/kernel/iommu_groups/<n>/devices/<bdf>
    <root>/bus/pci/drivers/<name>/bind, unbind   write a BDF
    <root>/bus/pci/drivers_probe            write a BDF: bind it to the driver its
                                               driver_override names
    <root>/class/vfio/<n>/dev               "<major>:<minor>" of /dev/vfio/<n>, once bound
    <root>/class/misc/vfio/dev              "10:196", /dev/vfio/vfio
    <root>/class/misc/iommu/dev             /dev/iommu, where the kernel has iommufd
    <bdf>/vfio-dev/vfio<N>/dev              /dev/vfio/devices/vfio<N>, the function's own
                                               node under iommufd

The kernel answers a write with a link moved (or an error: ``EBUSY``, ``ENODEV``);
``SysfsWriter`` is how a write is made, so that the simulated backend's tree, whose
"kernel" is ``drasil.driver.simulated.pcikernel``, answers the same way. Reads are
bounded: ``MAX_FILE_BYTES`` a file, ``MAX_GROUP_FUNCTIONS`` functions a group.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

MAX_FILE_BYTES: Final = 4096
MAX_GROUP_FUNCTIONS: Final = 32
VFIO_DRIVER: Final = "vfio-pci"
# /dev/vfio/vfio is the misc device 10:196 on every kernel (include/linux/miscdevice.h).
VFIO_CONTAINER_NUMBERS: Final = (10, 196)
BDF: Final = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
_PCI_ROOT: Final = re.compile(r"pci[0-9a-f]{4,}:[0-9a-f]{2}")
_DEV: Final = re.compile(r"(\d{1,10}):(\d{1,10})")

SysfsWriter = Callable[[Path, str], None]
"""Writes ``text`` to a sysfs file (the kernel acts on it); raises ``OSError``."""


class PciError(Exception):
    """A PCI function's files are missing or unexpected, or the kernel refused a write;
    the message names the function and the file."""


@dataclass(frozen=True)
class PciFunction:
    """One PCI function as sysfs shows it now."""

    bdf: str
    vendor_id: int
    device_id: int
    class_code: int
    driver: str | None  # None: bound to no driver
    driver_override: str | None
    iommu_group: int | None  # None: the IOMMU is off (or the platform has none)
    numa_node: int | None
    pcie_root: str | None


def write_sysfs(path: Path, text: str) -> None:
    """A real sysfs write: one ``write`` of the whole text, as the kernel wants it."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


@dataclass(frozen=True)
class PciBus:
    """A sysfs tree's PCI functions and the writes that move them between drivers."""

    root: Path
    write: SysfsWriter = write_sysfs

    def device_dir(self, bdf: str) -> Path:
        _check_bdf(bdf)
        return self.root / "bus" / "pci" / "devices" / bdf

    def driver_dir(self, driver: str) -> Path:
        return self.root / "bus" / "pci" / "drivers" / driver

    def read(self, bdf: str) -> PciFunction:
        """The function at ``bdf``; ``PciError`` when it is not there."""
        path = self.device_dir(bdf)
        if not path.exists():
            raise PciError(f"PCI function {bdf}: {path} is missing")
        override = _read(path / "driver_override", optional=True)
        return PciFunction(
            bdf=bdf,
            vendor_id=_hex(path / "vendor"),
            device_id=_hex(path / "device"),
            class_code=_hex(path / "class"),
            driver=_link_name(path / "driver"),
            driver_override=None if override in (None, "", "(null)") else override,
            iommu_group=_group(path / "iommu_group"),
            numa_node=_numa(path / "numa_node"),
            pcie_root=_pcie_root(path),
        )

    def group_members(self, group: int) -> tuple[str, ...]:
        """The BDFs of one IOMMU group, sorted."""
        folder = self.root / "kernel" / "iommu_groups" / str(group) / "devices"
        try:
            names = sorted(e.name for e in os.scandir(folder))
        except FileNotFoundError:
            raise PciError(f"IOMMU group {group}: {folder} is missing") from None
        members = tuple(n for n in names if BDF.fullmatch(n))
        if len(members) > MAX_GROUP_FUNCTIONS:
            raise PciError(f"IOMMU group {group} has {len(members)} functions")
        return members

    def functions_of(self, driver: str) -> tuple[str, ...]:
        """The BDFs bound to ``driver`` now, sorted."""
        try:
            names = sorted(e.name for e in os.scandir(self.driver_dir(driver)))
        except FileNotFoundError:
            return ()
        return tuple(n for n in names if BDF.fullmatch(n))

    # ---- writes ----------------------------------------------------------------------

    def set_override(self, bdf: str, driver: str | None) -> None:
        """Set (None: clear) the driver the kernel binds ``bdf`` to next."""
        self._write(bdf, self.device_dir(bdf) / "driver_override", driver or "\n")

    def unbind(self, bdf: str) -> None:
        """Unbind ``bdf`` from its driver (nothing when it has none)."""
        driver = _link_name(self.device_dir(bdf) / "driver")
        if driver is not None:
            self._write(bdf, self.driver_dir(driver) / "unbind", bdf)

    def bind(self, bdf: str, driver: str) -> None:
        """Bind an unbound ``bdf`` to ``driver``: its ``bind`` file, or, where the
        driver has none loaded, a probe that follows ``driver_override``."""
        bind = self.driver_dir(driver) / "bind"
        target = bind if bind.exists() else self.root / "bus" / "pci" / "drivers_probe"
        self._write(bdf, target, bdf)

    def _write(self, bdf: str, path: Path, text: str) -> None:
        try:
            self.write(path, text)
        except OSError as err:
            raise PciError(
                f"PCI function {bdf}: writing {text.strip()!r} to {path} failed: "
                f"{err.strerror or err}"
            ) from None

    # ---- VFIO's device numbers --------------------------------------------------------

    def group_numbers(self, group: int) -> tuple[int, int] | None:
        """``/dev/vfio/<group>``'s numbers, once a function of it is bound to vfio-pci."""
        return _numbers(self.root / "class" / "vfio" / str(group) / "dev")

    def iommufd_numbers(self) -> tuple[int, int] | None:
        """``/dev/iommu``'s numbers where the kernel has iommufd, else None."""
        return _numbers(self.root / "class" / "misc" / "iommu" / "dev")

    def cdev(self, bdf: str) -> tuple[str, tuple[int, int]] | None:
        """A vfio-pci function's own node (iommufd): (``vfio<N>``, its numbers), or None
        where the kernel makes none (``<bdf>/vfio-dev/vfio<N>/dev``)."""
        folder = self.device_dir(bdf) / "vfio-dev"
        try:
            names = sorted(e.name for e in os.scandir(folder) if e.name.startswith("vfio"))
        except FileNotFoundError:
            return None
        for name in names[:1]:
            numbers = _numbers(folder / name / "dev")
            if numbers is not None and name[4:].isdigit():
                return name, numbers
        return None


def _numbers(path: Path) -> tuple[int, int] | None:
    match = _DEV.fullmatch(_read(path, optional=True) or "")
    return (int(match[1]), int(match[2])) if match else None


def bdf_name(bdf: str) -> str:
    """A BDF as a DNS label part: ``0000:3b:00.0`` → ``0000-3b-00-0``."""
    return bdf.replace(":", "-").replace(".", "-")


def _check_bdf(bdf: str) -> None:
    # A BDF becomes a path: refuse anything that is not one.
    if not BDF.fullmatch(bdf):
        raise PciError(f"{bdf!r} is not a PCI address (dddd:bb:dd.f, lower-case hex)")


def _read(path: Path, *, optional: bool = False) -> str | None:
    try:
        with path.open("rb") as f:
            return f.read(MAX_FILE_BYTES).decode("utf-8", "replace").strip()
    except FileNotFoundError:
        if optional:
            return None
        raise PciError(f"{path} is missing") from None
    except OSError as err:
        raise PciError(f"{path} cannot be read: {err.strerror}") from None


def _hex(path: Path) -> int:
    text = _read(path) or ""
    try:
        return int(text, 16)
    except ValueError:
        raise PciError(f"{path} says {text[:32]!r}, not a hex number") from None


def _link_name(path: Path) -> str | None:
    try:
        return Path(os.readlink(path)).name
    except FileNotFoundError:
        return None
    except OSError as err:
        raise PciError(f"{path} cannot be read: {err.strerror}") from None


def _group(path: Path) -> int | None:
    name = _link_name(path)
    if name is None:
        return None
    if not name.isdigit():
        raise PciError(f"{path} names {name!r}, not an IOMMU group number")
    return int(name)


def _numa(path: Path) -> int | None:
    text = _read(path, optional=True)
    if text is None or not text.lstrip("-").isdigit():
        return None
    node = int(text)
    return node if node >= 0 else None


def _pcie_root(path: Path) -> str | None:
    """The ``pci<domain>:<bus>`` part of the function's real path: its root complex."""
    found = _PCI_ROOT.search(str(path.resolve()))
    return found[0] if found else None

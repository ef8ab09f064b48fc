"""The NVIDIA driver's user-space files a GPU container needs, found under a driver root.

A container that gets ``/dev/nvidia0`` can use it only with the driver's libraries of
the *running* version (``libcuda.so.<version>``, ``libnvidia-ml.so.<version>``, …), its
GSP firmware, its utilities and IPC sockets, and the SONAME links and ld cache entries
that make ``dlopen("libcuda.so.1")`` find them. What is looked for, and where, follows
NVIDIA's own CDI generator (the Container Toolkit's ``nvcdi``, management mode), which
the tests run as the oracle on the same driver roots:

- libraries: the folders holding ``lib*.so.<version>`` — first the usual library
  folders under the root, else the root's ``ld.so.cache`` (64-bit entries) — and in
  them (and their ``vdpau/``) every ``*.so.<version>``, plus ``libnvidia-nvvm70.so.*``;
  files of an older driver left in the same folder carry another suffix and are not
  taken;
- firmware: ``nvidia/<version>/gsp*.bin`` and ``ucodes*.bin`` under the kernel's
  firmware folders;
- binaries: ``nvidia-smi`` & co., the first executable of each name on the default
  ``PATH`` folders under the root;
- sockets: ``nvidia-persistenced`` and ``nvidia-fabricmanager`` under ``/run`` or
  ``/var/run``. The host's ``/tmp/nvidia-mps`` is deliberately not mounted: MPS in
  drasil is a daemon per shared GPU that drasil starts, with limits it sets
  (docs/sharing.md); a host-wide daemon would bypass them;
- links for ``create-symlinks``: ``<SONAME> -> <file>`` and ``<name>.so -> <SONAME>``
  where the driver's install has that link, and ``libcuda.so -> libcuda.so.1``.

Every path here is a path *inside* the root (``/usr/lib/x86_64-linux-gnu/…``), which
is also where the file appears in the container. The plugin may see the root at
another path than the host does (the chart mounts the host's root at
``/driver-root``): ``DriverRoot`` reads files through ``local`` and writes ``host`` into
specs, since the runtime that reads the spec runs on the host.
"""

from __future__ import annotations

import ctypes
import fnmatch
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Final

from drasil.driver.devices import HardwareError
from drasil.driver.nvidia.ldcache import elf_soname, read_ld_cache

LIBRARY_FOLDERS: Final = (
    "/",
    "/usr/lib64",
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib/x86_64-linux-gnu/nvidia/current",
    "/usr/lib/aarch64-linux-gnu/nvidia/current",
    "/lib64",
    "/lib/x86_64-linux-gnu",
    "/lib/aarch64-linux-gnu",
    "/lib/x86_64-linux-gnu/nvidia/current",
    "/lib/aarch64-linux-gnu/nvidia/current",
)
BINARY_FOLDERS: Final = (
    "/usr/local/sbin",
    "/usr/local/bin",
    "/usr/sbin",
    "/usr/bin",
    "/sbin",
    "/bin",
)
BINARIES: Final = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
    "nvidia-imex",
    "nvidia-imex-ctl",
)
SOCKETS: Final = ("nvidia-persistenced/socket", "nvidia-fabricmanager/socket")
SOCKET_FOLDERS: Final = ("/run", "/var/run")
LD_CACHE: Final = "/etc/ld.so.cache"
# GSP firmware and the microcode images drivers of the 580 series added beside it.
FIRMWARE: Final = ("gsp*.bin", "ucodes*.bin")
# Libraries named without the driver's version that the driver still ships.
LEGACY_LIBRARIES: Final = ("libnvidia-nvvm70.so.*",)
# Symlink hops followed inside a root before a path counts as a loop.
MAX_LINK_HOPS: Final = 40


class DriverFilesError(HardwareError):
    """The driver root holds no usable driver of the expected version."""


@dataclass(frozen=True)
class DriverRoot:
    """A driver root as the host sees it (``host``, written into specs) and as this
    process sees it (``local``, where files are read)."""

    host: str = "/"
    local: Path = Path("/")

    def local_path(self, inside: str) -> Path:
        """Where a path inside the root is for this process."""
        return self.local / inside.lstrip("/")

    def host_path(self, inside: str) -> str:
        """Where a path inside the root is on the host."""
        return str(PurePosixPath(self.host) / inside.lstrip("/"))

    def resolve(self, inside: str) -> str | None:
        """The path a path inside the root leads to after its links, followed inside the
        root (an absolute link target is relative to the root); ``None`` if it leads
        nowhere."""
        parts = [p for p in PurePosixPath(inside).parts if p != "/"]
        done: list[str] = []
        hops = 0
        while parts:
            part = parts.pop(0)
            if part in ("", "."):
                continue
            if part == "..":
                done = done[:-1]
                continue
            here = "/" + "/".join([*done, part])
            try:
                target = os.readlink(self.local_path(here))
            except FileNotFoundError:
                return None
            except OSError:  # not a link
                done.append(part)
                continue
            hops += 1
            if hops > MAX_LINK_HOPS:
                return None
            if target.startswith("/"):
                done = []
            parts = [p for p in PurePosixPath(target).parts if p != "/"] + parts
        result = "/" + "/".join(done)
        return result if self.local_path(result).exists() else None


@dataclass(frozen=True)
class DriverFiles:
    """What a container needs of one driver version; every path is inside the root."""

    version: str
    libraries: tuple[str, ...]
    library_folders: tuple[str, ...]
    firmware: tuple[str, ...] = ()
    binaries: tuple[str, ...] = ()
    sockets: tuple[str, ...] = ()
    # create-symlinks arguments: "<target>::<link>".
    links: tuple[str, ...] = ()

    @property
    def files(self) -> tuple[str, ...]:
        """Every path a spec would mount."""
        return self.libraries + self.firmware + self.binaries + self.sockets


# --- the version ------------------------------------------------------------------------


def root_driver_version(root: DriverRoot) -> str | None:
    """The version the root's driver libraries carry (``libcuda.so.580.95.05``), or
    ``None`` when it holds none. Newest first where several versions are present."""
    for name in ("libcuda.so.", "libnvidia-ml.so."):
        found = _locate_libraries(root, f"{name}*.*")
        versions = {PurePosixPath(p).name[len(name) :] for p in found}
        versions = {v for v in versions if v and v[0].isdigit()}
        if versions:
            return max(versions, key=_version_key)
    return None


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) if p.isdigit() else -1 for p in version.split("."))


# --- finding the files ------------------------------------------------------------------


def find_driver_files(root: DriverRoot, version: str) -> DriverFiles:
    """The files of driver ``version`` under ``root``.

    Raises ``DriverFilesError`` when the root holds no library of that version, naming
    the version it does hold, if any.
    """
    found = _locate_libraries(root, f"lib*.so.{version}")
    if not found:
        raise DriverFilesError(_no_driver_message(root, version))
    folders = _unique(str(PurePosixPath(p).parent) for p in found)
    libraries = _libraries(root, folders, version)
    return DriverFiles(
        version=version,
        libraries=libraries,
        library_folders=folders,
        firmware=_firmware(root, version),
        binaries=tuple(b for name in BINARIES if (b := find_binary(root, name))),
        sockets=tuple(s for name in SOCKETS if (s := _socket(root, name))),
        links=_links(root, libraries),
    )


def _no_driver_message(root: DriverRoot, version: str) -> str:
    held = root_driver_version(root)
    where = f"driver root {root.host}" + (
        f" (seen at {root.local})" if str(root.local) != root.host else ""
    )
    if held is None:
        return (
            f"{where} holds no NVIDIA driver libraries (no libcuda.so.* or libnvidia-ml.so.* "
            "in its library folders or its /etc/ld.so.cache); set --nvidia-driver-root "
            "(Helm nvidiaDriverRoot) to where the driver is installed"
        )
    return (
        f"{where} holds driver {held}, but NVML (the loaded kernel driver) reports {version}: "
        f"install driver {version}'s files under the root, or load the kernel driver of "
        f"{held} (reboot, or restart the driver container)"
    )


def _locate_libraries(root: DriverRoot, pattern: str) -> tuple[str, ...]:
    """``pattern``'s matches in the usual library folders, else in the ld cache; links
    followed inside the root."""
    found: list[str] = []
    for folder in LIBRARY_FOLDERS:
        found.extend(_glob_files(root, folder, pattern))
    if not found:
        # The cache names the SONAME links (libcuda.so.1): match what they lead to too.
        for entry in read_ld_cache(root.local_path(LD_CACHE)):
            if entry.bits != 64:
                continue
            for candidate in (entry.path, root.resolve(entry.path)):
                if candidate and fnmatch.fnmatchcase(PurePosixPath(candidate).name, pattern):
                    found.append(candidate)
    return _unique(r for p in found if (r := root.resolve(p)) and _is_file(root, r))


def find_library(root: DriverRoot, name: str) -> str | None:
    """The file a library name (``libnvidia-ml.so.1``) leads to under the root, found
    as the driver's libraries are; ``None`` if the root has none."""
    found = _locate_libraries(root, name)
    return found[0] if found else None


def load_nvml(root: DriverRoot) -> Path | None:
    """Load the root's ``libnvidia-ml.so.1`` by its path, so that NVML's own ``dlopen``
    by SONAME (pynvml's) gets it; returns the path, or ``None`` when the root has none
    or it does not load (NVML then searches the loader's path).

    Never through ``LD_LIBRARY_PATH``: that would make an image's Python load the
    host's ``libc.so.6`` too, which breaks wherever the two glibc versions differ.
    """
    found = find_library(root, "libnvidia-ml.so.1")
    if found is None:
        return None
    path = root.local_path(found)
    try:
        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return None
    return path


def _glob_files(root: DriverRoot, folder: str, pattern: str) -> list[str]:
    try:
        names = os.listdir(root.local_path(folder))
    except OSError:
        return []
    return [
        str(PurePosixPath(folder) / name)
        for name in sorted(names)
        if fnmatch.fnmatchcase(name, pattern)
    ]


def _is_file(root: DriverRoot, inside: str) -> bool:
    try:
        return stat.S_ISREG(root.local_path(inside).stat().st_mode)
    except OSError:
        return False


def _libraries(root: DriverRoot, folders: tuple[str, ...], version: str) -> tuple[str, ...]:
    found: list[str] = []
    for folder in folders:
        found.extend(_glob_files(root, folder, f"*.so.{version}"))
        found.extend(_glob_files(root, f"{folder}/vdpau", f"*.so.{version}"))
    for folder in folders:
        for pattern in LEGACY_LIBRARIES:
            found.extend(_glob_files(root, folder, pattern))
    return _unique(r for p in found if (r := root.resolve(p)) and _is_file(root, r))


def firmware_folders() -> tuple[str, ...]:
    """Where the kernel loads firmware from (``drivers/base/firmware_loader``): a custom
    path first, then the release-specific and generic folders."""
    release = os.uname().release
    folders = []
    try:
        custom = Path("/sys/module/firmware_class/parameters/path").read_text().strip()
    except OSError:
        custom = ""
    if custom:
        folders.append(custom)
    folders += [
        f"/lib/firmware/updates/{release}",
        "/lib/firmware/updates",
        f"/lib/firmware/{release}",
        "/lib/firmware",
    ]
    return tuple(folders)


def _firmware(root: DriverRoot, version: str) -> tuple[str, ...]:
    found: list[str] = []
    for folder in firmware_folders():
        for pattern in FIRMWARE:
            found.extend(_glob_files(root, f"{folder}/nvidia/{version}", pattern))
    return _unique(r for p in found if (r := root.resolve(p)) and _is_file(root, r))


def find_binary(root: DriverRoot, name: str) -> str | None:
    """The first executable ``name`` on the default ``PATH`` folders under the root
    (a path inside the root, its links followed), or None."""
    for folder in BINARY_FOLDERS:
        inside = f"{folder}/{name}"
        resolved = root.resolve(inside)
        if resolved and _is_file(root, resolved) and os.access(root.local_path(resolved), os.X_OK):
            return resolved
    return None


def _socket(root: DriverRoot, name: str) -> str | None:
    for folder in SOCKET_FOLDERS:
        resolved = root.resolve(f"{folder}/{name}")
        if resolved is not None:
            return resolved
    return None


def _links(root: DriverRoot, libraries: tuple[str, ...]) -> tuple[str, ...]:
    """``create-symlinks`` arguments: the links a driver install makes beside each
    library (SONAME and ``.so``), where the root has them, and ``libcuda.so``."""
    links: list[str] = []
    for library in libraries:
        folder, name = str(PurePosixPath(library).parent), PurePosixPath(library).name
        if fnmatch.fnmatchcase(name, "libcuda.so.*"):
            links.append(f"libcuda.so.1::{folder}/libcuda.so")
        elif fnmatch.fnmatchcase(name, "libnvidia-opticalflow.so.*"):
            links.append(f"libnvidia-opticalflow.so.1::{folder}/libnvidia-opticalflow.so")
        elif fnmatch.fnmatchcase(name, "libGLX_nvidia.so.*"):
            links.append(f"{name}::{folder}/libGLX_indirect.so.0")
        links.extend(_soname_links(root, folder, name))
    return _unique(links)


def _soname_links(root: DriverRoot, folder: str, name: str) -> list[str]:
    soname = elf_soname(root.local_path(f"{folder}/{name}"))
    links = []
    if soname and soname != name and _is_link(root, f"{folder}/{soname}"):
        links.append(f"{name}::{folder}/{soname}")
    target = soname or name
    so_link = _so_link(target)
    if so_link != target and _is_link(root, f"{folder}/{so_link}"):
        links.append(f"{target}::{folder}/{so_link}")
    return links


def _so_link(name: str) -> str:
    """``libfoo.so`` for ``libfoo.so.1`` (what the toolkit's ``getSoLink`` makes)."""
    head, sep, _ = name.partition(".so.")
    return f"{head}.so" if sep else name


def _is_link(root: DriverRoot, inside: str) -> bool:
    try:
        return stat.S_ISLNK(root.local_path(inside).lstat().st_mode)
    except OSError:
        return False


def _unique(items: Iterable[str]) -> tuple[str, ...]:
    """Items in their first order, each once."""
    return tuple(dict.fromkeys(items))

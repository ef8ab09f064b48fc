"""The spec-wide edits of a node's CDI specs: the driver's files, hooks and control nodes.

Every claim spec of a node carries the same spec-wide edits (docs/kubelet-plugin.md,
"What a container sees"), so a container with several claims gets each driver file
at one container path and the same hooks once per spec; the hooks are idempotent
(``create-symlinks`` keeps a link that already points at its target, ``update-ldcache``
rebuilds the cache from the same folders, ``enable-cuda-compat`` and
``disable-device-node-modification`` write the same files again).

``NodeEdits`` finds the files once and hands out the same edits until a folder they
came from changes (a driver upgraded, a driver container restarted under
``/run/nvidia/driver``): a handful of ``stat`` calls a prepare, and a new scan, for the
version NVML then reports, only after such a change. It never hands out edits whose
files it has not just seen (NVIDIA's DRA driver once wrote "empty device edits" after
the toolkit was replaced under it).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Final

from drasil.driver.cdi.spec import (
    ENV_NVIDIA_VISIBLE_DEVICES,
    ContainerEdits,
    Hook,
    Mount,
    host_device_node,
)
from drasil.driver.nvidia.driverfiles import (
    BINARY_FOLDERS,
    SOCKET_FOLDERS,
    DriverFiles,
    DriverFilesError,
    DriverRoot,
    find_driver_files,
    root_driver_version,
)

log = logging.getLogger(__name__)

LIBRARY_MOUNT_OPTIONS: Final = ("ro", "nosuid", "nodev", "rbind", "rprivate")
SOCKET_MOUNT_OPTIONS: Final = ("nosuid", "nodev", "rbind", "rprivate", "noexec")
ENV_LIBCUDA_DIR: Final = "NVIDIA_CTK_LIBCUDA_DIR"
HOOK_ENV: Final = ("NVIDIA_CTK_DEBUG=false",)
# The legacy NVIDIA runtime hook also reads the container's device list from mounts under
# this folder (its volume-mounts strategy); a file named ``void`` there says "none", as
# NVIDIA_VISIBLE_DEVICES=void does for the variable. NVIDIA's generator writes both, in
# every mode, spec-wide: /dev/null bound read-only.
VOID_MOUNT: Final = Mount(
    host_path="/dev/null",
    container_path="/var/run/nvidia-container-devices/void",
    options=("ro", "nosuid", "nodev", "bind"),
)
# What GBM (and so EGL on GBM) loads for NVIDIA: a link the toolkit's generator makes in
# nvml mode, NVIDIA's DRA driver's mode, in a create-symlinks hook of its own (its graphics
# part), before the driver libraries' one. The link's target is relative to its folder.
GBM_BACKEND_LINK: Final = ("gbm/nvidia-drm_gbm.so", "../libnvidia-allocator.so.1")


def driver_edits(files: DriverFiles, root: DriverRoot, *, hook_path: str | None) -> ContainerEdits:
    """The mounts, hooks and variable that give a container driver ``files``.

    ``hook_path``: the host path of ``nvidia-cdi-hook``; ``None`` leaves hooks out (for
    runtimes that refuse them: the container then needs its own ld cache entries).
    """
    mounts = tuple(
        Mount(host_path=root.host_path(p), container_path=p, options=LIBRARY_MOUNT_OPTIONS)
        for p in files.libraries + files.firmware + files.binaries
    ) + tuple(
        Mount(host_path=root.host_path(p), container_path=p, options=SOCKET_MOUNT_OPTIONS)
        for p in files.sockets
    )
    env = {ENV_LIBCUDA_DIR: ":".join(files.library_folders)}
    return ContainerEdits(env=env, mounts=mounts, hooks=hooks(files, hook_path=hook_path))


def hooks(files: DriverFiles, *, hook_path: str | None) -> tuple[Hook, ...]:
    """The toolkit's hooks in the order its generator writes them."""
    if hook_path is None:
        return ()
    name = PurePosixPath(hook_path).name
    made: list[Hook] = []

    def hook(command: str, *args: str) -> None:
        made.append(Hook(path=hook_path, args=(name, command, *args), env=HOOK_ENV))

    graphics = graphics_links(files)
    if graphics:
        hook("create-symlinks", *(a for link in graphics for a in ("--link", link)))
    if files.links:
        hook("create-symlinks", *(a for link in files.links for a in ("--link", link)))
    hook("enable-cuda-compat", f"--host-driver-version={files.version}")
    folders = _library_mount_folders(files)
    if folders:
        hook("update-ldcache", *(a for f in folders for a in ("--folder", f)))
    hook("disable-device-node-modification")
    return tuple(made)


def graphics_links(files: DriverFiles) -> list[str]:
    """The links of NVIDIA's graphics libraries (``target::link``), as the generator's
    graphics part makes them: GBM's backend for each mounted ``libnvidia-allocator``, and
    ``libnvidia-vulkan-producer.so`` where a driver still ships that library."""
    links = []
    for path in files.libraries:
        folder, name = PurePosixPath(path).parent, PurePosixPath(path).name
        if name == f"libnvidia-allocator.so.{files.version}":
            link, target = GBM_BACKEND_LINK
            links.append(f"{target}::{folder / link}")
        elif name == f"libnvidia-vulkan-producer.so.{files.version}":
            links.append(f"{name}::{folder / 'libnvidia-vulkan-producer.so'}")
    return links


def _library_mount_folders(files: DriverFiles) -> list[str]:
    return list(dict.fromkeys(str(PurePosixPath(p).parent) for p in files.libraries))


def control_edits(control_nodes: Sequence[str]) -> ContainerEdits:
    """The driver's control nodes, and ``NVIDIA_VISIBLE_DEVICES=void`` with its mount
    (``VOID_MOUNT``): CUDA images set ``all`` there, and the NVIDIA runtime's legacy hook
    would otherwise hand the container every GPU of the node; which GPUs it gets is the
    CDI devices' business."""
    nodes = tuple(host_device_node(path) for path in control_nodes)
    return ContainerEdits(
        env={ENV_NVIDIA_VISIBLE_DEVICES: "void"}, device_nodes=nodes, mounts=(VOID_MOUNT,)
    )


def merged(first: ContainerEdits, second: ContainerEdits) -> ContainerEdits:
    """Both edits in one (``second``'s variables win; the two never share one here)."""
    return ContainerEdits(
        env={**first.env, **second.env},
        device_nodes=first.device_nodes + second.device_nodes,
        mounts=first.mounts + second.mounts,
        hooks=first.hooks + second.hooks,
    )


def without_void(edits: ContainerEdits) -> ContainerEdits:
    """``edits`` without ``NVIDIA_VISIBLE_DEVICES`` and its ``void`` mount: for a
    container whose GPUs the NVIDIA runtime is told by that variable (device-plugin
    mode's Allocate sets it; CDI edits would win over it)."""
    env = {k: v for k, v in edits.env.items() if k != ENV_NVIDIA_VISIBLE_DEVICES}
    mounts = tuple(m for m in edits.mounts if m != VOID_MOUNT)
    return ContainerEdits(
        env=env, device_nodes=edits.device_nodes, mounts=mounts, hooks=edits.hooks
    )


# --- the node's edits, kept current -----------------------------------------------------

Stamp = tuple[tuple[str, int, int], ...]


@dataclass
class NodeEdits:
    """The spec-wide edits of this node's specs, rescanned only when the driver changed.

    ``version``: the driver version the files must carry (NVML's, asked again on each
    rescan); ``None`` for a node whose backend cannot say (the root's own version
    is taken). ``root``: ``None`` for a node without driver files (simulated GPUs with no
    driver root given): only the control nodes.
    """

    control: ContainerEdits
    root: DriverRoot | None = None
    version: Callable[[], str | None] = field(default=lambda: None)
    hook_path: str | None = None

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._files: DriverFiles | None = None
        self._edits: ContainerEdits = self.control
        self._stamp: Stamp = ()
        self._watched: tuple[str, ...] = ()

    @property
    def files(self) -> DriverFiles | None:
        """The driver files of the last scan."""
        return self._files

    def files_version(self) -> str:
        """The driver version of the files the edits name now ("unknown" before a scan)."""
        return self._files.version if self._files is not None else "unknown"

    def current(self) -> ContainerEdits:
        """The edits to write now. Raises ``DriverFilesError`` when the root holds no
        driver of the expected version (the message names both)."""
        if self.root is None:
            return self.control
        with self._lock:
            if self._files is None or _stamp(self._watched) != self._stamp:
                self._rescan(self.root)
            return self._edits

    def _rescan(self, root: DriverRoot) -> None:
        previous = self._files
        version = self.version() or _root_version(root)
        files = find_driver_files(root, version)
        self._watched = _watched_folders(root, files)
        self._files, self._stamp = files, _stamp(self._watched)
        self._edits = merged(self.control, driver_edits(files, root, hook_path=self.hook_path))
        if previous is None or previous.version != files.version:
            log.info(
                "driver files found",
                extra={
                    "root": root.host,
                    "version": files.version,
                    "libraries": len(files.libraries),
                    "firmware": len(files.firmware),
                    "binaries": len(files.binaries),
                },
            )


def _root_version(root: DriverRoot) -> str:
    version = root_driver_version(root)
    if version is None:
        raise DriverFilesError(
            f"driver root {root.host} holds no NVIDIA driver libraries (no libcuda.so.* "
            "or libnvidia-ml.so.*); set --nvidia-driver-root (Helm nvidiaDriverRoot) to "
            "where the driver is installed"
        )
    return version


def _watched_folders(root: DriverRoot, files: DriverFiles) -> tuple[str, ...]:
    """Where this process sees every folder a mounted file was found in, and the
    folders binaries and sockets are looked for in: any file added, removed or renamed
    there (how packages and the installer replace a driver) changes its stamp."""
    folders = {str(PurePosixPath(p).parent) for p in files.files}
    folders |= set(files.library_folders) | set(BINARY_FOLDERS) | set(SOCKET_FOLDERS)
    return tuple(str(root.local_path(f)) for f in sorted(folders))


def _stamp(folders: tuple[str, ...]) -> Stamp:
    """Identity and change time of each folder (paths precomputed: a prepare pays
    only the ``stat`` calls)."""
    stamp = []
    for folder in folders:
        try:
            st = os.stat(folder)
        except OSError:
            stamp.append((folder, 0, 0))
            continue
        stamp.append((folder, st.st_ino, st.st_mtime_ns))
    return tuple(stamp)

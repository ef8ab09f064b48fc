"""The NVIDIA driver's files, hook and readiness checks of this node, for both modes.

Builds the node's ``NodeEdits`` from the flags (``--nvidia-driver-root``,
``--container-driver-root``, ``--nvidia-cdi-hook-path``, ``--cdi-hooks``), puts the
image's ``nvidia-cdi-hook`` on the host where none is given (as NVIDIA's DRA driver
does: the runtime runs hooks on the host, so the path in a spec must be a host path),
and says at start what a real GPU container would miss on this node.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Final

from drasil.driver.files import read_regular, write_atomic
from drasil.driver.nvidia.driveredits import NodeEdits, control_edits
from drasil.driver.nvidia.driverfiles import DriverRoot, load_nvml, root_driver_version
from drasil.driver.nvidia.nodecheck import Check, check_device_nodes, check_driver, check_hook
from drasil.driver.nvidia.nvml import NvmlError, NvmlLibrary
from drasil.kubeletplugin.options import PluginOptions

log = logging.getLogger(__name__)

HOOK_NAME: Final = "nvidia-cdi-hook"


def driver_root(opts: PluginOptions) -> DriverRoot | None:
    """The root whose files go into specs; ``None`` for simulated GPUs given no root
    (a machine without a GPU has no driver to give), and for a node that serves no
    NVIDIA GPU."""
    if "nvidia" not in opts.vendors:
        return None
    if opts.backend == "simulated" and opts.nvidia_driver_root is None:
        return None
    root = DriverRoot(host=opts.driver_root_host, local=opts.driver_root_local)
    if opts.backend == "simulated" and root_driver_version(root) is None:
        # A root without a driver (`/` on a machine with none): simulated GPUs get no
        # driver files, as before (the driver-free demo).
        log.warning(
            "no NVIDIA driver under the driver root; simulated GPUs get no driver files",
            extra={"root": root.host},
        )
        return None
    return root


def preload_nvml(opts: PluginOptions) -> Path | None:
    """With ``--backend nvml`` for NVIDIA, NVML from the driver root (``load_nvml``)."""
    if opts.backend != "nvml" or "nvidia" not in opts.vendors:
        return None
    root = DriverRoot(host=opts.driver_root_host, local=opts.driver_root_local)
    path = load_nvml(root)
    if path is None:
        log.warning(
            "no loadable libnvidia-ml.so.1 under the driver root", extra={"root": root.host}
        )
    else:
        log.info("NVML loaded from the driver root", extra={"path": str(path)})
    return path


def nvml_driver_version(lib: NvmlLibrary) -> str | None:
    """The driver version the kernel runs, as NVML reports it now; ``None`` if NVML
    cannot answer."""
    try:
        lib.init()
    except NvmlError as err:
        log.warning("NVML unavailable for the driver version", extra={"error": str(err)})
        return None
    try:
        return lib.system_driver_version()
    except NvmlError as err:
        log.warning("NVML did not say the driver version", extra={"error": str(err)})
        return None
    finally:
        with contextlib.suppress(NvmlError):
            lib.shutdown()


def node_edits(opts: PluginOptions, lib: NvmlLibrary) -> NodeEdits:
    """The spec-wide edits of this node: control nodes, and the driver's files."""
    root = driver_root(opts)
    # The simulated backend's NVML has no real version: the root's files say it.
    real = opts.backend == "nvml"
    return NodeEdits(
        control=control_edits(lib.control_device_nodes()),
        root=root,
        version=(lambda: nvml_driver_version(lib)) if real else (lambda: None),
        hook_path=cdi_hook_path(opts) if root is not None else None,
    )


def cdi_hook_path(opts: PluginOptions) -> str | None:
    """The host path of the hook specs name: the given one, else the image's copied
    into the plugin's state dir (a host path mounted at the same path); ``None`` when
    hooks are disabled or there is none."""
    if opts.cdi_hooks != "enabled":
        return None
    if opts.nvidia_cdi_hook_path:
        return opts.nvidia_cdi_hook_path
    bundled = opts.bundled_cdi_hook
    if not bundled.is_file():
        log.warning(
            "no nvidia-cdi-hook: specs get no hooks",
            extra={"looked_at": str(bundled), "fix": "set --nvidia-cdi-hook-path"},
        )
        return None
    return str(install_hook(bundled, opts.state_dir))


def install_hook(bundled: Path, state_dir: Path) -> Path:
    """``bundled`` copied to ``<state_dir>/nvidia-cdi-hook`` (mode 0755) unless an
    identical copy is there: a running container's hook is never replaced half-written
    (the copy is renamed into place)."""
    dest = state_dir / HOOK_NAME
    data = bundled.read_bytes()
    try:  # never blocks on a FIFO nor follows a link left there (files.read_regular)
        same = read_regular(dest) == data
    except OSError:
        same = False
    if not same or not os.access(dest, os.X_OK):
        state_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(dest, data, mode=0o755, crash_tag="hook", durable=False)
        log.info("installed nvidia-cdi-hook", extra={"path": str(dest)})
    return dest


def readiness(opts: PluginOptions, lib: NvmlLibrary, edits: NodeEdits) -> list[Check]:
    """What a real GPU container would miss on this node (``drasil doctor`` runs the same)."""
    root = edits.root
    if root is None:
        return []
    checks = check_driver(
        root, nvml_version=nvml_driver_version(lib) if opts.backend == "nvml" else None
    )
    checks.append(
        check_hook(edits.hook_path, enabled=opts.cdi_hooks == "enabled", local=_host_to_local(opts))
    )
    if opts.backend == "nvml":
        nodes = [n.path for n in edits.control.device_nodes]
        checks.append(check_device_nodes(nodes))
    return checks


def _host_to_local(opts: PluginOptions) -> Callable[[str], Path | None]:
    """Where this process sees a host path: the state dir and the driver root are
    mounted here; in a container (``--container-driver-root``) nothing else is."""

    def local(host_path: str) -> Path | None:
        path, host_root = Path(host_path), Path(opts.driver_root_host)
        if path.is_relative_to(opts.state_dir):
            return path
        if path.is_relative_to(host_root):
            return opts.driver_root_local / path.relative_to(host_root)
        return path if opts.container_driver_root is None else None

    return local

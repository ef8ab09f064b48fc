"""The node under check: its driver root, drasil's NVML backend over it, and a
``Preparer`` built as the kubelet plugin builds one, but reading its claim from a file
and keeping its state, CDI specs and checkpoint in the check's work dir."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from drasil.driver.checkpoint import CHECKPOINT_DIR, CheckpointStore
from drasil.driver.devices import Device
from drasil.driver.nvidia.driveredits import NodeEdits, control_edits
from drasil.driver.nvidia.driverfiles import DriverRoot, load_nvml
from drasil.driver.nvidia.nvml import NvmlLibrary
from drasil.driver.nvidia.nvmladapter import PynvmlLibrary
from drasil.kubeletplugin.dra.prepare import Preparer, StateLock
from drasil.kubeletplugin.gpucheck.claim import FileClaims
from drasil.kubeletplugin.vendors.nvidia.migs import MigInstances
from drasil.kubeletplugin.vendors.nvidia.mps.daemons import DaemonProgram, MpsDaemons
from drasil.kubeletplugin.vendors.nvidia.mps.shares import GpuEffects

DRIVER = "gpu.drasil.dev"
HOOK = "nvidia-cdi-hook"
# Where the kubelet plugin puts the image's hook on a node (NVIDIA's driverroot.py's
# install_hook into its state dir): the path its specs name when none is given.
PLUGIN_HOOK = f"/var/lib/kubelet/plugins/{DRIVER}/{HOOK}"


@dataclass(frozen=True)
class NodeUnderCheck:
    name: str
    root: DriverRoot
    dev_root: str
    hook_path: str
    lib: NvmlLibrary
    nvml_path: Path | None


def hook_path(given: str | None, root: str, kit_hook: str | None = None) -> str:
    """The hook the specs name: the given one, the toolkit's on PATH or in the root,
    else the plugin's own install path, or where that is absent the container kit's
    (``kit_hook``: the container step's runc runs the hooks). The sandbox stands in for
    the hooks, so for it the hook need not exist."""
    if given:
        return given
    found = shutil.which(HOOK)
    if found:
        return found
    in_root = Path(root) / "usr/bin" / HOOK
    if in_root.is_file():
        return str(in_root)
    if kit_hook is not None and not os.path.exists(PLUGIN_HOOK):
        return kit_hook
    return PLUGIN_HOOK


def open_node(
    *,
    name: str,
    driver_root: str,
    dev_root: str,
    hook: str | None,
    nvidia_smi: str,
    proc_root: Path,
    kit_hook: str | None = None,
) -> NodeUnderCheck:
    """NVML loaded from the driver root (as the plugin does), then initialised."""
    root = DriverRoot(host=driver_root, local=Path(driver_root))
    nvml_path = load_nvml(root)
    lib = PynvmlLibrary(dev_root=dev_root, nvidia_smi=nvidia_smi, proc_root=proc_root)
    lib.init()
    hook = hook_path(hook, driver_root, kit_hook)
    return NodeUnderCheck(name, root, dev_root, hook, lib, nvml_path)


def node_edits(node: NodeUnderCheck) -> NodeEdits:
    lib = node.lib
    return NodeEdits(
        control=control_edits(lib.control_device_nodes()),
        root=node.root,
        version=lib.system_driver_version,
        hook_path=node.hook_path,
    )


def make_preparer(
    node: NodeUnderCheck,
    devices: Mapping[str, Device],
    claim: Mapping[str, Any],
    work: Path,
    *,
    migs: bool = False,
    mps: DaemonProgram | None = None,
) -> Preparer:
    """The plugin's Preparer over ``work``; ``migs``: may cut MIG instances (dynamic
    MIG only). Without ``mps`` no ``effects``: no MPS daemon, no time slice, no GPU
    setting changes; with it, the plugin's ``GpuEffects`` running that MPS program (the
    MPS step: a daemon, and compute mode EXCLUSIVE_PROCESS while it runs)."""
    state, cdi = work / "state", work / "cdi"
    state.mkdir(parents=True, exist_ok=True)
    cdi.mkdir(parents=True, exist_ok=True)
    os.chmod(work, 0o755)  # the sandbox's bind sources (metadata files) live here
    store = CheckpointStore(state / CHECKPOINT_DIR)
    store.load()
    lock = StateLock(store, state)
    effects = (
        GpuEffects(
            node.lib, MpsDaemons(state, program=mps), store=store, state_lock=lock, devices=devices
        )
        if mps is not None
        else None
    )
    return Preparer(
        driver=DRIVER,
        pool=node.name,
        devices=devices,
        claims=FileClaims(claim),
        store=store,
        cdi_root=cdi,
        state_dir=state,
        node_edits=node_edits(node),
        migs=MigInstances(node.lib, state_dir=state) if migs else None,
        effects=effects,
        lock=lock,
    )

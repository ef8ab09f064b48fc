"""AMD on the node daemon's vendor seam (``kubeletplugin.vendors.seam``).

``SOURCE`` is what the registry finds; ``AmdNode`` is AMD on one node: its GPUs and
compute partitions read from amdgpu's sysfs tree (the host's, or the simulated
backend's tree in the plugin's state dir), RAS error counters as its health source,
and one prepare step: a GPU switched to a claim's partition mode, and back once no
claim holds it (``modes``). AMD's containers need their device nodes alone (ROCm's
user space is in the image): no spec-wide edits, no readiness checks, no labels.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from pathlib import Path

from drasil.driver.amd.devices import discover_amd, skipped_text
from drasil.driver.amd.health import AmdHealthWatcher
from drasil.driver.amd.partitions import discover_dynamic
from drasil.driver.amd.simulated import (
    AMD_MODELS,
    is_amd_model,
    parse_amd_profile,
    write_simulated_tree,
)
from drasil.driver.amd.sysfs import amdgpu_driver_dir
from drasil.driver.devices import Device, Vendor
from drasil.driver.health import HealthTracker
from drasil.kubeletplugin.options import PluginOptions
from drasil.kubeletplugin.vendors.amd.modes import PartitionModes
from drasil.kubeletplugin.vendors.seam import (
    HealthSource,
    NodeState,
    PrepareSteps,
    ReadinessCheck,
    VendorDevices,
)

log = logging.getLogger(__name__)

_BDF = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")


class AmdNode:
    """AMD's GPUs of one node, read from the amdgpu sysfs tree under ``sysfs``."""

    vendor = Vendor.AMD

    def __init__(self, opts: PluginOptions, sysfs: Path) -> None:
        self.opts = opts
        self.sysfs = sysfs

    def discover(self, *, dra: bool) -> VendorDevices:
        # Only DRA mode switches modes at prepare; the device-plugin API sees the
        # partitions as they are.
        dynamic = dra and self.opts.amd_partition_mode == "dynamic"
        found = discover_dynamic(self.sysfs) if dynamic else discover_amd(self.sysfs)
        return VendorDevices(
            devices=found.devices,
            skipped=tuple(skipped_text(s) for s in found.skipped),
            counter_sets=found.counter_sets,
            driver=found.driver(),
        )

    def health_sources(
        self, devices: Sequence[Device], health: HealthTracker
    ) -> list[HealthSource]:
        return [("amd-health", AmdHealthWatcher(self.sysfs, devices, health).run)]

    def container_edits(self, *, device_plugin: bool = False) -> None:
        return None

    def readiness(self) -> list[ReadinessCheck]:
        return []

    def node_labels(self, devices: Sequence[Device]) -> None:
        return None

    def prepare_steps(self, node: NodeState) -> PrepareSteps:
        modes = PartitionModes(
            self.sysfs,
            store=node.store,
            state_lock=node.state_lock,
            state_dir=self.opts.state_dir,
        )

        def recover() -> None:
            """GPUs no prepared claim holds go back to the mode they had before (a
            crash, or claims unprepared while the plugin was away)."""
            try:
                done = modes.settle()
            except Exception as err:  # a refused switch must not keep the plugin down
                log.error("settling AMD partition modes failed", extra={"error": str(err)})
                return
            if done:
                node.node_event("PartitionModesRestored", "; ".join(done))

        return PrepareSteps(modes=modes, recover=recover)

    def close(self) -> None:
        return None


class AmdSource:
    """AMD as the registry knows it."""

    vendor = Vendor.AMD

    def detect(self, opts: PluginOptions) -> bool:
        found = amdgpu_driver_dir(opts.amd_sysfs_root)
        return found.is_dir() and any(_BDF.fullmatch(p.name) for p in found.iterdir())

    def where_detected(self, opts: PluginOptions) -> str:
        return f"no PCI device bound to amdgpu in {amdgpu_driver_dir(opts.amd_sysfs_root)}"

    def simulates(self, model: str) -> bool:
        return is_amd_model(model)

    def simulated_models(self) -> tuple[str, ...]:
        return AMD_MODELS

    def open(self, opts: PluginOptions, *, simulated: str | None) -> AmdNode:
        """Raises ``ValueError`` for simulated entries naming no AMD model."""
        if simulated is None:
            return AmdNode(opts, opts.amd_sysfs_root)
        root = opts.simulated_amd_root
        write_simulated_tree(parse_amd_profile(simulated), root, node_name=opts.node_name)
        return AmdNode(opts, root)


SOURCE = AmdSource()

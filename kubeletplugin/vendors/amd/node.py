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
from collections.abc import Sequence
from pathlib import Path

from drasil.driver.amd.devices import discover_amd, skipped_text
from drasil.driver.amd.health import AmdHealthWatcher
from drasil.driver.amd.partitions import ModeWriter, discover_dynamic, write_mode
from drasil.driver.amd.sysfs import (
    AMD_VENDOR_ID,
    SIMULATED_MANIFEST,
    amdgpu_driver_dir,
    gpu_links,
)
from drasil.driver.devices import Device, DeviceType, Vendor
from drasil.driver.health import HealthTracker
from drasil.driver.vfio.devices import VendorPassthrough
from drasil.kubeletplugin.options import PluginOptions
from drasil.kubeletplugin.vendors.amd.modes import PartitionModes
from drasil.kubeletplugin.vendors.passthrough import PciSide, settle_at_start
from drasil.kubeletplugin.vendors.seam import (
    HealthSource,
    NodeState,
    PrepareSteps,
    ReadinessCheck,
    VendorDevices,
)

log = logging.getLogger(__name__)

PASSTHROUGH = VendorPassthrough(
    gpu_type=DeviceType.AMDGPU,
    vfio_type=DeviceType.AMDGPU_VFIO,
    native_driver="amdgpu",
    vendor_id=AMD_VENDOR_ID,
    # A process using the GPU has its DRM nodes open (/dev/kfd is every GPU's).
    busy_nodes=lambda gpu: tuple(
        p
        for p in (*gpu.device_nodes, *(c.host_path for c in gpu.char_devices))
        if p.startswith("/dev/dri/")
    ),
)


class AmdNode:
    """AMD's GPUs of one node, read from the amdgpu sysfs tree under ``sysfs``."""

    vendor = Vendor.AMD

    def __init__(
        self,
        opts: PluginOptions,
        sysfs: Path,
        *,
        write: ModeWriter = write_mode,
        simulated: bool = False,
    ) -> None:
        self.opts = opts
        self.sysfs = sysfs
        self.write = write  # amdgpu's mode file, or the simulated tree's answer to it
        # --passthrough: GPUs rebound to vfio-pci in the same sysfs tree.
        self.pci = _pci_side(opts, sysfs, simulated=simulated) if opts.passthrough else None

    def discover(self, *, dra: bool) -> VendorDevices:
        # Only DRA mode switches modes at prepare; the device-plugin API sees the
        # partitions as they are.
        dynamic = dra and self.opts.amd_partition_mode == "dynamic"
        found = discover_dynamic(self.sysfs) if dynamic else discover_amd(self.sysfs)
        devices = VendorDevices(
            devices=found.devices,
            skipped=tuple(skipped_text(s) for s in found.skipped),
            counter_sets=found.counter_sets,
            driver=found.driver(),
        )
        if dra and self.pci is not None:
            return self.pci.publish(devices, PASSTHROUGH)
        return devices

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
            write=self.write,
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

        passthrough = self.pci.step(node) if self.pci is not None else None

        def recover_all() -> None:
            recover()
            if passthrough is not None:
                settle_at_start(passthrough, node)

        return PrepareSteps(modes=modes, passthrough=passthrough, recover=recover_all)

    def close(self) -> None:
        return None


class AmdSource:
    """AMD as the registry knows it."""

    vendor = Vendor.AMD

    def detect(self, opts: PluginOptions) -> bool:
        return any(gpu_links(opts.amd_sysfs_root))

    def where_detected(self, opts: PluginOptions) -> str:
        return f"no PCI device bound to amdgpu in {amdgpu_driver_dir(opts.amd_sysfs_root)}"

    def simulates(self, model: str) -> bool:
        return model in self.simulated_models()

    def simulated_models(self) -> tuple[str, ...]:
        # Asked only of a simulated profile: the simulator's own models.
        from drasil.driver.simulated.amdsysfs import AMD_MODELS  # noqa: PLC0415

        return AMD_MODELS

    def open(self, opts: PluginOptions, *, simulated: str | None) -> AmdNode:
        """Raises ``ValueError`` for simulated entries naming no AMD model."""
        if simulated is None and not _simulated_tree(opts.amd_sysfs_root):
            return AmdNode(opts, opts.amd_sysfs_root)
        # The simulated backend's tree (or one a test rig points --amd-sysfs-root at):
        # the only place the simulator is imported (drasil.driver.simulated).
        from drasil.driver.simulated import amdsysfs  # noqa: PLC0415

        root = opts.simulated_amd_root if simulated is not None else opts.amd_sysfs_root
        if simulated is not None:
            entries = amdsysfs.parse_amd_profile(simulated)
            amdsysfs.write_simulated_tree(entries, root, node_name=opts.node_name)
        return AmdNode(opts, root, write=amdsysfs.write_mode, simulated=True)


def _pci_side(opts: PluginOptions, sysfs: Path, *, simulated: bool) -> PciSide:
    if not simulated:
        return PciSide(opts, root=sysfs)
    from drasil.driver.simulated.pcikernel import AMD_GPU  # noqa: PLC0415

    return PciSide(opts, root=sysfs, simulated=AMD_GPU)


def _simulated_tree(root: Path) -> bool:
    """A tree the simulated backend wrote (it carries the manifest)."""
    return (root / SIMULATED_MANIFEST).is_file()


SOURCE = AmdSource()

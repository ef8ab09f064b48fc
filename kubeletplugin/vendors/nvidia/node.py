"""NVIDIA on the node daemon's vendor seam (``kubeletplugin.vendors.seam``).

``SOURCE`` is what the registry finds; ``NvidiaNode`` is NVIDIA on one node: its
GPUs and MIG devices read through NVML (the driver's library, or the simulated
backend's fake), XID events as its health source, the driver's files and control
nodes as the spec-wide edits (``driverroot``), GFD's Node labels, and three prepare
steps: MIG instances cut on demand (``migs``), MPS daemons and time slices
(``mps.shares``), and at start the repair of both against the checkpoint.

NVML is imported and initialised only here: a node that does not serve NVIDIA never
loads it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from drasil.driver.cdi.spec import ContainerEdits
from drasil.driver.devices import Device, DeviceType, HardwareError, Vendor
from drasil.driver.health import HealthTracker
from drasil.driver.kubeapi import KubeApi
from drasil.driver.nvidia.driveredits import NodeEdits, without_void
from drasil.driver.nvidia.driverfiles import DriverRoot, find_binary
from drasil.driver.nvidia.nodecheck import KERNEL_VERSION_FILE, kernel_module_loaded
from drasil.driver.nvidia.nodedevices import discover, driver_description, skipped_text
from drasil.driver.nvidia.nodelabels import OWN_KEY, node_labels
from drasil.driver.nvidia.nvml import NvmlError, NvmlLibrary, nvml_session
from drasil.driver.nvidia.nvmladapter import PynvmlLibrary
from drasil.driver.nvidia.xid import XidWatcher
from drasil.driver.vfio.devices import VendorPassthrough
from drasil.kubeletplugin.options import PluginOptions
from drasil.kubeletplugin.vendors.nvidia import driverroot
from drasil.kubeletplugin.vendors.nvidia.migs import MigInstances
from drasil.kubeletplugin.vendors.nvidia.mps.daemons import (
    CONTROL_PROGRAM,
    DaemonLauncher,
    DaemonProgram,
    MpsDaemons,
    ProcessLauncher,
)
from drasil.kubeletplugin.vendors.nvidia.mps.pods import DaemonPods, KubePods, PodLauncher
from drasil.kubeletplugin.vendors.nvidia.mps.shares import GpuEffects
from drasil.kubeletplugin.vendors.nvidia.mps.watch import DaemonWatch
from drasil.kubeletplugin.vendors.nvidia.recovery import reconcile_migs
from drasil.kubeletplugin.vendors.passthrough import PciSide, settle_at_start
from drasil.kubeletplugin.vendors.seam import (
    EditsSource,
    HealthSource,
    NodeLabelSet,
    NodeState,
    PrepareSteps,
    ReadinessCheck,
    VendorDevices,
)

log = logging.getLogger(__name__)

PASSTHROUGH = VendorPassthrough(
    gpu_type=DeviceType.GPU,
    vfio_type=DeviceType.VFIO,
    native_driver="nvidia",
    vendor_id=0x10DE,
    # Every process using a GPU has its node open (CUDA, nvidia-smi, an MPS server).
    busy_nodes=lambda gpu: (f"/dev/nvidia{gpu.minor}",),
)


class NvidiaNode:
    """NVIDIA's GPUs of one node, through ``lib``."""

    vendor = Vendor.NVIDIA

    def __init__(self, opts: PluginOptions, lib: NvmlLibrary, *, simulated: bool = False) -> None:
        self.opts = opts
        self.lib = lib
        # --passthrough: where GPUs are rebound to vfio-pci (the simulated kernel's tree
        # for the simulated backend).
        self.pci = _pci_side(opts, simulated=simulated) if opts.passthrough else None
        self._held = False
        self._edits: NodeEdits | None = None
        # The sharing step and the node it acts on, once prepare_steps made them.
        self._sharing: tuple[GpuEffects, NodeState] | None = None

    def hold(self) -> None:
        """Take the daemon's own NVML reference, kept until ``close``.

        NVML counts inits; discovery, MIG changes and the XID thread each take theirs
        around their calls, and with this one underneath the count never drops to zero
        between them: re-initialising NVML from zero is slow (it opens every GPU) and
        handles from before need not survive it. Raises ``HardwareError``.
        """
        if self._held:
            return
        try:
            self.lib.init()
        except NvmlError as err:
            raise HardwareError(str(err)) from err
        self._held = True

    def discover(self, *, dra: bool) -> VendorDevices:
        self.hold()
        # Only DRA mode can cut MIG devices on demand (prepare creates them), and share
        # GPUs by capacity: kubelet's device-plugin API has no counters and hands each
        # device to one container, so that mode sees the static, exclusive layout.
        found = discover(
            self.lib,
            node_name=self.opts.node_name,
            mig_mode=self.opts.mig_mode if dra else "static",
            gpu_sharing=self.opts.gpu_sharing if dra else "exclusive",
        )
        devices = VendorDevices(
            devices=found.devices,
            skipped=tuple(skipped_text(s) for s in found.skipped),
            counter_sets=found.counter_sets,
            driver=driver_description(found),
        )
        if dra and self.pci is not None:
            return self.pci.publish(devices, PASSTHROUGH)
        return devices

    def health_sources(
        self, devices: Sequence[Device], health: HealthTracker
    ) -> list[HealthSource]:
        # An NVML "GPU lost" that names no GPU marks every device it watches: NVIDIA's.
        sources: list[HealthSource] = [("xid", XidWatcher(self.lib, devices, health).run)]
        if self._sharing is not None:  # DRA mode: MPS daemons that die under claims
            effects, node = self._sharing
            watch = DaemonWatch(effects, health, node_event=node.node_event, api=node.api)
            sources.append(("mps-watch", watch.run))
        return sources

    def edits(self) -> NodeEdits:
        """The node's driver files and control nodes (built once, kept current)."""
        if self._edits is None:
            self._edits = driverroot.node_edits(self.opts, self.lib)
        return self._edits

    def container_edits(self, *, device_plugin: bool = False) -> EditsSource:
        edits = self.edits()
        return _WithoutVisibleDevices(edits) if device_plugin else edits

    def readiness(self) -> list[ReadinessCheck]:
        return list(driverroot.readiness(self.opts, self.lib, self.edits()))

    def node_labels(self, devices: Sequence[Device]) -> NodeLabelSet:
        wanted = node_labels(
            devices,
            mig_mode=self.opts.mig_mode,
            gpu_sharing=self.opts.gpu_sharing,
            gfd=self.opts.node_labels == "gfd",
        )
        return NodeLabelSet(wanted=wanted, owned=OWN_KEY)

    def prepare_steps(self, node: NodeState) -> PrepareSteps:
        migs = MigInstances(self.lib, state_dir=self.opts.state_dir)
        effects = GpuEffects(
            self.lib,
            MpsDaemons(
                self.opts.state_dir,
                program=mps_program(self.opts),
                launcher=mps_launcher(self.opts, node.api),
            ),
            store=node.store,
            state_lock=node.state_lock,
            devices=node.devices,
            pods=node.api,
            whole_devices=self.opts.mps_whole_devices,
        )
        self._sharing = (effects, node)

        def recover() -> None:
            message = reconcile_migs(
                migs,
                store=node.store,
                state_lock=node.state_lock,
                devices=node.devices,
                mig_mode=self.opts.mig_mode,
            )
            if message:
                log.warning("MIG instances reconciled: %s", message)
                node.node_event("MigInstancesReconciled", message)
            try:  # MPS daemons of prepared shares run again; what no claim needs is undone
                effects.resume()
            except Exception as err:  # a GPU tool failing must not keep the plugin down
                log.error("resuming GPU sharing state failed", extra={"error": str(err)})

        passthrough = (
            self.pci.step(node, processes=self._processes) if self.pci is not None else None
        )

        def recover_all() -> None:
            recover()
            if passthrough is not None:
                settle_at_start(passthrough, node)

        return PrepareSteps(
            instances=migs, sharing=effects, passthrough=passthrough, recover=recover_all
        )

    def _processes(self, device: Device) -> tuple[int, ...]:
        """NVML's compute and graphics processes of the GPU ``device`` is (by UUID)."""
        try:
            with nvml_session(self.lib):
                for index in range(self.lib.device_count()):
                    handle = self.lib.device_handle_by_index(index)
                    if self.lib.device_uuid(handle) == device.uuid:
                        return self.lib.device_processes(handle)
        except NvmlError as err:
            raise HardwareError(f"NVML: {err}") from err
        return ()  # not NVML's any more (bound elsewhere): the /proc walk decides

    def close(self) -> None:
        if not self._held:
            return
        self._held = False
        try:
            self.lib.shutdown()
        except NvmlError as err:
            log.warning("nvmlShutdown failed", extra={"error": str(err)})


def _pci_side(opts: PluginOptions, *, simulated: bool) -> PciSide:
    if not simulated:
        return PciSide(opts, root=opts.pci_sysfs_root)
    from drasil.driver.simulated.pcikernel import NVIDIA_GPU  # noqa: PLC0415

    return PciSide(opts, root=opts.simulated_pci_root, simulated=NVIDIA_GPU)


@dataclass(frozen=True)
class _WithoutVisibleDevices:
    """The node's edits less ``NVIDIA_VISIBLE_DEVICES`` and its ``void`` mount, for
    device-plugin mode: Allocate sets it to the container's GPUs, and CDI edits win over
    Allocate's env."""

    edits: NodeEdits

    def current(self) -> ContainerEdits:
        return without_void(self.edits.current())

    def files_version(self) -> str:
        return self.edits.files_version()


def mps_program(opts: PluginOptions) -> DaemonProgram:
    """The MPS control program of the plugin's backend: the stand-in, or the driver's
    ``nvidia-cuda-mps-control`` run chrooted into the driver root (by its path there)."""
    root = DriverRoot(host=opts.driver_root_host, local=opts.driver_root_local)
    control = find_binary(root, CONTROL_PROGRAM) if opts.backend == "nvml" else None
    return DaemonProgram.for_backend(
        opts.backend,
        control=control,
        driver_root=opts.driver_root_local,
        multiuser=opts.mps_multiuser,
    )


def mps_launcher(opts: PluginOptions, api: KubeApi) -> DaemonLauncher:
    """Daemons in Pods of their own where an image for them is given (the chart), so
    they outlive the plugin's Pod; else processes of the plugin's host."""
    if opts.mps_daemon_image is None or opts.pod_namespace is None:
        return ProcessLauncher()
    pods = DaemonPods(
        namespace=opts.pod_namespace,
        node=opts.node_name,
        driver=opts.driver_name,
        image=opts.mps_daemon_image,
        state_dir=opts.state_dir,
        driver_root_host=opts.driver_root_host,
        driver_root_local=opts.driver_root_local,
        overrides=opts.mps_daemon_pod,
    )
    return PodLauncher(KubePods(api), pods)


class NvidiaSource:
    """NVIDIA as the registry knows it."""

    vendor = Vendor.NVIDIA

    def detect(self, opts: PluginOptions) -> bool:
        return kernel_module_loaded(opts.proc_root)

    def where_detected(self, opts: PluginOptions) -> str:
        return f"no {opts.proc_root / KERNEL_VERSION_FILE} (NVIDIA's kernel module)"

    def simulates(self, model: str) -> bool:
        return model in self.simulated_models()

    def simulated_models(self) -> tuple[str, ...]:
        # Asked only of a simulated profile: the simulator's own models.
        from drasil.driver.simulated.gpucatalog import PROFILES  # noqa: PLC0415

        return tuple(sorted(PROFILES))

    def open(self, opts: PluginOptions, *, simulated: str | None) -> NvidiaNode:
        """Raises ``ProfileSpecError`` (a ValueError) for a simulated profile naming no
        known model."""
        if simulated is not None:
            # The only place the fake NVML is imported (drasil.driver.simulated).
            from drasil.driver.simulated.nvml import simulated_library  # noqa: PLC0415

            lib: NvmlLibrary = simulated_library(
                simulated, node_name=opts.node_name, state_file=opts.simulated_state_file
            )
            return NvidiaNode(opts, lib, simulated=True)
        # NVML from the driver root, before pynvml looks for it (driverroot.preload_nvml).
        driverroot.preload_nvml(opts)
        host, local = opts.dev_root
        lib = PynvmlLibrary(dev_root=host, dev_root_local=local, proc_root=opts.proc_root)
        return NvidiaNode(opts, lib)


SOURCE = NvidiaSource()

"""GPUs bound to vfio-pci for virtual machines (``--passthrough``), and back.

A passthrough device (``drasil.driver.vfio.devices``) is prepared by moving its GPU's
PCI function, and every other function of its IOMMU group (the GPU's audio function,
say: a VM gets a group whole or not at all), from their drivers to ``vfio-pci``:

1. no process uses the GPU: none the vendor's driver lists (NVML's running processes),
   and none has the GPU's nodes open (``drasil.driver.vfio.holders``); a GPU in use is
   refused, naming the process, and kubelet retries; nothing was changed;
2. per function, its driver before is recorded (GPU record ``pci:<bdf>``,
   ``nativeDriver``) unless a record is there already;
3. ``driver_override`` is set to ``vfio-pci``, the function unbound from its driver and
   bound to ``vfio-pci``;
4. ``/dev/vfio/<group>`` is waited for (udev makes it; at most ``NODE_WAIT`` s), and the
   device comes back with it and ``/dev/vfio/vfio`` by number; with the claim's
   ``VfioDeviceConfig`` preferring iommufd, where the kernel has it, the function's own
   ``/dev/vfio/devices/vfio<N>`` and ``/dev/iommu`` instead; without ``enableAPIDevice``
   no ``/dev/vfio/vfio`` (or ``/dev/iommu``).

The claim was recorded ``PrepareStarted`` with a ``vfio`` record before step 1. A
repeated prepare finds functions already on vfio-pci and skips them, so a crash at
any step is completed by the next call. ``settle`` (after the last unprepare, and at
start) binds every recorded function no claim holds back to its driver before:
unbind from vfio-pci, clear ``driver_override``, bind; then the record goes. A crash
in between is settled again. A reboot starts from the host's binding: the kernel
forgets ``driver_override``, and the checkpoint of an earlier boot is discarded.

One lock (threads, and a ``FileLock`` in the state dir for a second plugin instance)
covers every bind and settle. Crash points (``drasil.driver.files``):
``vfio-after-record``, ``vfio-after-override``, ``vfio-after-unbind``,
``vfio-after-bind``, ``vfio-after-restore``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Final

from drasil.api.checkpoint import GpuRecord
from drasil.driver.checkpoint import CheckpointStore
from drasil.driver.devices import (
    PCI_BUS_ID_ATTRIBUTE,
    CharDevice,
    Device,
    HardwareError,
    PciPassthrough,
)
from drasil.driver.files import FileLock, crash_point
from drasil.driver.vfio.devices import VendorPassthrough, VfioRequest, with_passthrough
from drasil.driver.vfio.holders import holders
from drasil.driver.vfio.pcisysfs import VFIO_CONTAINER_NUMBERS, VFIO_DRIVER, PciBus, PciError
from drasil.kubeletplugin.options import PluginOptions
from drasil.kubeletplugin.vendors.seam import NodeState, VendorDevices

if TYPE_CHECKING:
    from drasil.driver.simulated.pcikernel import SimGpuModel

log = logging.getLogger(__name__)

ProcessQuery = Callable[[Device], tuple[int, ...]]
"""The PIDs a vendor's driver says use a GPU (NVML's running processes); raises
``HardwareError`` when it cannot tell."""
NVIDIA_VENDOR_ID: Final = 0x10DE
LOCK_TIMEOUT: Final = 30.0  # below kubelet's 45 s call timeout, like the MIG lock
NODE_WAIT: Final = 10.0
NODE_POLL: Final = 0.05
RECORD_PREFIX: Final = "pci:"
VFIO_DIR: Final = "/dev/vfio"


class PassthroughError(HardwareError):
    """A GPU that cannot be passed through now (in use, refused by the kernel)."""


def record_key(bdf: str) -> str:
    """The checkpoint's GPU-record key of a PCI function drasil rebound."""
    return f"{RECORD_PREFIX}{bdf}"


class Passthrough:
    """Binds GPUs to vfio-pci for prepared claims, and back once no claim holds them."""

    def __init__(
        self,
        bus: PciBus,
        *,
        dev_root: Path,
        proc_root: Path,
        store: CheckpointStore,
        state_lock: Callable[[], AbstractContextManager[None]],
        state_dir: Path,
        node_wait: float = NODE_WAIT,
        processes: ProcessQuery | None = None,
    ) -> None:
        self.bus = bus
        # The vendor's own list of the GPU's processes (NVML's), beside the /proc walk.
        self.processes = processes
        self.dev_root = dev_root  # where /dev/vfio/<group> shows up (the host's /dev)
        self.proc_root = proc_root
        self.store = store
        self.state_lock = state_lock
        self.node_wait = node_wait
        self._thread_lock = threading.Lock()
        self._file_lock = state_dir / "vfio.lock"

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with self._thread_lock, FileLock(self._file_lock, timeout=LOCK_TIMEOUT):
            yield

    # ---- prepare ------------------------------------------------------------------------

    def bind(self, requests: Sequence[VfioRequest]) -> dict[str, Device]:
        """Bind each passthrough device's IOMMU group to vfio-pci; the devices with
        their VFIO nodes. Raises ``PassthroughError``."""
        out = {}
        with self._locked():
            for request in requests:
                device = request.device
                assert device.passthrough is not None
                self._bind(device, device.passthrough)
                out[device.name] = self._with_nodes(request, device.passthrough)
        return out

    def _bind(self, device: Device, passthrough: PciPassthrough) -> None:
        try:
            members = self.bus.group_members(passthrough.iommu_group)
            functions = {bdf: self.bus.read(bdf) for bdf in members}
        except PciError as err:
            raise PassthroughError(f"device {device.name}: {err}") from None
        gpu = functions.get(passthrough.bus_id)
        if gpu is None:
            raise PassthroughError(
                f"device {device.name}: PCI function {passthrough.bus_id} is not in IOMMU "
                f"group {passthrough.iommu_group} any more; the node changed since the "
                "plugin started"
            )
        if not self.bus.driver_dir(VFIO_DRIVER).is_dir():
            raise PassthroughError(
                f"device {device.name}: the vfio-pci driver is not loaded on this node "
                f"({self.bus.driver_dir(VFIO_DRIVER)} is missing); modprobe vfio-pci, and "
                "load it at boot (docs/passthrough.md)"
            )
        if gpu.driver == passthrough.native_driver:
            self._check_idle(device, passthrough)
        for bdf, function in functions.items():
            if function.driver == VFIO_DRIVER:
                continue
            self._remember(bdf, function.driver, passthrough)
            crash_point("vfio-after-record")
            self._move(bdf, device)

    def _check_idle(self, device: Device, passthrough: PciPassthrough) -> None:
        pids = self._vendor_processes(device)
        if pids:
            listed = ", ".join(str(p) for p in pids[:8])
            raise PassthroughError(
                f"device {device.name}: GPU {passthrough.bus_id} is in use (its driver lists "
                f"processes {listed}); it is passed through once no process uses it "
                "(kubelet retries)"
            )
        found = holders(self.proc_root, passthrough.busy_nodes)
        if found.found:
            held = "; ".join(h.text() for h in found.found[:4])
            raise PassthroughError(
                f"device {device.name}: GPU {passthrough.bus_id} is in use ({held}); it is "
                "passed through once no process uses it (kubelet retries)"
            )
        if found.incomplete:
            raise PassthroughError(
                f"device {device.name}: could not tell whether GPU {passthrough.bus_id} is in "
                f"use ({found.incomplete}); kubelet retries"
            )

    def _vendor_processes(self, device: Device) -> tuple[int, ...]:
        if self.processes is None or not device.uuid:
            return ()
        try:
            return self.processes(device)
        except HardwareError as err:  # the /proc walk still decides
            log.warning("the GPU's processes could not be listed", extra={"error": str(err)})
            return ()

    def _remember(self, bdf: str, driver: str | None, passthrough: PciPassthrough) -> None:
        """Record the function's driver before, once (a repeat finds it recorded)."""
        with self.state_lock():
            record = self.store.gpus().get(record_key(bdf)) or GpuRecord()
            if record.native_driver is not None:
                return
            # An unbound GPU function (a crash after its unbind, with its record lost)
            # goes back to the GPU's driver; any other function back to none.
            before = driver or (passthrough.native_driver if bdf == passthrough.bus_id else "")
            self.store.set_gpu(record_key(bdf), record.model_copy(update={"native_driver": before}))

    def _move(self, bdf: str, device: Device) -> None:
        try:
            self.bus.set_override(bdf, VFIO_DRIVER)
            crash_point("vfio-after-override")
            self.bus.unbind(bdf)
            crash_point("vfio-after-unbind")
            self.bus.bind(bdf, VFIO_DRIVER)
            crash_point("vfio-after-bind")
            now = self.bus.read(bdf).driver
        except PciError as err:
            raise PassthroughError(f"device {device.name}: {err}") from None
        if now != VFIO_DRIVER:
            raise PassthroughError(
                f"device {device.name}: PCI function {bdf} is bound to {now or 'no driver'} "
                "after binding it to vfio-pci; kubelet retries"
            )
        log.info("PCI function bound to vfio-pci", extra={"function": bdf, "device": device.name})

    def _with_nodes(self, request: VfioRequest, passthrough: PciPassthrough) -> Device:
        """The device with its VFIO nodes by number, once udev made them: the group's
        (or, with iommufd preferred and there, the function's own) and the API device."""
        device = request.device
        iommufd = self.bus.iommufd_numbers() if request.prefer_iommufd else None
        if iommufd is not None:
            cdev = self._wait(device, lambda: self._cdev(passthrough.bus_id))
            nodes = [cdev]
            api = _node("/dev/iommu", iommufd)
        else:
            nodes = [self._wait(device, lambda: self._group_node(passthrough.iommu_group))]
            api = _node(f"{VFIO_DIR}/vfio", VFIO_CONTAINER_NUMBERS)
        if request.api_device:
            nodes.insert(0, api)
        return replace(device, char_devices=tuple(nodes))

    def _group_node(self, group: int) -> CharDevice | None:
        numbers = self.bus.group_numbers(group)
        if numbers is None or not (self.dev_root / "vfio" / str(group)).exists():
            return None
        return _node(f"{VFIO_DIR}/{group}", numbers)

    def _cdev(self, bdf: str) -> CharDevice | None:
        found = self.bus.cdev(bdf)
        if found is None or not (self.dev_root / "vfio" / "devices" / found[0]).exists():
            return None
        return _node(f"{VFIO_DIR}/devices/{found[0]}", found[1])

    def _wait(self, device: Device, made: Callable[[], CharDevice | None]) -> CharDevice:
        deadline = time.monotonic() + self.node_wait
        while (node := made()) is None:
            if time.monotonic() > deadline:
                raise PassthroughError(
                    f"device {device.name}: its VFIO node did not appear under "
                    f"{self.dev_root / 'vfio'} within {self.node_wait:g} s of binding the "
                    "GPU to vfio-pci; kubelet retries"
                )
            time.sleep(NODE_POLL)
        return node

    # ---- unprepare and start ------------------------------------------------------------

    def settle(self) -> list[str]:
        """Bind the recorded functions no prepared claim holds back to their drivers;
        what was done. A function the kernel will not move is logged and kept for the
        next settle; the others are settled anyway."""
        done: list[str] = []
        with self._locked():
            with self.state_lock():
                records = {
                    key.removeprefix(RECORD_PREFIX): r.native_driver
                    for key, r in self.store.gpus().items()
                    if key.startswith(RECORD_PREFIX) and r.native_driver is not None
                }
                held = self._held()
            for bdf, driver in sorted(records.items()):
                try:
                    if self._group_of(bdf) in held:
                        continue
                    done.append(self._restore(bdf, driver or None))
                except PciError as err:
                    log.error("PCI function not bound back", extra={"error": str(err)})
        for what in done:
            log.info(what)
        return done

    def _restore(self, bdf: str, driver: str | None) -> str:
        try:
            function = self.bus.read(bdf)
        except PciError:
            function = None  # gone (hot-unplugged): forget it
        if function is not None:
            if function.driver == VFIO_DRIVER:
                self.bus.unbind(bdf)
            self.bus.set_override(bdf, None)
            if driver is not None and self.bus.read(bdf).driver is None:
                self.bus.bind(bdf, driver)
            crash_point("vfio-after-restore")
        with self.state_lock():
            record = self.store.gpus().get(record_key(bdf)) or GpuRecord()
            self.store.set_gpu(record_key(bdf), record.model_copy(update={"native_driver": None}))
        if function is None:
            return f"forgot PCI function {bdf}, which is not here any more"
        return f"bound PCI function {bdf} back to {driver or 'no driver'}"

    def _group_of(self, bdf: str) -> int | None:
        """The function's IOMMU group; None when it is gone."""
        try:
            return self.bus.read(bdf).iommu_group
        except PciError:
            if self.bus.device_dir(bdf).exists():
                raise
            return None

    def _held(self) -> set[int]:
        """The IOMMU groups recorded claims hold on vfio-pci."""
        return {
            device.vfio.iommu_group
            for record in self.store.claims().values()
            for device in record.devices
            if device.vfio is not None
        }


class PciSide:
    """Where a vendor's passthrough acts: the PCI tree, its writer and the host's /dev.

    ``root``: the sysfs tree (a vendor's simulated one, or ``--pci-sysfs-root``);
    ``simulated``: the simulated backend's GPUs of this model, whose PCI functions are
    written into ``root`` first and whose writes the simulated kernel answers.
    """

    def __init__(
        self, opts: PluginOptions, *, root: Path, simulated: SimGpuModel | None = None
    ) -> None:
        self.opts = opts
        self.model = simulated
        if simulated is not None:
            # The only place the simulated kernel is imported (drasil.driver.simulated).
            from drasil.driver.simulated.pcikernel import SimulatedKernel  # noqa: PLC0415

            dev = opts.simulated_dev_root
            self.bus = PciBus(root, write=SimulatedKernel(root, dev).write)
            self.dev_root = dev
        else:
            self.bus = PciBus(root)
            self.dev_root = opts.vfio_dev_root

    def publish(self, found: VendorDevices, vendor: VendorPassthrough) -> VendorDevices:
        """``found`` with its GPUs' passthrough devices (the simulated tree written)."""
        if self.model is not None:
            from drasil.driver.simulated.pcikernel import gpu_functions, write_tree  # noqa: PLC0415

            gpus = _simulated_gpus(found.devices, vendor)
            first = 20 if vendor.vendor_id == NVIDIA_VENDOR_ID else 60
            write_tree(self.bus.root, gpu_functions(gpus, self.model, first_group=first))
        added = with_passthrough(found.devices, self.bus, vendor)
        return replace(
            found,
            devices=added.devices,
            counter_sets=(*found.counter_sets, *added.counter_sets),
            skipped=(*found.skipped, *added.skipped),
        )

    def step(self, node: NodeState, *, processes: ProcessQuery | None = None) -> Passthrough:
        return Passthrough(
            self.bus,
            processes=processes,
            dev_root=self.dev_root,
            proc_root=self.opts.proc_root,
            store=node.store,
            state_lock=node.state_lock,
            state_dir=self.opts.state_dir,
        )


def _node(path: str, numbers: tuple[int, int]) -> CharDevice:
    return CharDevice(path=path, host_path=path, major=numbers[0], minor=numbers[1])


def settle_at_start(step: Passthrough, node: NodeState) -> None:
    """At start: functions no prepared claim holds go back to their drivers (a crash,
    or claims unprepared while the plugin was away)."""
    try:
        done = step.settle()
    except Exception as err:  # a refused rebind must not keep the plugin down
        log.error("binding PCI functions back failed", extra={"error": str(err)})
        return
    if done:
        node.node_event("PassthroughRestored", "; ".join(done))


def _simulated_gpus(
    devices: Sequence[Device], vendor: VendorPassthrough
) -> list[tuple[str, str | None, int | None]]:
    out = []
    for device in devices:
        bdf = device.attributes.get(PCI_BUS_ID_ATTRIBUTE)
        if device.type is vendor.gpu_type and device.parent_uuid is None and isinstance(bdf, str):
            out.append((bdf, device.pcie_root, device.numa_node))
    return out

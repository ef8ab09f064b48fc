"""The vendor seam: what a GPU vendor gives the node daemon, and nothing more.

The daemon's vendor-neutral parts (``kubeletplugin.node``, ``kubeletplugin.dra``,
``kubeletplugin.deviceplugin``) see a vendor only through these types; the registry
(``vendors.registry``) finds the vendors a node serves and opens each one:

- ``VendorSource``: a vendor as the registry knows it: whether its kernel driver is
  loaded here (``--vendors auto``), the models its simulated backend has, and
  ``open``, which gives the node's ``NodeVendor``.
- ``NodeVendor``: one vendor on one node: discovery of its devices (types of its own,
  never another vendor's), its health sources, the spec-wide container edits its
  devices need (driver files, control nodes), what a container would miss here
  (readiness), the Node labels it keeps, and its prepare steps.
- ``PrepareSteps``: what prepare asks of the hardware beyond writing specs: cutting
  instances (MIG), switching a GPU's mode (AMD partitions), sharing (MPS daemons,
  time slices), binding GPUs to vfio-pci for VMs, and what to repair at start. Each
  step acts on its own vendor's devices only; a step no vendor has is ``None``, and a
  claim that needs it is refused (``kubeletplugin.dra.prepare``).

A vendor's errors that are the claim's answer (the hardware refused) derive from
``drasil.driver.devices.HardwareError``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from re import Pattern
from typing import TYPE_CHECKING, Any, Protocol

from drasil.api.checkpoint import MigRecord, PreparedDevice
from drasil.driver.cdi.spec import ContainerEdits
from drasil.driver.checkpoint import CheckpointStore
from drasil.driver.claims.plan import PreparePlan
from drasil.driver.devices import CounterSet, Device, MigPlacement, Vendor
from drasil.driver.health import HealthTracker
from drasil.driver.vfio.devices import VfioRequest

if TYPE_CHECKING:
    # For annotations only: `make gpu-check` runs the Preparer, and so imports this seam,
    # on a machine whose bundle has no kubernetes client (docs/gpu-check.md).
    from drasil.driver.kubeapi import KubeApi
    from drasil.kubeletplugin.options import PluginOptions

HealthSource = tuple[str, Callable[[threading.Event], None]]
"""A health loop: its thread's name, and the loop (run until the event is set)."""


@dataclass(frozen=True)
class VendorDevices:
    """What one vendor's discovery found on the node."""

    devices: tuple[Device, ...]
    # What could not be published, and why: "NVIDIA GPU 3: ...".
    skipped: tuple[str, ...] = ()
    counter_sets: tuple[CounterSet, ...] = ()
    # The driver behind the devices, for people ("amdgpu 6.8.5"); "" when none.
    driver: str = ""


class EditsSource(Protocol):
    """Spec-wide container edits, kept current (a driver upgrade changes them)."""

    def current(self) -> ContainerEdits:
        """The edits to write now; ``HardwareError`` when the driver's files cannot
        be used (mid-upgrade, no driver)."""
        ...

    def files_version(self) -> str:
        """The driver version the edits are of, for people ("unknown" before any)."""
        ...


class ReadinessCheck(Protocol):
    """One finding of what a real container would miss on this node."""

    @property
    def name(self) -> str: ...

    @property
    def ok(self) -> bool: ...

    @property
    def detail(self) -> str: ...


@dataclass(frozen=True)
class NodeLabelSet:
    """The Node labels a vendor keeps, and the keys it owns (only those are ever
    changed or removed, so the operator's own labels stay)."""

    wanted: Mapping[str, str]
    owned: Pattern[str]


@dataclass(frozen=True)
class NodeState:
    """What the DRA daemon gives a vendor's prepare steps: the checkpoint and its lock
    (held around every read-modify-write), the node's devices, the API, and a way to
    tell the operator (a Node Event)."""

    store: CheckpointStore
    state_lock: Callable[[], AbstractContextManager[None]]
    devices: Mapping[str, Device]
    api: KubeApi
    node_event: Callable[[str, str], None]


class MadeInstance(Protocol):
    """An instance that exists (a MIG device): its record and the device it is."""

    def record(self) -> MigRecord: ...

    def device(self, planned: Device) -> Device: ...


class InstanceMaker(Protocol):
    """Cuts instances of a partitionable GPU on demand (dynamic MIG)."""

    def ensure(self, placement: MigPlacement) -> MadeInstance: ...

    def whole_gpu(self, gpu_uuid: str) -> None: ...

    def destroy(self, record: MigRecord) -> None: ...


class ModeSwitcher(Protocol):
    """Puts GPUs in the mode a claim's partitions need (AMD compute partitions), and
    back once no claim holds them."""

    def switch(self, devices: Sequence[Device]) -> dict[str, Device]: ...

    def settle(self) -> list[str]: ...


class PassthroughBinder(Protocol):
    """Binds GPUs to vfio-pci for claims that pass them through to virtual machines,
    and back to their drivers once no claim holds them (``vendors.passthrough``)."""

    def bind(self, requests: Sequence[VfioRequest]) -> dict[str, Device]: ...

    def settle(self) -> list[str]: ...


class SharingStep(Protocol):
    """What claims change on a GPU they share or configure (MPS daemons, time slices)."""

    def check(self, plan: PreparePlan, claim: Mapping[str, Any]) -> None: ...

    def apply(self, plan: PreparePlan, claim: Mapping[str, Any]) -> PreparePlan:
        """The plan with what sharing gives its containers; ``claim`` is the claim
        object (whose Pods an error may be told to)."""
        ...

    def holding(self, uuid: str) -> AbstractContextManager[None]:
        """The lock of one GPU's (or instance's) sharing state, taken before the
        state lock by a caller that changes the instance under it."""
        ...

    def stop_daemon(self, uuid: str) -> None: ...

    def settle(self, released: Sequence[PreparedDevice] | None = None) -> list[str]:
        """Undo what no claim needs; ``released``: the devices of the claim just
        unprepared (None: at start, everything)."""
        ...


@dataclass(frozen=True)
class PrepareSteps:
    """A vendor's (or the node's merged) prepare steps; ``None``: none of that kind."""

    instances: InstanceMaker | None = None
    modes: ModeSwitcher | None = None
    sharing: SharingStep | None = None
    passthrough: PassthroughBinder | None = None
    # At start, before kubelet's calls: repair what a crash or a restart left (MIG
    # instances against the checkpoint, MPS daemons of prepared shares, GPU modes).
    recover: Callable[[], None] | None = None


class NodeVendor(Protocol):
    """One vendor on one node (opened by its ``VendorSource``)."""

    @property
    def vendor(self) -> Vendor: ...

    def discover(self, *, dra: bool) -> VendorDevices:
        """The vendor's devices; ``dra`` False: as kubelet's device-plugin API can
        serve them (no counters, no sharing by capacity)."""
        ...

    def health_sources(
        self, devices: Sequence[Device], health: HealthTracker
    ) -> list[HealthSource]: ...

    def container_edits(self, *, device_plugin: bool = False) -> EditsSource | None:
        """Edits every spec with one of its devices gets; None: its devices' nodes
        are all a container needs."""
        ...

    def readiness(self) -> list[ReadinessCheck]: ...

    def node_labels(self, devices: Sequence[Device]) -> NodeLabelSet | None: ...

    def prepare_steps(self, node: NodeState) -> PrepareSteps: ...

    def close(self) -> None: ...


class VendorSource(Protocol):
    """A vendor as the registry knows it."""

    @property
    def vendor(self) -> Vendor: ...

    def detect(self, opts: PluginOptions) -> bool:
        """Whether its kernel driver is loaded here with a GPU (``--vendors auto``)."""
        ...

    def simulates(self, model: str) -> bool:
        """Whether ``model`` of a simulated profile is one of its GPUs."""
        ...

    def simulated_models(self) -> tuple[str, ...]:
        """The models ``simulates`` knows, for an error naming them."""
        ...

    def where_detected(self, opts: PluginOptions) -> str:
        """Where ``detect`` looked, for the error when no vendor is found."""
        ...

    def open(self, opts: PluginOptions, *, simulated: str | None) -> NodeVendor:
        """The vendor on this node; ``simulated``: its entries of the simulated
        profile (``--backend simulated``), else the real hardware."""
        ...

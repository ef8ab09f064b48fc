"""The device model every part of drasil shares.

A ``Device`` is what discovery produces and what ResourceSlices, CDI specs, config
resolution and health all consume. Attribute values carry their ResourceSlice type
(``int``, ``bool``, ``string`` or ``version``) in their Python type, so the slice
builder never guesses.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import ClassVar, Final

from drasil.api.checkpoint import PartitionRecord

# The standard attributes every driver shares (k8s.io/dynamic-resource-allocation/
# deviceattribute), whatever the vendor.
PCI_BUS_ID_ATTRIBUTE: Final = "resource.kubernetes.io/pciBusID"
PCIE_ROOT_ATTRIBUTE: Final = "resource.kubernetes.io/pcieRoot"
# KEP-6072's standard NUMA attribute (StandardDeviceAttributeNUMANode): the scalar int
# form, which needs no feature gate; the list form needs DRAListTypeAttributes on every
# component. Drivers of other devices (NICs, CPUs) publish the same name, so one
# matchAttribute lines them up with a GPU.
NUMA_NODE_ATTRIBUTE: Final = "resource.kubernetes.io/numaNode"


class Vendor(str):
    """A GPU vendor (``--vendors``): drasil's own (``NVIDIA``, ``AMD``), or one a vendor
    package declares (``Vendor.declare``, docs/design.md#vendor-backends).

    One object per name, so ``is`` compares like an enum's members; ``Vendor(name)``
    finds a declared one (``ValueError`` for any other name)."""

    NVIDIA: ClassVar[Vendor]
    AMD: ClassVar[Vendor]
    _known: ClassVar[dict[str, Vendor]] = {}

    def __new__(cls, name: str) -> Vendor:
        known = cls._known.get(name)
        if known is None:
            raise ValueError(f"{name!r} is no vendor; known: {', '.join(cls._known)}")
        return known

    @classmethod
    def declare(cls, name: str) -> Vendor:
        """The vendor ``name``, declared on first use."""
        if name not in cls._known:
            cls._known[name] = str.__new__(cls, name)
        return cls._known[name]

    @classmethod
    def known(cls) -> tuple[Vendor, ...]:
        """Every declared vendor, in the order declared (drasil's first)."""
        return tuple(cls._known.values())

    @property
    def value(self) -> str:
        return str.__str__(self)

    @property
    def name(self) -> str:
        """For people: ``NVIDIA``, ``AMD``."""
        return self.value.upper()

    def __repr__(self) -> str:
        return f"Vendor({self.value!r})"

    def __reduce__(self) -> tuple[type[Vendor], tuple[str]]:
        return (Vendor, (self.value,))  # a copy is the same object


Vendor.NVIDIA = Vendor.declare("nvidia")
Vendor.AMD = Vendor.declare("amd")


class DeviceType(str):
    """The value of the ``type`` attribute; DeviceClasses select on it.

    Each vendor has types of its own, so a class written for one vendor's type never
    matches another vendor's device (``gpu`` has always meant an NVIDIA GPU). drasil's
    are below; a vendor package declares its own (``DeviceType.declare``). One object
    per name, as with ``Vendor``.
    """

    GPU: ClassVar[DeviceType]
    MIG: ClassVar[DeviceType]
    AMDGPU: ClassVar[DeviceType]
    AMDGPU_PARTITION: ClassVar[DeviceType]
    VFIO: ClassVar[DeviceType]
    AMDGPU_VFIO: ClassVar[DeviceType]
    _known: ClassVar[dict[str, DeviceType]] = {}
    _vendors: ClassVar[dict[str, Vendor]] = {}

    def __new__(cls, name: str) -> DeviceType:
        known = cls._known.get(name)
        if known is None:
            raise ValueError(f"{name!r} is no device type; known: {', '.join(cls._known)}")
        return known

    @classmethod
    def declare(cls, name: str, *, vendor: Vendor) -> DeviceType:
        """The type ``name`` of ``vendor``'s devices, declared on first use; a name
        another vendor declared is refused (``ValueError``)."""
        if name not in cls._known:
            cls._known[name] = str.__new__(cls, name)
            cls._vendors[name] = vendor
        if cls._vendors[name] is not vendor:
            raise ValueError(f"device type {name!r} is {cls._vendors[name].name}'s")
        return cls._known[name]

    @classmethod
    def known(cls) -> tuple[DeviceType, ...]:
        return tuple(cls._known.values())

    @property
    def value(self) -> str:
        return str.__str__(self)

    @property
    def vendor(self) -> Vendor:
        """Whose device this type is."""
        return DeviceType._vendors[self.value]

    def __repr__(self) -> str:
        return f"DeviceType({self.value!r})"

    def __reduce__(self) -> tuple[type[DeviceType], tuple[str]]:
        return (DeviceType, (self.value,))


DeviceType.GPU = DeviceType.declare("gpu", vendor=Vendor.NVIDIA)
DeviceType.MIG = DeviceType.declare("mig", vendor=Vendor.NVIDIA)
DeviceType.AMDGPU = DeviceType.declare("amdgpu", vendor=Vendor.AMD)
DeviceType.AMDGPU_PARTITION = DeviceType.declare("amdgpu-partition", vendor=Vendor.AMD)
# A whole GPU handed to a virtual machine (bound to vfio-pci at prepare; passthrough.md).
DeviceType.VFIO = DeviceType.declare("vfio", vendor=Vendor.NVIDIA)
DeviceType.AMDGPU_VFIO = DeviceType.declare("amdgpu-vfio", vendor=Vendor.AMD)


class HardwareError(Exception):
    """A GPU, its driver or its tool refused a step of a claim's prepare or unprepare
    (NVML would not cut a MIG instance, amdgpu would not switch a partition mode, the
    driver's files cannot be read): the claim's answer, which kubelet shows in the
    Pod's events and retries. Each vendor's errors of that kind derive from it, so the
    vendor-neutral prepare path tells them from its own bugs without knowing vendors."""


class VendorError(ValueError):
    """Vendors that cannot be served here: ``--vendors auto`` found no GPU driver, a
    vendor no backend is installed for, or a simulated profile no vendor has."""


@dataclass(frozen=True)
class Version:
    """A semantic version attribute (published as ``{version: "9.0.0"}``)."""

    value: str


AttributeValue = bool | int | str | Version
"""An attribute value; its Python type picks the ResourceSlice field it is written to."""


def attribute_json(value: AttributeValue) -> dict[str, object]:
    """A value in the API's form, as slices and device metadata carry it:
    ``{"int": 3}``, ``{"version": "9.0.0"}``, ``{"bool": true}``, ``{"string": …}``."""
    # bool before int: True is an int to Python, never to the API.
    if isinstance(value, bool):
        return {"bool": value}
    if isinstance(value, int):
        return {"int": value}
    if isinstance(value, Version):
        return {"version": value.value}
    return {"string": value}


@dataclass(frozen=True)
class CounterSet:
    """A named set of shared counters (partitionable devices), values in their unit."""

    name: str
    counters: Mapping[str, int]


@dataclass(frozen=True)
class CounterConsumption:
    """What one device takes from a counter set when it is allocated."""

    counter_set: str
    counters: Mapping[str, int]


@dataclass(frozen=True)
class CapacityPolicy:
    """How much of a consumable capacity one allocation may take (``requestPolicy``).

    A request that names no amount takes ``default``; one that does is rounded up to
    ``minimum + n * step`` and must stay within ``maximum`` (None: the capacity).
    """

    default: int
    minimum: int
    step: int | None = None
    maximum: int | None = None


@dataclass(frozen=True)
class CharDevice:
    """A character device a container gets by number: ``path`` in the container (and
    on the host as ``host_path``), ``major``/``minor`` from the driver's ``/proc``.

    MIG capability nodes (``/dev/nvidia-caps/nvidia-cap<N>``) are given this way, as
    NVIDIA's DRA driver gives them: a CDI device node with its type and numbers is made
    in the container without the runtime looking for the host's node, which need not
    exist (only ``nvidia-modprobe`` or ``nvidia-ctk system create-dev-char-symlinks``
    makes it).
    """

    path: str
    host_path: str
    major: int
    minor: int


@dataclass(frozen=True)
class PciPassthrough:
    """What a passthrough device (``--passthrough``) is on the host: its GPU's PCI
    function, the function's IOMMU group, the driver it is bound to when not passed
    through (``nvidia``, ``amdgpu``), and the GPU's device nodes, which any process
    using the GPU holds open (a GPU in use is never taken from under it)."""

    bus_id: str
    iommu_group: int
    native_driver: str
    busy_nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class MigPlacement:
    """Where a MIG device that does not exist yet would be cut (``--mig-mode dynamic``).

    ``start`` and ``size`` are in memory slices, as NVML's placements are;
    ``profile_id`` is NVML's GPU instance profile id (``nvidia-smi mig -lgip``'s ID).
    Prepare creates the GPU and compute instance here; until then the device has no
    UUID of its own.
    """

    parent_uuid: str
    parent_minor: int
    profile: str
    profile_id: int
    start: int
    size: int


@dataclass(frozen=True)
class MigSite:
    """Where a MIG device that exists (``--mig-mode static``) sits on its GPU.

    Its GPU instance's placement, in memory slices as ``MigPlacement``'s, and its ids:
    enough to tell the instance apart from a dynamic MIG device's after a change of
    ``--mig-mode``, when claims of both modes may hold parts of one GPU.
    """

    parent_uuid: str
    profile_id: int
    gpu_instance_id: int
    compute_instance_id: int
    start: int
    size: int


@dataclass(frozen=True)
class Device:
    """One allocatable device of a node: a full GPU or a MIG device.

    ``attributes`` keys are bare names in the driver's domain (``uuid``, ``productName``)
    or qualified names (``resource.kubernetes.io/pciBusID``). ``capacity`` values are
    integers in the capacity's unit (bytes for ``memory``, a count otherwise).
    ``device_nodes`` are host paths the container needs (``/dev/nvidia0``); the
    simulated backend has none. ``char_devices`` are the nodes a MIG device adds (its
    GPU and compute instances' capability nodes), given by number. In ``--mig-mode
    dynamic`` a MIG placement device has ``mig_placement`` set and ``uuid`` empty until
    prepare creates it, and every device of a partitionable GPU lists the shared counters
    it takes (``consumes_counters``).
    """

    name: str
    type: DeviceType
    uuid: str
    minor: int
    attributes: Mapping[str, AttributeValue]
    capacity: Mapping[str, int]
    parent_uuid: str | None = None
    device_nodes: tuple[str, ...] = ()
    char_devices: tuple[CharDevice, ...] = ()
    numa_node: int | None = None
    pcie_root: str | None = None
    mig_placement: MigPlacement | None = None
    # A static MIG device: the GPU instance it is (None where NVML did not list it).
    mig_site: MigSite | None = None
    # --amd-partition-mode dynamic: the partition prepare makes by switching the mode.
    # (PartitionRecord: what the checkpoint records of it too; partition index, mode,
    # and ``start``/``size`` in the GPU's compute dies, the counters it draws.)
    compute_partition: PartitionRecord | None = None
    consumes_counters: tuple[CounterConsumption, ...] = ()
    # A GPU for a virtual machine: bound to vfio-pci at prepare, back at unprepare.
    passthrough: PciPassthrough | None = None
    # --gpu-sharing consumable: several claims may hold the device, each taking part
    # of the capacities that have a policy.
    allow_multiple_allocations: bool = False
    capacity_policies: Mapping[str, CapacityPolicy] = field(default_factory=dict)
    # KEP-5007 (DevicePool devices behind a fabric): the scheduler limits the claim
    # to the node it chose and waits, before binding the Pod, until every binding
    # condition is True in the claim's status.devices entry (any failure condition
    # True: it un-allocates and tries again).
    binds_to_node: bool = False
    binding_conditions: tuple[str, ...] = ()
    binding_failure_conditions: tuple[str, ...] = ()
    # Host resources (``cpu``, ``memory``: quantities) each Pod using the device takes
    # from the node's allocatable (``drasil.driver.hostresources``).
    host_resources: Mapping[str, str] = field(default_factory=dict)

    @property
    def vendor(self) -> Vendor:
        """Whose device this is (from its type)."""
        return self.type.vendor

    def __post_init__(self) -> None:
        # Devices are shared between threads (publisher, prepare, health); make the
        # mappings read-only so nobody edits a Device in place.
        object.__setattr__(self, "attributes", MappingProxyType(dict(self.attributes)))
        object.__setattr__(self, "capacity", MappingProxyType(dict(self.capacity)))
        object.__setattr__(
            self, "capacity_policies", MappingProxyType(dict(self.capacity_policies))
        )
        object.__setattr__(self, "host_resources", MappingProxyType(dict(self.host_resources)))

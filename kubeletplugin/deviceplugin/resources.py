"""What device-plugin mode advertises: extended resources, their device IDs, CDI names.

kubelet's device-plugin API counts opaque IDs per extended resource name. drasil
advertises one ID per device (its discovery name, ``gpu-3``), or with time-slicing
``--time-slicing-replicas N`` the IDs ``gpu-3::0`` … ``gpu-3::<N-1>``, all mapped back
to the same device when kubelet allocates them.

MIG strategies decide which devices a resource holds (the classic NVIDIA plugin's
semantics, so manifests written for it keep working):

- ``none``: full GPUs only under ``--resource-name``; a GPU in MIG mode is not
  advertised (discovery reports its MIG devices instead, and they are left out);
- ``single``: every MIG device under ``--resource-name``; it needs one profile on the
  whole node, otherwise users could not tell what one unit of the resource is. A node
  without MIG devices falls back to ``none``;
- ``mixed``: full GPUs under ``--resource-name`` and each MIG profile as its own
  resource ``<domain>/mig-<profile>`` (``drasil.dev/mig-1g.5gb``).

AMD GPUs and their compute partitions (``amdgpu``, ``amdgpu-partition``) are all
advertised under ``--amd-resource-name`` (``amd.com/gpu``, ROCm's device plugin's
resource, so Pods written for it run unchanged), one ID per device. MIG strategies
and ``--time-slicing-replicas`` are NVIDIA settings and leave them alone: time-slicing
is NVIDIA's (its device plugin's sharing of one GPU), and ROCm's plugin advertises each
GPU or partition once. A vendor's resources are served only where the node has that
vendor's devices, except that a node with no devices at all still serves
``--resource-name``, empty, as before AMD was supported (see ``plan_resources``).

Each resource is served on its own socket, registered with kubelet on its own.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

from drasil.driver.devices import Device, DeviceType, Vendor
from drasil.kubeletplugin.sockets import pod_tag

log = logging.getLogger(__name__)

MIG_STRATEGIES: Final = ("none", "single", "mixed")
REPLICA_SEPARATOR: Final = "::"
SOCKET_PREFIX: Final = "drasil-"
AMD_RESOURCE_NAME: Final = "amd.com/gpu"

# Extended resource names: <DNS subdomain>/<qualified name part> (k8s.io/apimachinery).
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_NAME_PART = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_MAX_NAME_PART = 63
_MAX_DOMAIN = 253


class DevicePluginConfigError(ValueError):
    """Device-plugin settings this node's devices cannot be advertised with."""


@dataclass(frozen=True)
class Unit:
    """One advertised device ID: a whole device, or one time-sliced replica of it."""

    id: str
    # IDs are unique within a resource; Device itself is not hashable (mapping fields).
    device: Device = field(compare=False)
    replica: int | None = None

    def sort_key(self) -> tuple[int, str, int]:
        """Minor number first, so ``gpu-10`` sorts after ``gpu-2``."""
        return (self.device.minor, self.device.name, -1 if self.replica is None else self.replica)


@dataclass(frozen=True)
class Resource:
    """One extended resource and the IDs advertised for it, in a stable order."""

    name: str
    units: tuple[Unit, ...]
    # Every device of a resource is this vendor's: its socket name and CDI kind follow.
    vendor: Vendor = Vendor.NVIDIA
    by_id: Mapping[str, Unit] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_id", MappingProxyType({u.id: u for u in self.units}))

    @property
    def devices(self) -> tuple[Device, ...]:
        """The distinct devices behind the units, in unit order."""
        return tuple({u.device.name: u.device for u in self.units}.values())


def validate_resource_name(name: str) -> None:
    """Raise ``DevicePluginConfigError`` unless kubelet would accept ``name``."""
    domain, sep, part = name.partition("/")
    problem = ""
    if not sep or not domain or not part:
        problem = "must be <domain>/<name>, e.g. drasil.dev/gpu"
    elif len(domain) > _MAX_DOMAIN or not _DNS_SUBDOMAIN.fullmatch(domain):
        problem = f"domain {domain!r} is not a lower-case DNS subdomain"
    elif domain == "kubernetes.io" or domain.endswith(".kubernetes.io"):
        problem = "the kubernetes.io domain is reserved for Kubernetes itself"
    elif len(part) > _MAX_NAME_PART or not _NAME_PART.fullmatch(part):
        problem = (
            f"name {part!r} must be at most 63 letters, digits, '-', '_' or '.', "
            "starting and ending with a letter or digit"
        )
    if problem:
        raise DevicePluginConfigError(f"resource name {name!r}: {problem}")


def mig_resource_name(resource_name: str, profile: str) -> str:
    """``drasil.dev/gpu`` + ``1g.5gb`` → ``drasil.dev/mig-1g.5gb`` (same domain)."""
    domain, _, _ = resource_name.partition("/")
    return f"{domain}/mig-{profile}"


def socket_name(
    resource_name: str, *, pod_uid: str | None = None, vendor: Vendor = Vendor.NVIDIA
) -> str:
    """``drasil-gpu.sock``; with a Pod UID ``drasil-gpu-<uid prefix>.sock``.

    The Pod UID keeps two instances of a rolling update from deleting each other's
    socket (each would re-create its own forever otherwise); its first characters
    (``sockets.pod_tag``) are enough for that. An AMD resource's socket carries the
    vendor (``drasil-amd-gpu.sock`` for ``amd.com/gpu``), so that it never takes the
    socket of ``drasil.dev/gpu``.
    """
    _, _, part = resource_name.partition("/")
    vendor_tag = "" if vendor == Vendor.NVIDIA else f"{vendor.value}-"
    suffix = f"-{pod_tag(pod_uid)}" if pod_uid else ""
    return f"{SOCKET_PREFIX}{vendor_tag}{part}{suffix}.sock"


def plan_resources(
    devices: Sequence[Device],
    *,
    resource_name: str,
    mig_strategy: str,
    replicas: int,
    amd_resource_name: str = AMD_RESOURCE_NAME,
) -> tuple[Resource, ...]:
    """The resources to serve for the node's devices; see the module docstring.

    NVIDIA's resources come first, as before; AMD's one follows. A node with AMD
    devices and no NVIDIA device serves no NVIDIA resource: registering an empty
    ``drasil.dev/gpu`` there would only add a socket, a stream and a ``0`` to the
    node's capacity for a GPU it cannot have (kubelet handles a resource nobody
    registers the same way: Pods asking for it do not fit the node). A node without
    any device keeps serving ``--resource-name`` empty, as it always did.
    """
    validate_resource_name(resource_name)
    validate_resource_name(amd_resource_name)
    if replicas < 1:
        raise DevicePluginConfigError(f"--time-slicing-replicas: {replicas} is less than 1")
    nvidia = [d for d in devices if d.vendor == Vendor.NVIDIA]
    amd = [d for d in devices if d.vendor == Vendor.AMD]
    resources: list[Resource] = []
    if nvidia or not amd:
        groups = _groups(nvidia, resource_name=resource_name, mig_strategy=mig_strategy)
        resources += (
            Resource(name=name, units=_units(members, replicas=replicas))
            for name, members in groups.items()
        )
    if amd:
        if replicas > 1:
            log.info(
                "--time-slicing-replicas applies to NVIDIA devices only; "
                "AMD devices are advertised once each",
                extra={"count": len(amd)},
            )
        # No MIG strategy either: a partitioned AMD GPU is discovered as its
        # partitions, each one ID of the one AMD resource (ROCm's plugin's default).
        resources.append(
            Resource(name=amd_resource_name, units=_units(amd, replicas=1), vendor=Vendor.AMD)
        )
    for resource in resources:
        validate_resource_name(resource.name)
    _check_distinct(resources)
    return tuple(resources)


def _check_distinct(resources: Sequence[Resource]) -> None:
    # Two resources of one name (say --amd-resource-name = --resource-name) would be
    # registered twice, the second replacing the first in kubelet; two of one socket
    # name would take each other's socket.
    seen: dict[str, str] = {}
    for resource in resources:
        for key in (resource.name, socket_name(resource.name, vendor=resource.vendor)):
            if key in seen:
                raise DevicePluginConfigError(
                    f"resources {seen[key]} and {resource.name} clash ({key}); "
                    "give --resource-name and --amd-resource-name distinct names"
                )
            seen[key] = resource.name


def _groups(
    devices: Sequence[Device], *, resource_name: str, mig_strategy: str
) -> dict[str, list[Device]]:
    full = [d for d in devices if d.type == DeviceType.GPU]
    migs = [d for d in devices if d.type == DeviceType.MIG]
    if mig_strategy == "none":
        if migs:
            log.info(
                "MIG devices are not advertised with --mig-strategy none",
                extra={"count": len(migs)},
            )
        return {resource_name: full}
    if mig_strategy == "single":
        return {resource_name: _single(full, migs)}
    if mig_strategy == "mixed":
        return {resource_name: full, **_by_profile(migs, resource_name=resource_name)}
    raise DevicePluginConfigError(
        f"--mig-strategy: unsupported value {mig_strategy!r}; allowed values are {MIG_STRATEGIES}"
    )


def _single(full: list[Device], migs: list[Device]) -> list[Device]:
    if not migs:
        log.info("no MIG devices on this node; --mig-strategy single advertises full GPUs")
        return full
    if full:
        names = ", ".join(d.name for d in full)
        raise DevicePluginConfigError(
            f"--mig-strategy single needs every GPU in MIG mode; not in MIG mode: {names}; "
            "enable MIG on them or use --mig-strategy mixed"
        )
    profiles = sorted({_profile(d) for d in migs})
    if len(profiles) > 1:
        raise DevicePluginConfigError(
            "--mig-strategy single needs one MIG profile on the whole node, found "
            f"{', '.join(profiles)}; use --mig-strategy mixed or repartition the GPUs"
        )
    return migs


def _by_profile(migs: Iterable[Device], *, resource_name: str) -> dict[str, list[Device]]:
    groups: dict[str, list[Device]] = {}
    for device in sorted(migs, key=lambda d: (_profile(d), d.minor, d.name)):
        groups.setdefault(mig_resource_name(resource_name, _profile(device)), []).append(device)
    return groups


def _profile(device: Device) -> str:
    profile = device.attributes.get("profile")
    if not isinstance(profile, str):
        raise DevicePluginConfigError(f"MIG device {device.name} has no profile attribute")
    return profile


def _units(devices: Iterable[Device], *, replicas: int) -> tuple[Unit, ...]:
    ordered = sorted(devices, key=lambda d: (d.minor, d.name))
    if replicas == 1:
        return tuple(Unit(id=d.name, device=d) for d in ordered)
    return tuple(
        Unit(id=f"{d.name}{REPLICA_SEPARATOR}{n}", device=d, replica=n)
        for d in ordered
        for n in range(replicas)
    )

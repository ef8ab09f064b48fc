"""Which opaque config applies to each device of an allocated ResourceClaim.

The scheduler copies the configs of the DeviceClasses and of the claim into
``status.allocation.devices.config``: class configs first, then claim configs. For
each allocated device the last entry that applies wins, and it replaces any earlier
one as a whole object (no field-by-field merging: a claim that says
``strategy: TimeSlicing`` does not inherit the class's MPS limits). An entry applies
to a result when its ``requests`` name the result's request, or the base request of
a ``firstAvailable`` subrequest (``gpu`` for ``gpu/full``), or when it has no
``requests`` at all. Devices without any config get their kind's default (Exclusive).

Kinds: a ``GpuConfig`` fits devices of type ``gpu``, a ``MigDeviceConfig`` type
``mig``; AMD devices (``amdgpu``, ``amdgpu-partition``) fit no kind: both kinds set
NVIDIA sharing (time-slicing, MPS) or MIG, which AMD's driver does not have (an AMD
GPU is shared by its compute partitions, docs/amd.md), so an entry naming an AMD
device's request is refused, naming the vendor. An entry that names the request must
fit the device, or it is an error. An entry for all requests (empty ``requests``)
applies only to the devices it fits, as in NVIDIA's driver, so one claim-wide
``GpuConfig`` does not break the claim's MIG (or AMD) devices.

A config that fits must also be one drasil applies to the device
(``sharing.not_applied``): strategy ``MPS`` is applied to every GPU and MIG device,
shared or allocated whole, and is an error only on a device of an admin-access request.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from types import MappingProxyType
from typing import Any, Final, Literal, cast, get_args

from drasil.api.config import (
    GpuConfig,
    MigDeviceConfig,
    OpaqueConfig,
    VfioDeviceConfig,
    decode_config,
)
from drasil.api.documents import ConfigError
from drasil.api.quantity import QuantityError, parse_quantity
from drasil.driver.claims.sharing import not_applied
from drasil.driver.devices import Device, DeviceType

ConfigSource = Literal["FromClass", "FromClaim"]

MAX_CONSUMED: Final = Decimal(2) ** 63  # no capacity of ours comes near; bounds ceil()

_DEFAULTS: Final[Mapping[DeviceType, OpaqueConfig]] = {
    DeviceType.GPU: GpuConfig(),
    DeviceType.MIG: MigDeviceConfig(),
    DeviceType.VFIO: VfioDeviceConfig(),
    DeviceType.AMDGPU_VFIO: VfioDeviceConfig(),
}
"""The config of a device that no entry applies to."""
_EXCLUSIVE: Final = GpuConfig()
"""The config of a device of any other type (AMD's, a vendor package's): exclusive,
with no sharing settings to apply."""

_FITTING: Final[Mapping[DeviceType, str]] = {
    DeviceType.GPU: GpuConfig().kind,
    DeviceType.MIG: MigDeviceConfig().kind,
    DeviceType.VFIO: VfioDeviceConfig().kind,
    DeviceType.AMDGPU_VFIO: VfioDeviceConfig().kind,
}
"""The config kind that fits each type; a type missing here takes no config."""


class AllocationError(ValueError):
    """A ResourceClaim whose ``status.allocation`` cannot be read; names the field."""


class ConfigResolutionError(ValueError):
    """Configs that cannot be applied to a claim; ``problems`` holds every one found."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = tuple(problems)
        super().__init__("; ".join(self.problems))


@dataclass(frozen=True)
class AllocatedDevice:
    """One entry of ``status.allocation.devices.results``."""

    request: str
    driver: str
    pool: str
    device: str
    admin_access: bool = False
    share_id: str | None = None
    # Consumable capacity: what the scheduler counted this share as taking, in the
    # capacity's unit (bytes for memory).
    consumed_capacity: Mapping[str, int] = field(default_factory=dict)

    @property
    def base_request(self) -> str:
        """The claim's request: ``gpu`` for the ``firstAvailable`` subrequest ``gpu/full``."""
        return self.request.partition("/")[0]


@dataclass(frozen=True)
class OpaqueConfigEntry:
    """One opaque entry of ``status.allocation.devices.config``.

    ``index`` is the entry's position in that list, so errors point at the entry the
    user can find in ``kubectl get resourceclaim -o yaml``.
    """

    source: ConfigSource
    requests: tuple[str, ...]
    driver: str
    parameters: Mapping[str, Any]
    index: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "parameters", MappingProxyType(dict(self.parameters)))

    def names(self, result: AllocatedDevice) -> bool:
        """Whether ``requests`` names the result's request (or its base request)."""
        return result.request in self.requests or result.base_request in self.requests

    def describe(self) -> str:
        scope = f"requests [{', '.join(self.requests)}]" if self.requests else "all requests"
        return f"config[{self.index}] ({self.source}, {scope})"


@dataclass(frozen=True)
class Allocation:
    """The part of a claim's allocation that belongs to one driver."""

    driver: str
    devices: tuple[AllocatedDevice, ...]
    configs: tuple[OpaqueConfigEntry, ...]


@dataclass(frozen=True)
class ResolvedConfig:
    """The config for one allocated device; ``entry`` is None for the type's default."""

    result: AllocatedDevice
    config: OpaqueConfig
    entry: OpaqueConfigEntry | None


# --- parsing the claim -------------------------------------------------------------


def _object(value: object, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise AllocationError(f"{path}: expected an object, got {type(value).__name__}")
    return value


def _list(value: object, path: str) -> Sequence[Any]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise AllocationError(f"{path}: expected a list, got {type(value).__name__}")
    return value


def _string(entry: Mapping[str, Any], key: str, *, path: str) -> str:
    value = entry.get(key)
    if not isinstance(value, str) or not value:
        raise AllocationError(f"{path}.{key}: expected a non-empty string, got {value!r}")
    return value


def _result(item: object, path: str) -> AllocatedDevice:
    entry = _object(item, path)
    share_id = entry.get("shareID")
    return AllocatedDevice(
        request=_string(entry, "request", path=path),
        driver=_string(entry, "driver", path=path),
        pool=_string(entry, "pool", path=path),
        device=_string(entry, "device", path=path),
        admin_access=entry.get("adminAccess") is True,
        share_id=share_id if isinstance(share_id, str) else None,
        consumed_capacity=_consumed(entry.get("consumedCapacity"), f"{path}.consumedCapacity"),
    )


def _consumed(value: object, path: str) -> dict[str, int]:
    if value is None:
        return {}
    entries = _object(value, path)
    consumed: dict[str, int] = {}
    for name, quantity in entries.items():
        try:
            amount = parse_quantity(str(quantity))
        except QuantityError as err:
            raise AllocationError(f"{path}.{name}: {err}") from None
        if amount < 0 or amount > MAX_CONSUMED:
            raise AllocationError(f"{path}.{name}: {quantity} is out of range")
        consumed[str(name)] = math.ceil(amount)
    return consumed


def _config_entry(item: object, *, index: int, path: str) -> OpaqueConfigEntry | None:
    entry = _object(item, path)
    if entry.get("opaque") is None:
        return None  # a configuration type other than opaque: not ours to read
    opaque = _object(entry["opaque"], f"{path}.opaque")
    source = _string(entry, "source", path=path)
    if source not in get_args(ConfigSource):
        raise AllocationError(f'{path}.source: expected "FromClass" or "FromClaim", got {source!r}')
    requests = _list(entry.get("requests"), f"{path}.requests")
    if not all(isinstance(request, str) for request in requests):
        raise AllocationError(f"{path}.requests: expected a list of strings, got {requests!r}")
    return OpaqueConfigEntry(
        source=cast(ConfigSource, source),
        requests=tuple(requests),
        driver=_string(opaque, "driver", path=f"{path}.opaque"),
        parameters=_object(opaque.get("parameters"), f"{path}.opaque.parameters"),
        index=index,
    )


def _claim_name(claim: Mapping[str, Any]) -> str:
    metadata = claim.get("metadata")
    if not isinstance(metadata, Mapping):
        return "ResourceClaim"
    return f"ResourceClaim {metadata.get('namespace', '')}/{metadata.get('name', '')}"


def parse_allocation(claim: Mapping[str, Any], *, driver: str) -> Allocation:
    """Read ``status.allocation.devices`` of a claim in its API JSON form (camelCase).

    Keeps only the results and opaque configs of ``driver``. Raises ``AllocationError``
    naming the field when the claim is not allocated or the allocation is malformed.
    """
    try:
        status = _object(claim.get("status") or {}, "status")
        if status.get("allocation") is None:
            raise AllocationError("status.allocation: missing; the claim is not allocated yet")
        allocation = _object(status["allocation"], "status.allocation")
        path = "status.allocation.devices"
        devices = _object(allocation.get("devices") or {}, path)
        results = [
            _result(item, f"{path}.results[{i}]")
            for i, item in enumerate(_list(devices.get("results"), f"{path}.results"))
        ]
        entries = [
            _config_entry(item, index=i, path=f"{path}.config[{i}]")
            for i, item in enumerate(_list(devices.get("config"), f"{path}.config"))
        ]
    except AllocationError as err:
        raise AllocationError(f"{_claim_name(claim)}: {err}") from None
    return Allocation(
        driver=driver,
        devices=tuple(result for result in results if result.driver == driver),
        configs=tuple(entry for entry in entries if entry is not None and entry.driver == driver),
    )


# --- resolution --------------------------------------------------------------------


def _decoded(
    allocation: Allocation, problems: list[str]
) -> list[tuple[OpaqueConfigEntry, OpaqueConfig]]:
    """Every entry of the driver, decoded, lowest precedence first.

    All entries are decoded, including ones a later entry overrides: a broken config
    is the user's mistake to hear about, not to have hidden by precedence.
    """
    ours = [entry for entry in allocation.configs if entry.driver == allocation.driver]
    decoded = []
    # Stable sort: the API already lists class configs first; this keeps it so.
    for entry in sorted(ours, key=lambda entry: entry.source == "FromClaim"):
        try:
            decoded.append((entry, decode_config(entry.parameters)))
        except ConfigError as err:
            problems.extend(f"{entry.describe()}: {issue}" for issue in err.issues)
    return decoded


def _candidates(
    result: AllocatedDevice,
    device: Device,
    *,
    decoded: Sequence[tuple[OpaqueConfigEntry, OpaqueConfig]],
) -> Iterator[tuple[OpaqueConfigEntry, OpaqueConfig]]:
    """The entries that apply to one result, highest precedence first."""
    fitting_kind = _FITTING.get(device.type)
    for entry, config in reversed(decoded):
        if entry.names(result) or (not entry.requests and config.kind == fitting_kind):
            yield entry, config


def _resolve_one(
    result: AllocatedDevice,
    device: Device,
    *,
    decoded: Sequence[tuple[OpaqueConfigEntry, OpaqueConfig]],
    problems: list[str],
) -> ResolvedConfig | None:
    winner = next(_candidates(result, device, decoded=decoded), None)
    if winner is None:
        default = _DEFAULTS.get(device.type, _EXCLUSIVE)
        return ResolvedConfig(result=result, config=default, entry=None)
    entry, config = winner
    fitting_kind = _FITTING.get(device.type)
    if config.kind == fitting_kind:
        return ResolvedConfig(result=result, config=config, entry=entry)
    if fitting_kind is None:
        problems.append(_no_config_fits(entry, config, device, result))
        return None
    problems.append(
        f"{entry.describe()}: a {config.kind} cannot be applied to device "
        f'"{device.name}" of type {device.type} (request {result.request}); '
        f"use a {fitting_kind}"
    )
    return None


def _no_config_fits(
    entry: OpaqueConfigEntry, config: OpaqueConfig, device: Device, result: AllocatedDevice
) -> str:
    return (
        f"{entry.describe()}: a {config.kind} cannot be applied to device "
        f'"{device.name}" of type {device.type} (request {result.request}): it is an '
        f"{device.vendor.name} GPU, which takes no opaque config; its driver has no "
        "time-slicing, MPS or MIG settings, and an AMD GPU is shared by compute "
        "partitions (amdgpu-partition devices, docs/amd.md)"
    )


def _add(resolved: dict[str, ResolvedConfig], new: ResolvedConfig, *, problems: list[str]) -> None:
    # One device can appear in several results (shared devices, admin access); it has
    # one set of sharing settings, so the results must agree on them.
    old = resolved.setdefault(new.result.device, new)
    if old.config != new.config:
        problems.append(
            f'device "{new.result.device}" is allocated to requests {old.result.request} and '
            f"{new.result.request} with different configs; give both requests the same config"
        )


def resolve_configs(
    allocation: Allocation, *, devices: Mapping[str, Device]
) -> dict[str, ResolvedConfig]:
    """The config of every allocated device of the driver, keyed by device name.

    ``devices`` are the driver's devices on this node by name. Raises
    ``ConfigResolutionError`` with every problem: undecodable entries, kinds that do
    not fit, strategies not applied to the device (``_not_applied``), devices this
    node does not have.
    """
    problems: list[str] = []
    decoded = _decoded(allocation, problems)
    resolved: dict[str, ResolvedConfig] = {}
    for result in allocation.devices:
        if result.driver != allocation.driver:
            continue
        device = devices.get(result.device)
        if device is None:
            problems.append(
                f'request {result.request}: device "{result.device}" (pool {result.pool}) '
                f"is not a device of driver {allocation.driver} on this node"
            )
            continue
        one = _resolve_one(result, device, decoded=decoded, problems=problems)
        if one is not None:
            _add(resolved, one, problems=problems)
    problems.extend(_not_applied(resolved.values(), devices=devices))
    problems.extend(_fitting_nothing(allocation, decoded, devices=devices))
    if problems:
        raise ConfigResolutionError(problems)
    return resolved


def _fitting_nothing(
    allocation: Allocation,
    decoded: Sequence[tuple[OpaqueConfigEntry, OpaqueConfig]],
    *,
    devices: Mapping[str, Device],
) -> list[str]:
    """Entries for all requests that fit none of the claim's devices, where some of
    them take no config (AMD's): refused as if they named those devices.

    The scheduler clears an entry's ``requests`` when the entry names every request
    of the claim, so a GpuConfig written for the one request of an AMD claim arrives
    here with none; skipping it as a claim-wide entry would prepare the GPU as if the
    config were not there.
    """
    ours = [r for r in allocation.devices if r.driver == allocation.driver and r.device in devices]
    untyped = [r for r in ours if devices[r.device].type not in _FITTING]
    if not untyped:
        return []
    kinds = {_FITTING.get(devices[r.device].type) for r in ours}
    return [
        _no_config_fits(entry, config, devices[untyped[0].device], untyped[0])
        for entry, config in decoded
        if not entry.requests and config.kind not in kinds
    ]


def _not_applied(resolved: Iterable[ResolvedConfig], *, devices: Mapping[str, Device]) -> list[str]:
    """One problem per entry whose strategy drasil would not apply to its devices: MPS
    on a device of an admin-access request (it sits beside the claim that holds the
    device, and must not change that claim's sharing)."""
    found: dict[int, tuple[OpaqueConfigEntry, str, list[str]]] = {}
    for one in resolved:
        if one.entry is None:
            continue
        device = devices[one.result.device]
        issue = not_applied(one.config, admin_access=one.result.admin_access)
        if issue is not None:
            found.setdefault(one.entry.index, (one.entry, str(issue), []))[2].append(device.name)
    problems = []
    for entry, text, names in found.values():
        quoted = ", ".join(f'"{name}"' for name in names)
        what = f"device {quoted}" if len(names) == 1 else f"devices {quoted}"
        problems.append(f"{entry.describe()} for {what}: {text}")
    return problems

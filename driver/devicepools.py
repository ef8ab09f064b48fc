"""DevicePool devices as ``Device`` objects: what the controller publishes and what a
node's plugin prepares are one conversion.

The controller turns a DevicePool's devices into ResourceSlices through the same
``build_slices`` as a node's GPUs; the node's plugin, asked to prepare a claim that
holds one of them, turns the same spec into the ``Device`` its CDI edits describe.
Both go through ``to_device``, so the container sees the device as it was published.

``Device.type``, ``uuid`` and ``minor`` describe a local GPU and do not reach a slice;
a pool device takes them from its ``type``/``uuid``/``minor`` attributes where those
exist. A device of a pool with ``simulatedFabric`` and no ``uuid`` attribute is a
SIMULATED GPU that appears on the node when it is attached: its UUID is derived from
the pool's UID and the device's name (``simulated_uuid``), the same on every node and
every prepare, different for a re-created pool.
"""

from __future__ import annotations

import uuid as uuidlib
from collections.abc import Mapping
from dataclasses import replace

from drasil.api.devicepool import DeviceAttribute, DevicePool, PoolDevice
from drasil.api.quantity import QuantityError, parse_quantity
from drasil.driver.devices import AttributeValue, Device, DeviceType, Version

_SIMULATED_NAMESPACE = uuidlib.UUID("5b0c7a53-6f1e-4c55-9d4b-2f6c0b8a1d3e")


class PoolSpecError(ValueError):
    """A DevicePool that cannot be published; the message says what to fix."""


def _attribute(device: str, name: str, value: DeviceAttribute) -> AttributeValue:
    given: list[AttributeValue] = []
    if value.int_ is not None:
        given.append(value.int_)
    if value.bool_ is not None:
        given.append(value.bool_)
    if value.string is not None:
        given.append(value.string)
    if value.version is not None:
        given.append(Version(value.version))
    if len(given) != 1:
        raise PoolSpecError(
            f'device "{device}": attribute "{name}": needs exactly one of int, bool, string, '
            "version"
        )
    return given[0]


def _capacity(device: str, name: str, value: int | str) -> int:
    where = f'device "{device}": capacity "{name}"'
    try:
        amount = parse_quantity(str(value))
    except QuantityError as err:
        raise PoolSpecError(f"{where}: {err}") from None
    if amount < 0 or amount != amount.to_integral_value():
        # Device capacities are whole units (bytes, counts), as the slice builder writes them.
        raise PoolSpecError(f"{where}: {value!r} is not a whole non-negative number")
    return int(amount)


def _device_type(attributes: Mapping[str, AttributeValue]) -> DeviceType:
    value = attributes.get("type")
    return DeviceType(value) if value in DeviceType.known() else DeviceType.GPU


def to_device(spec: PoolDevice) -> Device:
    """One DevicePool device as a ``Device`` (for the slice builder and for prepare)."""
    attributes = {k: _attribute(spec.name, k, v) for k, v in spec.attributes.items()}
    uuid, minor = attributes.get("uuid"), attributes.get("minor")
    return Device(
        name=spec.name,
        type=_device_type(attributes),
        uuid=uuid if isinstance(uuid, str) else "",
        minor=minor if isinstance(minor, int) and not isinstance(minor, bool) else 0,
        attributes=attributes,
        capacity={k: _capacity(spec.name, k, v.value) for k, v in spec.capacity.items()},
        binds_to_node=spec.binds_to_node is True,
        binding_conditions=tuple(spec.binding_conditions),
        binding_failure_conditions=tuple(spec.binding_failure_conditions),
    )


def simulated_uuid(pool: DevicePool, device: str) -> str:
    """The UUID of a simulated fabric's GPU: ``GPU-`` and a UUID derived from the
    pool's UID (its name where it has none) and the device's name."""
    key = f"{pool.metadata.get('uid') or pool.name}/{device}"
    return f"GPU-{uuidlib.uuid5(_SIMULATED_NAMESPACE, key)}"


def prepared_device(pool: DevicePool, spec: PoolDevice) -> Device:
    """The device a node prepares for a claim: as published, and with a simulated
    fabric's UUID where the pool gives none (module docstring)."""
    device = to_device(spec)
    if device.uuid or pool.spec.simulated_fabric is None:
        return device
    uuid = simulated_uuid(pool, spec.name)
    return replace(device, uuid=uuid, attributes={**device.attributes, "uuid": uuid})

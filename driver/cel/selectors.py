"""Device selectors: CEL evaluated the way kube-scheduler evaluates it for DRA.

``compile_selector`` compiles a DeviceClass or claim selector once (cached by its
text); ``CelDevice`` is a ResourceSlice device converted to CEL values once; and
``CompiledSelector.evaluate`` runs the one against the other in microseconds, so
explaining a pending claim against every published device stays cheap.

The environment is upstream's (``k8s.io/dynamic-resource-allocation/cel``): one
variable ``device`` with ``driver``, ``attributes["<domain>"].<name>`` (bare attribute
names belong to the driver's domain, ``<domain>/<name>`` to that domain),
``capacity["<domain>"].<name>`` as quantities and ``allowMultipleAllocations``; an
unknown domain is an empty map and an unknown attribute an evaluation error, which
reads like the scheduler's (``no such key: foo. Consider using …``). Version
attributes are ``semver`` values. The function library is in ``celfunctions``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from threading import Lock
from types import MappingProxyType
from typing import Any

from drasil.driver.cel.compiler import Activation, CelCompileError, Eval, compile_expression
from drasil.driver.cel.values import (
    COST_KEY,
    CelDeadlineExceeded,
    CelError,
    CostMeter,
    Quantity,
    Semver,
    type_name,
)

DEVICE_FIELDS = frozenset({"driver", "attributes", "capacity", "allowMultipleAllocations"})
"""What ``device`` has; selecting anything else is a compile error, as upstream."""

SELECTOR_VARIABLES = MappingProxyType({"device": DEVICE_FIELDS})

# Upstream's EnhanceRuntimeError (dynamic-resource-allocation/cel/errors.go) appends
# this to "no such key" errors; users see the same hint from the scheduler.
_NO_SUCH_KEY_HINT = (
    ". Consider using CEL optional chaining (?), has() macro, or orValue() for optional fields"
)
_EMPTY_DOMAIN: Mapping[str, Any] = MappingProxyType({})

__all__ = [
    "DEVICE_FIELDS",
    "CelCompileError",
    "CelDeadlineExceeded",
    "CelDevice",
    "CelDeviceCache",
    "CompiledSelector",
    "SelectorResult",
    "clear_compile_cache",
    "compile_selector",
    "scheduler_error",
    "slice_devices",
]


@dataclass(frozen=True, slots=True)
class SelectorResult:
    """Whether a device passed a selector, or why the selector failed on it."""

    matched: bool
    error: str | None = None


MATCHED = SelectorResult(matched=True)
NOT_MATCHED = SelectorResult(matched=False)


class _Domains(dict[str, Any]):
    """``device.attributes`` / ``device.capacity``: an unknown domain is an empty map."""

    __slots__ = ()

    def __missing__(self, domain: str) -> Mapping[str, Any]:
        return _EMPTY_DOMAIN


@dataclass(frozen=True, slots=True)
class CelDevice:
    """One ResourceSlice device as CEL sees it, converted once and evaluated many times.

    ``error`` is set when the device cannot be converted (a version attribute that is
    not semver); upstream fails every selector on such a device with that error.
    """

    name: str
    driver: str
    activation: Activation
    error: str | None = None

    @classmethod
    def from_json(cls, device: Mapping[str, Any], *, driver: str) -> CelDevice:
        """Convert a ResourceSlice ``spec.devices[]`` entry of the slice's ``spec.driver``."""
        name = str(device.get("name", ""))
        try:
            value = _device_value(device, driver)
        except CelError as err:
            return cls(name=name, driver=driver, activation={}, error=str(err))
        return cls(name=name, driver=driver, activation={"device": value})


def _device_value(device: Mapping[str, Any], driver: str) -> dict[str, Any]:
    attributes = _Domains()
    for name, attribute in (device.get("attributes") or {}).items():
        domain, ident = _qualified(name, driver)
        attributes.setdefault(domain, {})[ident] = _attribute_value(name, attribute)
    capacity = _Domains()
    for name, entry in (device.get("capacity") or {}).items():
        domain, ident = _qualified(name, driver)
        capacity.setdefault(domain, {})[ident] = _capacity_value(name, entry)
    return {
        "driver": driver,
        "attributes": attributes,
        "capacity": capacity,
        "allowMultipleAllocations": bool(device.get("allowMultipleAllocations", False)),
    }


@lru_cache(maxsize=4096)
def _qualified(name: str, driver: str) -> tuple[str, str]:
    """``domain/id`` → (domain, id); a bare ``id`` belongs to the driver's domain."""
    domain, slash, ident = name.partition("/")
    return (domain, ident) if slash else (driver, name)


# Devices of one node share versions and sizes; the values are immutable, so parse
# each distinct text once.
_semver = lru_cache(maxsize=4096)(Semver.parse)
_quantity = lru_cache(maxsize=4096)(Quantity.parse)


def _attribute_value(name: str, attribute: Mapping[str, Any]) -> Any:
    # Upstream's getAttributeValue: the first of int, bool, string, version that is set.
    for kind in ("int", "bool", "string"):
        value = attribute.get(kind)
        if value is not None:
            return value
    version = attribute.get("version")
    if version is None:
        raise CelError(f"attribute {name}: unsupported attribute value")
    try:
        return _semver(str(version))
    except CelError as err:
        raise CelError(f"attribute {name}: parse semantic version: {err}") from None


def _capacity_value(name: str, entry: Mapping[str, Any]) -> Quantity:
    try:
        return _quantity(str(entry.get("value", "")))
    except CelError as err:
        raise CelError(f"capacity {name}: {err}") from None


@dataclass(frozen=True, slots=True, eq=False)
class CompiledSelector:
    """A compiled selector expression; ``evaluate`` it against any number of devices."""

    expression: str
    run: Eval

    def evaluate(self, device: CelDevice, *, deadline: float | None = None) -> SelectorResult:
        """Match ``device``; raises ``CelDeadlineExceeded`` once ``time.monotonic()``
        passes ``deadline`` (checked as comprehensions iterate).

        The evaluation's cost is metered as the API server meters it: past
        ``RUNTIME_COST_LIMIT`` it fails with upstream's error, like any CEL error.
        """
        if device.error is not None:
            return SelectorResult(matched=False, error=device.error)
        activation = {**device.activation, COST_KEY: CostMeter(deadline=deadline)}
        try:
            value = self.run(activation)
        except CelError as err:
            return SelectorResult(matched=False, error=_runtime_error(str(err)))
        except (ArithmeticError, RecursionError, TypeError, ValueError) as err:
            # A gap in this evaluator must cost one explanation, not the controller.
            return SelectorResult(matched=False, error=f"internal error: {err!r}")
        if value is True:
            return MATCHED
        if value is False:
            return NOT_MATCHED
        return SelectorResult(
            matched=False,
            error=f"CEL result of type {type_name(value)} could not be converted to bool",
        )


def _runtime_error(message: str) -> str:
    if message.startswith("no such key:"):
        return message + _NO_SUCH_KEY_HINT
    return message


def compile_selector(expression: str) -> CompiledSelector:
    """Compile a device selector once; raises ``CelCompileError`` (also cached)."""
    compiled = _compile(expression)
    if isinstance(compiled, CelCompileError):
        raise compiled.with_traceback(None)
    return compiled


def clear_compile_cache() -> None:
    """Forget every compiled selector (benchmarks measure cold compiles with it)."""
    _compile.cache_clear()


@lru_cache(maxsize=1024)
def _compile(expression: str) -> CompiledSelector | CelCompileError:
    # A bad selector is as common as a good one in explain; cache its error too.
    try:
        node = compile_expression(expression, variables=SELECTOR_VARIABLES)
    except CelCompileError as err:
        return err
    if node.constant and type(node.value) is not bool:
        return CelCompileError(
            f"must evaluate to bool or the unknown type, not {type_name(node.value)}",
            expression=expression,
            line=1,
            column=1,
        )
    return CompiledSelector(expression=expression, run=node.run)


class CelDeviceCache:
    """``CelDevice``s of ResourceSlices, converted once per slice ``resourceVersion``.

    Keyed by the slice's uid (or name); a new resourceVersion replaces the entry. The
    least recently used slices are dropped beyond ``max_slices``. Thread-safe.
    """

    def __init__(self, *, max_slices: int = 4096) -> None:
        self._max = max_slices
        self._slices: OrderedDict[str, tuple[str, tuple[CelDevice, ...]]] = OrderedDict()
        self._lock = Lock()

    def devices(self, resource_slice: Mapping[str, Any]) -> tuple[CelDevice, ...]:
        metadata = resource_slice.get("metadata") or {}
        key = str(metadata.get("uid") or metadata.get("name") or "")
        version = str(metadata.get("resourceVersion") or "")
        with self._lock:
            cached = self._slices.get(key)
            if key and version and cached is not None and cached[0] == version:
                self._slices.move_to_end(key)
                return cached[1]
        devices = slice_devices(resource_slice)
        if key and version:
            with self._lock:
                self._slices[key] = (version, devices)
                self._slices.move_to_end(key)
                while len(self._slices) > self._max:
                    self._slices.popitem(last=False)
        return devices

    def clear(self) -> None:
        """Forget every slice's devices (the controller, once no claim is pending)."""
        with self._lock:
            self._slices.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._slices)


def slice_devices(resource_slice: Mapping[str, Any]) -> tuple[CelDevice, ...]:
    """Every device of a ResourceSlice, converted (uncached)."""
    spec = resource_slice.get("spec") or {}
    driver = str(spec.get("driver", ""))
    return tuple(CelDevice.from_json(d, driver=driver) for d in spec.get("devices") or ())


def scheduler_error(*, owner: str, index: int, device_id: str, error: str) -> str:
    """An evaluation error worded like kube-scheduler's allocator.

    ``owner`` is ``class <name>`` or ``claim <namespace>/<name>``; ``device_id`` is
    ``<driver>/<pool>/<device>``; ``index`` is the selector's position.
    """
    return f"{owner}: selector #{index} on device {device_id}: CEL runtime error: {error}"

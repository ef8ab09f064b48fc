"""What the API server accepts in a ResourceSlice (``resource.k8s.io/v1``), checked here.

``validate_slice`` checks a slice against what the API server would reject and
names the device and field at fault; ``validate_device`` does it for one device entry.
``drasil.driver.slices.build`` runs it on every slice it builds and packs devices
under the limits here (``docs/design.md#resourceslice-limits``). The name rules
(DNS labels and subdomains, qualified names, semver) and ``TaintEffect`` are the API
server's too.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from decimal import Decimal
from enum import StrEnum
from typing import Any

from drasil.api.limits import MAX_BINDING_CONDITIONS, MAX_BINDING_FAILURE_CONDITIONS
from drasil.api.quantity import QuantityError, parse_quantity

MAX_DEVICES_PER_SLICE = 128
MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS = 64
MAX_COUNTER_SETS_PER_SLICE = 8
MAX_COUNTERS_PER_SET = 32
MAX_ATTRIBUTES_AND_CAPACITIES = 32
MAX_TAINTS_PER_DEVICE = 16  # 4 on Kubernetes 1.34
MAX_CONSUMED_COUNTER_SETS = 2
MAX_CONSUMED_COUNTERS_PER_SLICE = 2048
MAX_VALUE_LENGTH = 64
MAX_DRIVER_NAME = 63
MAX_POOL_NAME = 253
MAX_SUBDOMAIN = 253
MAX_VALID_VALUES = 10


class TaintEffect(StrEnum):
    """What a device taint does to claims that do not tolerate it."""

    NONE = "None"
    NO_SCHEDULE = "NoSchedule"
    NO_EXECUTE = "NoExecute"


class SliceValidationError(ValueError):
    """A slice the API server would reject; the message names the device and field."""


_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_C_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_LABEL_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_SEMVER = re.compile(
    r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(-((0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(\.(0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(\+([0-9a-zA-Z-]+(\.[0-9a-zA-Z-]+)*))?"
)


def is_dns_label(text: str) -> bool:
    return len(text) <= 63 and _DNS_LABEL.fullmatch(text) is not None


def is_dns_subdomain(text: str, *, limit: int = MAX_SUBDOMAIN) -> bool:
    return len(text) <= limit and _DNS_SUBDOMAIN.fullmatch(text) is not None


def is_semver(text: str) -> bool:
    return _SEMVER.fullmatch(text) is not None


def qualified_name_error(name: str) -> str | None:
    """Why ``name`` is not an attribute/capacity name, or None when it is one."""
    domain, slash, identifier = name.rpartition("/")
    if slash and not is_dns_subdomain(domain, limit=63):
        return f"domain {domain!r} is not a DNS subdomain of at most 63 characters"
    if len(identifier) > 32 or _C_IDENTIFIER.fullmatch(identifier) is None:
        return f"{identifier!r} is not a C identifier of at most 32 characters"
    return None


def _label_key_error(key: str) -> str | None:
    prefix, slash, name = key.rpartition("/")
    if slash and not is_dns_subdomain(prefix):
        return f"prefix {prefix!r} is not a DNS subdomain"
    if len(name) > 63 or _LABEL_NAME.fullmatch(name) is None:
        return f"name {name!r} is not a label name of at most 63 characters"
    return None


def is_restricted(device: Mapping[str, Any]) -> bool:
    return bool(device.get("taints") or device.get("consumesCounters"))


def consumed_counters(device: Mapping[str, Any]) -> int:
    return sum(len(use.get("counters") or {}) for use in device.get("consumesCounters") or ())


def _fail(where: str, message: str) -> SliceValidationError:
    return SliceValidationError(f"{where}: {message}")


def validate_slice(obj: Mapping[str, Any]) -> None:
    """Raise SliceValidationError for anything the API server would reject."""
    metadata = obj.get("metadata", {})
    where = f'ResourceSlice "{metadata.get("name") or metadata.get("generateName", "?")}"'
    name = metadata.get("name")
    if name is not None and not is_dns_subdomain(name):
        raise _fail(where, "metadata.name is not a DNS subdomain of at most 253 characters")
    spec = obj.get("spec", {})
    _validate_pool(where, spec)
    _validate_node_selection(where, spec)
    devices = spec.get("devices") or []
    counter_sets = spec.get("sharedCounters") or []
    if devices and counter_sets:
        raise _fail(where, "a slice holds either devices or sharedCounters, not both")
    _validate_counter_sets(where, counter_sets)
    _validate_devices(where, devices)


def _validate_pool(where: str, spec: Mapping[str, Any]) -> None:
    driver = spec.get("driver", "")
    if not is_dns_subdomain(driver, limit=MAX_DRIVER_NAME):
        raise _fail(
            where, f"spec.driver {driver!r} is not a DNS subdomain of at most 63 characters"
        )
    pool = spec.get("pool", {})
    pool_name = pool.get("name", "")
    if not pool_name or len(pool_name) > MAX_POOL_NAME:
        raise _fail(where, f"spec.pool.name must have 1 to {MAX_POOL_NAME} characters")
    if not all(is_dns_subdomain(part) for part in pool_name.split("/")):
        raise _fail(where, f"spec.pool.name {pool_name!r} is not DNS subdomains joined by /")
    if not isinstance(pool.get("generation"), int) or pool["generation"] < 0:
        raise _fail(where, "spec.pool.generation must be a non-negative integer")
    if not isinstance(pool.get("resourceSliceCount"), int) or pool["resourceSliceCount"] < 1:
        raise _fail(where, "spec.pool.resourceSliceCount must be at least 1")


def _validate_node_selection(where: str, spec: Mapping[str, Any]) -> None:
    chosen = [
        bool(spec.get("nodeName")),
        spec.get("nodeSelector") is not None,
        spec.get("allNodes") is True,
        spec.get("perDeviceNodeSelection") is True,
    ]
    if sum(chosen) != 1:
        raise _fail(
            where, "exactly one of nodeName, nodeSelector, allNodes, perDeviceNodeSelection"
        )
    selector = spec.get("nodeSelector")
    if selector is not None and len(selector.get("nodeSelectorTerms") or []) != 1:
        raise _fail(where, "spec.nodeSelector must have exactly one nodeSelectorTerm")


def _validate_counter_sets(where: str, counter_sets: Sequence[Mapping[str, Any]]) -> None:
    if len(counter_sets) > MAX_COUNTER_SETS_PER_SLICE:
        raise _fail(where, f"more than {MAX_COUNTER_SETS_PER_SLICE} counter sets")
    seen: set[str] = set()
    for counter_set in counter_sets:
        name = counter_set.get("name", "")
        at = f'{where}: counter set "{name}"'
        if not is_dns_label(name) or name in seen:
            raise _fail(at, "name must be a unique DNS label")
        seen.add(name)
        counters = counter_set.get("counters") or {}
        if len(counters) > MAX_COUNTERS_PER_SET:
            raise _fail(at, f"more than {MAX_COUNTERS_PER_SET} counters")
        _validate_counter_map(at, counters)


def _validate_counter_map(where: str, counters: Mapping[str, Any]) -> None:
    for name, counter in counters.items():
        if not is_dns_label(name):
            raise _fail(where, f'counter "{name}": name is not a DNS label')
        _validate_quantity(f'{where}: counter "{name}"', counter)


def _validate_quantity(where: str, entry: Any) -> None:
    value = entry.get("value") if isinstance(entry, Mapping) else None
    if not isinstance(value, str):
        raise _fail(where, "needs {value: <quantity string>}")
    try:
        parse_quantity(value)
    except QuantityError as err:
        raise _fail(where, f"value: {err}") from None


def _validate_devices(where: str, devices: Sequence[Mapping[str, Any]]) -> None:
    restricted = any(is_restricted(d) for d in devices)
    limit = MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS if restricted else MAX_DEVICES_PER_SLICE
    if len(devices) > limit:
        reason = " (some have taints or consumesCounters)" if restricted else ""
        raise _fail(where, f"{len(devices)} devices, more than {limit}{reason}")
    consumed = sum(consumed_counters(d) for d in devices)
    if consumed > MAX_CONSUMED_COUNTERS_PER_SLICE:
        raise _fail(
            where,
            f"devices consume {consumed} counters, more than {MAX_CONSUMED_COUNTERS_PER_SLICE}",
        )
    seen: set[str] = set()
    for device in devices:
        name = device.get("name", "")
        if name in seen:
            raise _fail(where, f'device name "{name}" is used twice')
        seen.add(name)
        validate_device(device, where=where)


def validate_device(device: Mapping[str, Any], *, where: str = "ResourceSlice") -> None:
    """Raise SliceValidationError for a device entry the API server would reject."""
    name = device.get("name", "")
    at = f'{where}: device "{name}"'
    if not is_dns_label(name):
        raise _fail(at, "name is not a DNS label (lowercase alphanumerics and '-', ≤ 63)")
    attributes = device.get("attributes") or {}
    capacity = device.get("capacity") or {}
    if len(attributes) + len(capacity) > MAX_ATTRIBUTES_AND_CAPACITIES:
        raise _fail(at, f"more than {MAX_ATTRIBUTES_AND_CAPACITIES} attributes and capacities")
    for key, value in attributes.items():
        _validate_attribute(at, key, value)
    shareable = device.get("allowMultipleAllocations") is True
    for key, value in capacity.items():
        error = qualified_name_error(key)
        if error:
            raise _fail(at, f'capacity "{key}": {error}')
        _validate_quantity(f'{at}: capacity "{key}"', value)
        policy = value.get("requestPolicy")
        if policy is not None:
            if not shareable:
                raise _fail(at, f'capacity "{key}": requestPolicy needs allowMultipleAllocations')
            _validate_request_policy(f'{at}: capacity "{key}": requestPolicy', value, policy)
    _validate_taints(at, device.get("taints") or [])
    _validate_consumption(at, device.get("consumesCounters") or [])
    _validate_binding(at, device)


def _policy_quantity(where: str, field: str, text: Any) -> Decimal:
    if not isinstance(text, str):
        raise _fail(where, f"{field} must be a quantity string")
    try:
        return parse_quantity(text)
    except QuantityError as err:
        raise _fail(where, f"{field}: {err}") from None


def _validate_request_policy(where: str, capacity: Mapping[str, Any], policy: Any) -> None:
    """The API server's rules for a ``requestPolicy`` (pkg/apis/resource/validation)."""
    if not isinstance(policy, Mapping):
        raise _fail(where, "must be an object")
    value = parse_quantity(capacity["value"])
    values, valid_range = policy.get("validValues"), policy.get("validRange")
    if values and valid_range is not None:
        raise _fail(where, "set validValues or validRange, not both")
    if not values and valid_range is None:
        return  # a bare default is not checked by the API server either
    if policy.get("default") is None:
        raise _fail(where, "default is required with validValues or validRange")
    default = _policy_quantity(where, "default", policy["default"])
    if values:
        _validate_valid_values(where, value, default, values)
    else:
        _validate_valid_range(where, value, default, valid_range)


def _validate_valid_values(where: str, value: Decimal, default: Decimal, values: Any) -> None:
    if not isinstance(values, list) or len(values) > MAX_VALID_VALUES:
        raise _fail(where, f"validValues must be a list of at most {MAX_VALID_VALUES}")
    options = [_policy_quantity(where, "validValues", v) for v in values]
    if options != sorted(options) or len(set(options)) != len(options):
        raise _fail(where, "validValues must be unique and in ascending order")
    if options[-1] > value:
        raise _fail(where, "validValues has an option larger than the capacity")
    if default not in options:
        raise _fail(where, "default is not one of validValues")


def _validate_valid_range(where: str, value: Decimal, default: Decimal, bounds: Any) -> None:
    if not isinstance(bounds, Mapping) or bounds.get("min") is None:
        raise _fail(where, "validRange.min is required")
    low = _policy_quantity(where, "validRange.min", bounds["min"])
    high = _policy_quantity(where, "validRange.max", bounds["max"]) if "max" in bounds else None
    if low > value:
        raise _fail(where, "validRange.min is larger than the capacity")
    if default < low:
        raise _fail(where, "default is less than validRange.min")
    if high is not None and not low <= high <= value:
        raise _fail(where, "validRange.max must lie between min and the capacity")
    if high is not None and default > high:
        raise _fail(where, "default is more than validRange.max")
    if bounds.get("step") is not None:
        step = _policy_quantity(where, "validRange.step", bounds["step"])
        _validate_step(where, value=value, default=default, low=low, high=high, step=step)


def _validate_step(
    where: str,
    *,
    value: Decimal,
    default: Decimal,
    low: Decimal,
    high: Decimal | None,
    step: Decimal,
) -> None:
    if step <= 0:
        raise _fail(where, "validRange.step must be greater than zero")
    if low + step > value:
        raise _fail(where, "validRange.min + step is larger than the capacity")
    # Only with a step does the server read the bounds as int64 and refuse negative
    # ones; without a step a negative min passes.
    if any(q < 0 for q in (low, default, step, high or 0)):
        raise _fail(where, "default and validRange bounds must not be negative with a step")
    for name, bound in (("default", default), ("validRange.max", high)):
        if bound is not None and (bound - low) % step != 0:
            raise _fail(where, f"{name} is not validRange.min plus a multiple of step")


def _validate_attribute(where: str, key: str, value: Any) -> None:
    at = f'{where}: attribute "{key}"'
    error = qualified_name_error(key)
    if error:
        raise _fail(at, error)
    if not isinstance(value, Mapping) or len(value) != 1:
        raise _fail(at, "needs exactly one of int, bool, string, version")
    (kind, inner), *_ = value.items()
    checks = {
        "int": isinstance(inner, int) and not isinstance(inner, bool),
        "bool": isinstance(inner, bool),
        "string": isinstance(inner, str) and len(inner) <= MAX_VALUE_LENGTH,
        "version": isinstance(inner, str) and len(inner) <= MAX_VALUE_LENGTH and is_semver(inner),
    }
    if kind not in checks:
        raise _fail(at, f"unknown value type {kind!r} (int, bool, string, version)")
    if not checks[kind]:
        detail = " semver" if kind == "version" else ""
        raise _fail(at, f"{inner!r} is not a valid{detail} {kind} of at most 64 characters")


def _validate_taints(where: str, taints: Sequence[Mapping[str, Any]]) -> None:
    if len(taints) > MAX_TAINTS_PER_DEVICE:
        raise _fail(where, f"more than {MAX_TAINTS_PER_DEVICE} taints")
    effects = {e.value for e in TaintEffect}
    for taint in taints:
        key = taint.get("key", "")
        error = _label_key_error(key)
        if error:
            raise _fail(where, f'taint "{key}": key {error}')
        value = taint.get("value", "")
        if value and (len(value) > 63 or _LABEL_NAME.fullmatch(value) is None):
            raise _fail(where, f'taint "{key}": value {value!r} is not a label value')
        if taint.get("effect") not in effects:
            raise _fail(where, f'taint "{key}": effect must be one of {sorted(effects)}')


def _validate_consumption(where: str, consumes: Sequence[Mapping[str, Any]]) -> None:
    if len(consumes) > MAX_CONSUMED_COUNTER_SETS:
        raise _fail(where, f"consumes from more than {MAX_CONSUMED_COUNTER_SETS} counter sets")
    for use in consumes:
        counter_set = use.get("counterSet", "")
        if not is_dns_label(counter_set):
            raise _fail(where, f'consumesCounters: "{counter_set}" is not a DNS label')
        _validate_counter_map(
            f'{where}: consumesCounters "{counter_set}"', use.get("counters") or {}
        )


def _validate_condition_types(where: str, field: str, types: Any, limit: int) -> list[str]:
    if not isinstance(types, list):
        raise _fail(where, f"{field} must be a list of condition types")
    if len(types) > limit:
        raise _fail(where, f"{field}: {len(types)} condition types, more than {limit}")
    seen: set[str] = set()
    for kind in types:
        error = _label_key_error(kind) if isinstance(kind, str) else "not a string"
        if error:
            raise _fail(where, f"{field}: {kind!r}: {error}")
        if kind in seen:
            raise _fail(where, f"{field}: {kind!r} is listed twice")
        seen.add(kind)
    return list(types)


def _validate_binding(where: str, device: Mapping[str, Any]) -> None:
    """KEP-5007's rules: condition types are label names, at most 4 of each, no
    repeats and no overlap, and the two lists only together."""
    binds = device.get("bindsToNode")
    if binds is not None and not isinstance(binds, bool):
        raise _fail(where, "bindsToNode must be a boolean")
    ok = _validate_condition_types(
        where, "bindingConditions", device.get("bindingConditions") or [], MAX_BINDING_CONDITIONS
    )
    failed = _validate_condition_types(
        where,
        "bindingFailureConditions",
        device.get("bindingFailureConditions") or [],
        MAX_BINDING_FAILURE_CONDITIONS,
    )
    both = sorted(set(ok) & set(failed))
    if both:
        raise _fail(where, f"bindingFailureConditions: {both[0]!r} is also a binding condition")
    if bool(ok) != bool(failed):
        missing = "bindingFailureConditions" if ok else "bindingConditions"
        raise _fail(
            where,
            f"{missing} are required: bindingConditions and bindingFailureConditions go together",
        )

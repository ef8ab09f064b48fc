"""The opaque configs of ResourceClaims and ResourceClaimTemplates, checked early.

The API server stores ``opaque.parameters`` without looking inside, so a bad
GpuConfig would otherwise surface only when kubelet prepares the claim on a node,
after scheduling, as a Pod stuck in ContainerCreating. Decoding with the same strict
API the plugin uses turns it into an Event on the claim minutes earlier, naming the
field, the value and what is allowed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from drasil.api.config import ConfigError, decode_config

# Where each kind keeps its list of config entries.
CONFIG_PATHS: Final[Mapping[str, tuple[str, ...]]] = {
    "ResourceClaim": ("spec", "devices", "config"),
    "ResourceClaimTemplate": ("spec", "spec", "devices", "config"),
}


def _entries(obj: Mapping[str, Any], path: Sequence[str]) -> Sequence[Any]:
    value: Any = obj
    for key in path:
        value = value.get(key) if isinstance(value, Mapping) else None
    return value if isinstance(value, list) else ()


def _issue_path(prefix: str, path: str) -> str:
    if not path:
        return prefix
    return f"{prefix}{path}" if path.startswith("[") else f"{prefix}.{path}"


def entry_problems(parameters: object, *, where: str) -> list[str]:
    """What is wrong with one ``opaque.parameters`` value, each naming its path."""
    if not isinstance(parameters, Mapping):
        return [f"{where}: must be an object (a GpuConfig or MigDeviceConfig)"]
    try:
        decode_config(parameters)
    except ConfigError as err:
        return [f"{_issue_path(where, issue.path)}: {issue.message}" for issue in err.issues]
    return []


def config_problems(obj: Mapping[str, Any], *, driver: str) -> list[str]:
    """Problems of every opaque config entry for ``driver`` in a claim or template.

    Each reads like ``spec.devices.config[0].opaque.parameters.sharing.strategy:
    unsupported value "Foo": allowed values are "Exclusive", "TimeSlicing", "MPS"``.
    Other kinds and entries for other drivers have none.
    """
    path = CONFIG_PATHS.get(str(obj.get("kind", "")))
    if path is None:
        return []
    problems: list[str] = []
    for index, entry in enumerate(_entries(obj, path)):
        opaque = entry.get("opaque") if isinstance(entry, Mapping) else None
        if not isinstance(opaque, Mapping) or opaque.get("driver") != driver:
            continue
        where = f"{'.'.join(path)}[{index}].opaque.parameters"
        problems.extend(entry_problems(opaque.get("parameters"), where=where))
    return problems

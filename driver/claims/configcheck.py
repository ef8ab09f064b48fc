"""Checking config files before they reach the cluster (``drasil validate-config FILE``).

The API server stores ``opaque.parameters`` without looking inside, so a typo in a
GpuConfig surfaces only when a Pod fails to start. This check runs the driver's own
decoder over a file instead: an opaque config itself, or ResourceClaims,
ResourceClaimTemplates and DeviceClasses holding opaque entries for the driver.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from drasil.api.config import API_VERSION, KINDS, ConfigError, decode_config, load_documents

# Where each kind keeps its list of config entries.
_CONFIG_LISTS: Final[Mapping[str, tuple[str, ...]]] = {
    "ResourceClaim": ("spec", "devices", "config"),
    "ResourceClaimTemplate": ("spec", "spec", "devices", "config"),
    "DeviceClass": ("spec", "config"),
}


def _label(document: Mapping[str, Any], number: int) -> str:
    metadata = document.get("metadata")
    name = metadata.get("name") if isinstance(metadata, Mapping) else None
    kind = document.get("kind") or "object"
    return f"{kind}/{name}" if name else f"{kind} (document {number})"


def _decode_problems(parameters: object, *, where: str) -> list[str]:
    if not isinstance(parameters, Mapping):
        kinds = " or ".join(KINDS)
        return [f"{where}: must be an object holding a {kinds}, got {type(parameters).__name__}"]
    try:
        decode_config(parameters)
    except ConfigError as err:
        return [f"{where}: {issue}" for issue in err.issues]
    return []


def _entries(document: Mapping[str, Any], path: Sequence[str]) -> Sequence[Any]:
    value: Any = document
    for key in path:
        value = value.get(key) if isinstance(value, Mapping) else None
    return value if isinstance(value, list) else ()


def _opaque_parameters(entry: object, driver: str) -> tuple[bool, object]:
    """Whether an entry is an opaque config for ``driver``, and its parameters."""
    opaque = entry.get("opaque") if isinstance(entry, Mapping) else None
    if not isinstance(opaque, Mapping) or opaque.get("driver") != driver:
        return False, None
    return True, opaque.get("parameters")


def _check_document(document: object, *, number: int, driver: str) -> list[str] | None:
    """The problems of one document; None for a document that holds no configs (a Pod)."""
    if not isinstance(document, Mapping):
        return [f"document {number}: expected an object, got {type(document).__name__}"]
    label, kind = _label(document, number), document.get("kind")
    if kind in KINDS or document.get("apiVersion") == API_VERSION:
        return _decode_problems(document, where=label)
    path = _CONFIG_LISTS.get(kind) if isinstance(kind, str) else None
    if path is None:
        return None
    problems: list[str] = []
    found = False
    for index, entry in enumerate(_entries(document, path)):
        ours, parameters = _opaque_parameters(entry, driver)
        if ours:
            found = True
            where = f"{label}: {'.'.join(path)}[{index}].opaque.parameters"
            problems.extend(_decode_problems(parameters, where=where))
    if not found:
        problems.append(f"{label}: no opaque config for driver {driver} found in {'.'.join(path)}")
    return problems


def validate_config_document(text: str, *, driver: str = "gpu.drasil.dev") -> list[str]:
    """Human-readable problems of a config file; an empty list means it is valid.

    The text is a GpuConfig/MigDeviceConfig (YAML or JSON), or YAML documents of
    which ResourceClaims, ResourceClaimTemplates and DeviceClasses are checked: each
    must hold an opaque config for ``driver``, and every such config must decode.
    Other documents (a Pod using the claim) are skipped; a file with nothing to check
    is a problem, so nobody is told "valid" about nothing.
    """
    try:
        documents = load_documents(text)
    except ConfigError as err:
        return [str(err)]
    results = [
        _check_document(document, number=number, driver=driver)
        for number, document in enumerate(documents, 1)
    ]
    checked = [problems for problems in results if problems is not None]
    if not checked:
        return [f"no opaque config for driver {driver} found"]
    return [problem for problems in checked for problem in problems]

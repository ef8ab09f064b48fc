"""Opaque configs checked before a node ever sees them.

The API server stores ``opaque.parameters`` without looking inside, so a bad GpuConfig
would otherwise surface only when kubelet prepares the claim on a node, after
scheduling, as a Pod stuck in ContainerCreating. Two callers decode with the same
strict API the plugin uses, earlier:

- the controller (``config_problems``) turns the problems of a ResourceClaim or
  ResourceClaimTemplate into an Event on it minutes before the Pod would fail;
- ``drasil validate-config FILE`` (``validate_config_document``) checks an opaque
  config itself, or the ResourceClaims, ResourceClaimTemplates and DeviceClasses of a
  file, before they reach the cluster.

Beyond decoding, both refuse a strategy drasil would not apply, with the words
prepare uses (``sharing.not_applied``): ``MPS`` in a GpuConfig or MigDeviceConfig
where no device can be a share (of a consumable GPU, or of a MIG placement in dynamic
MIG mode; the controller knows whether the cluster publishes any; a file alone does
not say, so ``validate-config`` lets it pass and prepare decides).

Every problem names its path, the value and what is allowed.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final

from drasil.api.config import (
    API_VERSION,
    KINDS,
    ConfigError,
    ConfigIssue,
    OpaqueConfig,
    decode_config,
    load_documents,
)
from drasil.driver.claims.sharing import not_applied

# Where each kind keeps its list of config entries.
CONFIG_PATHS: Final[Mapping[str, tuple[str, ...]]] = {
    "ResourceClaim": ("spec", "devices", "config"),
    "ResourceClaimTemplate": ("spec", "spec", "devices", "config"),
    "DeviceClass": ("spec", "config"),
}


def _entries(obj: Mapping[str, Any], path: Sequence[str]) -> Sequence[Any]:
    value: Any = obj
    for key in path:
        value = value.get(key) if isinstance(value, Mapping) else None
    return value if isinstance(value, list) else ()


def driver_parameters(
    obj: Mapping[str, Any], path: Sequence[str], *, driver: str
) -> Iterator[tuple[str, object]]:
    """``(where, parameters)`` of each opaque entry for ``driver`` under ``path``."""
    for index, entry in enumerate(_entries(obj, path)):
        opaque = entry.get("opaque") if isinstance(entry, Mapping) else None
        if isinstance(opaque, Mapping) and opaque.get("driver") == driver:
            yield f"{'.'.join(path)}[{index}].opaque.parameters", opaque.get("parameters")


def _issue_path(prefix: str, path: str) -> str:
    if not path:
        return prefix
    return f"{prefix}{path}" if path.startswith("[") else f"{prefix}.{path}"


NO_SHARED_GPU: Final = "no GPU in this cluster is consumable"
"""Said after the controller's MPS problem when the cluster publishes no GPU share."""


def _not_applied(config: OpaqueConfig, *, shared_gpus: bool) -> list[ConfigIssue]:
    """The strategy drasil would not apply, as prepare says it, where it is sure to."""
    issue = not_applied(config, share=shared_gpus)
    if issue is None:
        return []
    if not shared_gpus:
        message = f"{issue.message}; {NO_SHARED_GPU}"
        issue = ConfigIssue(issue.path, issue.value, message, issue.allowed)
    return [issue]


def entry_problems(parameters: object, *, where: str, shared_gpus: bool = True) -> list[str]:
    """What is wrong with one ``opaque.parameters`` value, each naming its path.

    ``shared_gpus``: whether a GPU of the driver may be allocated as a share of a
    consumable GPU, where a GpuConfig's MPS is applied; False makes it a problem.
    """
    if not isinstance(parameters, Mapping):
        return [f"{where}: must be an object (a GpuConfig or MigDeviceConfig)"]
    try:
        config = decode_config(parameters)
    except ConfigError as err:
        issues = list(err.issues)
    else:
        issues = _not_applied(config, shared_gpus=shared_gpus)
    return [f"{_issue_path(where, issue.path)}: {issue.message}" for issue in issues]


def config_problems(obj: Mapping[str, Any], *, driver: str, shared_gpus: bool = True) -> list[str]:
    """Problems of every opaque config entry for ``driver`` in a claim or template.

    Each reads like ``spec.devices.config[0].opaque.parameters.sharing.strategy:
    unsupported value "Foo": allowed values are "Exclusive", "TimeSlicing", "MPS"``.
    Other kinds and entries for other drivers have none. ``shared_gpus`` as for
    ``entry_problems``: the controller passes whether the cluster publishes a GPU
    of the driver that can be shared.
    """
    path = CONFIG_PATHS.get(str(obj.get("kind", "")))
    if path is None:
        return []
    problems: list[str] = []
    for where, parameters in driver_parameters(obj, path, driver=driver):
        problems.extend(entry_problems(parameters, where=where, shared_gpus=shared_gpus))
    return problems


# --- files (drasil validate-config) ----------------------------------------------------


def _label(document: Mapping[str, Any], number: int) -> str:
    metadata = document.get("metadata")
    name = metadata.get("name") if isinstance(metadata, Mapping) else None
    kind = document.get("kind")
    kind = kind if isinstance(kind, str) and kind else "object"
    return f"{kind}/{name}" if isinstance(name, str) and name else f"{kind} (document {number})"


def _decode_problems(parameters: object, *, where: str) -> list[str]:
    if not isinstance(parameters, Mapping):
        kinds = " or ".join(KINDS)
        return [f"{where}: must be an object holding a {kinds}, got {type(parameters).__name__}"]
    try:
        config = decode_config(parameters)
    except ConfigError as err:
        return [f"{where}: {issue}" for issue in err.issues]
    # A file does not say where its claims will run: a GpuConfig's MPS may be applied.
    return [f"{where}: {issue}" for issue in _not_applied(config, shared_gpus=True)]


def _check_document(document: object, *, number: int, driver: str) -> list[str] | None:
    """The problems of one document; None for a document that holds no configs (a Pod)."""
    if not isinstance(document, Mapping):
        return [f"document {number}: expected an object, got {type(document).__name__}"]
    label, kind = _label(document, number), document.get("kind")
    kind = kind if isinstance(kind, str) else None
    if kind in KINDS or document.get("apiVersion") == API_VERSION:
        return _decode_problems(document, where=label)
    path = CONFIG_PATHS.get(kind) if kind else None
    if path is None:
        return None
    problems: list[str] = []
    found = False
    for where, parameters in driver_parameters(document, path, driver=driver):
        found = True
        problems.extend(_decode_problems(parameters, where=f"{label}: {where}"))
    if not found:
        problems.append(f"{label}: no opaque config for driver {driver} found in {'.'.join(path)}")
    return problems


def validate_config_document(text: str | bytes, *, driver: str = "gpu.drasil.dev") -> list[str]:
    """Human-readable problems of a config file; an empty list means it is valid.

    The text is a GpuConfig/MigDeviceConfig (YAML or JSON), or YAML documents of
    which ResourceClaims, ResourceClaimTemplates and DeviceClasses are checked: each
    must hold an opaque config for ``driver``, and every such config must decode.
    Other documents (a Pod using the claim) are skipped; a file with nothing to check
    is a problem, so nobody is told "valid" about nothing.

    Bytes must be UTF-8. Whatever the input, problems are returned, never raised:
    the limits of ``drasil.api.limits`` hold for the file and for each config in it.
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

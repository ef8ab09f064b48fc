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

Beyond decoding, the controller refuses what prepare would refuse for sure, with the
words prepare uses (``sharing.not_applied``): ``MPS`` in an entry for a request with
admin access. MPS is otherwise applied to every GPU and MIG device (shared, or allocated
whole with a daemon of its own), so nothing else depends on the cluster.

Every problem names its path, the value and what is allowed.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final

from drasil.api.config import API_VERSIONS, KINDS, decode_config
from drasil.api.documents import ConfigError, load_documents
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


def _admin_requests(obj: Mapping[str, Any], path: Sequence[str]) -> set[str]:
    """The names of a claim's (or template's) requests with ``adminAccess: true``."""
    devices = _entries(obj, (*path[:-1], "requests"))
    names = set()
    for request in devices:
        if not isinstance(request, Mapping):
            continue
        exactly = request.get("exactly")
        if isinstance(exactly, Mapping) and exactly.get("adminAccess") is True:
            names.add(str(request.get("name")))
    return names


def _entry_requests(obj: Mapping[str, Any], path: Sequence[str], index: int) -> list[str] | None:
    """The requests config entry ``index`` names; None for one of all requests."""
    entry = _entries(obj, path)[index]
    requests = entry.get("requests") if isinstance(entry, Mapping) else None
    if not isinstance(requests, list) or not requests:
        return None
    return [str(name).partition("/")[0] for name in requests]


def entry_problems(parameters: object, *, where: str, admin_access: bool = False) -> list[str]:
    """What is wrong with one ``opaque.parameters`` value, each naming its path.

    ``admin_access``: whether the entry applies to a request with admin access, which
    takes no MPS (``sharing.not_applied``).
    """
    if not isinstance(parameters, Mapping):
        return [f"{where}: must be an object (a GpuConfig or MigDeviceConfig)"]
    try:
        config = decode_config(parameters)
    except ConfigError as err:
        issues = list(err.issues)
    else:
        issue = not_applied(config, admin_access=admin_access)
        issues = [issue] if issue is not None else []
    return [f"{_issue_path(where, issue.path)}: {issue.message}" for issue in issues]


def config_problems(obj: Mapping[str, Any], *, driver: str) -> list[str]:
    """Problems of every opaque config entry for ``driver`` in a claim or template.

    Each reads like ``spec.devices.config[0].opaque.parameters.sharing.strategy:
    unsupported value "Foo": allowed values are "Exclusive", "TimeSlicing", "MPS"``.
    Other kinds and entries for other drivers have none. An entry that names a request
    with admin access, or is for all requests of a claim that has one, may not say MPS
    (prepare refuses it on that device).
    """
    path = CONFIG_PATHS.get(str(obj.get("kind", "")))
    if path is None:
        return []
    admin = _admin_requests(obj, path)
    problems: list[str] = []
    for index, entry in enumerate(_entries(obj, path)):
        opaque = entry.get("opaque") if isinstance(entry, Mapping) else None
        if not (isinstance(opaque, Mapping) and opaque.get("driver") == driver):
            continue
        requests = _entry_requests(obj, path, index)
        on_admin = bool(admin) and (requests is None or bool(admin & set(requests)))
        where = f"{'.'.join(path)}[{index}].opaque.parameters"
        problems.extend(
            entry_problems(opaque.get("parameters"), where=where, admin_access=on_admin)
        )
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
        names = list(KINDS)
        kinds = f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]
        return [f"{where}: must be an object holding a {kinds}, got {type(parameters).__name__}"]
    try:
        decode_config(parameters)
    except ConfigError as err:
        return [f"{where}: {issue}" for issue in err.issues]
    return []


def _check_document(document: object, *, number: int, driver: str) -> list[str] | None:
    """The problems of one document; None for a document that holds no configs (a Pod)."""
    if not isinstance(document, Mapping):
        return [f"document {number}: expected an object, got {type(document).__name__}"]
    label, kind = _label(document, number), document.get("kind")
    kind = kind if isinstance(kind, str) else None
    if kind in KINDS or document.get("apiVersion") in tuple(API_VERSIONS):
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

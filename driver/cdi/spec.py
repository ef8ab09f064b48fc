"""CDI specs as container runtimes read them: edits, the lowest ``cdiVersion``, validation.

Runtimes reject a whole file for one bad field or a ``cdiVersion`` newer than they
know, so every spec drasil writes (per claim in ``claimspecs``, per node in
``staticspec``) is validated here first and carries the lowest version its content
needs. The rules are the CDI specification's (``cncf-tags/container-device-interface``,
spec 1.1.0, and the version rules of its ``pkg/cdi`` ``MinimumRequiredVersion``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from drasil.driver.devices import CharDevice, Device

CdiSpec = dict[str, Any]
"""A CDI spec as the JSON object runtimes read."""

SPEC_FILE_MODE: Final = 0o644
# Variables drasil sets in containers. Per device: DRASIL_DEVICE_<device name, upper
# case, "-" as "_">=<uuid>.
ENV_VISIBLE_DEVICES: Final = "DRASIL_VISIBLE_DEVICES"
ENV_NVIDIA_VISIBLE_DEVICES: Final = "NVIDIA_VISIBLE_DEVICES"
ENV_DEVICE_PREFIX: Final = "DRASIL_DEVICE_"

_VENDOR_OR_CLASS = re.compile(r"[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?")
DEVICE_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?")
# POSIX portable names: what shells and every runtime accept without quoting.
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DEVICE_NODE_TYPES: Final = frozenset("bcup")
_KNOWN_VERSIONS: Final = ("0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0")
# Runtimes parse specs strictly, and the official schema does not forbid extra keys.
_SPEC_KEYS: Final = frozenset({"cdiVersion", "kind", "annotations", "devices", "containerEdits"})
_DEVICE_KEYS: Final = frozenset({"name", "annotations", "containerEdits"})
_EDITS_KEYS: Final = frozenset(
    {"env", "deviceNodes", "mounts", "hooks", "additionalGids", "intelRdt", "netDevices"}
)
_NODE_KEYS: Final = frozenset(
    {"path", "hostPath", "type", "major", "minor", "fileMode", "permissions", "uid", "gid"}
)
_MOUNT_KEYS: Final = frozenset({"hostPath", "containerPath", "options", "type"})
_HOOK_KEYS: Final = frozenset({"hookName", "path", "args", "env", "timeout"})
# The OCI runtime spec's hook points (CDI 0.5.0 names them in its schema).
HOOK_NAMES: Final = (
    "prestart",
    "createRuntime",
    "createContainer",
    "startContainer",
    "poststart",
    "poststop",
)


class CdiSpecError(ValueError):
    """A spec that a runtime would reject; the message starts with the bad field."""


@dataclass(frozen=True)
class DeviceNode:
    """A device node to create in the container (``/dev/nvidiactl``)."""

    path: str
    host_path: str | None = None
    permissions: str | None = None
    type: str | None = None  # "c" with major and minor: made without the host's node
    major: int | None = None
    minor: int | None = None


def host_device_node(host_path: str) -> DeviceNode:
    """The container's node for a host node: at the same path, or at its ``/dev/…``
    path where the host keeps it elsewhere (a driver root's ``dev/``, as the GPU
    Operator's driver container has it)."""
    if host_path.startswith("/dev/") or "/dev/" not in host_path:
        return DeviceNode(path=host_path)
    return DeviceNode(path=host_path[host_path.rindex("/dev/") :], host_path=host_path)


def char_device_node(device: CharDevice) -> DeviceNode:
    """A node given by its numbers (MIG capability nodes; see ``CharDevice``)."""
    host = device.host_path if device.host_path != device.path else None
    return DeviceNode(
        path=device.path, host_path=host, type="c", major=device.major, minor=device.minor
    )


def device_nodes_of(device: Device) -> tuple[DeviceNode, ...]:
    """Every node a container of ``device`` gets: its GPU's, then its MIG ones."""
    return tuple(host_device_node(p) for p in device.device_nodes) + tuple(
        char_device_node(c) for c in device.char_devices
    )


@dataclass(frozen=True)
class Mount:
    """A bind mount into the container."""

    host_path: str
    container_path: str
    options: tuple[str, ...] = ()
    type: str | None = None


@dataclass(frozen=True)
class Hook:
    """An OCI hook the runtime runs (``nvidia-cdi-hook create-symlinks …``)."""

    path: str
    args: tuple[str, ...]
    hook_name: str = "createContainer"
    env: tuple[str, ...] = ()


@dataclass(frozen=True)
class ContainerEdits:
    """Edits every container using any device of the claim gets (spec-level edits)."""

    env: Mapping[str, str] = field(default_factory=dict)
    device_nodes: tuple[DeviceNode, ...] = ()
    mounts: tuple[Mount, ...] = ()
    hooks: tuple[Hook, ...] = ()


def device_env_name(device_name: str) -> str:
    """The per-device variable, e.g. ``DRASIL_DEVICE_GPU_0`` for ``gpu-0``."""
    return ENV_DEVICE_PREFIX + re.sub(r"[^A-Za-z0-9_]", "_", device_name).upper()


def edits_dict(
    env: Mapping[str, str],
    nodes: Iterable[DeviceNode],
    mounts: Iterable[Mount],
    hooks: Iterable[Hook] = (),
) -> CdiSpec:
    edits: CdiSpec = {}
    if env:
        # Sorted by name so a caller's mapping order cannot change the file's bytes.
        edits["env"] = [f"{name}={env[name]}" for name in sorted(env)]
    if node_dicts := [_node_dict(n) for n in nodes]:
        edits["deviceNodes"] = node_dicts
    if mount_dicts := [_mount_dict(m) for m in mounts]:
        edits["mounts"] = mount_dicts
    if hook_dicts := [_hook_dict(h) for h in hooks]:
        edits["hooks"] = hook_dicts
    return edits


def common_edits_dict(edits: ContainerEdits) -> CdiSpec:
    """The JSON form of a whole ``ContainerEdits``."""
    return edits_dict(edits.env, edits.device_nodes, edits.mounts, edits.hooks)


def _hook_dict(hook: Hook) -> CdiSpec:
    out: CdiSpec = {"hookName": hook.hook_name, "path": hook.path, "args": list(hook.args)}
    if hook.env:
        out["env"] = list(hook.env)
    return out


def _node_dict(node: DeviceNode) -> CdiSpec:
    out: CdiSpec = {"path": node.path}
    if node.host_path is not None:
        out["hostPath"] = node.host_path
    if node.type is not None:
        out["type"] = node.type
    if node.major is not None:
        out["major"] = node.major
    if node.minor is not None:
        out["minor"] = node.minor
    if node.permissions is not None:
        out["permissions"] = node.permissions
    return out


def _mount_dict(mount: Mount) -> CdiSpec:
    out: CdiSpec = {"hostPath": mount.host_path, "containerPath": mount.container_path}
    if mount.options:
        out["options"] = list(mount.options)
    if mount.type is not None:
        out["type"] = mount.type
    return out


# --- version selection ---------------------------------------------------------------


def _all_edits(spec: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    edits = [d.get("containerEdits") or {} for d in spec.get("devices") or []]
    return [*edits, spec.get("containerEdits") or {}]


def _needs_mount_type(spec: Mapping[str, Any]) -> bool:
    return any(m.get("type") for e in _all_edits(spec) for m in e.get("mounts") or [])


def _needs_host_path_or_digit_name(spec: Mapping[str, Any]) -> bool:
    names = (str(d.get("name") or "") for d in spec.get("devices") or [])
    if any(n[:1].isascii() and n[:1].isdigit() for n in names):
        return True
    return any(n.get("hostPath") for e in _all_edits(spec) for n in e.get("deviceNodes") or [])


def _needs_annotations_or_dotted_class(spec: Mapping[str, Any]) -> bool:
    if spec.get("annotations") or any(d.get("annotations") for d in spec.get("devices") or []):
        return True
    # Dots in the vendor part were always allowed; only the class part matters.
    _, _, cls = str(spec.get("kind") or "").partition("/")
    return "." in cls


def _needs_rdt_or_gids(spec: Mapping[str, Any]) -> bool:
    return any(e.get("intelRdt") is not None or e.get("additionalGids") for e in _all_edits(spec))


def _needs_net_devices_or_rdt_monitoring(spec: Mapping[str, Any]) -> bool:
    # Upstream's requiresV110 also counts intelRdt.schemata/enableMonitoring, which
    # docs/design.md#cdi notes as well; upstream's code wins over any summary.
    for e in _all_edits(spec):
        rdt = e.get("intelRdt") or {}
        if e.get("netDevices") or rdt.get("schemata") is not None or rdt.get("enableMonitoring"):
            return True
    return False


_VERSION_RULES: Final[tuple[tuple[str, Callable[[Mapping[str, Any]], bool]], ...]] = (
    ("1.1.0", _needs_net_devices_or_rdt_monitoring),
    ("0.7.0", _needs_rdt_or_gids),
    ("0.6.0", _needs_annotations_or_dotted_class),
    ("0.5.0", _needs_host_path_or_digit_name),
    ("0.4.0", _needs_mount_type),
)
BASE_CDI_VERSION: Final = "0.3.0"


def required_cdi_version(spec: Mapping[str, Any]) -> str:
    """The lowest ``cdiVersion`` that allows everything ``spec`` uses."""
    for version, needed in _VERSION_RULES:
        if needed(spec):
            return version
    return BASE_CDI_VERSION


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


# --- validation ----------------------------------------------------------------------


def validate_spec(spec: Mapping[str, Any]) -> None:
    """Raise ``CdiSpecError`` for anything a runtime's CDI library would reject.

    Covers what the official JSON Schema cannot (its env rule is broken) and the
    runtime's own checks: names, env, device nodes, duplicates, the version.
    """
    _check_keys(spec, _SPEC_KEYS, where="spec")
    _validate_kind(spec.get("kind"))
    devices = spec.get("devices")
    if not isinstance(devices, list) or not devices:
        raise CdiSpecError("devices: must be a non-empty list")
    seen: set[str] = set()
    for index, device in enumerate(devices):
        _validate_device(device, where=f"devices[{index}]", seen=seen)
    edits = spec.get("containerEdits") or {}
    if not isinstance(edits, dict):
        raise CdiSpecError("containerEdits: must be an object")
    _validate_edits(edits, where="containerEdits")
    # Last: the version rules read the structure checked above.
    _validate_version(spec)


def _validate_version(spec: Mapping[str, Any]) -> None:
    version = spec.get("cdiVersion")
    if version not in _KNOWN_VERSIONS:
        raise CdiSpecError(f"cdiVersion: {version!r} is not one of {', '.join(_KNOWN_VERSIONS)}")
    needed = required_cdi_version(spec)
    if _version_key(version) < _version_key(needed):
        raise CdiSpecError(f"cdiVersion: {version} is too old, the content needs {needed}")


def _validate_kind(kind: object) -> None:
    if not isinstance(kind, str) or "/" not in kind:
        raise CdiSpecError(f"kind: {kind!r} is not vendor/class")
    vendor, _, cls = kind.partition("/")
    for part, label in ((vendor, "vendor"), (cls, "class")):
        if not _VENDOR_OR_CLASS.fullmatch(part):
            raise CdiSpecError(
                f"kind: {label} {part!r} must start with a letter, end with a letter or "
                "digit and contain only letters, digits, '_', '.', '-'"
            )


def _validate_device(device: object, *, where: str, seen: set[str]) -> None:
    if not isinstance(device, dict):
        raise CdiSpecError(f"{where}: must be an object")
    _check_keys(device, _DEVICE_KEYS, where=where)
    name = device.get("name")
    if not isinstance(name, str) or not DEVICE_NAME.fullmatch(name):
        raise CdiSpecError(
            f"{where}.name: {name!r} must start and end with a letter or digit and "
            "contain only letters, digits, '_', '.', ':', '-'"
        )
    if name in seen:
        raise CdiSpecError(f"{where}.name: duplicate device name {name!r}")
    seen.add(name)
    edits = device.get("containerEdits")
    if not isinstance(edits, dict) or not any(edits.values()):
        raise CdiSpecError(f"{where}.containerEdits: a device needs at least one edit")
    _validate_edits(edits, where=f"{where}.containerEdits")


def _check_keys(obj: Mapping[str, Any], allowed: frozenset[str], *, where: str) -> None:
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise CdiSpecError(f"{where}.{unknown[0]}: unknown field")


def _validate_edits(edits: Mapping[str, Any], *, where: str) -> None:
    _check_keys(edits, _EDITS_KEYS, where=where)
    names: set[str] = set()
    for index, entry in enumerate(_list_field(edits, "env", where=where)):
        _validate_env(entry, where=f"{where}.env[{index}]", names=names)
    for index, node in enumerate(_list_field(edits, "deviceNodes", where=where)):
        _validate_device_node(node, where=f"{where}.deviceNodes[{index}]")
    for index, mount in enumerate(_list_field(edits, "mounts", where=where)):
        _validate_mount(mount, where=f"{where}.mounts[{index}]")
    for index, hook in enumerate(_list_field(edits, "hooks", where=where)):
        _validate_hook(hook, where=f"{where}.hooks[{index}]")


def _list_field(edits: Mapping[str, Any], key: str, *, where: str) -> list[Any]:
    value = edits.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise CdiSpecError(f"{where}.{key}: must be a list")
    return value


def _validate_env(entry: object, *, where: str, names: set[str]) -> None:
    if not isinstance(entry, str) or "=" not in entry:
        raise CdiSpecError(f"{where}: {entry!r} is not NAME=value")
    name, _, value = entry.partition("=")
    if not _ENV_NAME.fullmatch(name):
        raise CdiSpecError(f"{where}: name {name!r} must match [A-Za-z_][A-Za-z0-9_]*")
    if "\0" in value:
        raise CdiSpecError(f"{where}: value of {name} contains a NUL byte")
    if name in names:
        raise CdiSpecError(f"{where}: {name} is set twice")
    names.add(name)


def _validate_device_node(node: object, *, where: str) -> None:
    if not isinstance(node, dict):
        raise CdiSpecError(f"{where}: must be an object")
    _check_keys(node, _NODE_KEYS, where=where)
    for key in ("path", "hostPath"):
        value = node.get(key)
        if (key == "path" or value is not None) and not (
            isinstance(value, str) and value.startswith("/")
        ):
            raise CdiSpecError(f"{where}.{key}: {value!r} is not an absolute path")
    node_type = node.get("type")
    if node_type is not None and node_type not in _DEVICE_NODE_TYPES:
        raise CdiSpecError(f"{where}.type: {node_type!r} is not one of b, c, u, p")
    permissions = node.get("permissions")
    if permissions is not None and not (
        isinstance(permissions, str) and set(permissions) <= set("rwm")
    ):
        raise CdiSpecError(f"{where}.permissions: {permissions!r} is not a subset of rwm")


def _validate_mount(mount: object, *, where: str) -> None:
    if not isinstance(mount, dict):
        raise CdiSpecError(f"{where}: must be an object")
    _check_keys(mount, _MOUNT_KEYS, where=where)
    for key in ("hostPath", "containerPath"):
        if not isinstance(mount.get(key), str) or not mount[key]:
            raise CdiSpecError(f"{where}.{key}: required")


def _validate_hook(hook: object, *, where: str) -> None:
    if not isinstance(hook, dict):
        raise CdiSpecError(f"{where}: must be an object")
    _check_keys(hook, _HOOK_KEYS, where=where)
    if hook.get("hookName") not in HOOK_NAMES:
        raise CdiSpecError(
            f"{where}.hookName: {hook.get('hookName')!r} is not one of {', '.join(HOOK_NAMES)}"
        )
    path = hook.get("path")
    if not (isinstance(path, str) and path.startswith("/")):
        raise CdiSpecError(f"{where}.path: {path!r} is not an absolute path")
    for key in ("args", "env"):
        value = hook.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise CdiSpecError(f"{where}.{key}: must be a list of strings")
    names: set[str] = set()
    for index, entry in enumerate(hook.get("env", [])):
        _validate_env(entry, where=f"{where}.env[{index}]", names=names)
    timeout = hook.get("timeout")
    if timeout is not None and not (isinstance(timeout, int) and timeout > 0):
        raise CdiSpecError(f"{where}.timeout: {timeout!r} is not a positive integer")


# --- encoding ------------------------------------------------------------------------


def encode_spec(spec: Mapping[str, Any]) -> bytes:
    """Deterministic bytes: sorted keys, compact, ASCII, trailing newline.

    Compact because only then does ``json`` use its C encoder: a spec with the
    driver's files is ~10 KB, and the indented form took 0.6 ms of each prepare.
    ``jq . <file>`` shows it indented.
    """
    text = json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return (text + "\n").encode("ascii")

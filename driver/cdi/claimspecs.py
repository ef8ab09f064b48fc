"""Per-claim transient CDI specs: build, validate, write, read, delete, list, and
give the written ones the node's new spec-wide edits.

One spec file per prepared claim, ``<cdi_root>/k8s.<driver>-claim_<claimUID>.json``,
kind ``k8s.<driver>/claim``, one CDI device per allocated device named
``<claimUID>-<deviceName>``. The container runtime reads the file when kubelet hands
it the fully-qualified IDs (``k8s.gpu.drasil.dev/claim=<uid>-gpu-0``) from prepare.

A container gets the union of the CDI devices of every claim and request it names,
and a runtime keeps one value per variable. So every edit belongs to one device and
sets only variables named after that device (``DRASIL_DEVICE_GPU_0``,
``DRASIL_DEVICE_GPU_0_SHARING_STRATEGY``); the spec-wide edits are the node's common
ones, identical in every spec; and the claim's identity, which a lost checkpoint is
rebuilt from, is in the spec's annotations, which no container sees
(docs/kubelet-plugin.md, "What a container sees"). Beside the devices, one CDI device
per request, ``<claimUID>_<request>``, only bind-mounts that request's KEP-5304
metadata file (``drasil.driver.cdi.metadata``).

Specs are validated (``drasil.driver.cdi.spec``) before they are written. Crash points
(see ``drasil.driver.files``): ``cdi-mid-write``, ``cdi-before-rename``,
``cdi-after-rename``, ``cdi-before-remove``.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from drasil.driver.cdi.metadata import MetadataMount, metadata_cdi_name
from drasil.driver.cdi.spec import (
    DEVICE_NAME,
    ENV_DEVICE_PREFIX,
    SPEC_FILE_MODE,
    CdiSpec,
    CdiSpecError,
    ContainerEdits,
    common_edits_dict,
    device_env_name,
    device_nodes_of,
    edits_dict,
    encode_spec,
    required_cdi_version,
    validate_spec,
)
from drasil.driver.devices import Device
from drasil.driver.files import (
    NotRegularFile,
    move_aside,
    read_regular,
    remove_file,
    sweep_temp_files,
    write_atomic,
)

log = logging.getLogger(__name__)

CLAIM_CLASS: Final = "claim"
ANNOTATION_PREFIX: Final = "drasil.dev/"
ANNOTATION_CLAIM_UID: Final = ANNOTATION_PREFIX + "claim-uid"
ANNOTATION_CLAIM_NAMESPACE: Final = ANNOTATION_PREFIX + "claim-namespace"
ANNOTATION_CLAIM_NAME: Final = ANNOTATION_PREFIX + "claim-name"
# Where specs written before 0.2 kept the claim's identity (read for an upgrade only).
_LEGACY_IDENTITY_ENV: Final = ("DRASIL_CLAIM_UID", "DRASIL_CLAIM_NAMESPACE", "DRASIL_CLAIM_NAME")
_CRASH_TAG: Final = "cdi"


@dataclass(frozen=True)
class ClaimDevice:
    """One allocated device and its own settings, as ``<SETTING>: value``.

    Each setting becomes ``DRASIL_DEVICE_<NAME>_<SETTING>=value`` on this device's
    edits only (``SHARING_STRATEGY``, ``ADMIN_ACCESS``, …).
    """

    device: Device
    settings: Mapping[str, str] = field(default_factory=dict)
    # A share of a consumable GPU: its CDI device is named after the share too, and
    # carries the share's MPS edits (limits, the GPU's MPS pipe and log mounts).
    share_id: str | None = None
    edits: ContainerEdits = field(default_factory=ContainerEdits)


@dataclass(frozen=True)
class ClaimIdentity:
    """Whose spec this is: the claim it was written for."""

    uid: str
    namespace: str
    name: str


@dataclass(frozen=True)
class ClaimSpecRequest:
    """What the spec of one claim is built from."""

    claim_uid: str
    namespace: str
    name: str
    devices: tuple[ClaimDevice, ...]
    common_edits: ContainerEdits = field(default_factory=ContainerEdits)
    # KEP-5304: one CDI device per request, mounting only its metadata file.
    metadata: tuple[MetadataMount, ...] = ()


# --- names -------------------------------------------------------------------------


def claim_kind(driver: str) -> str:
    """``k8s.<driver>/claim``: the vendor is derived from the driver name."""
    return f"k8s.{driver}/{CLAIM_CLASS}"


SHARE_MARK: Final = "-share-"


def cdi_device_name(claim_uid: str, device_name: str, share_id: str | None = None) -> str:
    """The CDI device name of one device (or share of a device) of a claim, unique
    across claims: ``<claimUID>-<device>``, ``<claimUID>-<device>-share-<shareID>``."""
    share = f"{SHARE_MARK}{share_id}" if share_id else ""
    return f"{claim_uid}-{device_name}{share}"


def device_of_cdi_name(claim_uid: str, cdi_name: str) -> str:
    """The device name inside a CDI device name of the claim (share suffix dropped)."""
    return cdi_name.removeprefix(f"{claim_uid}-").partition(SHARE_MARK)[0]


def cdi_device_id(
    *, driver: str, claim_uid: str, device_name: str, share_id: str | None = None
) -> str:
    """The fully-qualified ID kubelet passes to the runtime: ``vendor/class=name``."""
    return f"{claim_kind(driver)}={cdi_device_name(claim_uid, device_name, share_id)}"


def metadata_cdi_device_id(*, driver: str, claim_uid: str, request: str) -> str:
    """The fully-qualified ID of a request's metadata mount (KEP-5304)."""
    return f"{claim_kind(driver)}={metadata_cdi_name(claim_uid, request)}"


def claim_cdi_device_ids(req: ClaimSpecRequest, *, driver: str) -> dict[str, str]:
    """Fully-qualified CDI ID per device name, in the request's device order."""
    return {
        d.device.name: cdi_device_id(
            driver=driver, claim_uid=req.claim_uid, device_name=d.device.name, share_id=d.share_id
        )
        for d in req.devices
    }


def _spec_file_prefix(driver: str) -> str:
    # The CDI spec (docs/design.md#cdi): transient spec files are named <vendor>-<class>_<id>.
    vendor, cls = claim_kind(driver).split("/")
    return f"{vendor}-{cls}_"


def spec_path(cdi_root: Path, *, driver: str, claim_uid: str) -> Path:
    """``<cdi_root>/k8s.<driver>-claim_<claimUID>.json``."""
    # CDI maps a "/" in the id to "_" (docs/design.md#cdi); a claim UID never has one (checked).
    _check_claim_uid(claim_uid)
    return cdi_root / f"{_spec_file_prefix(driver)}{claim_uid}.json"


# A Kubernetes UID is a UUID, 36 characters; kubelet passes the claim's. Anything much
# longer is not one, and would not fit a file name (255 bytes) with the spec's prefix.
MAX_CLAIM_UID: Final = 128


def _check_claim_uid(claim_uid: str) -> None:
    # The UID becomes part of a file name and of device names; refuse anything that
    # could escape the directory, make an invalid device name or a name too long.
    if len(claim_uid) > MAX_CLAIM_UID:
        raise CdiSpecError(
            f"claimUID: {len(claim_uid)} characters ({claim_uid[:16]!r}…); a Kubernetes "
            f"UID has 36, at most {MAX_CLAIM_UID} are accepted"
        )
    if not DEVICE_NAME.fullmatch(claim_uid):
        raise CdiSpecError(f"claimUID: {claim_uid!r} is not a valid CDI name part")


# --- building ----------------------------------------------------------------------


def build_claim_spec(req: ClaimSpecRequest, *, driver: str) -> CdiSpec:
    """The validated spec of one claim, with the lowest ``cdiVersion`` it needs."""
    if not req.devices:
        raise CdiSpecError(f"devices: claim {req.namespace}/{req.name} has no device")
    _check_claim_uid(req.claim_uid)
    # Env is per container, and a container may get devices of several claims: no
    # variable here may take another value in another spec (module docstring).
    common = req.common_edits
    for name in common.env:
        if name.startswith(ENV_DEVICE_PREFIX):
            raise CdiSpecError(f"containerEdits.env: {name} is set per device by drasil")
    spec: CdiSpec = {
        "kind": claim_kind(driver),
        "annotations": {
            ANNOTATION_CLAIM_UID: req.claim_uid,
            ANNOTATION_CLAIM_NAMESPACE: req.namespace,
            ANNOTATION_CLAIM_NAME: req.name,
        },
        "devices": [
            *(_device_entry(req.claim_uid, d, index=i) for i, d in enumerate(req.devices)),
            *(_metadata_entry(m) for m in req.metadata),
        ],
        "containerEdits": common_edits_dict(common),
    }
    spec["cdiVersion"] = required_cdi_version(spec)
    try:
        validate_spec(spec)
    except CdiSpecError as err:
        raise CdiSpecError(f"{err} (claim {req.namespace}/{req.name})") from err
    return spec


def device_env(claim_device: ClaimDevice) -> dict[str, str]:
    """The variables of one device: its UUID and its settings, all named after it."""
    base = device_env_name(claim_device.device.name)
    env = {base: claim_device.device.uuid}
    for setting, value in claim_device.settings.items():
        env[f"{base}_{setting}"] = value
    return env


def _device_entry(claim_uid: str, claim_device: ClaimDevice, *, index: int) -> CdiSpec:
    device = claim_device.device
    extra = claim_device.edits
    env = {**extra.env, **device_env(claim_device)}
    nodes = device_nodes_of(device) + extra.device_nodes
    return {
        "name": cdi_device_name(claim_uid, device.name, claim_device.share_id),
        "containerEdits": edits_dict(env, nodes, extra.mounts),
    }


def _metadata_entry(metadata: MetadataMount) -> CdiSpec:
    # Only a mount at a path named after one claim and request: nothing another
    # spec could set differently in the same container.
    return {"name": metadata.cdi_name, "containerEdits": edits_dict({}, (), (metadata.mount,))}


def write_claim_spec(req: ClaimSpecRequest, *, cdi_root: Path, driver: str) -> Path:
    """Build, validate and atomically write the claim's spec; returns its path.

    A repeated prepare produces the same bytes; then the file is left alone, which
    keeps the repeat cheap (no fsync) and the runtime's file watch quiet.
    """
    data = encode_spec(build_claim_spec(req, driver=driver))
    path = spec_path(cdi_root, driver=driver, claim_uid=req.claim_uid)
    try:
        if read_regular(path) == data:
            return path
    # Something else under the spec's name (a FIFO would hang a plain read) is
    # replaced by the rename like an old spec; a directory, which a rename cannot
    # replace, is moved aside first, or every prepare of the claim would fail.
    except NotRegularFile:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            moved = move_aside(path)
            log.warning("a directory had a claim spec's name", extra={"moved_to": str(moved)})
    except FileNotFoundError:
        pass
    # /var/run/cdi is tmpfs: a power loss wipes it whatever we fsync, and a process
    # crash keeps the page cache. The rename alone gives what runtimes need: they
    # never see a partial spec.
    write_atomic(path, data, mode=SPEC_FILE_MODE, crash_tag=_CRASH_TAG, durable=False)
    return path


def rewrite_common_edits(
    cdi_root: Path, *, driver: str, claim_uid: str, edits: ContainerEdits
) -> bool:
    """Give a written claim spec the node's spec-wide edits of now; True when the
    file changed.

    Its devices stay as they are: only the driver's files and hooks, which every spec
    of the node shares, are replaced (a driver upgraded under running Pods: kubelet
    does not prepare again when a container restarts, so the spec it reads then must
    name files that exist). A missing spec, and one without spec-wide edits (a claim
    of no NVIDIA device), are left alone.
    """
    spec = read_claim_spec(cdi_root, driver=driver, claim_uid=claim_uid)
    if spec is None or not spec.get("containerEdits"):
        return False
    wanted = common_edits_dict(edits)
    if spec["containerEdits"] == wanted:
        return False
    spec = {**spec, "containerEdits": wanted}
    spec["cdiVersion"] = required_cdi_version(spec)
    validate_spec(spec)
    path = spec_path(cdi_root, driver=driver, claim_uid=claim_uid)
    write_atomic(path, encode_spec(spec), mode=SPEC_FILE_MODE, crash_tag=_CRASH_TAG, durable=False)
    return True


def read_claim_spec(cdi_root: Path, *, driver: str, claim_uid: str) -> CdiSpec | None:
    """The claim's spec as written, or ``None`` when there is none.

    ``CdiSpecError`` when it cannot be read as a spec: not JSON, or not a regular file
    (a directory, a FIFO, which a plain read would wait on forever, or a symlink,
    which is not followed out of the CDI dir).
    """
    path = spec_path(cdi_root, driver=driver, claim_uid=claim_uid)
    try:
        data = read_regular(path)
    except FileNotFoundError:
        return None
    except NotRegularFile as err:
        raise CdiSpecError(f"{path}: {err}") from err
    try:
        spec = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CdiSpecError(f"{path}: not JSON: {err}") from err
    if not isinstance(spec, dict):
        raise CdiSpecError(f"{path}: not a JSON object")
    return spec


def claim_identity(spec: Mapping[str, object]) -> ClaimIdentity | None:
    """The claim a spec was written for (annotations; a pre-0.2 spec: its env)."""
    annotations = spec.get("annotations")
    if isinstance(annotations, Mapping) and ANNOTATION_CLAIM_UID in annotations:
        values = [annotations.get(k) for k in _IDENTITY_ANNOTATIONS]
    else:
        env = _spec_env(spec)
        values = [env.get(k) for k in _LEGACY_IDENTITY_ENV]
    if not all(isinstance(v, str) for v in values):
        return None
    uid, namespace, name = (str(v) for v in values)
    return ClaimIdentity(uid=uid, namespace=namespace, name=name)


_IDENTITY_ANNOTATIONS: Final = (
    ANNOTATION_CLAIM_UID,
    ANNOTATION_CLAIM_NAMESPACE,
    ANNOTATION_CLAIM_NAME,
)


def _spec_env(spec: Mapping[str, object]) -> dict[str, str]:
    edits = spec.get("containerEdits")
    items = edits.get("env", []) if isinstance(edits, Mapping) else []
    pairs = (str(item).partition("=") for item in items or [])
    return {name: value for name, eq, value in pairs if eq}


def delete_claim_spec(cdi_root: Path, *, driver: str, claim_uid: str) -> bool:
    """Remove the claim's spec durably; returns whether one existed (idempotent)."""
    path = spec_path(cdi_root, driver=driver, claim_uid=claim_uid)
    return remove_file(path, crash_tag=_CRASH_TAG, durable=False)


def sweep_claim_spec_temps(
    cdi_root: Path, driver: str, *, claim_uid: str | None = None, older_than: float | None = None
) -> list[Path]:
    """Remove temp files of spec writes that crashed (see ``sweep_temp_files``).

    With ``claim_uid``, only that claim's: safe while holding the claim's lock.
    """
    prefix = _spec_file_prefix(driver)
    if claim_uid is not None:
        prefix = spec_path(cdi_root, driver=driver, claim_uid=claim_uid).name + "."
    return sweep_temp_files(cdi_root, prefix=prefix, older_than=older_than)


def list_claim_specs(cdi_root: Path, driver: str) -> list[str]:
    """Sorted UIDs of the claims with a spec of this driver in ``cdi_root``."""
    prefix = _spec_file_prefix(driver)
    try:
        entries = list(os.scandir(cdi_root))
    except FileNotFoundError:
        return []
    uids = [
        entry.name[len(prefix) : -len(".json")]
        for entry in entries
        if entry.name.startswith(prefix) and entry.name.endswith(".json") and entry.is_file()
    ]
    return sorted(uid for uid in uids if uid)

"""Device metadata for workloads (KEP-5304): a JSON file per request, bind-mounted by CDI.

KEP-5304 (beta in Kubernetes 1.37; its reference code is
``k8s.io/dynamic-resource-allocation/api/metadata`` and the kubelet plugin helper's
``metadata.go``) defines where a container finds the devices of its claims described,
and in which format. kubelet and the DRA gRPC API take no part: the driver writes the
files and mounts them with CDI.

- in the container, read-only, one file per claim, request and driver:
  ``/var/run/kubernetes.io/dra-device-attributes/resourceclaims/<claim>/<request>/<driver>-metadata.json``,
  or ``resourceclaimtemplates/<pod claim name>/…`` for a claim made from a template
  (its ``resource.kubernetes.io/pod-claim-name`` annotation), because the generated
  claim name is unknown when the Pod spec is written;
- the file is a stream of JSON objects, the same ``DeviceMetadata`` once per API
  version, newest first (``metadata.resource.k8s.io/v1beta1``, then ``v1alpha1``), so
  a reader takes the first version it knows: ``metadata`` (claim name, namespace,
  UID, generation 1), ``podClaimName``, and one request with its devices (``driver``,
  ``pool``, ``name``, ``attributes`` as in a ResourceSlice, at most 32).

On the host the files live in the plugin's state dir,
``<state dir>/dra-device-metadata/<claimUID>/<request>.json``: keyed by UID, so a claim
re-created under the same name while the old one is still prepared never shares a
file with it. The mount is its own CDI device ``<claimUID>_<request>`` in the claim's
spec (``drasil.driver.cdi.claimspecs``); ``_`` never occurs in a UID or a device name,
so it cannot collide with a device's CDI name. Its container path is named after one
claim (or pod claim) and one request, which a container names only once, so no two
specs can mount different files there (docs/kubelet-plugin.md, "What a container sees").

Crash points: ``metadata-mid-write``, ``metadata-before-rename``,
``metadata-after-rename``, ``metadata-before-remove``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from drasil.driver.cdi.spec import DEVICE_NAME, CdiSpecError, Mount
from drasil.driver.devices import AttributeValue, attribute_json
from drasil.driver.files import (
    NotRegularFile,
    crash_point,
    read_regular,
    sweep_temp_files,
    write_atomic,
)

METADATA_DIR: Final = "dra-device-metadata"
CONTAINER_DIR: Final = "/var/run/kubernetes.io/dra-device-attributes"
CLAIMS_SUBDIR: Final = "resourceclaims"
TEMPLATES_SUBDIR: Final = "resourceclaimtemplates"
FILE_SUFFIX: Final = "-metadata.json"
API_GROUP: Final = "metadata.resource.k8s.io"
# Newest first: a reader takes the first object whose apiVersion it knows (KubeVirt
# 1.9 knows only v1alpha1; the schema of both is the same).
API_VERSIONS: Final = ("v1beta1", "v1alpha1")
KIND: Final = "DeviceMetadata"
POD_CLAIM_NAME_ANNOTATION: Final = "resource.kubernetes.io/pod-claim-name"
MAX_ATTRIBUTES: Final = 32  # the schema's limit, as a ResourceSlice's
FILE_MODE: Final = 0o644  # read by any container user; it holds nothing secret
MOUNT_OPTIONS: Final = ("ro", "bind")
_CRASH_TAG: Final = "metadata"

# Path segments come from the API (names are validated there) but are re-checked
# here: a segment must never climb out of its directory.
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


@dataclass(frozen=True)
class MetadataDevice:
    """One device of a request as its metadata describes it."""

    pool: str
    name: str
    attributes: Mapping[str, AttributeValue]


@dataclass(frozen=True)
class RequestMetadata:
    """The devices of one request; ``request`` as in the allocation (``gpu/full``)."""

    request: str
    devices: tuple[MetadataDevice, ...]

    @property
    def base_request(self) -> str:
        return self.request.partition("/")[0]


@dataclass(frozen=True)
class ClaimMetadata:
    """What a claim's metadata files say, one file per request."""

    claim_uid: str
    namespace: str
    name: str
    pod_claim_name: str | None
    requests: tuple[RequestMetadata, ...]


@dataclass(frozen=True)
class MetadataMount:
    """The CDI device that bind-mounts one request's file into a container."""

    cdi_name: str
    mount: Mount


# --- names and paths -----------------------------------------------------------------


def metadata_cdi_name(claim_uid: str, request: str) -> str:
    """``<claimUID>_<request>``: the CDI device of a request's metadata file."""
    return f"{claim_uid}_{request}"


def is_metadata_cdi_name(cdi_name: str) -> bool:
    """Whether a CDI device name of a claim spec is a metadata mount, not a device."""
    return "_" in cdi_name


def _segment(value: str, pattern: re.Pattern[str], what: str) -> str:
    if not pattern.fullmatch(value):
        raise CdiSpecError(f"device metadata: {what} {value!r} cannot name a directory")
    return value


def claim_dir(root: Path, claim_uid: str) -> Path:
    """``<root>/<claimUID>``: everything one claim's metadata takes on the host."""
    return root / _segment(claim_uid, DEVICE_NAME, "claim UID")


def host_path(root: Path, claim_uid: str, request: str) -> Path:
    return claim_dir(root, claim_uid) / f"{_segment(request, _DNS_LABEL, 'request')}.json"


def container_path(claim: ClaimMetadata, request: str, *, driver: str) -> str:
    """Where the container finds a request's file (KEP-5304's fixed layout)."""
    if claim.pod_claim_name:
        parent = f"{TEMPLATES_SUBDIR}/{_segment(claim.pod_claim_name, _DNS_LABEL, 'pod claim')}"
    else:
        parent = f"{CLAIMS_SUBDIR}/{_segment(claim.name, _DNS_SUBDOMAIN, 'claim')}"
    leaf = (
        f"{_segment(request, _DNS_LABEL, 'request')}/{_segment(driver, _DNS_SUBDOMAIN, 'driver')}"
    )
    return f"{CONTAINER_DIR}/{parent}/{leaf}{FILE_SUFFIX}"


def metadata_mounts(claim: ClaimMetadata, *, driver: str, root: Path) -> tuple[MetadataMount, ...]:
    """The CDI mount of each request's file (validates every path segment)."""
    return tuple(
        MetadataMount(
            cdi_name=metadata_cdi_name(claim.claim_uid, r.base_request),
            mount=Mount(
                host_path=str(host_path(root, claim.claim_uid, r.base_request)),
                container_path=container_path(claim, r.base_request, driver=driver),
                options=MOUNT_OPTIONS,
            ),
        )
        for r in claim.requests
    )


# --- the document --------------------------------------------------------------------


def _device_json(device: MetadataDevice, *, driver: str) -> dict[str, Any]:
    if len(device.attributes) > MAX_ATTRIBUTES:
        raise CdiSpecError(
            f"device metadata: device {device.name} has {len(device.attributes)} attributes, "
            f"at most {MAX_ATTRIBUTES} fit"
        )
    return {
        "driver": driver,
        "pool": device.pool,
        "name": device.name,
        "attributes": {k: attribute_json(device.attributes[k]) for k in sorted(device.attributes)},
    }


def metadata_document(
    claim: ClaimMetadata, request: RequestMetadata, *, driver: str, version: str
) -> dict[str, Any]:
    """One request's ``DeviceMetadata`` in one API version."""
    doc: dict[str, Any] = {
        "apiVersion": f"{API_GROUP}/{version}",
        "kind": KIND,
        "metadata": {
            "name": claim.name,
            "namespace": claim.namespace,
            "uid": claim.claim_uid,
            # Written once at prepare and never updated: GPU metadata is known then.
            "generation": 1,
        },
        "requests": [
            {
                "name": request.request,
                "devices": [_device_json(d, driver=driver) for d in request.devices],
            }
        ],
    }
    if claim.pod_claim_name:
        doc["podClaimName"] = claim.pod_claim_name
    return doc


def encode_metadata(claim: ClaimMetadata, request: RequestMetadata, *, driver: str) -> bytes:
    """The file's bytes: one object per API version, newest first, one per line."""
    docs = (metadata_document(claim, request, driver=driver, version=v) for v in API_VERSIONS)
    lines = (json.dumps(doc, sort_keys=True, ensure_ascii=True) for doc in docs)
    return "".join(f"{line}\n" for line in lines).encode("ascii")


# --- files ---------------------------------------------------------------------------


def write_claim_metadata(claim: ClaimMetadata, *, driver: str, root: Path) -> None:
    """Write each request's file atomically; an unchanged file is left alone.

    Not fsynced, like the CDI spec: a crash keeps the page cache, and a power loss
    means a reboot, after which kubelet prepares the claim again. Call it under the
    claim's lock: temp files a crashed write left in the claim's directory are swept.
    """
    directory = claim_dir(root, claim.claim_uid)
    try:
        directory.mkdir(parents=True)
        new = True  # the common case: nothing to sweep or compare with
    except FileExistsError:
        new = False
        sweep_temp_files(directory, prefix="")
    for request in claim.requests:
        path = host_path(root, claim.claim_uid, request.base_request)
        data = encode_metadata(claim, request, driver=driver)
        if not new and _holds(path, data):
            continue
        write_atomic(path, data, mode=FILE_MODE, crash_tag=_CRASH_TAG, durable=False)


def _holds(path: Path, data: bytes) -> bool:
    """Whether ``path`` already holds ``data``; anything else there (a FIFO, a link, a
    directory: ``NotRegularFile``) is replaced, never opened blocking or followed."""
    try:
        return read_regular(path) == data
    except (FileNotFoundError, NotRegularFile):
        return False


def delete_claim_metadata(root: Path, claim_uid: str) -> bool:
    """Remove the claim's files (temp files of a crashed write too); idempotent."""
    directory = claim_dir(root, claim_uid)
    crash_point(f"{_CRASH_TAG}-before-remove")
    try:
        shutil.rmtree(directory)
    except FileNotFoundError:
        return False
    return True


def list_claim_metadata(root: Path) -> list[str]:
    """Sorted UIDs of the claims with metadata under ``root``."""
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    return sorted(e.name for e in entries if e.is_dir() and DEVICE_NAME.fullmatch(e.name))

"""The claim the check prepares: from a file (YAML or JSON), or one made up for it.

The kubelet plugin reads claims from the API server; the check reads one file
instead, through the same ``ClaimReader`` Protocol of the ``Preparer``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from drasil.driver.claims.plan import ClaimRef
from drasil.driver.objects import ResourceClaim, meta

CLAIM_NAME = "gpu-check"
CLAIM_NAMESPACE = "default"
REQUEST = "gpu"


class ClaimFileError(ValueError):
    """The claim file is not a ResourceClaim with an allocation."""


def make_claim(
    *,
    driver: str,
    pool: str,
    device: str,
    uid: str | None = None,
    consumed: Mapping[str, str] | None = None,
    config: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """An allocated ResourceClaim of one device, as the API server would return it;
    with ``consumed`` (capacity name to quantity), a share of it: a ``shareID`` and the
    ``consumedCapacity`` the scheduler counted; ``config``: the allocation's opaque
    config entries."""
    result: dict[str, Any] = {"request": REQUEST, "driver": driver, "pool": pool, "device": device}
    if consumed is not None:
        result["shareID"] = str(uuid.uuid4())
        result["consumedCapacity"] = dict(consumed)
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": CLAIM_NAME,
            "namespace": CLAIM_NAMESPACE,
            "uid": uid or str(uuid.uuid4()),
        },
        "spec": {
            "devices": {
                "requests": [{"name": REQUEST, "exactly": {"deviceClassName": driver, "count": 1}}]
            }
        },
        "status": {"allocation": {"devices": {"results": [result], "config": list(config)}}},
    }


def read_claim(path: Path) -> dict[str, Any]:
    """A claim file; a missing UID is made up (a file has no API server to give one)."""
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ClaimFileError(f"{path}: not YAML or JSON: {err}") from err
    if not isinstance(data, dict) or data.get("kind", "ResourceClaim") != "ResourceClaim":
        raise ClaimFileError(f"{path}: not a ResourceClaim")
    meta = data.setdefault("metadata", {})
    if not meta.get("name"):
        raise ClaimFileError(f"{path}: metadata.name is missing")
    meta.setdefault("namespace", CLAIM_NAMESPACE)
    meta.setdefault("uid", str(uuid.uuid4()))
    if not ResourceClaim(data).allocated:
        raise ClaimFileError(f"{path}: status.allocation is missing (the check allocates nothing)")
    return data


def write_claim(claim: Mapping[str, Any], path: Path) -> None:
    path.write_text(json.dumps(claim, indent=2) + "\n")


def claim_ref(claim: Mapping[str, Any]) -> ClaimRef:
    m = meta(claim)
    return ClaimRef(namespace=m.namespace, name=m.name, uid=m.uid)


def allocated_devices(claim: Mapping[str, Any], *, driver: str) -> list[str]:
    return [r["device"] for r in ResourceClaim(claim).results(driver)]


class FileClaims:
    """A ``ClaimReader`` answering the one claim of the check."""

    def __init__(self, claim: Mapping[str, Any]) -> None:
        self.claim = claim

    def get_claim(
        self, namespace: str, name: str, *, cached: bool = False
    ) -> Mapping[str, Any] | None:
        m = meta(self.claim)
        if (m.namespace, m.name) == (namespace, name):
            return self.claim
        return None

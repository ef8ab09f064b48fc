"""DRA works end to end in the control plane, before drasil publishes anything:
a hand-written ResourceSlice, a DeviceClass, and Pods with ResourceClaimTemplates."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from e2e.harness.kube import RESOURCE, Kube, NotYet, gone, pending_pod, wait_for

DRIVER = "smoke.example.com"
NODE = "e2e-node-1"
DEVICES = ("gpu-0", "gpu-1")


@pytest.fixture
def device_class(kube: Kube) -> Iterator[str]:
    name = DRIVER
    kube.delete(RESOURCE, "DeviceClass", name)  # a leftover of an interrupted run
    kube.create(
        {
            "apiVersion": RESOURCE,
            "kind": "DeviceClass",
            "metadata": {"name": name},
            "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
        }
    )
    yield name
    kube.delete(RESOURCE, "DeviceClass", name)


@pytest.fixture
def node_with_devices(
    kube: Kube, make_node: Callable[..., dict[str, Any]]
) -> Iterator[dict[str, Any]]:
    """Node e2e-node-1 and a ResourceSlice with two devices on it, owned by the Node
    (so the garbage collector would remove it with the Node, too)."""
    node = make_node(NODE)
    slice_name = f"{NODE}-{DRIVER}"
    kube.create(
        {
            "apiVersion": RESOURCE,
            "kind": "ResourceSlice",
            "metadata": {
                "name": slice_name,
                "ownerReferences": [
                    {
                        "apiVersion": "v1",
                        "kind": "Node",
                        "name": NODE,
                        "uid": node["metadata"]["uid"],
                        "controller": True,
                    }
                ],
            },
            "spec": {
                "driver": DRIVER,
                "nodeName": NODE,
                "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1},
                "devices": [
                    {
                        "name": dev,
                        "attributes": {
                            "model": {"string": "smoke-a"},
                            "index": {"int": i},
                        },
                        "capacity": {"memory": {"value": "16Gi"}},
                    }
                    for i, dev in enumerate(DEVICES)
                ],
            },
        }
    )
    yield node
    # Gone before the next test makes a slice of the same name (GC would be late).
    kube.delete(RESOURCE, "ResourceSlice", slice_name)
    wait_for(
        lambda: gone(kube, RESOURCE, "ResourceSlice", slice_name),
        timeout=30,
        what=f"ResourceSlice {slice_name} to be deleted",
    )


def _claim_template(name: str, selector: str) -> dict[str, Any]:
    return {
        "apiVersion": RESOURCE,
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "gpu",
                            "exactly": {
                                "deviceClassName": DRIVER,
                                "selectors": [{"cel": {"expression": selector}}],
                            },
                        }
                    ]
                }
            }
        },
    }


def _claim_of(kube: Kube, namespace: str, pod_name: str) -> Any:
    """The ResourceClaim the controller made from the pod's template, once it exists."""
    pod = kube.get("v1", "Pod", pod_name, namespace)
    statuses = pod.get("status", {}).get("resourceClaimStatuses") or []
    names = [s.get("resourceClaimName") for s in statuses if s.get("name") == "gpu"]
    if not names or not names[0]:
        return NotYet({"pod.status": pod.get("status")})
    return kube.get(RESOURCE, "ResourceClaim", names[0], namespace)


def test_claim_from_template_is_allocated_reserved_and_pod_bound(
    kube: Kube, namespace: str, device_class: str, node_with_devices: dict[str, Any]
) -> None:
    kube.create(
        _claim_template("smoke-gpu", f'device.attributes["{DRIVER}"].model == "smoke-a"'),
        namespace,
    )
    pod = kube.create(pending_pod("smoke", template="smoke-gpu"), namespace)

    claim = wait_for(
        lambda: _claim_of(kube, namespace, "smoke"),
        timeout=60,
        what="the resourceclaim controller to create the pod's claim from its template",
    )
    owners = claim["metadata"].get("ownerReferences") or []
    assert [(o["kind"], o["name"], o["uid"]) for o in owners] == [
        ("Pod", "smoke", pod["metadata"]["uid"])
    ]
    assert claim["metadata"]["annotations"]["resource.kubernetes.io/pod-claim-name"] == "gpu"

    def allocated_and_reserved() -> Any:
        c = _claim_of(kube, namespace, "smoke")
        status = c.get("status") or {}
        if status.get("allocation") and status.get("reservedFor"):
            return c
        return NotYet({"claim.status": status})

    claim = wait_for(
        allocated_and_reserved, timeout=60, what="the scheduler to allocate and reserve the claim"
    )
    results = claim["status"]["allocation"]["devices"]["results"]
    assert len(results) == 1, results
    result = results[0]
    assert result["request"] == "gpu"
    assert result["driver"] == DRIVER
    assert result["pool"] == NODE
    assert result["device"] in DEVICES
    # The allocation pins the claim to the node the devices are on.
    terms = claim["status"]["allocation"]["nodeSelector"]["nodeSelectorTerms"]
    assert json.dumps(terms).count(NODE) == 1, terms
    assert claim["status"]["reservedFor"] == [
        {"resource": "pods", "name": "smoke", "uid": pod["metadata"]["uid"]}
    ]

    def bound() -> Any:
        p = kube.get("v1", "Pod", "smoke", namespace)
        return p if p["spec"].get("nodeName") else NotYet({"pod.status": p.get("status")})

    bound_pod = wait_for(bound, timeout=60, what="the scheduler to bind pod smoke")
    assert bound_pod["spec"]["nodeName"] == NODE


def test_pod_whose_claim_matches_no_device_stays_pending_with_reason(
    kube: Kube, namespace: str, device_class: str, node_with_devices: dict[str, Any]
) -> None:
    kube.create(
        _claim_template("no-such-gpu", f'device.attributes["{DRIVER}"].model == "no-such-model"'),
        namespace,
    )
    kube.create(pending_pod("unmatched", template="no-such-gpu"), namespace)

    def unschedulable() -> Any:
        p = kube.get("v1", "Pod", "unmatched", namespace)
        conditions = p.get("status", {}).get("conditions") or []
        for c in conditions:
            if c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable":
                return c
        return NotYet({"pod.status": p.get("status")})

    condition = wait_for(
        unschedulable, timeout=60, what="the scheduler to report pod unmatched Unschedulable"
    )
    assert condition["status"] == "False"
    assert "cannot allocate all claims" in condition["message"], condition["message"]

    pod = kube.get("v1", "Pod", "unmatched", namespace)
    assert not pod["spec"].get("nodeName")
    assert pod["status"]["phase"] == "Pending"
    claim = _claim_of(kube, namespace, "unmatched")
    assert claim, "the claim is created from the template even if it cannot be allocated"
    assert not (claim.get("status") or {}).get("allocation")


def test_kubectl_reads_resource_v1(
    kubectl: Callable[..., Any],
) -> None:
    out = kubectl("get", "--raw", f"/apis/{RESOURCE}")
    body = json.loads(out.stdout)
    assert body["groupVersion"] == RESOURCE
    names = {r["name"] for r in body["resources"]}
    assert {
        "deviceclasses",
        "devicetaintrules",
        "resourceclaims",
        "resourceclaims/status",
        "resourceclaimtemplates",
        "resourceslices",
    } <= names, names

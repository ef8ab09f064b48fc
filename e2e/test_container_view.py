"""What a container sees on the real node: exactly the devices of the claims and
requests it names, across all its claims, each device with its own settings.

containerd applies the CDI devices kubelet collects for each container (every device
of a claim it lists, or of the one request it names); these tests read the env the
containers print and compare it with the claims' allocations.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from drasil.driver.cdi.metadata import CONTAINER_DIR, FILE_SUFFIX, TEMPLATES_SUBDIR
from e2e.harness import versions
from e2e.harness.cluster.node import Node
from e2e.harness.kube import RESOURCE, Kube, NotYet, wait_for
from e2e.harness.pluginproc import DRIVER
from e2e.harness.pods import (
    COMMAND,
    container_env,
    device_uuid,
    device_variable,
    pod,
    template,
    visible_uuids,
    wait_running,
)

CONFIG_API = "resource.drasil.dev/v1beta1"


def _request(name: str) -> dict[str, Any]:
    return {"name": name, "exactly": {"deviceClassName": DRIVER}}


def _config(request: str, sharing: dict[str, Any]) -> dict[str, Any]:
    parameters = {"apiVersion": CONFIG_API, "kind": "GpuConfig", "sharing": sharing}
    return {"requests": [request], "opaque": {"driver": DRIVER, "parameters": parameters}}


def _claim(kube: Kube, ns: str, requests: list[str], configs: list[dict[str, Any]]) -> str:
    name = f"claim-{secrets.token_hex(3)}"
    devices = {"requests": [_request(r) for r in requests], "config": configs}
    kube.create(
        {
            "apiVersion": RESOURCE,
            "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": {"devices": devices},
        },
        ns,
    )
    return name


def _pod(
    kube: Kube,
    ns: str,
    node: Node,
    *,
    claims: dict[str, dict[str, str]],
    containers: dict[str, list[dict[str, str]]],
    running: bool = True,
) -> str:
    """A Pod with ``claims`` (Pod claim name -> source) and ``containers`` (name -> its
    ``resources.claims`` entries); every container prints its env. Waits until it runs,
    unless ``running`` is False."""
    name = f"pod-{secrets.token_hex(3)}"
    spec = {
        "nodeSelector": {"kubernetes.io/hostname": node.name},
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 5,
        "resourceClaims": [{"name": n, **source} for n, source in claims.items()],
        "containers": [
            {
                "name": c,
                "image": versions.TEST_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["sh", "-c", COMMAND],
                "resources": {"claims": refs},
            }
            for c, refs in containers.items()
        ],
    }
    kube.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}, ns)
    if running:
        wait_running(kube, ns, name)
    return name


def _allocated(kube: Kube, ns: str, claim: str) -> dict[str, str]:
    """Base request name -> allocated device of a claim."""
    obj = kube.get(RESOURCE, "ResourceClaim", claim, ns)
    results = obj["status"]["allocation"]["devices"]["results"]
    return {r["request"].partition("/")[0]: r["device"] for r in results}


def _pod_claim(kube: Kube, ns: str, pod: str, name: str) -> str:
    statuses = kube.get("v1", "Pod", pod, ns)["status"]["resourceClaimStatuses"]
    return str(next(s["resourceClaimName"] for s in statuses if s["name"] == name))


def test_a_container_with_two_claims_sees_both_gpus(kube: Kube, ns: str, node: Node) -> None:
    one_gpu = template(kube, ns)
    claims = {"first": {"resourceClaimTemplateName": one_gpu}}
    claims["second"] = {"resourceClaimTemplateName": one_gpu}
    name = _pod(
        kube, ns, node, claims=claims, containers={"c": [{"name": "first"}, {"name": "second"}]}
    )

    devices = [_allocated(kube, ns, _pod_claim(kube, ns, name, c))["gpu"] for c in claims]
    env = container_env(kube, ns, name)

    assert len(set(devices)) == 2
    assert visible_uuids(env) == sorted(device_uuid(kube, node, d) for d in devices)
    for device in devices:
        assert env[device_variable(device)] == device_uuid(kube, node, device)


def test_a_container_naming_one_request_sees_only_its_devices(
    kube: Kube, ns: str, node: Node
) -> None:
    claim = _claim(kube, ns, ["ts-gpu", "other"], [])
    name = _pod(
        kube,
        ns,
        node,
        claims={"gpus": {"resourceClaimName": claim}},
        containers={"c": [{"name": "gpus", "request": "ts-gpu"}]},
    )

    allocated = _allocated(kube, ns, claim)
    env = container_env(kube, ns, name)

    assert visible_uuids(env) == [device_uuid(kube, node, allocated["ts-gpu"])]
    other = device_variable(allocated["other"])
    assert [n for n in env if n.startswith(other)] == []


def test_mixed_sharing_settings_stay_with_their_devices(kube: Kube, ns: str, node: Node) -> None:
    sliced = _config("sliced", {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}})
    whole = _config("whole", {"strategy": "Exclusive"})
    claim = _claim(kube, ns, ["sliced", "whole"], [sliced, whole])
    name = _pod(
        kube,
        ns,
        node,
        claims={"gpus": {"resourceClaimName": claim}},
        containers={"c": [{"name": "gpus"}]},
    )

    allocated = _allocated(kube, ns, claim)
    env = container_env(kube, ns, name)
    sliced_var = device_variable(allocated["sliced"])
    whole_var = device_variable(allocated["whole"])

    assert env[f"{sliced_var}_SHARING_STRATEGY"] == "TimeSlicing"
    assert env[f"{sliced_var}_TIMESLICE_INTERVAL"] == "Long"
    assert env[f"{whole_var}_SHARING_STRATEGY"] == "Exclusive"
    assert f"{whole_var}_TIMESLICE_INTERVAL" not in env
    # Nothing claim-wide could contradict a device's settings, and no MPS variable
    # claims what no MPS daemon enforces.
    assert [
        n
        for n in env
        if n.startswith(("DRASIL_SHARING", "DRASIL_TIMESLICE", "CUDA_MPS")) or "_MPS_" in n
    ] == []


def test_three_containers_naming_three_requests_see_three_disjoint_sets(
    kube: Kube, ns: str, node: Node
) -> None:
    requests = ["a", "b", "c"]
    claim = _claim(kube, ns, requests, [])
    containers = {f"c-{r}": [{"name": "gpus", "request": r}] for r in requests}
    name = _pod(
        kube, ns, node, claims={"gpus": {"resourceClaimName": claim}}, containers=containers
    )

    allocated = _allocated(kube, ns, claim)
    seen = {r: visible_uuids(container_env(kube, ns, name, container=f"c-{r}")) for r in requests}

    assert seen == {r: [device_uuid(kube, node, allocated[r])] for r in requests}
    assert len({u for uuids in seen.values() for u in uuids}) == 3


def test_the_container_reads_its_device_metadata_the_kep_5304_way(
    kube: Kube, ns: str, node: Node
) -> None:
    """The metadata file drasil mounts for the Pod's claim "gpu" (from a template),
    request "gpu", at the path the KEP defines: the device's published attributes."""
    path = f"{CONTAINER_DIR}/{TEMPLATES_SUBDIR}/gpu/gpu/{DRIVER}{FILE_SUFFIX}"
    name = pod(
        kube,
        ns,
        node,
        template_name=template(kube, ns),
        command=f"sed 's/^/META:/' {path}; trap 'exit 0' TERM; sleep 3600 & wait",
    )
    wait_running(kube, ns, name)

    def printed() -> Any:
        log = kube.core.read_namespaced_pod_log(name, ns, container="c")
        lines = [line[len("META:") :] for line in log.splitlines() if line.startswith("META:")]
        return lines or NotYet(log)

    documents = [json.loads(line) for line in wait_for(printed, timeout=60, what="metadata")]
    assert [d["apiVersion"] for d in documents] == [
        "metadata.resource.k8s.io/v1beta1",
        "metadata.resource.k8s.io/v1alpha1",
    ]
    (request,) = documents[0]["requests"]
    (device,) = request["devices"]
    assert documents[0]["podClaimName"] == "gpu"
    claim = _pod_claim(kube, ns, name, "gpu")
    assert device["name"] == _allocated(kube, ns, claim)["gpu"]
    assert device["attributes"]["uuid"]["string"] == device_uuid(kube, node, device["name"])
    assert "productName" in device["attributes"]

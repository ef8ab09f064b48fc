"""The harness's control plane is configured as drasil needs it."""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client

from e2e.harness import versions
from e2e.harness.cluster import Cluster
from e2e.harness.kube import Kube
from e2e.harness.procs import read_pid_file


def _own(cluster: Cluster | None) -> Cluster:
    if cluster is None:
        pytest.skip("checks the flags of the harness's own cluster; DRASIL_E2E_KUBECONFIG is set")
    return cluster


def test_beta_resource_versions_are_served_and_dra_gates_on(
    cluster: Cluster | None, kubectl: Callable[..., Any]
) -> None:
    _own(cluster)
    served = {
        "resource.k8s.io": {"deviceclasses", "resourceclaims", "resourceslices"},
        "scheduling.k8s.io": {"workloads", "podgroups"},
    }
    for version in versions.RUNTIME_CONFIG:
        body = json.loads(kubectl("get", "--raw", f"/apis/{version}").stdout)
        wanted = served[version.split("/")[0]]
        assert wanted <= {r["name"] for r in body["resources"]}, body
    metrics = kubectl("get", "--raw", "/metrics").stdout
    for gate, enabled in versions.FEATURE_GATES.items():
        match = re.search(
            rf'^kubernetes_feature_enabled{{name="{gate}",[^}}]*}} (\d)$', metrics, re.M
        )
        assert match, f"apiserver does not know feature gate {gate}"
        assert match.group(1) == ("1" if enabled else "0"), f"{gate} is {match.group(1)}"


def test_pod_bound_token_names_the_node(
    kube: Kube, namespace: str, make_node: Callable[..., dict[str, Any]]
) -> None:
    """Tokens bound to a Pod carry the Pod's node (kubernetes.io.node), which node-local
    admission policies of the driver rely on."""
    node = make_node("e2e-token-node")
    pod = kube.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "token-holder"},
            "spec": {
                "nodeName": "e2e-token-node",
                "automountServiceAccountToken": False,
                "containers": [{"name": "main", "image": "registry.invalid/never-pulled:1"}],
            },
        },
        namespace,
    )
    request = client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(
            audiences=["drasil-e2e"],
            expiration_seconds=600,
            bound_object_ref=client.V1BoundObjectReference(
                api_version="v1", kind="Pod", name="token-holder", uid=pod["metadata"]["uid"]
            ),
        )
    )
    token = kube.core.create_namespaced_service_account_token("default", namespace, request)
    assert token.status is not None
    assert token.status.token
    payload = token.status.token.split(".")[1]
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    assert claims["kubernetes.io"]["pod"]["name"] == "token-holder"
    assert claims["kubernetes.io"]["node"] == {
        "name": "e2e-token-node",
        "uid": node["metadata"]["uid"],
    }


def test_second_cluster_runs_side_by_side_and_down_leaves_nothing(
    cluster: Cluster | None,
) -> None:
    second = Cluster(die_with_parent=True)
    try:
        second.up()
        assert second.status().running, second.status().format()
        if cluster is not None:
            assert second.run_dir != cluster.run_dir
            mine = set(vars(cluster.ports).values())
            assert not mine & set(vars(second.ports).values())
        started = [read_pid_file(p) for p in second.pids_dir.glob("*.pid")]
        assert len(started) == 4
    finally:
        second.down()
    assert all(p is not None and not p.alive() for p in started)
    assert not list(second.pids_dir.glob("*.pid"))
    assert not second.etcd_data_dir.exists()
    if cluster is not None:
        assert cluster.status().running, "taking the second cluster down hurt the first"

"""The chart's RBAC and ValidatingAdmissionPolicies, enforced by the real API server.

The chart's ServiceAccounts, (Cluster)Roles, bindings and policies are installed with
`helm template | kubectl apply` (no workloads: nothing would run them). Requests are then
made with real tokens of the two service accounts from the TokenRequest API:

- the kubelet plugin's token is bound to a Pod on node A, so it carries the node claim
  (user extra authentication.kubernetes.io/node-name = A), as its DaemonSet Pod's would;
- the controller's token likewise (its Pods run on nodes too; the claim must not help it).

(Over 600 lines: every test shares the installed objects, tokens and slices above.)
"""

from __future__ import annotations

import base64
import functools
import json
import os
import secrets
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from e2e.harness.chart import crd_installed, dump, kubectl_run, render, token_kubeconfig
from e2e.harness.cluster.host import free_ports
from e2e.harness.kube import RESOURCE, Kube, NotYet, wait_for
from tools.image import build_image, image_env, sandbox_command, unpack

OUR_DRIVER = "gpu.drasil.dev"
OTHER_DRIVER = "gpu.other.example.com"
POLICY_KINDS = {
    "ServiceAccount",
    "ClusterRole",
    "ClusterRoleBinding",
    "Role",
    "RoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
}
SLICES = (RESOURCE, "ResourceSlice")


@dataclass
class Install:
    release: str
    namespace: str
    objects: list[dict[str, Any]]

    @property
    def fullname(self) -> str:
        return f"{self.release}-drasil"

    @property
    def plugin_sa(self) -> str:
        return f"{self.fullname}-kubelet-plugin"

    @property
    def controller_sa(self) -> str:
        return f"{self.fullname}-controller"

    @property
    def plugin_policy(self) -> str:
        return f"{self.fullname}-kubelet-plugin-slices"

    @property
    def node_label_policy(self) -> str:
        return f"{self.fullname}-kubelet-plugin-node-labels"

    @property
    def controller_policy(self) -> str:
        return f"{self.fullname}-controller-slices"

    def user(self, sa: str) -> str:
        return f"system:serviceaccount:{self.namespace}:{sa}"


@pytest.fixture
def install(kubeconfig: Path, namespace: str) -> Iterator[Install]:
    release = f"pol{secrets.token_hex(3)}"
    objs = [o for o in render(namespace=namespace, release=release) if o["kind"] in POLICY_KINDS]
    assert {o["kind"] for o in objs} == POLICY_KINDS
    kubectl_run(kubeconfig, "apply", "-f", "-", stdin=dump(objs))
    try:
        yield Install(release=release, namespace=namespace, objects=objs)
    finally:
        cluster_scoped = [o for o in objs if "namespace" not in o["metadata"]]
        kubectl_run(
            kubeconfig,
            "delete",
            "--ignore-not-found",
            "--wait=false",
            "-f",
            "-",
            stdin=dump(cluster_scoped),
        )


@pytest.fixture
def nodes(make_node: Callable[..., dict[str, Any]]) -> tuple[str, str]:
    suffix = secrets.token_hex(3)
    a, b = f"e2e-policy-a-{suffix}", f"e2e-policy-b-{suffix}"
    make_node(a)
    make_node(b)
    return a, b


def _claims(token: str) -> dict[str, Any]:
    payload = token.split(".")[1]
    return dict(json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))))


def _issued(request: client.AuthenticationV1TokenRequest) -> str:
    """The token the API server issued for a TokenRequest."""
    if request.status is None or not request.status.token:
        raise AssertionError(f"TokenRequest answered without a token: {request}")
    return request.status.token


def pod_bound_token(kube: Kube, namespace: str, sa: str, node: str) -> str:
    """A token of `sa` bound to a (never running) Pod on `node`: it carries the node."""
    pod = kube.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"generateName": f"{sa[-20:]}-"},
            "spec": {
                "nodeName": node,
                "serviceAccountName": sa,
                "automountServiceAccountToken": False,
                "containers": [{"name": "main", "image": "registry.invalid/never-pulled:1"}],
            },
        },
        namespace,
    )
    request = client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(
            audiences=[],
            expiration_seconds=600,
            bound_object_ref=client.V1BoundObjectReference(
                api_version="v1",
                kind="Pod",
                name=pod["metadata"]["name"],
                uid=pod["metadata"]["uid"],
            ),
        )
    )
    value = _issued(kube.core.create_namespaced_service_account_token(sa, namespace, request))
    assert _claims(value)["kubernetes.io"]["node"]["name"] == node
    return value


def unbound_token(kube: Kube, namespace: str, sa: str) -> str:
    request = client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=600)
    )
    value = _issued(kube.core.create_namespaced_service_account_token(sa, namespace, request))
    assert "node" not in _claims(value)["kubernetes.io"]
    return value


def as_token(kubeconfig: Path, token: str, tmp_path: Path, name: str) -> Kube:
    """API clients that authenticate with `token` against the cluster of `kubeconfig`."""
    return Kube(token_kubeconfig(kubeconfig, token, tmp_path / f"{name}.kubeconfig", name))


def as_daemon(
    kube: Kube, kubeconfig: Path, namespace: str, sa: str, node: str, tmp_path: Path
) -> Kube:
    """API clients of a daemon's Pod on `node`: a token of `sa` bound to a Pod there."""
    token = pod_bound_token(kube, namespace, sa, node)
    return as_token(kubeconfig, token, tmp_path, sa)


def slice_body(
    name: str,
    *,
    driver: str = OUR_DRIVER,
    node: str | None = None,
    pool: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A slice of `node`, or of all nodes; with a DevicePool `pool` it looks like the
    controller's: labelled with and owned by that pool."""
    metadata: dict[str, Any] = {"name": name}
    if pool is not None:
        meta = pool["metadata"]
        metadata["labels"] = {"drasil.dev/devicepool": meta["name"]}
        metadata["ownerReferences"] = [
            {
                "apiVersion": "drasil.dev/v1alpha1",
                "kind": "DevicePool",
                "name": meta["name"],
                "uid": meta["uid"],
                "controller": True,
            }
        ]
    spec: dict[str, Any] = {
        "driver": driver,
        "pool": {"name": node or "shared-pool", "generation": 1, "resourceSliceCount": 1},
        "devices": [{"name": "gpu-0"}],
    }
    if node is None:
        spec["allNodes"] = True
    else:
        spec["nodeName"] = node
    return {
        "apiVersion": RESOURCE,
        "kind": "ResourceSlice",
        "metadata": metadata,
        "spec": spec,
    }


def denied(call: Callable[[], Any]) -> str:
    """Run an API call that must be refused; return the server's message."""
    with pytest.raises(ApiException) as err:
        call()
    assert err.value.status == 403, err.value.body
    body = json.loads(err.value.body or "")
    return str(body["message"])


class Slices:
    """ResourceSlices made by a test, deleted (as admin) afterwards."""

    def __init__(self, admin: Kube, prefix: str) -> None:
        self.admin = admin
        self.prefix = prefix
        self.names: set[str] = set()

    def name(self, what: str) -> str:
        name = f"{self.prefix}-{what}"
        self.names.add(name)
        return name

    def cleanup(self) -> None:
        for name in self.names:
            self.admin.delete(*SLICES, name)


@pytest.fixture
def device_pool(kube: Kube, kubeconfig: Path, namespace: str) -> Iterator[dict[str, Any]]:
    """A real DevicePool to own the controller's slices (else the garbage collector
    would remove them mid-test)."""
    with crd_installed(kube, kubeconfig):
        pool = kube.create(
            {
                "apiVersion": "drasil.dev/v1alpha1",
                "kind": "DevicePool",
                "metadata": {"name": namespace},
                "spec": {"allNodes": True, "devices": [{"name": "gpu-0"}]},
            }
        )
        try:
            yield pool
        finally:
            kube.delete("drasil.dev/v1alpha1", "DevicePool", namespace)


@pytest.fixture
def slices(kube: Kube, namespace: str) -> Iterator[Slices]:
    s = Slices(kube, namespace)
    yield s
    s.cleanup()


def _create(k: Kube, body: dict[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
    res = k.resource(*SLICES)
    created = res.create(body=body, dry_run="All" if dry_run else None)
    return dict(created.to_dict())


def wait_until_enforced(k: Kube, body: dict[str, Any], policy: str) -> None:
    """RBAC and admission policies take effect once the API server's informers see them:
    poll a dry-run of a write the policy must refuse until it is refused by the policy."""

    def refused() -> Any:
        try:
            _create(k, body, dry_run=True)
        except ApiException as e:
            message = json.loads(e.body).get("message", "") if e.body else str(e)
            if e.status == 403 and f"ValidatingAdmissionPolicy '{policy}'" in message:
                return True
            return NotYet({"status": e.status, "message": message})
        return NotYet("dry-run create was allowed")

    wait_for(refused, timeout=60, what=f"policy {policy} to refuse {body['spec']}")


def _policy_status(kube: Kube, name: str) -> dict[str, Any]:
    policy = kube.get("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy", name)
    return dict(policy.get("status") or {})


def _checked_status(kube: Kube, name: str) -> dict[str, Any] | NotYet:
    """For wait_for: the status of policy `name` once the API server has written one."""
    return _policy_status(kube, name) or NotYet("no status yet")


def test_policies_type_check_cleanly(kube: Kube, install: Install) -> None:
    """The API server type-checks the CEL of a policy against ResourceSlice's schema
    in the background; a warning there means an expression can fail at run time."""
    for name in (install.plugin_policy, install.node_label_policy, install.controller_policy):
        status = wait_for(
            functools.partial(_checked_status, kube, name),
            timeout=60,
            what=f"type checking of {name}",
        )
        assert not (status.get("typeChecking") or {}).get("expressionWarnings"), status


def test_plugin_writes_only_its_own_nodes_slices_of_our_driver(
    kube: Kube,
    kubeconfig: Path,
    namespace: str,
    install: Install,
    nodes: tuple[str, str],
    slices: Slices,
    tmp_path: Path,
) -> None:
    node_a, node_b = nodes
    plugin = as_daemon(kube, kubeconfig, namespace, install.plugin_sa, node_a, tmp_path)
    policy = install.plugin_policy
    wait_until_enforced(plugin, slice_body(slices.name("probe"), node=node_b), policy)

    # Its own node and driver: create, update, delete all pass.
    own = _create(plugin, slice_body(slices.name("own"), node=node_a))
    assert own["spec"]["nodeName"] == node_a
    own["spec"]["devices"].append({"name": "gpu-1"})
    updated = plugin.resource(*SLICES).replace(body=own).to_dict()
    assert [d["name"] for d in updated["spec"]["devices"]] == ["gpu-0", "gpu-1"]

    # Another node's slice: neither create...
    message = denied(lambda: _create(plugin, slice_body(slices.name("b"), node=node_b)))
    assert f"ValidatingAdmissionPolicy '{policy}'" in message
    assert f"on node {node_a} may only write ResourceSlices with spec.nodeName {node_a}" in message
    assert f"not of node {node_b}" in message
    # (Moving its own slice to node B is refused by the API already: spec.nodeName and
    # spec.driver are immutable. The policy checks the old object on UPDATE anyway.)
    # ... nor update or delete the slice node B's plugin published.
    theirs = _create(kube, slice_body(slices.name("theirs"), node=node_b))
    theirs["spec"]["devices"].append({"name": "gpu-9"})
    message = denied(lambda: plugin.resource(*SLICES).replace(body=theirs))
    assert f"ValidatingAdmissionPolicy '{policy}'" in message
    message = denied(lambda: plugin.resource(*SLICES).delete(name=theirs["metadata"]["name"]))
    assert f"ValidatingAdmissionPolicy '{policy}'" in message
    assert f"not of node {node_b}" in message
    # Nor a slice of all nodes, nor a slice of another driver on its own node.
    message = denied(lambda: _create(plugin, slice_body(slices.name("all"))))
    assert "not slices without spec.nodeName" in message
    other = slice_body(slices.name("other"), driver=OTHER_DRIVER, node=node_a)
    message = denied(lambda: _create(plugin, other))
    assert f"ValidatingAdmissionPolicy '{policy}'" in message
    assert f"only write ResourceSlices of driver {OUR_DRIVER}, not {OTHER_DRIVER}" in message
    other_on_a = _create(kube, other)
    message = denied(lambda: plugin.resource(*SLICES).delete(name=other_on_a["metadata"]["name"]))
    assert f"not {OTHER_DRIVER}" in message

    plugin.resource(*SLICES).delete(name=own["metadata"]["name"])  # own: allowed
    assert kube.get(*SLICES, theirs["metadata"]["name"])  # untouched


def _node_labels(kube: Kube, name: str) -> dict[str, str]:
    meta = kube.core.read_node(name, _request_timeout=30).metadata
    return dict(meta.labels or {}) if meta is not None else {}


def test_plugin_labels_only_its_own_node_with_its_own_keys(
    kube: Kube,
    kubeconfig: Path,
    namespace: str,
    install: Install,
    nodes: tuple[str, str],
    tmp_path: Path,
) -> None:
    """The plugin's GPU labels (nodeLabels): RBAC lets it patch Nodes, the policy only
    its own Node, only drasil's label keys, nothing else of the Node."""
    node_a, node_b = nodes
    plugin = as_daemon(kube, kubeconfig, namespace, install.plugin_sa, node_a, tmp_path)
    policy = install.node_label_policy

    def label(node: str, labels: dict[str, str | None], *, dry_run: bool = False) -> Any:
        body = {"metadata": {"labels": labels}}
        return plugin.core.patch_node(
            node, body, dry_run="All" if dry_run else None, _request_timeout=30
        )

    def refused() -> Any:
        try:
            label(node_b, {"drasil.dev/gpu.present": "true"}, dry_run=True)
        except ApiException as e:
            if e.status == 403 and f"ValidatingAdmissionPolicy '{policy}'" in (e.body or ""):
                return True
            return NotYet({"status": e.status, "body": e.body})
        return NotYet("dry-run patch of another Node was allowed")

    wait_for(refused, timeout=60, what=f"policy {policy} to be enforced")

    # Its own Node, its own keys: set, changed, removed.
    label(node_a, {"drasil.dev/gpu.product": "NVIDIA-H100", "drasil.dev/mig-1g.10gb.count": "7"})
    label(node_a, {"drasil.dev/gpu.product": "NVIDIA-H200", "drasil.dev/mig-1g.10gb.count": None})
    own = _node_labels(kube, node_a)
    assert own["drasil.dev/gpu.product"] == "NVIDIA-H200"
    assert "drasil.dev/mig-1g.10gb.count" not in own

    # Another Node: no.
    message = denied(lambda: label(node_b, {"drasil.dev/gpu.present": "true"}))
    assert f"on node {node_a} may only label its own Node, not {node_b}" in message
    # Any other key: the operator's drasil.dev/mig-mode, GFD's names (nodeLabels.names is
    # drasil here), anyone's.
    for key in ("drasil.dev/mig-mode", "nvidia.com/gpu.product", "node-role.kubernetes.io/gpu"):
        message = denied(functools.partial(label, node_a, {key: "x"}))
        assert f"may only change its own GPU labels of a Node, not {key}" in message
    # Nothing else of the Node: a taint, an annotation.
    taint = {"spec": {"taints": [{"key": "k", "value": "v", "effect": "NoSchedule"}]}}
    message = denied(lambda: plugin.core.patch_node(node_a, taint, _request_timeout=30))
    assert "may change nothing of a Node but its GPU labels" in message
    note = {"metadata": {"annotations": {"example.com/a": "b"}}}
    message = denied(lambda: plugin.core.patch_node(node_a, note, _request_timeout=30))
    assert "may change nothing of a Node but its GPU labels" in message
    assert "drasil.dev/gpu.present" not in _node_labels(kube, node_b)


def test_plugin_token_without_a_node_writes_nothing(
    kube: Kube,
    kubeconfig: Path,
    namespace: str,
    install: Install,
    nodes: tuple[str, str],
    slices: Slices,
    tmp_path: Path,
) -> None:
    """A token of the plugin's account that is not bound to a Pod on a node (e.g. a
    copied long-lived token) may not publish, whatever node it names."""
    node_a, _ = nodes
    plugin = as_token(kubeconfig, unbound_token(kube, namespace, install.plugin_sa), tmp_path, "p")
    body = slice_body(slices.name("a"), node=node_a)
    wait_until_enforced(plugin, body, install.plugin_policy)
    message = denied(lambda: _create(plugin, body))
    assert "must use a token bound to a Pod on a node" in message


def test_controller_cannot_write_node_slices(
    kube: Kube,
    device_pool: dict[str, Any],
    kubeconfig: Path,
    namespace: str,
    install: Install,
    nodes: tuple[str, str],
    slices: Slices,
    tmp_path: Path,
) -> None:
    node_a, _ = nodes
    controller = as_daemon(kube, kubeconfig, namespace, install.controller_sa, node_a, tmp_path)
    policy = install.controller_policy
    wait_until_enforced(controller, slice_body(slices.name("probe"), node=node_a), policy)

    # Not even on the node its own Pod runs on, labelled and owned like a pool's slice.
    node_body = slice_body(slices.name("node"), node=node_a, pool=device_pool)
    message = denied(lambda: _create(controller, node_body))
    assert f"ValidatingAdmissionPolicy '{policy}'" in message
    assert f"may not write node-local ResourceSlices (spec.nodeName {node_a})" in message
    node_slice = _create(kube, slice_body(slices.name("plugin-made"), node=node_a))
    message = denied(
        lambda: controller.resource(*SLICES).delete(name=node_slice["metadata"]["name"])
    )
    assert f"ValidatingAdmissionPolicy '{policy}'" in message

    # What it is for: a DevicePool's slice reachable from all nodes, of our driver.
    published = _create(controller, slice_body(slices.name("pool"), pool=device_pool))
    assert published["spec"]["allNodes"] is True
    published["spec"]["devices"].append({"name": "gpu-1"})
    controller.resource(*SLICES).replace(body=published)
    controller.resource(*SLICES).delete(name=published["metadata"]["name"])

    # Not of another driver, and not a slice that no DevicePool owns.
    other = slice_body(slices.name("other"), driver=OTHER_DRIVER, pool=device_pool)
    message = denied(lambda: _create(controller, other))
    assert f"only write ResourceSlices of driver {OUR_DRIVER}, not {OTHER_DRIVER}" in message
    message = denied(lambda: _create(controller, slice_body(slices.name("unlabelled"))))
    assert "only write ResourceSlices of a DevicePool (label drasil.dev/devicepool)" in message
    unowned = slice_body(slices.name("unowned"), pool=device_pool)
    del unowned["metadata"]["ownerReferences"]
    message = denied(lambda: _create(controller, unowned))
    assert "must be owned by their DevicePool" in message
    # A pool's slice left from before a driver rename may go; another driver's own
    # slices may not.
    renamed = _create(
        kube, slice_body(slices.name("renamed"), driver=OTHER_DRIVER, pool=device_pool)
    )
    controller.resource(*SLICES).delete(name=renamed["metadata"]["name"])
    foreign = _create(kube, slice_body(slices.name("foreign"), driver=OTHER_DRIVER))
    message = denied(lambda: controller.resource(*SLICES).delete(name=foreign["metadata"]["name"]))
    assert "(label drasil.dev/devicepool)" in message


# ---- RBAC: least verbs -------------------------------------------------------------


def _can(
    kube: Kube,
    user: str,
    verb: str,
    resource: str,
    *,
    group: str = "",
    sub: str = "",
    namespace: str = "",
    name: str = "",
) -> bool:
    review = client.V1SubjectAccessReview(
        spec=client.V1SubjectAccessReviewSpec(
            user=user,
            groups=["system:serviceaccounts", "system:authenticated"],
            resource_attributes=client.V1ResourceAttributes(
                verb=verb,
                group=group,
                resource=resource,
                subresource=sub or None,
                namespace=namespace or None,
                name=name or None,
            ),
        )
    )
    result = client.AuthorizationV1Api(kube.api).create_subject_access_review(review)
    if result.status is None:
        raise AssertionError(f"SubjectAccessReview answered without a status: {result}")
    return bool(result.status.allowed)


R = "resource.k8s.io"
Rights = list[tuple[str, str, str, str, bool, bool]]


def _rights(*resources: tuple[str, str, str, bool, str, str]) -> Rights:
    """(verb, group, resource, subresource, namespaced, allowed) of each verb, from
    (group, resource, subresource, namespaced, allowed verbs, refused verbs)."""
    return [
        (verb, group, resource, sub, namespaced, allowed)
        for group, resource, sub, namespaced, granted, refused in resources
        for verbs, allowed in ((granted, True), (refused, False))
        for verb in verbs.split()
    ]


PLUGIN_RIGHTS = _rights(
    # (group, resource, subresource, namespaced, allowed verbs, refused verbs)
    (R, "resourceclaims", "", True, "get", "list watch"),
    (R, "resourceclaims", "status", True, "", "update"),
    (R, "resourceslices", "", False, "list create update delete", "patch deletecollection"),
    ("", "nodes", "", False, "get patch", "list update"),
    ("", "events", "", True, "create", "update"),
    ("", "secrets", "", True, "", "get"),
    ("", "pods", "", True, "", "list"),
    ("drasil.dev", "devicepools", "", False, "get", "list watch create"),
    (R, "deviceclasses", "", False, "", "get"),
)
CONTROLLER_RIGHTS = _rights(
    ("drasil.dev", "devicepools", "", False, "watch patch", "create delete"),
    ("drasil.dev", "devicepools", "status", False, "patch", ""),
    (R, "resourceslices", "", False, "create delete", "deletecollection"),
    (R, "resourceclaims", "", True, "watch", "update"),
    (R, "resourceclaims", "status", True, "patch", "update"),
    (R, "resourceclaimtemplates", "", True, "list", "create"),
    (R, "deviceclasses", "", False, "list", "create"),
    ("", "pods", "", True, "watch", "delete"),
    ("", "events", "", True, "create", "patch"),
    ("", "secrets", "", True, "", "get"),
    ("", "nodes", "", False, "list", "watch patch"),
    ("scheduling.k8s.io", "podgroups", "", True, "get", "list watch update"),
)


def test_rbac_grants_each_daemon_only_what_it_needs(kube: Kube, install: Install) -> None:
    def check(user: str, table: Rights) -> Any:
        wrong = []
        for verb, group, resource, sub, namespaced, allowed in table:
            ns = "default" if namespaced else ""
            if _can(kube, user, verb, resource, group=group, sub=sub, namespace=ns) != allowed:
                wrong.append(
                    f"{verb} {group}/{resource}{'/' + sub if sub else ''}: expected {allowed}"
                )
        return not wrong or NotYet(wrong)

    plugin = install.user(install.plugin_sa)
    controller = install.user(install.controller_sa)
    # The authorizer's caches follow the new bindings within a moment.
    wait_for(lambda: check(plugin, PLUGIN_RIGHTS), timeout=30, what="the plugin's RBAC")
    wait_for(lambda: check(controller, CONTROLLER_RIGHTS), timeout=30, what="the controller's RBAC")
    # Its own Lease, only in the release namespace.
    ns, lease = install.namespace, install.controller_sa
    leases = {"group": "coordination.k8s.io"}
    assert _can(kube, controller, "update", "leases", namespace=ns, name=lease, **leases)
    assert _can(kube, controller, "create", "leases", namespace=ns, **leases)
    assert not _can(kube, controller, "update", "leases", namespace=ns, name="other", **leases)
    assert not _can(kube, controller, "create", "leases", namespace="kube-system", **leases)
    assert not _can(kube, plugin, "get", "leases", namespace=ns, name=lease, **leases)


# ---- the real plugin, from the image, as the chart runs it ------------------------------


def _http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_plugin_from_the_image_publishes_its_node_under_the_charts_rbac_and_policy(
    kube: Kube,
    kubeconfig: Path,
    namespace: str,
    install: Install,
    nodes: tuple[str, str],
    tmp_path: Path,
) -> None:
    """The DaemonSet's command, env, mounts and securityContext, run from the locally
    built image without a container runtime (tools.image.sandbox_command: read-only root,
    no capabilities, no_new_privs, uid 0) with a token of the plugin's account bound to
    a Pod on node A: it publishes node A's devices, its probes answer, and it writes only
    into the host directories the chart mounts."""
    if os.geteuid() != 0:
        pytest.fail("needs root: it mounts and chroots like a container runtime")
    node_a, _ = nodes
    image = build_image()
    rootfs = unpack(image, tmp_path / "rootfs")
    metrics_port, health_port = free_ports(2)
    objs = render(
        namespace=namespace,
        release=install.release,
        sets=[
            "backend=simulated",
            "simulatedProfile=l4:3",
            "logFormat=text",
            f"kubeletPlugin.metricsPort={metrics_port}",
            f"kubeletPlugin.healthPort={health_port}",
        ],
    )
    ds = next(o for o in objs if o["kind"] == "DaemonSet")
    pod_spec = ds["spec"]["template"]["spec"]
    (container,) = pod_spec["containers"]
    assert pod_spec["serviceAccountName"] == install.plugin_sa
    security = container["securityContext"]
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["readOnlyRootFilesystem"] is True

    # What kubelet would mount: hostPath dirs as kubelet leaves them (root, 0750), the
    # projected service account token, tmpfs for emptyDir(medium: Memory).
    host = tmp_path / "host"
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    binds: dict[str, Path] = {}
    tmpfs: list[str] = []
    for mount in container["volumeMounts"]:
        volume = volumes[mount["name"]]
        if "hostPath" in volume:
            source = host / volume["hostPath"]["path"].lstrip("/")
            source.mkdir(parents=True, mode=0o750)
            binds[mount["mountPath"]] = source
        else:
            assert volume["emptyDir"]["medium"] == "Memory"
            tmpfs.append(mount["mountPath"])
    token = pod_bound_token(kube, namespace, install.plugin_sa, node_a)
    pod_uid = _claims(token)["kubernetes.io"]["pod"]["uid"]
    sa_dir = tmp_path / "serviceaccount"
    sa_dir.mkdir()
    config = yaml.safe_load(kubeconfig.read_text())
    cluster = config["clusters"][0]["cluster"]
    (sa_dir / "token").write_text(token)
    (sa_dir / "ca.crt").write_bytes(base64.b64decode(cluster["certificate-authority-data"]))
    (sa_dir / "namespace").write_text(namespace)
    binds["/var/run/secrets/kubernetes.io/serviceaccount"] = sa_dir
    server = urllib.parse.urlsplit(cluster["server"])

    env = {
        **image_env(image),
        "NODE_NAME": node_a,  # fieldRef spec.nodeName
        "POD_UID": pod_uid,  # fieldRef metadata.uid
        # kubelet's service links; the harness's API server is on loopback.
        "KUBERNETES_SERVICE_HOST": server.hostname or "127.0.0.1",
        "KUBERNETES_SERVICE_PORT": str(server.port),
    }
    for var in container["env"]:
        assert var["name"] in env or "value" in var, var
        if "value" in var:
            env[var["name"]] = var["value"]
    # The runtime looks the command up in the image's PATH.
    path = os.pathsep.join(f"{rootfs}{d}" for d in env["PATH"].split(os.pathsep))
    found = shutil.which(container["command"][0], path=path)
    assert found, f"{container['command'][0]} is not on the image's PATH"
    argv = [found.removeprefix(str(rootfs)), *container["args"]]
    log = tmp_path / "plugin.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            sandbox_command(rootfs, argv, binds=binds, env=env, tmpfs=tmpfs),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:

        def healthy() -> Any:
            if proc.poll() is not None:
                raise AssertionError(f"the plugin exited {proc.returncode}:\n{log.read_text()}")
            try:
                code, body = _http_get(f"http://127.0.0.1:{health_port}/healthz")
            except OSError as e:
                return NotYet(str(e))
            return code == 200 or NotYet({"code": code, "body": body})

        wait_for(healthy, timeout=90, what="the plugin's /healthz (the DaemonSet's probe)")
        assert _http_get(f"http://127.0.0.1:{health_port}/readyz")[0] == 200

        def published() -> Any:
            items = kube.resource(*SLICES).get(field_selector=f"spec.nodeName={node_a}").items
            devices = [d["name"] for s in items for d in s.spec.devices or []]
            return (len(devices) == 3 and items) or NotYet({"devices": devices})

        items = wait_for(published, timeout=60, what=f"node {node_a}'s ResourceSlices")
        for item in items:
            assert item.spec.driver == OUR_DRIVER
            (owner,) = item.metadata.ownerReferences
            assert (owner.kind, owner.name) == ("Node", node_a)
        metrics = _http_get(f"http://127.0.0.1:{metrics_port}/metrics")[1]
        assert 'drasil_resourceslice_writes_total{result="success",verb="create"}' in metrics
        assert 'result="error"' not in metrics

        # It wrote where the chart mounts host directories, and nowhere else it could.
        state_dir = binds[f"/var/lib/kubelet/plugins/{OUR_DRIVER}"]
        registrar = binds["/var/lib/kubelet/plugins_registry"]
        assert (state_dir / f"dra-{pod_uid[:13]}.sock").is_socket()
        assert (registrar / f"{OUR_DRIVER}-{pod_uid[:13]}-reg.sock").is_socket()
        assert (state_dir / "checkpoint.lock").is_file()  # owner access, no capability
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log.read_text()

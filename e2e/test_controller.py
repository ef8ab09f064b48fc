"""drasil-controller against the real control plane, run as a process like in a cluster.

A DevicePool becomes slices kube-scheduler allocates from; bad pools and bad opaque
configs are reported in words; a pending claim is explained within 30 s; two
replicas take turns through the Lease; hostile claims cost one Event each; and
nothing of kopf's or ours is ever written onto ResourceClaims, Pods or ResourceSlices.
The controller runs with the chart's RBAC (a token of its service account).

Each run uses a driver name of its own, so slices other e2e tests publish for
gpu.drasil.dev never show up in the counts asserted here. (Over 600 lines: the tests
share the fixtures and helpers around one controller process, e2e.harness.controllerproc.)
"""

from __future__ import annotations

import functools
import json
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from drasil.api.devicepool import API_VERSION as POOL_API
from drasil.api.devicepool import CRD_NAME, crd_manifest
from drasil.api.limits import allow_nesting
from drasil.driver.explain.fromapi import explain_from_api
from drasil.driver.kubeapi import KubeApi
from e2e.harness.chart import ChartIdentity, chart_identity, remove_crd
from e2e.harness.controllerproc import ControllerProcess
from e2e.harness.kube import RESOURCE, Kube, NotYet, pending_pod, wait_for

TOKEN = secrets.token_hex(3)
DRIVER = f"ctl-{TOKEN}.drasil.dev"
H200 = f'device.attributes["{DRIVER}"].productName == "NVIDIA H200"'
CONFIG_API = "resource.drasil.dev/v1beta1"
OURS = re.compile(r"kopf|drasil", re.IGNORECASE)


# --- fixtures --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def crd(kube: Kube) -> Iterator[None]:
    """The DevicePool CRD from the generated manifest, Established."""
    remove_crd(kube)  # an old one, from the chart's crds/ or a test before
    kube.create(crd_manifest())

    def established() -> Any:
        obj = kube.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", CRD_NAME)
        conditions = (obj.get("status") or {}).get("conditions") or []
        ok = any(c["type"] == "Established" and c["status"] == "True" for c in conditions)
        return ok or NotYet(conditions)

    wait_for(established, timeout=60, what="the DevicePool CRD to be established")
    kube.dyn.resources.invalidate_cache()
    yield
    kube.delete("apiextensions.k8s.io/v1", "CustomResourceDefinition", CRD_NAME)


@pytest.fixture(scope="module")
def device_class(kube: Kube) -> Iterator[str]:
    kube.delete(RESOURCE, "DeviceClass", DRIVER)
    kube.create(
        {
            "apiVersion": RESOURCE,
            "kind": "DeviceClass",
            "metadata": {"name": DRIVER},
            "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
        }
    )
    yield DRIVER
    kube.delete(RESOURCE, "DeviceClass", DRIVER)


@pytest.fixture(scope="module")
def identity(
    kube: Kube, kubeconfig: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ChartIdentity]:
    """The controller's service account with the chart's RBAC for DRIVER: the tests see
    what a permission the chart lacks would break."""
    directory = tmp_path_factory.mktemp("identity")
    with chart_identity(
        kube,
        kubeconfig,
        component="controller",
        release=f"ctl-{TOKEN}",
        driver=DRIVER,
        directory=directory,
    ) as made:
        yield made


@pytest.fixture(scope="module")
def controller(
    crd: None,
    device_class: str,
    identity: ChartIdentity,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ControllerProcess]:
    """One controller for the driver of this module, leading its own Lease."""
    proc = ControllerProcess(
        kubeconfig=identity.kubeconfig,
        log_path=tmp_path_factory.mktemp("controller") / "controller.log",
        driver=DRIVER,
        lease=identity.lease,
        lease_namespace=identity.namespace,
        identity=f"e2e-{TOKEN}",
        args=["--stall-after=15"],
    )
    proc.start()
    proc.wait_logged("leading")
    yield proc
    proc.stop()
    print(f"controller log ({proc.log_path}):\n{proc.tail()}")


@pytest.fixture
def rack_node(make_node: Callable[..., dict[str, Any]]) -> str:
    name = f"e2e-rack-{secrets.token_hex(3)}"
    make_node(name, labels={"rack": "a"})
    return name


@pytest.fixture
def pools(kube: Kube) -> Iterator[Callable[..., dict[str, Any]]]:
    """make(name, devices, **spec) creates a DevicePool; all are deleted after, and
    their slices awaited gone so the next test counts devices from zero."""
    made: list[str] = []

    def make(name: str, devices: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
        made.append(name)
        body = {
            "apiVersion": POOL_API,
            "kind": "DevicePool",
            "metadata": {"name": name},
            "spec": {"devices": devices, **spec},
        }
        return kube.create(body)

    yield make
    for name in made:
        kube.delete(POOL_API, "DevicePool", name)
    for name in made:
        wait_for(
            functools.partial(_no_pool_slices, kube, name),
            timeout=30,
            what=f"the slices of DevicePool {name} to go",
        )


def gpu(name: str, product: str = "NVIDIA L4", **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "attributes": {"type": {"string": "gpu"}, "productName": {"string": product}},
        "capacity": {"memory": {"value": "24Gi"}},
        **extra,
    }


RACK_A = {
    "nodeSelectorTerms": [
        {"matchExpressions": [{"key": "rack", "operator": "In", "values": ["a"]}]}
    ]
}


# --- helpers ---------------------------------------------------------------------------


def pool_slices(kube: Kube, pool: str, driver: str = DRIVER) -> list[dict[str, Any]]:
    items = kube.resource(RESOURCE, "ResourceSlice").get(
        field_selector=f"spec.driver={driver},spec.pool.name={pool}"
    )
    return [dict(i.to_dict()) for i in items.items]


def _no_pool_slices(kube: Kube, pool: str) -> bool | NotYet:
    """For wait_for: True once DevicePool `pool` has no slices left."""
    left = pool_slices(kube, pool)
    return not left or NotYet(left)


def ready_condition(kube: Kube, name: str) -> dict[str, Any] | None:
    obj = kube.get(POOL_API, "DevicePool", name)
    for condition in (obj.get("status") or {}).get("conditions") or []:
        if condition["type"] == "Ready":
            return dict(condition)
    return None


def wait_ready(kube: Kube, name: str, status: str, *, generation: int = 1) -> dict[str, Any]:
    def reported() -> Any:
        condition = ready_condition(kube, name)
        if (
            condition
            and condition["status"] == status
            and condition.get("observedGeneration") == generation
        ):
            return condition
        return NotYet(condition)

    result: dict[str, Any] = wait_for(
        reported, timeout=30, what=f"DevicePool {name} Ready={status} (generation {generation})"
    )
    return result


def events(kube: Kube, namespace: str, uid: str, reason: str) -> list[Any]:
    selector = f"involvedObject.uid={uid},reason={reason}"
    return list(kube.core.list_namespaced_event(namespace, field_selector=selector).items)


def wait_event(kube: Kube, namespace: str, uid: str, reason: str, *, timeout: float = 30) -> Any:
    def posted() -> Any:
        found = events(kube, namespace, uid, reason)
        return found[0] if found else NotYet(f"no {reason} event for {uid}")

    return wait_for(posted, timeout=timeout, what=f"a {reason} Event")


def claim_template(
    name: str, *selectors: str, config: dict[str, Any] | None = None
) -> dict[str, Any]:
    request: dict[str, Any] = {"deviceClassName": DRIVER}
    if selectors:
        request["selectors"] = [{"cel": {"expression": s}} for s in selectors]
    devices: dict[str, Any] = {"requests": [{"name": "gpu", "exactly": request}]}
    if config is not None:
        devices["config"] = [
            {"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": config}}
        ]
    return {
        "apiVersion": RESOURCE,
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {"spec": {"devices": devices}},
    }


def pod_claim(kube: Kube, namespace: str, pod_name: str) -> Any:
    obj = kube.get("v1", "Pod", pod_name, namespace)
    statuses = (obj.get("status") or {}).get("resourceClaimStatuses") or []
    names = [s.get("resourceClaimName") for s in statuses if s.get("resourceClaimName")]
    if not names:
        return NotYet(obj.get("status"))
    return kube.get(RESOURCE, "ResourceClaim", names[0], namespace)


def explain_cli(kubeconfig: Path, namespace: str, claim: str) -> subprocess.CompletedProcess[str]:
    """`drasil explain` as a user runs it, for this module's driver."""
    return subprocess.run(
        [sys.executable, "-m", "drasil.driver.cli", "explain", f"--kubeconfig={kubeconfig}",
         f"--driver-name={DRIVER}", "-n", namespace, claim],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def unsatisfiable(kube: Kube, namespace: str, pod_name: str) -> tuple[Any, Any]:
    """The claim of a waiting Pod and the controller's Unsatisfiable Event on it
    (--explain-after is 10 s)."""
    claim = wait_for(lambda: pod_claim(kube, namespace, pod_name), timeout=30, what="the claim")
    event = wait_event(kube, namespace, claim["metadata"]["uid"], "Unsatisfiable", timeout=40)
    return claim, event


def assert_untouched(kube: Kube, namespace: str) -> None:
    """No annotation, finalizer or status field of kopf's or ours on the objects we watch."""
    objects = [
        dict(i.to_dict())
        for i in kube.resource(RESOURCE, "ResourceClaim").get(namespace=namespace).items
    ]
    objects += [
        dict(i.to_dict()) for i in kube.resource("v1", "Pod").get(namespace=namespace).items
    ]
    objects += [dict(i.to_dict()) for i in kube.resource(RESOURCE, "ResourceSlice").get().items]
    assert objects
    for obj in objects:
        meta = obj["metadata"]
        where = f"{obj['kind']} {meta.get('namespace', '')}/{meta['name']}"
        assert not [a for a in meta.get("annotations") or {} if OURS.search(a)], where
        assert not [f for f in meta.get("finalizers") or [] if OURS.search(f)], where
        assert "kopf" not in (obj.get("status") or {}), where


# --- DevicePool ------------------------------------------------------------------------


def test_devicepool_becomes_slices_the_scheduler_allocates_from(
    kube: Kube,
    namespace: str,
    controller: ControllerProcess,
    rack_node: str,
    pools: Callable[..., dict[str, Any]],
) -> None:
    pool = pools("rack-a", [gpu("remote-0"), gpu("remote-1")], nodeSelector=RACK_A)

    condition = wait_ready(kube, "rack-a", "True")
    assert condition["reason"] == "Published"
    assert (
        condition["message"]
        == f"2 devices published in 1 ResourceSlice of pool rack-a (driver {DRIVER})"
    )
    slices = pool_slices(kube, "rack-a")
    assert len(slices) == 1
    spec = slices[0]["spec"]
    assert spec["nodeSelector"] == RACK_A
    assert spec["pool"] == {"name": "rack-a", "generation": 1, "resourceSliceCount": 1}
    assert [d["name"] for d in spec["devices"]] == ["remote-0", "remote-1"]
    assert spec["devices"][0]["attributes"]["productName"] == {"string": "NVIDIA L4"}
    owners = slices[0]["metadata"]["ownerReferences"]
    assert [(o["kind"], o["name"], o["uid"], o["controller"]) for o in owners] == [
        ("DevicePool", "rack-a", pool["metadata"]["uid"], True)
    ]
    status = kube.get(POOL_API, "DevicePool", "rack-a")["status"]
    assert status["publishedSlices"] == [slices[0]["metadata"]["name"]]

    kube.create(claim_template("remote-gpu"), namespace)
    kube.create(pending_pod("worker", template="remote-gpu"), namespace)

    def allocated() -> Any:
        claim = pod_claim(kube, namespace, "worker")
        return claim if claim and (claim.get("status") or {}).get("allocation") else NotYet(claim)

    claim = wait_for(allocated, timeout=60, what="the scheduler to allocate from the DevicePool")
    [result] = claim["status"]["allocation"]["devices"]["results"]
    assert (result["driver"], result["pool"]) == (DRIVER, "rack-a")
    assert result["device"] in ("remote-0", "remote-1")

    def device_status() -> Any:
        c = pod_claim(kube, namespace, "worker")
        entries = (c.get("status") or {}).get("devices") or []
        return c if entries else NotYet(c.get("status"))

    claim = wait_for(device_status, timeout=30, what="the controller to write status.devices")
    [entry] = claim["status"]["devices"]
    assert (entry["driver"], entry["pool"], entry["device"]) == (DRIVER, "rack-a", result["device"])
    assert [(c["type"], c["status"]) for c in entry["conditions"]] == [("Ready", "True")]
    managers = [
        m["manager"]
        for m in claim["metadata"]["managedFields"]
        if m.get("subresource") == "status" and m["operation"] == "Apply"
    ]
    assert managers == ["drasil-controller"]
    assert_untouched(kube, namespace)

    kube.delete(POOL_API, "DevicePool", "rack-a")
    wait_for(
        lambda: not pool_slices(kube, "rack-a") or NotYet(pool_slices(kube, "rack-a")),
        timeout=30,
        what="the slices to go with the DevicePool",
    )


def test_bad_devicepool_is_reported_and_keeps_the_good_slices(
    kube: Kube, controller: ControllerProcess, pools: Callable[..., dict[str, Any]]
) -> None:
    pools("rack-b", [gpu("remote-0")], allNodes=True)
    wait_ready(kube, "rack-b", "True")
    [good] = pool_slices(kube, "rack-b")

    broken = {"name": "remote-0", "attributes": {"bad name!": {"string": "x"}}}
    kube.dyn.resources.get(api_version=POOL_API, kind="DevicePool").patch(
        name="rack-b",
        body={"spec": {"devices": [broken]}},
        content_type="application/merge-patch+json",
    )

    condition = wait_ready(kube, "rack-b", "False", generation=2)
    assert condition["reason"] == "InvalidSpec"
    assert 'device "remote-0": attribute "bad name!"' in condition["message"]
    assert "is not a C identifier" in condition["message"]
    assert condition["message"].endswith("the previously published slices are kept")
    [kept] = pool_slices(kube, "rack-b")
    assert kept["metadata"]["resourceVersion"] == good["metadata"]["resourceVersion"]

    pools("rack-c", [gpu("remote-0"), {"name": "Remote_1"}], allNodes=True)
    condition = wait_ready(kube, "rack-c", "False")
    assert 'device "Remote_1": name is not a DNS label' in condition["message"]
    assert pool_slices(kube, "rack-c") == []
    assert kube.get(POOL_API, "DevicePool", "rack-c")["status"]["publishedSlices"] == []


def test_a_pool_moved_to_another_driver_takes_our_slices_away(
    kube: Kube, controller: ControllerProcess, pools: Callable[..., dict[str, Any]]
) -> None:
    pools("rack-e", [gpu("remote-0")], allNodes=True)
    wait_ready(kube, "rack-e", "True")
    assert pool_slices(kube, "rack-e")

    kube.dyn.resources.get(api_version=POOL_API, kind="DevicePool").patch(
        name="rack-e",
        body={"spec": {"driver": "elsewhere.example.com"}},
        content_type="application/merge-patch+json",
    )

    wait_for(
        lambda: not pool_slices(kube, "rack-e") or NotYet(pool_slices(kube, "rack-e")),
        timeout=30,
        what="our slices of a DevicePool that names another driver to go",
    )
    # Its status is the other driver's controller's to write.
    assert ready_condition(kube, "rack-e") == wait_ready(kube, "rack-e", "True")


# --- claims ----------------------------------------------------------------------------


def test_invalid_opaque_config_gets_an_event_naming_the_field(
    kube: Kube,
    namespace: str,
    controller: ControllerProcess,
    kubectl: Callable[..., Any],
    tmp_path: Path,
) -> None:
    config = {"apiVersion": CONFIG_API, "kind": "GpuConfig", "sharing": {"strategy": "Foo"}}
    template = kube.create(claim_template("bad-sharing", config=config), namespace)
    # kubectl, not the Python client: the API server keeps opaque parameters byte for
    # byte, and json.dumps' spaces would make every later patch of the claim fail
    # "spec: field is immutable".
    manifest = tmp_path / "claim.json"
    body = {
        "apiVersion": RESOURCE,
        "kind": "ResourceClaim",
        "metadata": {"name": "bad-sharing", "namespace": namespace},
        "spec": claim_template("x", config=config)["spec"]["spec"],
    }
    manifest.write_text(json.dumps(body, separators=(",", ":")))
    kubectl("create", "-f", str(manifest))
    claim = kube.get(RESOURCE, "ResourceClaim", "bad-sharing", namespace)
    waiting = kube.create(pending_pod("user", claim="bad-sharing"), namespace)

    expected = (
        'spec.devices.config[0].opaque.parameters.sharing.strategy: unsupported value "Foo": '
        'allowed values are "Exclusive", "TimeSlicing", "MPS"'
    )
    event = wait_event(kube, namespace, claim["metadata"]["uid"], "InvalidDeviceConfig")
    assert event.message == expected
    assert event.type == "Warning"
    assert event.source.component == "drasil-controller"
    on_template = wait_event(kube, namespace, template["metadata"]["uid"], "InvalidDeviceConfig")
    assert on_template.message == expected.replace("spec.devices", "spec.spec.devices")
    on_pod = wait_event(kube, namespace, waiting["metadata"]["uid"], "InvalidDeviceConfig")
    assert on_pod.message == f"ResourceClaim bad-sharing: {expected}"

    # A change that does not fix the config does not repeat the Event; a claim created
    # after the change is checked after it, so its Event marks the change as seen.
    client.CustomObjectsApi(kube.api).patch_namespaced_custom_object(
        "resource.k8s.io",
        "v1",
        namespace,
        "resourceclaims",
        "bad-sharing",
        {"metadata": {"labels": {"touched": "yes"}}},
    )
    config["sharing"] = {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Forever"}}
    marker = kube.create(
        {
            "apiVersion": RESOURCE,
            "kind": "ResourceClaim",
            "metadata": {"name": "bad-interval"},
            "spec": claim_template("x", config=config)["spec"]["spec"],
        },
        namespace,
    )
    later = wait_event(kube, namespace, marker["metadata"]["uid"], "InvalidDeviceConfig")
    assert "sharing.timeSlicing.interval" in later.message
    assert '"Forever"' in later.message
    assert len(events(kube, namespace, claim["metadata"]["uid"], "InvalidDeviceConfig")) == 1
    assert_untouched(kube, namespace)


MPS_ON_AN_ADMIN_REQUEST = (
    'spec.devices.config[0].opaque.parameters.sharing.strategy: unsupported value "MPS" '
    "for a device of an admin-access request: such a request sits beside the claim that "
    'holds the device and takes no sharing of its own; allowed values are "Exclusive", '
    '"TimeSlicing" (or no config for that request)'
)


def test_mps_on_an_admin_access_request_is_an_event_when_the_claim_is_created(
    kube: Kube,
    namespace: str,
    controller: ControllerProcess,
    kubectl: Callable[..., Any],
    tmp_path: Path,
) -> None:
    """MPS runs for every GPU and MIG device, shared or allocated whole, except one of an
    admin-access request: that claim is refused before any node would prepare it, and a
    claim with MPS on a request of its own is not."""
    # Admin access is for namespaces an administrator marked so (DRAAdminAccess).
    label = {"metadata": {"labels": {"resource.kubernetes.io/admin-access": "true"}}}
    kube.core.patch_namespace(namespace, label, _request_timeout=30)
    mps = f'{{"apiVersion":"{CONFIG_API}","kind":"GpuConfig","sharing":{{"strategy":"MPS"}}}}'
    admin = _devices_json(mps).replace(
        f'"deviceClassName":"{DRIVER}"', f'"deviceClassName":"{DRIVER}","adminAccess":true'
    )
    for name, devices in (("mps-gpu", _devices_json(mps)), ("mps-admin", admin)):
        kubectl("create", "-f", str(_claim_file(tmp_path, namespace, name, devices)))

    def refused() -> Any:
        found = events(kube, namespace, _uid(kube, namespace, "mps-admin"), "InvalidDeviceConfig")
        return found[0] if found else NotYet("no InvalidDeviceConfig event for mps-admin")

    on_admin = wait_for(refused, timeout=30, what="the MPS refusal of mps-admin")
    assert on_admin.message == MPS_ON_AN_ADMIN_REQUEST
    assert on_admin.source.component == "drasil-controller"
    # Checked by then (the claims were created in this order, and each event is handled
    # in order): MPS on a GPU of the claim's own is no problem.
    assert events(kube, namespace, _uid(kube, namespace, "mps-gpu"), "InvalidDeviceConfig") == []


def test_unmatched_selector_is_explained_within_30s(
    kube: Kube,
    kubeconfig: Path,
    namespace: str,
    controller: ControllerProcess,
    rack_node: str,
    pools: Callable[..., dict[str, Any]],
) -> None:
    pools("rack-d", [gpu("remote-0"), gpu("remote-1")], nodeSelector=RACK_A)
    wait_ready(kube, "rack-d", "True")
    kube.create(claim_template("h200", H200), namespace)
    started = time.monotonic()
    waiting = kube.create(pending_pod("trainer", template="h200"), namespace)
    claim = wait_for(lambda: pod_claim(kube, namespace, "trainer"), timeout=30, what="the claim")

    # The default --explain-after (10 s) applies; 30 s from the Pod's creation on.
    left = 30 - (time.monotonic() - started)
    event = wait_event(kube, namespace, claim["metadata"]["uid"], "Unsatisfiable", timeout=left)

    expected = (
        f'request "gpu": 2 devices of {DRIVER}; 2 pass class {DRIVER}; 0 pass selector {H200}'
    )
    assert event.message == expected
    on_pod = wait_event(kube, namespace, waiting["metadata"]["uid"], "Unsatisfiable")
    assert on_pod.message == f"ResourceClaim {claim['metadata']['name']}: {expected}"
    # `drasil explain` reads the same objects and says the same.
    api = KubeApi(kube.api)
    explanation = explain_from_api(
        api, namespace=namespace, name=claim["metadata"]["name"], driver=DRIVER
    )
    assert explanation.message() == expected
    cli = explain_cli(kubeconfig, namespace, claim["metadata"]["name"])
    assert cli.returncode == 0, cli.stderr
    assert f"0 pass selector {H200}" in cli.stdout
    assert_untouched(kube, namespace)


def test_a_rolled_controller_neither_loses_nor_doubles_an_event(
    kube: Kube,
    namespace: str,
    controller: ControllerProcess,
    rack_node: str,
    pools: Callable[..., dict[str, Any]],
) -> None:
    """The Deployment rolled while claims are pending. Expected: each claim explained
    before the roll keeps one Unsatisfiable Event (count 1: the new leader's post of the
    same text is the same Event); a claim that became pending while no controller ran
    is explained by the new leader; no Event storm (one Event per claim and Pod)."""
    pools("rack-r", [gpu("remote-0")], nodeSelector=RACK_A)
    wait_ready(kube, "rack-r", "True")
    kube.create(claim_template("h200-r", H200), namespace)
    before = [uid for i in range(3) for uid in _pending_claim(kube, namespace, f"roll-{i}")]
    for uid in before:
        wait_event(kube, namespace, uid, "Unsatisfiable")
    leading = _count_logged(controller, "leading")
    controller.stop()
    during = _pending_claim(kube, namespace, "roll-3")
    controller.start()
    wait_for(
        lambda: _count_logged(controller, "leading") > leading or NotYet(controller.tail(5)),
        timeout=60,
        what="the new controller to lead",
    )
    for uid in during:
        wait_event(kube, namespace, uid, "Unsatisfiable")
    time.sleep(15)  # past --explain-after: the new leader re-explained every claim
    for uid in [*before, *during]:  # each claim and each waiting Pod
        (event,) = events(kube, namespace, uid, "Unsatisfiable")
        assert event.count == 1, event
    assert_untouched(kube, namespace)


def _pending_claim(kube: Kube, namespace: str, pod: str) -> tuple[str, str]:
    """A Pod whose claim (of template h200-r) can never be allocated; the UIDs of the
    claim and the Pod."""
    made = kube.create(pending_pod(pod, template="h200-r"), namespace)
    claim = wait_for(lambda: pod_claim(kube, namespace, pod), timeout=30, what="the claim")
    return str(claim["metadata"]["uid"]), str(made["metadata"]["uid"])


def _count_logged(controller: ControllerProcess, message: str) -> int:
    return sum(1 for entry in controller.logs() if entry.get("msg") == message)


def node_slice(node: dict[str, Any], devices: list[dict[str, Any]]) -> dict[str, Any]:
    """A node-local ResourceSlice of this module's driver, owned by (and deleted with)
    the Node, as a node's plugin publishes it."""
    name = node["metadata"]["name"]
    return {
        "apiVersion": RESOURCE,
        "kind": "ResourceSlice",
        "metadata": {
            "name": f"{name}-{DRIVER}",
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "Node", "name": name, "uid": node["metadata"]["uid"]}
            ],
        },
        "spec": {
            "driver": DRIVER,
            "nodeName": name,
            "pool": {"name": name, "generation": 1, "resourceSliceCount": 1},
            "devices": devices,
        },
    }


def test_gpus_spread_over_nodes_are_explained(
    kube: Kube,
    kubeconfig: Path,
    namespace: str,
    controller: ControllerProcess,
    make_node: Callable[..., dict[str, Any]],
) -> None:
    """Three free GPUs in the cluster, one per node, and a claim for two: kube-scheduler
    says only "cannot allocate all claims"; the Event says that no node has two."""
    for i in range(3):
        node = make_node(f"e2e-spread-{TOKEN}-{i}")
        kube.create(node_slice(node, [gpu("gpu-0")]))
    template = claim_template("pair")
    template["spec"]["spec"]["devices"]["requests"][0]["exactly"]["count"] = 2
    kube.create(template, namespace)
    kube.create(pending_pod("pair-trainer", template="pair"), namespace)
    claim, event = unsatisfiable(kube, namespace, "pair-trainer")

    assert event.message == (
        "a claim's devices must all be reachable from the one node its Pod runs on, and no "
        f"node has enough: free devices on 3 nodes; node e2e-spread-{TOKEN}-0 comes closest "
        "with 1 of the 2 needed"
    )
    cli = explain_cli(kubeconfig, namespace, claim["metadata"]["name"])
    assert cli.returncode == 0, cli.stderr
    assert "3  free (2 needed)" in cli.stdout
    assert event.message in cli.stdout
    assert_untouched(kube, namespace)


def test_a_pods_node_selector_that_rules_out_the_free_gpus_is_explained(
    kube: Kube,
    kubeconfig: Path,
    namespace: str,
    controller: ControllerProcess,
    make_node: Callable[..., dict[str, Any]],
) -> None:
    """The only free GPU is on a node the Pod's nodeSelector excludes."""
    with_gpu = make_node(f"e2e-sel-{TOKEN}-gpu", labels={"team": "a"})
    kube.create(node_slice(with_gpu, [gpu("gpu-0")]))
    make_node(f"e2e-sel-{TOKEN}-cpu", labels={"team": "b"})
    kube.create(claim_template("one"), namespace)
    waiting = pending_pod("team-b-trainer", template="one")
    waiting["spec"]["nodeSelector"] = {"team": "b"}
    kube.create(waiting, namespace)
    claim, event = unsatisfiable(kube, namespace, "team-b-trainer")

    assert event.message == (
        "the Pod's node constraints rule out every node with free devices: "
        f"e2e-sel-{TOKEN}-gpu (nodeSelector team=b)"
    )
    explanation = explain_from_api(
        KubeApi(kube.api), namespace=namespace, name=claim["metadata"]["name"], driver=DRIVER
    )
    assert explanation.message() == event.message
    assert_untouched(kube, namespace)


def test_a_satisfiable_claim_the_scheduler_leaves_pending_is_called_a_stall(
    kube: Kube,
    namespace: str,
    controller: ControllerProcess,
    make_node: Callable[..., dict[str, Any]],
) -> None:
    """A free GPU and a Pod whose scheduler never comes (a schedulerName nobody serves):
    the claim stays unallocated though it could be allocated. After --stall-after (15 s
    here) of explanations that find it satisfiable, the claim and the Pod are told the
    wait is not capacity, and the metric counts it."""
    node = make_node(f"e2e-stall-{TOKEN}")
    kube.create(node_slice(node, [gpu("gpu-0")]))
    kube.create(claim_template("free"), namespace)
    waiting = pending_pod("never-scheduled", template="free")
    waiting["spec"]["schedulerName"] = f"no-scheduler-{TOKEN}"
    pod = kube.create(waiting, namespace)
    claim = wait_for(
        lambda: pod_claim(kube, namespace, "never-scheduled"), timeout=30, what="the claim"
    )

    # Explained at 10 s (satisfiable: no Event), again at 40 s: stalled for 30 s by then.
    event = wait_event(kube, namespace, claim["metadata"]["uid"], "SchedulerNotRetried", timeout=70)
    assert event.message.startswith("satisfiable since "), event.message
    assert "kube-scheduler has not retried its Pod" in event.message
    on_pod = wait_event(kube, namespace, pod["metadata"]["uid"], "SchedulerNotRetried")
    assert on_pod.message == f"ResourceClaim {claim['metadata']['name']}: {event.message}"
    assert not events(kube, namespace, claim["metadata"]["uid"], "Unsatisfiable")
    assert controller.metrics()["drasil_controller_scheduler_stalls_total"] >= 1
    assert_untouched(kube, namespace)


# --- two replicas ----------------------------------------------------------------------


def lease_holder(kube: Kube, name: str, namespace: str) -> str | None:
    try:
        lease = kube.get("coordination.k8s.io/v1", "Lease", name, namespace)
    except ApiException as err:
        if err.status == 404:
            return None
        raise
    return (lease.get("spec") or {}).get("holderIdentity")


def test_two_replicas_only_the_leader_publishes_and_the_other_takes_over(
    kube: Kube, crd: None, kubeconfig: Path, tmp_path: Path, pools: Callable[..., dict[str, Any]]
) -> None:
    driver = f"ha-{TOKEN}.drasil.dev"
    with chart_identity(
        kube,
        kubeconfig,
        component="controller",
        release=f"ha-{TOKEN}",
        driver=driver,
        directory=tmp_path,
    ) as ha:
        _two_replicas(kube, ha, driver=driver, tmp_path=tmp_path, pools=pools)


def _two_replicas(
    kube: Kube,
    ha: ChartIdentity,
    *,
    driver: str,
    tmp_path: Path,
    pools: Callable[..., dict[str, Any]],
) -> None:
    lease = ha.lease
    replicas = [
        ControllerProcess(
            kubeconfig=ha.kubeconfig,
            log_path=tmp_path / f"replica-{name}.log",
            driver=driver,
            lease=lease,
            lease_namespace=ha.namespace,
            identity=f"replica-{name}",
        )
        for name in ("a", "b")
    ]
    a, b = replicas
    try:
        a.start()
        a.wait_logged("leading")
        b.start()
        b.wait_logged("serving HTTP")
        pools("ha-pool", [gpu("remote-0")], allNodes=True, driver=driver)
        wait_for(lambda: pool_slices(kube, "ha-pool", driver), timeout=30, what="slices of ha-pool")
        wait_ready(kube, "ha-pool", "True")

        assert lease_holder(kube, lease, ha.namespace) == "replica-a"
        metrics_a, metrics_b = a.metrics(), b.metrics()
        assert metrics_a["drasil_controller_leader"] == 1
        assert metrics_a['drasil_controller_pool_publishes_total{result="published"}'] >= 1
        assert metrics_b["drasil_controller_leader"] == 0
        assert not [k for k in metrics_b if k.startswith("drasil_controller_pool_publishes_total")]
        assert not [e for e in b.logs() if e.get("msg") == "leading"]

        a.kill()
        b.wait_logged("leading", timeout=30)
        assert lease_holder(kube, lease, ha.namespace) == "replica-b"
        kube.dyn.resources.get(api_version=POOL_API, kind="DevicePool").patch(
            name="ha-pool",
            body={"spec": {"devices": [gpu("remote-0"), gpu("remote-1")]}},
            content_type="application/merge-patch+json",
        )

        def republished() -> Any:
            slices = pool_slices(kube, "ha-pool", driver)
            devices = [d["name"] for s in slices for d in s["spec"].get("devices") or []]
            return devices == ["remote-0", "remote-1"] or NotYet(slices)

        wait_for(republished, timeout=30, what="the new leader to publish the changed pool")
        assert b.metrics()['drasil_controller_pool_publishes_total{result="published"}'] >= 1
    finally:
        for replica in replicas:
            replica.stop()
            print(f"{replica.identity} log:\n{replica.tail()}")
        kube.delete("coordination.k8s.io/v1", "Lease", lease, ha.namespace)


# --- hostile claims: one Event each, and the controller keeps serving ----------------


def _claim_file(tmp_path: Path, namespace: str, name: str, devices_json: str) -> Path:
    # Written as text: json.dumps would recurse into the deep parameters like the
    # decoders this test is about.
    manifest = tmp_path / f"{name}.json"
    manifest.write_text(
        f'{{"apiVersion":"{RESOURCE}","kind":"ResourceClaim",'
        f'"metadata":{{"name":"{name}","namespace":"{namespace}"}},'
        f'"spec":{{"devices":{devices_json}}}}}'
    )
    return manifest


def _devices_json(parameters: str, *, selector: str | None = None) -> str:
    selectors = (
        f',"selectors":[{{"cel":{{"expression":{json.dumps(selector)}}}}}]' if selector else ""
    )
    return (
        f'{{"requests":[{{"name":"gpu","exactly":{{"deviceClassName":"{DRIVER}"{selectors}}}}}],'
        f'"config":[{{"requests":["gpu"],"opaque":{{"driver":"{DRIVER}",'
        f'"parameters":{parameters}}}}}]}}'
    )


def test_hostile_claims_cost_one_event_each_and_the_controller_keeps_serving(
    kube: Kube,
    namespace: str,
    controller: ControllerProcess,
    kubectl: Callable[..., Any],
    tmp_path: Path,
    pools: Callable[..., dict[str, Any]],
) -> None:
    deep = '{"apiVersion":"%s","kind":"GpuConfig","x":%s}' % (  # noqa: UP031
        CONFIG_API,
        "[" * 3000 + "]" * 3000,
    )
    huge = (
        f'{{"apiVersion":"{CONFIG_API}","kind":"GpuConfig","sharing":{{"strategy":"MPS",'
        '"mps":{"defaultPinnedDeviceMemoryLimit":"1e999999"}}}'
    )
    for name, parameters in (("deep", deep), ("huge", huge)):
        kubectl(
            "create", "-f", str(_claim_file(tmp_path, namespace, name, _devices_json(parameters)))
        )

    allow_nesting()  # this test's own client reads the deep claim back, as a user's would
    deep_event = wait_event(kube, namespace, _uid(kube, namespace, "deep"), "InvalidDeviceConfig")
    assert "nested too deeply" in deep_event.message
    huge_event = wait_event(kube, namespace, _uid(kube, namespace, "huge"), "InvalidDeviceConfig")
    assert "sharing.mps.defaultPinnedDeviceMemoryLimit" in huge_event.message
    assert "out of range" in huge_event.message

    # Selectors the API server accepts that strain an evaluator: nested comprehensions
    # over every attribute (the API server refuses one more level as too costly) and a
    # chain nested 240 deep. Each is explained like any other: an Event, not a crash.
    wide = gpu("wide-0")
    wide["attributes"] |= {f"a{i}": {"int": i} for i in range(29)}
    pools("hostile", [wide], allNodes=True)
    wait_ready(kube, "hostile", "True")
    nested = f'device.attributes["{DRIVER}"]'
    costly = "v0 == 'none'"
    for level in range(3):
        costly = f"{nested}.exists(v{level}, {costly})"
    deep_selector = " + ".join(["1"] * 240) + " < 0"
    for name, selector in (("costly", costly), ("deep-selector", deep_selector)):
        kube.create(claim_template(name, selector), namespace)
        kube.create(pending_pod(f"user-{name}", template=name), namespace)
    for name in ("costly", "deep-selector"):
        _, event = unsatisfiable(kube, namespace, f"user-{name}")
        assert "0 pass selector" in event.message

    assert controller.alive(), controller.tail()
    assert not [e for e in controller.logs() if "RecursionError" in json.dumps(e)]


def _uid(kube: Kube, namespace: str, name: str) -> str:
    return str(kube.get(RESOURCE, "ResourceClaim", name, namespace)["metadata"]["uid"])

"""The chart installed for real: `helm install` into the local cluster with its real node
(containerd, kubelet), the kubelet plugin running as the chart's DaemonSet Pod from the
locally built image (tools.image, imported with `ctr`); a workload Pod gets a GPU;
`helm upgrade` rolls the DaemonSet while the workload keeps running; `helm uninstall`
removes everything it made. Then the same in device-plugin mode (its own resource name,
drasil.dev/install-gpu): the Node advertises the GPUs, a Pod with limits gets one.

The node's own plugin (e2e.harness.cluster.node, driver gpu.drasil.dev) keeps running for the
other node tests; the chart installs a second driver beside it, gpu.install.drasil.dev,
with its own DeviceClass made here (the node tests own gpu.drasil.dev). The values the
local cluster needs are e2e.harness.chart.local_node_values (all ordinary chart values).
"""

from __future__ import annotations

import functools
import json
import secrets
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from drasil.driver.simulated import mpsstandin
from drasil.kubeletplugin.vendors.nvidia.mps.daemons import folder_key
from e2e.harness import versions
from e2e.harness.chart import (
    CHART,
    LocalNode,
    crd_exists,
    crd_terminating_gone,
    helm,
    local_node_values,
    remove_crd,
)
from e2e.harness.cluster.host import free_ports
from e2e.harness.cluster.node import Node
from e2e.harness.kube import RESOURCE, Kube, NotYet, gone, wait_for
from e2e.harness.pods import (
    container_env,
    events,
    node_events,
    pod,
    template,
    visible_uuids,
    wait_running,
)
from e2e.test_controller import pod_claim
from tools.image import LocalImage, build_image, import_image

DRIVER = "gpu.install.drasil.dev"
CLASS = "install.drasil.dev"
PROFILE = "l4:2"
COMMAND = "env | sort; trap 'exit 0' TERM; sleep 3600 & wait"
TIMEOUT = 180
# Host resources each Pod with a whole GPU takes (--host-resources-per-gpu): small, so
# that the workloads fit the local node.
HOST_RESOURCES = {"cpu": "100m", "memory": "128Mi"}


@pytest.fixture(scope="module")
def local_image(node: Node) -> LocalImage:
    image = build_image()
    import_image(image, ctr=node.bin("ctr"), address=node.containerd_socket)
    return image


def _device_class(kube: Kube, name: str, selector: str) -> Iterator[str]:
    """A DeviceClass of one CEL selector, there for the test and deleted after it."""
    kube.delete(RESOURCE, "DeviceClass", name)
    kube.create(
        {
            "apiVersion": RESOURCE,
            "kind": "DeviceClass",
            "metadata": {"name": name},
            "spec": {"selectors": [{"cel": {"expression": selector}}]},
        }
    )
    yield name
    kube.delete(RESOURCE, "DeviceClass", name)


@pytest.fixture
def device_class(kube: Kube) -> Iterator[str]:
    selector = f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].type == "gpu"'
    yield from _device_class(kube, CLASS, selector)


@pytest.fixture
def fabric_class(kube: Kube) -> Iterator[str]:
    """The devices of the test's DevicePool (type fabric-gpu), apart from the GPUs."""
    selector = f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].type == "fabric-gpu"'
    yield from _device_class(kube, f"fabric.{CLASS}", selector)


@pytest.fixture
def crd_restored(kube: Kube) -> Iterator[None]:
    """helm installs the CRD from crds/ and never removes it: put things back."""
    crd_terminating_gone(kube)
    existed = crd_exists(kube)
    yield
    if not existed:
        # Gone before the next install: a CRD still terminating (its DevicePools being
        # removed) is found by helm, which then waits for it until it is NotFound.
        remove_crd(kube)


def _values(node: Node, image: LocalImage, kubeconfig: Path) -> tuple[dict[str, Any], int]:
    ports = free_ports(4)
    here = LocalNode(node.name, node.registrar_dir, node.plugins_dir, node.cdi_dir)
    values = local_node_values(
        here, kubeconfig=kubeconfig, repository=image.repository, tag=image.tag, ports=ports
    )
    values.update(driverName=DRIVER, simulatedProfile=PROFILE, logFormat="text")
    values["controller"]["explainAfterSeconds"] = 2
    values["deviceClasses"] = {"create": False}
    values["kubeletPlugin"]["hostResourcesPerGpu"] = HOST_RESOURCES
    return values, ports[1]


def _helm(kubeconfig: Path, *args: str) -> str:
    return helm(f"--kubeconfig={kubeconfig}", *args, timeout=TIMEOUT + 60).stdout


def _plugin_pods(kube: Kube, namespace: str, release: str) -> list[Any]:
    selector = f"app.kubernetes.io/instance={release},app.kubernetes.io/component=kubelet-plugin"
    pods = kube.core.list_namespaced_pod(namespace, label_selector=selector, _request_timeout=30)
    return list(pods.items)


def _pod(kube: Kube, namespace: str, name: str) -> Any:
    """The Pod as the API server has it (its status and metadata are set)."""
    return kube.core.read_namespaced_pod(name, namespace)


def _ready(pod: Any) -> bool:
    conditions = pod.status.conditions or []
    return any(c.type == "Ready" and c.status == "True" for c in conditions)


def _health(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
        return str(r.read().decode())


def _published(kube: Kube, node: Node) -> Any:
    items = (
        kube.resource(RESOURCE, "ResourceSlice")
        .get(field_selector=f"spec.driver={DRIVER},spec.nodeName={node.name}")
        .items
    )
    devices = [d["name"] for s in items for d in s.spec.devices or []]
    return len(devices) == 2 or NotYet({"devices": devices})


def _workload(kube: Kube, namespace: str, node: Node, device_class: str = CLASS) -> str:
    name = template(kube, namespace, device_class=device_class, name=f"w-{secrets.token_hex(3)}")
    kube.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": node.name},
                "terminationGracePeriodSeconds": 5,
                "automountServiceAccountToken": False,
                "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": name}],
                "containers": [
                    {
                        "name": "main",
                        "image": versions.TEST_IMAGE,
                        "imagePullPolicy": "Never",
                        "command": ["sh", "-c", COMMAND],
                        "resources": {"claims": [{"name": "gpu"}]},
                    }
                ],
            },
        },
        namespace,
    )
    return name


def _running_with_gpu(kube: Kube, namespace: str, name: str) -> str:
    (uuid,) = visible_uuids(_running_env(kube, namespace, name))
    return uuid


def _running_env(kube: Kube, namespace: str, name: str) -> dict[str, str]:
    """The environment of the Pod's container, once it runs (its command prints it)."""

    def running() -> Any:
        pod = _pod(kube, namespace, name)
        if pod.status.phase != "Running":
            return NotYet({"phase": pod.status.phase, "conditions": str(pod.status.conditions)})
        log = kube.core.read_namespaced_pod_log(name, namespace)
        return ("PATH=" in log and log) or NotYet(log)

    log: str = wait_for(running, timeout=TIMEOUT, what=f"Pod {name} to run with its GPU")
    return dict(line.split("=", 1) for line in log.splitlines() if "=" in line)


def _host_resources_debited(kube: Kube, namespace: str, pod: str, node: Node) -> None:
    """The GPUs carry HOST_RESOURCES as an overhead per Pod, and kube-scheduler recorded
    that it debited them for ``pod`` (DRANodeAllocatableResources)."""
    items = (
        kube.resource(RESOURCE, "ResourceSlice")
        .get(field_selector=f"spec.driver={DRIVER},spec.nodeName={node.name}")
        .items
    )
    published = [d.to_dict() for s in items for d in s.spec.devices or []]
    expected = {k: {"overhead": {"perPod": v}} for k, v in HOST_RESOURCES.items()}
    assert [d.get("nodeAllocatableResources") for d in published] == [expected] * 2

    def recorded() -> Any:
        status = kube.get("v1", "Pod", pod, namespace)["status"]
        return status.get("nodeAllocatableResourceClaimStatuses") or NotYet(status)

    [claim] = wait_for(recorded, timeout=60, what=f"Pod {pod}'s host resources recorded")
    debited = {o["name"]: o.get("perPod") for o in claim.get("overhead") or []}
    assert debited == HOST_RESOURCES, claim


def _delete_pod(kube: Kube, namespace: str, name: str) -> None:
    kube.core.delete_namespaced_pod(name, namespace)
    wait_for(
        lambda: gone(kube, "v1", "Pod", name, namespace),
        timeout=TIMEOUT,
        what=f"Pod {name} to be deleted (its claim unprepared by the chart's plugin)",
    )


ATTACHED = "drasil.dev/Attached"
ATTACH_FAILED = "drasil.dev/AttachFailed"


def _fabric_device(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "attributes": {"type": {"string": "fabric-gpu"}},
        "capacity": {"memory": {"value": "24Gi"}},
        "bindsToNode": True,
        "bindingConditions": [ATTACHED],
        "bindingFailureConditions": [ATTACH_FAILED],
    }


def _pool_slices(kube: Kube, name: str) -> list[Any]:
    selector = f"drasil.dev/devicepool={name}"
    return list(kube.resource(RESOURCE, "ResourceSlice").get(label_selector=selector).items)


def _published_pool(kube: Kube, name: str) -> Any:
    pool = kube.get("drasil.dev/v1alpha1", "DevicePool", name)
    conditions = (pool.get("status") or {}).get("conditions") or []
    ok = any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
    items = _pool_slices(kube, name)
    return (ok and items) or NotYet({"conditions": conditions, "slices": len(items)})


def _fabric_device_reaches_a_pod(kube: Kube, namespace: str, node: Node, device_class: str) -> None:
    """A DevicePool of attachable devices (the simulated fabric fails fab-0): a Pod's
    claim is allocated fab-0, its attach fails, the scheduler takes fab-1, the
    controller attaches it, the Pod is bound to the real node and the chart's plugin
    prepares the pool device: the container sees it as a GPU; deleting the Pod
    unprepares it."""
    name = f"{namespace}-fabric"
    kube.create(
        {
            "apiVersion": "drasil.dev/v1alpha1",
            "kind": "DevicePool",
            "metadata": {"name": name},
            "spec": {
                "allNodes": True,
                "devices": [_fabric_device("fab-0"), _fabric_device("fab-1")],
                "simulatedFabric": {"attachSeconds": 2, "failDevices": ["fab-0"]},
            },
        }
    )
    try:
        (published,) = wait_for(
            lambda: _published_pool(kube, name), timeout=TIMEOUT, what=f"DevicePool {name}"
        )
        assert published.spec.driver == DRIVER
        assert published.spec.allNodes is True
        workload = _workload(kube, namespace, node, device_class=device_class)
        env = _running_env(kube, namespace, workload)
        claim = pod_claim(kube, namespace, workload)
        [result] = claim["status"]["allocation"]["devices"]["results"]
        assert (result["pool"], result["device"]) == (name, "fab-1")
        assert env["DRASIL_DEVICE_FAB_1"].startswith("GPU-")
        assert env["DRASIL_DEVICE_FAB_1_POOL"] == name
        assert visible_uuids(env) == [env["DRASIL_DEVICE_FAB_1"]]
        # fab-0 was tried first and failed: the controller tainted it for the retry.
        [failed] = [
            d for s in _pool_slices(kube, name) for d in s.spec.devices if d.name == "fab-0"
        ]
        assert [t.key for t in failed.taints or []] == ["drasil.dev/attach-failed"]
        uid = claim["metadata"]["uid"]
        spec = node.cdi_dir / f"k8s.{DRIVER}-claim_{uid}.json"
        assert spec.is_file()
        _delete_pod(kube, namespace, workload)
        assert not spec.exists(), "the pool device's claim was unprepared"
    finally:
        kube.delete("drasil.dev/v1alpha1", "DevicePool", name)
    wait_for(
        lambda: not _pool_slices(kube, name) or NotYet("slices left"),
        timeout=TIMEOUT,
        what=f"the slices of DevicePool {name} to go with it",
    )


def test_install_upgrade_uninstall(
    kube: Kube,
    kubeconfig: Path,
    namespace: str,
    node: Node,
    local_image: LocalImage,
    device_class: str,
    fabric_class: str,
    crd_restored: None,
    tmp_path: Path,
) -> None:
    release = f"inst{secrets.token_hex(2)}"
    values, health_port = _values(node, local_image, kubeconfig)
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    common = [f"--namespace={namespace}", f"--timeout={TIMEOUT}s", "--wait"]

    # Install: the plugin Pod runs from the local image, registers, publishes.
    _helm(kubeconfig, "install", release, str(CHART), "-f", str(values_file), *common)
    (plugin,) = _plugin_pods(kube, namespace, release)
    assert _ready(plugin)
    wait_for(lambda: _published(kube, node), timeout=TIMEOUT, what=f"{DRIVER} slices")

    def registered() -> Any:
        body = _health(health_port)  # "ok (registered)" once kubelet has said so
        return ("not yet" not in body and "registered" in body) or NotYet(body)

    wait_for(registered, timeout=TIMEOUT, what="kubelet to register the chart's plugin")

    # The controller leads (its Lease) and publishes a DevicePool through the policy
    # that keeps it to non-node-local slices of its driver.
    lease_name = f"{release}-drasil-controller"
    lease = wait_for(
        lambda: kube.get("coordination.k8s.io/v1", "Lease", lease_name, namespace),
        timeout=TIMEOUT,
        what=f"the controller to take the Lease {lease_name}",
    )
    assert lease["spec"]["holderIdentity"].startswith(f"{release}-drasil-controller-")
    _fabric_device_reaches_a_pod(kube, namespace, node, fabric_class)

    # A workload gets a GPU through the chart's driver, and the host resources that go
    # with it: published with each GPU, debited by the scheduler for the Pod.
    first = _workload(kube, namespace, node)
    first_gpu = _running_with_gpu(kube, namespace, first)
    _host_resources_debited(kube, namespace, first, node)
    first_uid = _pod(kube, namespace, first).metadata.uid

    # Upgrade with a changed value: the DaemonSet rolls, the workload keeps running.
    _helm(
        kubeconfig,
        "upgrade",
        release,
        str(CHART),
        "-f",
        str(values_file),
        "--set",
        "verbosity=2",
        *common,
    )

    def rolled() -> Any:
        pods = _plugin_pods(kube, namespace, release)
        fresh = [p for p in pods if p.metadata.uid != plugin.metadata.uid]
        done = len(pods) == 1 and fresh and _ready(fresh[0])
        return done or NotYet([(p.metadata.name, p.status.phase) for p in pods])

    wait_for(rolled, timeout=TIMEOUT, what="the DaemonSet to roll to the upgraded Pod")
    (upgraded,) = _plugin_pods(kube, namespace, release)
    assert "--v=2" in upgraded.spec.containers[0].args
    still = _pod(kube, namespace, first)
    assert still.metadata.uid == first_uid
    assert still.status.phase == "Running"
    assert still.status.container_statuses[0].restart_count == 0
    second = _workload(kube, namespace, node)
    second_gpu = _running_with_gpu(kube, namespace, second)
    assert second_gpu != first_gpu  # two devices, one each

    # Uninstall removes what helm made (workloads first: their claims need the plugin
    # to be unprepared).
    for name in (first, second):
        _delete_pod(kube, namespace, name)
    made = yaml.safe_load_all(
        _helm(kubeconfig, "get", "manifest", release, f"--namespace={namespace}")
    )
    objects = [o for o in made if o]
    kinds = {o["kind"] for o in objects}
    assert kinds >= {"DaemonSet", "Deployment", "ClusterRole", "ValidatingAdmissionPolicy"}
    _helm(
        kubeconfig,
        "uninstall",
        release,
        f"--namespace={namespace}",
        "--wait",
        f"--timeout={TIMEOUT}s",
    )
    for obj in objects:
        meta = obj["metadata"]
        wait_for(
            functools.partial(
                gone, kube, obj["apiVersion"], obj["kind"], meta["name"], meta.get("namespace")
            ),
            timeout=60,
            what=f"{obj['kind']} {meta['name']} to be removed by helm uninstall",
        )
    wait_for(
        lambda: not _plugin_pods(kube, namespace, release) or NotYet("plugin Pods left"),
        timeout=60,
        what="the plugin Pods to go",
    )


# --- device-plugin mode --------------------------------------------------------------

INSTALL_RESOURCE = "drasil.dev/install-gpu"  # apart from test_deviceplugin's drasil.dev/gpu


def test_install_in_device_plugin_mode_advertises_gpus_to_kubelet(
    kube: Kube,
    kubeconfig: Path,
    namespace: str,
    node: Node,
    local_image: LocalImage,
    tmp_path: Path,
) -> None:
    """A cluster without DRA, as an operator installs it: `mode: device-plugin`, no
    controller, no DeviceClasses; the DaemonSet's Pod serves kubelet's device-plugin
    API from the image, the Node advertises the GPUs, a Pod with limits gets one."""
    node.check_device_plugin_socket()
    release = f"dp{secrets.token_hex(2)}"
    values, health_port = _values(node, local_image, kubeconfig)
    values.update(mode="device-plugin", controller={"enabled": False})
    values["validatingAdmissionPolicy"] = {"enabled": False}
    values["kubeletPlugin"]["devicePlugin"] = {"resourceName": INSTALL_RESOURCE}
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    common = [f"--namespace={namespace}", f"--timeout={TIMEOUT}s", "--wait"]

    _helm(kubeconfig, "install", release, str(CHART), "-f", str(values_file), *common)
    try:
        (plugin,) = _plugin_pods(kube, namespace, release)
        assert "--mode=device-plugin" in plugin.spec.containers[0].args
        node.wait_extended_resource(INSTALL_RESOURCE, capacity=2, allocatable=2, timeout=TIMEOUT)
        assert "ok (registered)" in _health(health_port)

        name = pod(kube, namespace, node, limits={INSTALL_RESOURCE: 1})
        wait_running(kube, namespace, name)
        visible = container_env(kube, namespace, name)["NVIDIA_VISIBLE_DEVICES"]
        assert visible.startswith("GPU-")
        assert "," not in visible  # one GPU
        _delete_pod(kube, namespace, name)
    finally:
        _helm(kubeconfig, "uninstall", release, f"--namespace={namespace}", "--wait")
    # The plugin is gone: kubelet counts none of its devices as allocatable.
    node.wait_extended_resource(INSTALL_RESOURCE, allocatable=0, timeout=TIMEOUT)


# --- MPS daemons in Pods of their own -------------------------------------------------

SHARED_CLASS = "install-shared.drasil.dev"
MPS_DAEMONS = f"app.kubernetes.io/component=mps-daemon,drasil.dev/driver={DRIVER}"


@pytest.fixture
def shared_class(kube: Kube) -> Iterator[str]:
    selector = f'device.driver == "{DRIVER}" && device.allowMultipleAllocations'
    yield from _device_class(kube, SHARED_CLASS, selector)


def _mps_client(
    kube: Kube, namespace: str, node: Node, command: str, request: dict[str, Any] | None = None
) -> str:
    """A Pod of the probe image (it has ``mps-client``) with ``request``: by default a
    4Gi share of gpu-0."""
    name = f"mps-{secrets.token_hex(3)}"
    request = request or {
        "deviceClassName": SHARED_CLASS,
        "selectors": [{"cel": {"expression": f'device.attributes["{DRIVER}"].minor == 0'}}],
        "capacity": {"requests": {"memory": "4Gi"}},
    }
    claims = template(kube, namespace, name=name, requests=[{"name": "gpu", "exactly": request}])
    spec = {
        "nodeSelector": {"kubernetes.io/hostname": node.name},
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 1,
        "automountServiceAccountToken": False,
        "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": claims}],
        "containers": [
            {
                "name": "c",
                "image": versions.PROBE_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["sh", "-c", command],
                "resources": {"claims": [{"name": "gpu"}]},
            }
        ],
    }
    kube.create(
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}, namespace
    )
    return name


def _connected(kube: Kube, namespace: str, name: str) -> str:
    def said() -> Any:
        pod = _pod(kube, namespace, name)
        log = (
            kube.core.read_namespaced_pod_log(name, namespace)
            if pod.status.phase != "Pending"
            else ""
        )
        return log if "MPS: connected" in log else NotYet({"phase": pod.status.phase, "log": log})

    log: str = wait_for(said, timeout=TIMEOUT, what=f"{name} connected to its MPS daemon")
    return log


def _daemon_pods(kube: Kube, namespace: str) -> list[Any]:
    return list(kube.core.list_namespaced_pod(namespace, label_selector=MPS_DAEMONS).items)


def _still_held(kube: Kube, namespace: str, held: str, daemon: Any, pipe: Path) -> None:
    """The daemon Pod is the one it was and the held client is still its client."""
    (now,) = _daemon_pods(kube, namespace)
    assert (now.metadata.uid, now.status.phase) == (daemon.metadata.uid, "Running")
    assert int(mpsstandin.control(pipe, "get_client_count")) >= 1
    client = _pod(kube, namespace, held)
    assert client.status.phase == "Running"
    assert "lost" not in kube.core.read_namespaced_pod_log(held, namespace)


def _new_share_connects(kube: Kube, namespace: str, node: Node) -> None:
    name = _mps_client(kube, namespace, node, "mps-client; sleep 3600")
    _connected(kube, namespace, name)
    _delete_pod(kube, namespace, name)


def _replaced(kube: Kube, namespace: str, release: str, old: str) -> Any:
    def ready() -> Any:
        pods = _plugin_pods(kube, namespace, release)
        fresh = [p for p in pods if p.metadata.uid != old]
        done = len(pods) == 1 and fresh and _ready(fresh[0])
        return fresh[0] if done else NotYet([(p.metadata.name, p.status.phase) for p in pods])

    return wait_for(ready, timeout=TIMEOUT, what="a new plugin Pod ready")


def _install(
    kubeconfig: Path, release: str, namespace: str, values: dict[str, Any], tmp_path: Path
) -> tuple[Path, list[str]]:
    """``helm install --wait`` of ``values`` without the admission policy (the sharing
    tests' Pods are the node's); the values file and the flags, for an upgrade."""
    values["validatingAdmissionPolicy"] = {"enabled": False}
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    common = [f"--namespace={namespace}", f"--timeout={TIMEOUT}s", "--wait"]
    _helm(kubeconfig, "install", release, str(CHART), "-f", str(values_file), *common)
    return values_file, common


def _compute_mode(state_dir: Path, gpu: str) -> int:
    path = state_dir / "simulated-gpus.json"
    state = json.loads(path.read_text()) if path.exists() else {}
    return int(((state.get("gpus") or {}).get(gpu) or {}).get("computeMode", 0))


def test_an_mps_daemon_pod_outlives_plugin_restarts_and_updates_with_its_client(
    kube: Kube,
    kubeconfig: Path,
    namespace: str,
    node: Node,
    local_image: LocalImage,
    shared_class: str,
    tmp_path: Path,
) -> None:
    """gpuSharing consumable under the chart: each GPU's MPS daemon runs in a Pod the
    plugin creates on its node; killing the plugin Pod and a `helm upgrade` that rolls
    it leave that Pod and its connected client alone, and the last share's end
    removes it and puts the compute mode back."""
    release = f"mps{secrets.token_hex(2)}"
    values, _ = _values(node, local_image, kubeconfig)
    values.update(gpuSharing="consumable", controller={"enabled": False})
    values_file, common = _install(kubeconfig, release, namespace, values, tmp_path)
    state_dir = node.plugins_dir / DRIVER
    try:
        (plugin,) = _plugin_pods(kube, namespace, release)
        held = _mps_client(kube, namespace, node, "mps-client --hold")
        _connected(kube, namespace, held)
        (daemon,) = _daemon_pods(kube, namespace)
        gpu = daemon.metadata.annotations["drasil.dev/gpu"]
        assert daemon.spec.node_name == node.name
        assert daemon.spec.host_pid is True
        assert not daemon.metadata.owner_references  # not the plugin Pod's: it outlives it
        assert _compute_mode(state_dir, gpu) == 3  # EXCLUSIVE_PROCESS
        pipe = state_dir / "mps" / folder_key(gpu) / "pipe"

        # (a) The plugin Pod killed (no grace): the DaemonSet's new Pod adopts the daemon.
        kube.core.delete_namespaced_pod(plugin.metadata.name, namespace, grace_period_seconds=0)
        plugin = _replaced(kube, namespace, release, plugin.metadata.uid)
        _still_held(kube, namespace, held, daemon, pipe)
        _new_share_connects(kube, namespace, node)

        # (b) An upgrade that rolls the DaemonSet.
        roll = ["--set", "kubeletPlugin.podAnnotations.rolled=yes"]
        _helm(kubeconfig, "upgrade", release, str(CHART), "-f", str(values_file), *roll, *common)
        _replaced(kube, namespace, release, plugin.metadata.uid)
        _still_held(kube, namespace, held, daemon, pipe)
        _new_share_connects(kube, namespace, node)

        # The last share goes: so do the daemon's Pod and the compute mode.
        _delete_pod(kube, namespace, held)
        wait_for(
            lambda: not _daemon_pods(kube, namespace) or NotYet("the MPS daemon Pod is left"),
            timeout=TIMEOUT,
            what="the MPS daemon Pod deleted after the last share",
        )
        assert _compute_mode(state_dir, gpu) == 0
    finally:
        _helm(kubeconfig, "uninstall", release, f"--namespace={namespace}", "--wait")


SMALL_0 = "gpu-0-mig-1g10gb-at-0"  # 9984 MiB on the simulated H100


@pytest.fixture
def mig_class(kube: Kube) -> Iterator[str]:
    selector = f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].type == "mig"'
    yield from _device_class(kube, f"mig.{CLASS}", selector)


def _mig_share(mig_class: str, memory: str) -> dict[str, Any]:
    """A request for a share of the 1g.10gb placement at slice 0."""
    attribute = f'device.attributes["{DRIVER}"]'
    selector = f'{attribute}.profile == "1g.10gb" && {attribute}.placementStart == 0'
    return {
        "deviceClassName": mig_class,
        "selectors": [{"cel": {"expression": selector}}],
        "capacity": {"requests": {"memory": memory}},
    }


def _mig_instances(state_dir: Path) -> list[tuple[int, int]]:
    """(start, size) of the simulated GPU's instances, from its state file."""
    state = json.loads((state_dir / "simulated-gpus.json").read_text())
    return sorted(
        (int(gi["start"]), int(gi["size"]))
        for gpu in state["gpus"].values()
        for gi in gpu.get("gpuInstances") or []
    )


def test_shares_of_a_mig_device_cut_it_once_and_destroy_it_after_the_last(
    kube: Kube,
    kubeconfig: Path,
    namespace: str,
    node: Node,
    local_image: LocalImage,
    mig_class: str,
    tmp_path: Path,
) -> None:
    """migMode dynamic with gpuSharing consumable, as a user installs it: two Pods share
    one MIG placement by memory (one instance, one MPS daemon Pod on it, each client
    with its own limits); a third that does not fit is explained by the controller;
    the first Pod's end leaves the instance to the second, the last one's removes the
    daemon and the instance."""
    release = f"migs{secrets.token_hex(2)}"
    values, _ = _values(node, local_image, kubeconfig)
    values.update(simulatedProfile="h100-80gb:1", migMode="dynamic", gpuSharing="consumable")
    _install(kubeconfig, release, namespace, values, tmp_path)
    state_dir = node.plugins_dir / DRIVER
    try:
        hold = "env | sort; mps-client --hold"
        a = _mps_client(kube, namespace, node, hold, _mig_share(mig_class, "4Gi"))
        b = _mps_client(kube, namespace, node, hold, _mig_share(mig_class, "2Gi"))
        for name in (a, b):
            _connected(kube, namespace, name)
        env_a, env_b = container_env(kube, namespace, a), container_env(kube, namespace, b)
        variable = "DRASIL_DEVICE_" + SMALL_0.upper().replace("-", "_")
        mig = env_a[variable]
        assert mig.startswith("MIG-")
        assert env_b[variable] == mig  # one instance, cut for the first share
        assert env_a["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"
        assert env_b["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=2048M"
        assert env_a[f"{variable}_SHARING_STRATEGY"] == "MPS"
        assert _mig_instances(state_dir) == [(0, 1)]
        (daemon,) = _daemon_pods(kube, namespace)
        assert daemon.metadata.annotations["drasil.dev/gpu"] == mig

        # 4Gi + 2Gi of 9984 MiB leave 3840Mi: a third 4Gi share waits, and says why.
        c = _mps_client(kube, namespace, node, hold, _mig_share(mig_class, "4Gi"))
        left = f"{SMALL_0} has 3840Mi of memory left; request needs 4Gi"
        wait_for(
            lambda: (
                any(left in e for e in events(kube, namespace, c))
                or NotYet(events(kube, namespace, c))
            ),
            timeout=TIMEOUT,
            what="the controller's explanation of the share that does not fit",
        )
        assert _pod(kube, namespace, c).status.phase == "Pending"
        _delete_pod(kube, namespace, c)

        _delete_pod(kube, namespace, a)
        assert _mig_instances(state_dir) == [(0, 1)]
        (still,) = _daemon_pods(kube, namespace)
        assert still.metadata.uid == daemon.metadata.uid
        assert "lost" not in kube.core.read_namespaced_pod_log(b, namespace, _request_timeout=30)
        _delete_pod(kube, namespace, b)
        wait_for(
            lambda: not _daemon_pods(kube, namespace) or NotYet("the MPS daemon Pod is left"),
            timeout=TIMEOUT,
            what="the MIG instance's MPS daemon Pod deleted after the last share",
        )
        # The daemon goes first (its server holds the instance), then the instance.
        wait_for(
            lambda: _mig_instances(state_dir) == [] or NotYet(_mig_instances(state_dir)),
            timeout=TIMEOUT,
            what="the MIG instance destroyed after the last share",
        )
    finally:
        _helm(kubeconfig, "uninstall", release, f"--namespace={namespace}", "--wait")


# --- MPS daemons at node scale: a burst of shares, a daemon killed under its clients -----

BURST_PROFILE = "l4:8"  # 8 GPUs, so 8 daemon Pods start and stop at once
DEATH_TIMEOUT = 30  # the issue's bound: a dead daemon's claims Unhealthy in the Pods' status
# A client that lost its daemon says so and stays: `mps-client --hold` exits 2 about a second
# after the daemon goes, and a Pod that ends (restartPolicy Never) has its claim unprepared
# by kubelet, which then writes no health for it at all. A long-running workload that logs
# the error and lives on is what the Pod status is for.
HOLD_AND_STAY = "mps-client --hold; echo client exited $?; sleep 3600"


def _share_of(minor: int, memory: str = "4Gi") -> dict[str, Any]:
    return {
        "deviceClassName": SHARED_CLASS,
        "selectors": [{"cel": {"expression": f'device.attributes["{DRIVER}"].minor == {minor}'}}],
        "capacity": {"requests": {"memory": memory}},
    }


def _retried(kube: Kube, namespace: str, names: list[str]) -> list[str]:
    """kubelet's retries of a prepare the plugin failed, as it tells the Pods. Not its
    own read of the claim refused before the node authorizer saw the Pod's claim ("no
    relationship found between node ... and this object"): the plugin was not asked."""
    return [
        f"{name}: {said}"
        for name in names
        for said in events(kube, namespace, name)
        if said.startswith("FailedPrepareDynamicResources") and "fetch ResourceClaim" not in said
    ]


def _log(kube: Kube, namespace: str, name: str) -> str:
    return str(kube.core.read_namespaced_pod_log(name, namespace))


def _claim_health(kube: Kube, namespace: str, name: str) -> str | None:
    """The health kubelet shows for the Pod's one claim device (``claim:gpu``)."""
    status = kube.get("v1", "Pod", name, namespace).get("status") or {}
    for container in status.get("containerStatuses") or []:
        for entry in container.get("allocatedResourcesStatus") or []:
            if entry.get("name") == "claim:gpu":
                for resource in entry.get("resources") or []:
                    return str(resource.get("health"))
    return None


def test_mps_daemon_pods_start_and_stop_in_parallel_and_a_dead_one_is_said(
    kube: Kube,
    kubeconfig: Path,
    namespace: str,
    node: Node,
    local_image: LocalImage,
    shared_class: str,
    tmp_path: Path,
) -> None:
    """gpuSharing consumable under the chart, eight GPUs: eight shares created at once
    (one per GPU: eight daemon Pods started in parallel) all run with no prepare retried
    by kubelet, and go at once; then a daemon Pod deleted under two clients: both Pods'
    status shows the claim Unhealthy within 30 s, each gets an MpsDaemonDied Event, a Node
    Event names the GPU, and a new Pod on that GPU gets a new daemon and connects."""
    release = f"mpsn{secrets.token_hex(2)}"
    values, _ = _values(node, local_image, kubeconfig)
    values.update(gpuSharing="consumable", controller={"enabled": False})
    values["simulatedProfile"] = BURST_PROFILE
    _install(kubeconfig, release, namespace, values, tmp_path)
    try:
        hold = "mps-client --hold"
        burst = [_mps_client(kube, namespace, node, hold, _share_of(i)) for i in range(8)]
        for name in burst:
            _connected(kube, namespace, name)
        assert len(_daemon_pods(kube, namespace)) == 8
        assert _retried(kube, namespace, burst) == []
        for name in burst:
            kube.core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
        wait_for(
            lambda: not _daemon_pods(kube, namespace) or NotYet(len(_daemon_pods(kube, namespace))),
            timeout=TIMEOUT,
            what="every MPS daemon Pod deleted after the burst's shares",
        )

        # Two clients of gpu-0's daemon (one after the other: see test_node_sharing).
        clients = []
        for _ in range(2):
            clients.append(_mps_client(kube, namespace, node, HOLD_AND_STAY, _share_of(0)))
            _connected(kube, namespace, clients[-1])
        (daemon,) = _daemon_pods(kube, namespace)
        gpu = daemon.metadata.annotations["drasil.dev/gpu"]
        kube.core.delete_namespaced_pod(daemon.metadata.name, namespace, grace_period_seconds=0)
        for name in clients:
            wait_for(
                lambda name=name: (  # type: ignore[misc]
                    _claim_health(kube, namespace, name) == "Unhealthy"
                    or NotYet(_claim_health(kube, namespace, name))
                ),
                timeout=DEATH_TIMEOUT,
                interval=1.0,
                what=f"Pod {name}'s claim Unhealthy after its MPS daemon died",
            )
            wait_for(
                lambda name=name: (
                    (  # type: ignore[misc]
                        "MPS: lost connection" in (log := _log(kube, namespace, name))
                        and "client exited 2" in log
                    )
                    or NotYet(_log(kube, namespace, name))
                ),
                timeout=DEATH_TIMEOUT,
                what=f"Pod {name}'s client saying it lost its daemon",
            )
        (said,) = node_events(kube, node.name, "MpsDaemonDied", containing=gpu)[-1:]
        assert "restart the Pod" in said

        def told() -> Any:  # posted in the background, after the claims are read
            said = [e for name in clients for e in events(kube, namespace, name)]
            died = sum(e.startswith("MpsDaemonDied") for e in said)
            return True if died == 2 else NotYet(said)

        wait_for(told, timeout=DEATH_TIMEOUT, what="an MpsDaemonDied Event on each client Pod")

        fresh = _mps_client(kube, namespace, node, hold, _share_of(0))
        _connected(kube, namespace, fresh)
        (new,) = _daemon_pods(kube, namespace)
        assert new.metadata.uid != daemon.metadata.uid
        assert new.metadata.annotations["drasil.dev/gpu"] == gpu
        for name in [*clients, fresh]:
            _delete_pod(kube, namespace, name)
        wait_for(
            lambda: not _daemon_pods(kube, namespace) or NotYet("the MPS daemon Pod is left"),
            timeout=TIMEOUT,
            what="the new MPS daemon Pod deleted after the last share",
        )
        assert _compute_mode(node.plugins_dir / DRIVER, gpu) == 0
    finally:
        _helm(kubeconfig, "uninstall", release, f"--namespace={namespace}", "--wait")

"""Pods on a real node get their GPUs: a real kubelet finds the plugin through its plugin
watcher and calls NodePrepareResources/NodeUnprepareResources; containerd reads the
plugin's CDI specs and injects them into real containers (runc).

What is asserted is what a user sees: the env inside the container (its log), the
Pod's events, the CDI file on the node, the plugin's checkpoint and kubelet's own log.
"""

from __future__ import annotations

import json
import re
from typing import Any

from e2e.harness.cluster.node import Node
from e2e.harness.kube import RESOURCE, Kube, NotYet, gone, wait_for
from e2e.harness.pluginproc import DRIVER
from e2e.harness.pods import (
    EXTENDED_RESOURCE,
    POD_TIMEOUT,
    cdi_spec,
    checkpoint,
    container_env,
    delete_pod,
    device_uuid,
    device_variable,
    events,
    pod,
    prepared_in,
    template,
    visible_uuids,
    wait_running,
)

# -- helpers -------------------------------------------------------------------------


def pod_claim(kube: Kube, namespace: str, name: str) -> dict[str, Any]:
    """The ResourceClaim a Pod's claim (template or extended resource) resolved to."""
    p = kube.get("v1", "Pod", name, namespace)
    status = p["status"]
    claim_name = None
    for s in status.get("resourceClaimStatuses") or []:
        claim_name = s.get("resourceClaimName")
    if claim_name is None and status.get("extendedResourceClaimStatus"):
        claim_name = status["extendedResourceClaimStatus"]["resourceClaimName"]
    if claim_name is None:
        for c in p["spec"].get("resourceClaims") or []:
            claim_name = c.get("resourceClaimName")
    assert claim_name, f"Pod {namespace}/{name} has no claim: {status}"
    return kube.get(RESOURCE, "ResourceClaim", claim_name, namespace)


def allocated_device(kube: Kube, claim: dict[str, Any]) -> str:
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert result["driver"] == DRIVER
    return str(result["device"])


def kubelet_log(node: Node) -> str:
    return node.log("kubelet").read_text(errors="replace")


def kubelet_prepared(node: Node, uid: str) -> list[str]:
    """kubelet's own log lines for a successful NodePrepareResources of claim `uid`."""
    return [
        line
        for line in kubelet_log(node).splitlines()
        if "Done calling NodePrepareResources rpc" in line
        and uid in line
        and line.rstrip().endswith("err=null")
    ]


def wait_unprepared(node: Node, uid: str) -> None:
    def clean() -> Any:
        left = {"spec": cdi_spec(node, uid).exists(), "checkpoint": uid in checkpoint(node)}
        return True if not any(left.values()) else NotYet(left)

    wait_for(clean, timeout=POD_TIMEOUT, what=f"claim {uid} unprepared on the node")


def gpu_pod(
    kube: Kube, namespace: str, node: Node, **kw: Any
) -> tuple[str, dict[str, Any], dict[str, str]]:
    """A running Pod with a GPU from a fresh template: (name, claim, container env)."""
    name = pod(kube, namespace, node, template_name=template(kube, namespace, **kw))
    wait_running(kube, namespace, name)
    return name, pod_claim(kube, namespace, name), container_env(kube, namespace, name)


# -- tests ---------------------------------------------------------------------------


def test_plugin_registered_through_kubelets_plugin_watcher(node: Node) -> None:
    log = kubelet_log(node)
    assert re.search(
        r'"Registered DRA plugin".*driverName="gpu.drasil.dev".*chosenService="v1.DRAPlugin"', log
    ), "kubelet's log has no registration of the plugin"
    assert f'path="{node.registrar_dir}' in log  # found by the plugin watcher


def test_pod_sees_its_gpu_and_delete_unprepares(kube: Kube, ns: str, node: Node) -> None:
    name, claim, env = gpu_pod(kube, ns, node)
    uid = claim["metadata"]["uid"]
    device = allocated_device(kube, claim)
    uuid = device_uuid(kube, node, device)
    assert uuid.startswith("GPU-")

    # What the container saw is what our CDI spec says, for the allocated device.
    assert visible_uuids(env) == [uuid]
    assert env[device_variable(device)] == uuid
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void"
    spec = json.loads(cdi_spec(node, uid).read_text())
    assert f"{device_variable(device)}={uuid}" in spec["devices"][0]["containerEdits"]["env"]
    assert spec["annotations"]["drasil.dev/claim-uid"] == uid
    assert checkpoint(node)[uid]["state"] == "PrepareCompleted"
    # kubelet itself called NodePrepareResources and got our CDI device back.
    (line,) = kubelet_prepared(node, uid)[:1]
    assert f"k8s.{DRIVER}/claim={uid}-{device}" in line

    delete_pod(kube, ns, name)
    wait_unprepared(node, uid)
    assert any(
        "Done calling NodeUnprepareResources rpc" in ln and uid in ln
        for ln in kubelet_log(node).splitlines()
    )


def test_two_pods_get_distinct_gpus(kube: Kube, ns: str, node: Node) -> None:
    first, second = (gpu_pod(kube, ns, node) for _ in range(2))
    devices = {allocated_device(kube, first[1]), allocated_device(kube, second[1])}
    assert len(devices) == 2
    seen = visible_uuids(first[2]) + visible_uuids(second[2])
    assert sorted(seen) == sorted(device_uuid(kube, node, d) for d in devices)


def test_one_claim_shared_by_two_pods(kube: Kube, ns: str, node: Node) -> None:
    claim_name = "shared-gpu"
    kube.create(
        {
            "apiVersion": RESOURCE,
            "kind": "ResourceClaim",
            "metadata": {"name": claim_name},
            "spec": {
                "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}
            },
        },
        ns,
    )
    names = [pod(kube, ns, node, claim_name=claim_name) for _ in range(2)]
    for name in names:
        wait_running(kube, ns, name)
    claim = kube.get(RESOURCE, "ResourceClaim", claim_name, ns)
    uid = claim["metadata"]["uid"]
    assert len(claim["status"]["reservedFor"]) == 2
    uuid = device_uuid(kube, node, allocated_device(kube, claim))
    assert [visible_uuids(container_env(kube, ns, n)) for n in names] == [[uuid], [uuid]]

    # Prepared once for the node; stays while one Pod still uses it.
    delete_pod(kube, ns, names[0])
    assert cdi_spec(node, uid).exists()
    assert visible_uuids(container_env(kube, ns, names[1])) == [uuid]
    delete_pod(kube, ns, names[1])
    wait_unprepared(node, uid)


def test_time_slicing_config_reaches_the_container(kube: Kube, ns: str, node: Node) -> None:
    config = {
        "apiVersion": "resource.drasil.dev/v1beta1",
        "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}},
    }
    _, claim, env = gpu_pod(kube, ns, node, config=config)
    variable = device_variable(allocated_device(kube, claim))
    assert env[f"{variable}_SHARING_STRATEGY"] == "TimeSlicing"
    assert env[f"{variable}_TIMESLICE_INTERVAL"] == "Long"


def test_invalid_config_is_reported_in_the_pods_events(kube: Kube, ns: str, node: Node) -> None:
    bad = {
        "apiVersion": "resource.drasil.dev/v1beta1",
        "kind": "GpuConfig",
        "sharing": {"strategy": "Foo"},
    }
    name = pod(kube, ns, node, template_name=template(kube, ns, config=bad))

    def reported() -> Any:
        found = [e for e in events(kube, ns, name) if "sharing.strategy" in e]
        return found or NotYet(events(kube, ns, name))

    (event, *_) = wait_for(
        reported, timeout=POD_TIMEOUT, what=f"the plugin's error in the events of {name}"
    )
    assert "Foo" in event
    assert "TimeSlicing" in event  # names what is allowed
    p = kube.get("v1", "Pod", name, ns)
    assert p["status"]["phase"] == "Pending"  # never started without its device
    uid = pod_claim(kube, ns, name)["metadata"]["uid"]
    assert not cdi_spec(node, uid).exists()


def test_plugin_killed_and_restarted_leaks_nothing(kube: Kube, ns: str, node: Node) -> None:
    keep, keep_claim, keep_env = gpu_pod(kube, ns, node)
    doomed, doomed_claim, _ = gpu_pod(kube, ns, node)

    node.plugin.kill()  # kill -9 while both Pods run
    delete_pod(kube, ns, doomed, wait=False)  # kubelet must unprepare without a plugin
    node.restart_plugin(kill=False)

    delete_pod_uid = doomed_claim["metadata"]["uid"]
    wait_for(
        lambda: gone(kube, "v1", "Pod", doomed, ns),
        timeout=POD_TIMEOUT,
        what=f"Pod {doomed} deleted",
    )
    wait_unprepared(node, delete_pod_uid)
    # The Pod that kept running still has its device; nothing else is held.
    keep_uid = keep_claim["metadata"]["uid"]
    assert set(prepared_in(node, ns)) == {keep_uid, cdi_spec(node, keep_uid).name}
    assert wait_running(kube, ns, keep)["status"]["containerStatuses"][0]["restartCount"] == 0

    _, _, env = gpu_pod(kube, ns, node)
    assert [u[:4] for u in visible_uuids(env)] == ["GPU-"]
    assert visible_uuids(env) != visible_uuids(keep_env)


def test_extended_resource_gets_a_device_through_dra(kube: Kube, ns: str, node: Node) -> None:
    name = pod(kube, ns, node, limits={EXTENDED_RESOURCE: 1})
    wait_running(kube, ns, name)
    claim = pod_claim(kube, ns, name)
    assert (
        claim["metadata"]["annotations"]["resource.kubernetes.io/extended-resource-claim"] == "true"
    )
    uuid = device_uuid(kube, node, allocated_device(kube, claim))
    assert visible_uuids(container_env(kube, ns, name)) == [uuid]
    assert checkpoint(node)[claim["metadata"]["uid"]]["state"] == "PrepareCompleted"

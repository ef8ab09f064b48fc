"""Device health in the Pod's status (KEP-4680, gate ResourceHealthStatus): kubelet
watches drasil's DRAResourceHealth stream and writes what it hears about a container's
devices into `status.containerStatuses[].allocatedResourcesStatus`.

A user sees it as `kubectl get pod -o yaml`. kubelet 1.37 names each entry after the
container's claim reference, `claim:<Pod claim name>` (`claim:<name>/<request>` when
the container names a request), and each device by the CDI ID the plugin returned
from NodePrepareResources (`k8s.gpu.drasil.dev/claim=<claim UID>-<device>`), with a
`health` of Healthy, Unhealthy or Unknown (as measured against kubelet v1.37.1).

The fault is injected with the CLI an operator uses, `drasil fault inject <device>
--plugins-dir <dir>`, against the real node's plugin.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from e2e.harness.cluster.node import Node
from e2e.harness.kube import RESOURCE, Kube, NotYet, wait_for
from e2e.harness.pluginproc import DRIVER
from e2e.harness.pods import pod, template, wait_running

# The plugin resends every 30 s and on every change; kubelet then updates the Pod's
# status on its next sync, so a change shows within a minute or two.
HEALTH_TIMEOUT = 150
DRASIL = Path(sys.executable).with_name("drasil")


def _fault(node: Node, action: str, device: str) -> None:
    subprocess.run(
        [str(DRASIL), "fault", action, device, "--plugins-dir", str(node.plugins_dir)],
        check=True,
        capture_output=True,
        text=True,
    )


def _allocated_device(kube: Kube, ns: str, pod_name: str) -> tuple[str, str, str]:
    """(claim UID, pool, device) of the Pod's one allocated GPU."""
    status = kube.get("v1", "Pod", pod_name, ns)["status"]
    claim = kube.get(
        RESOURCE, "ResourceClaim", status["resourceClaimStatuses"][0]["resourceClaimName"], ns
    )
    result = claim["status"]["allocation"]["devices"]["results"][0]
    return claim["metadata"]["uid"], result["pool"], result["device"]


def _health_of(pod_obj: dict[str, Any], resource: str) -> dict[str, Any]:
    """The container's allocatedResourcesStatus entries, resourceID -> health."""
    statuses = pod_obj.get("status", {}).get("containerStatuses") or []
    found: dict[str, Any] = {}
    for entry in statuses[0].get("allocatedResourcesStatus") or [] if statuses else []:
        if entry.get("name") == resource:
            found |= {r["resourceID"]: r.get("health") for r in entry.get("resources") or []}
    return found


def _wait_health(kube: Kube, ns: str, pod_name: str, resource: str, rid: str, want: str) -> None:
    def reached() -> bool | NotYet:
        p = kube.get("v1", "Pod", pod_name, ns)
        health = _health_of(p, resource)
        if health.get(rid) == want:
            return True
        statuses = p.get("status", {}).get("containerStatuses")
        return NotYet({"health": health, "containerStatuses": statuses})

    wait_for(
        reached,
        timeout=HEALTH_TIMEOUT,
        interval=1.0,
        what=f"{resource} {rid} {want} in Pod {ns}/{pod_name}",
    )


def test_pod_status_follows_device_health(kube: Kube, node: Node, ns: str) -> None:
    name = pod(kube, ns, node, template_name=template(kube, ns))
    wait_running(kube, ns, name)
    uid, pool, device = _allocated_device(kube, ns, name)
    assert pool == node.name
    resource = "claim:gpu"  # the Pod's claim entry; the container names no request
    rid = f"k8s.{DRIVER}/claim={uid}-{device}"
    _wait_health(kube, ns, name, resource, rid, "Healthy")
    try:
        _fault(node, "inject", device)
        _wait_health(kube, ns, name, resource, rid, "Unhealthy")
    finally:
        _fault(node, "clear", device)
    _wait_health(kube, ns, name, resource, rid, "Healthy")

"""`python -m e2e.demo` (what `make demo` runs): drasil on a real local node, end to end.

1. Builds what is missing (Kubernetes, etcd, containerd, runc, CNI plugins, the pause
   and busybox images; all cached under `<cache>/e2e/<version>/`, minutes only once).
2. Starts a local cluster with a real node (`python -m e2e.cluster up --with-node`):
   control plane, containerd, kubelet and the drasil kubelet plugin with a simulated
   8x H100 node. A demo cluster that is still running is reused.
3. Creates the DeviceClass `gpu.drasil.dev` and, in namespace `drasil-demo`, a Pod whose
   ResourceClaimTemplate asks for one GPU; waits until the container ran.
4. Prints Pod → claim → device → UUID → what the container saw, and how to explore and
   stop the cluster, which stays up.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from typing import Any

from kubernetes.client.exceptions import ApiException

from e2e import versions
from e2e.binaries import BuildError
from e2e.cluster import Cluster, ClusterError
from e2e.cluster.node import Node, NodeError
from e2e.kube import Kube, NotYet, gone, wait_for
from e2e.node_images import ImageError
from e2e.pluginproc import DRIVER, GPU_CLASS
from e2e.pods import device_variable, template, visible_uuids

NAMESPACE = "drasil-demo"
POD = "gpu-demo"
TEMPLATE = "one-gpu"
RESOURCE = "resource.k8s.io/v1"
SHOWN_SETTING = "SHARING_STRATEGY"


def say(msg: str) -> None:
    print(f"demo: {msg}", file=sys.stderr, flush=True)


def running_demo_cluster() -> Cluster | None:
    """The newest run started by a previous demo whose every component is healthy."""
    latest = Cluster.latest()
    if latest is None or not latest.state().get("demo") or latest.node is None:
        return None
    status = latest.status()
    return latest if status.running else None


def start_cluster() -> Cluster:
    reused = running_demo_cluster()
    if reused is not None:
        say(f"reusing the demo cluster that is still running ({reused.run_dir})")
        return reused
    cluster = Cluster(out=sys.stderr)
    say(f"starting a cluster with a node in {cluster.run_dir} (the first run builds: minutes)")
    started = time.monotonic()
    cluster.up(with_node=True)
    cluster.save_state(demo=True)
    say(f"cluster and node up in {time.monotonic() - started:.1f}s")
    return cluster


def apply_objects(kube: Kube, node: Node) -> None:
    kube.delete(RESOURCE, "DeviceClass", DRIVER)
    kube.create(GPU_CLASS)
    try:
        kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    except ApiException as e:
        if e.status != 409:
            raise
    wait_for(
        lambda: kube.core.read_namespaced_service_account("default", NAMESPACE),
        timeout=60,
        what=f"ServiceAccount default in {NAMESPACE}",
    )
    # A previous demo's Pod and template in a reused cluster.
    kube.delete("v1", "Pod", POD, NAMESPACE)
    wait_for(
        lambda: gone(kube, "v1", "Pod", POD, NAMESPACE),
        timeout=120,
        what=f"the previous Pod {NAMESPACE}/{POD} deleted",
    )
    kube.delete(RESOURCE, "ResourceClaimTemplate", TEMPLATE, NAMESPACE)
    template(kube, NAMESPACE, name=TEMPLATE)
    kube.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": POD},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": node.name},
                "dnsPolicy": "Default",
                "terminationGracePeriodSeconds": 5,
                "containers": [
                    {
                        "name": "app",
                        "image": versions.TEST_IMAGE,
                        "imagePullPolicy": "Never",
                        "command": [
                            "sh",
                            "-c",
                            "env | grep -E '^(NVIDIA|DRASIL)_' | sort; "
                            "trap 'exit 0' TERM; sleep 86400 & wait",
                        ],
                        "resources": {"claims": [{"name": "gpu"}]},
                    }
                ],
                "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": TEMPLATE}],
            },
        },
        NAMESPACE,
    )


def wait_ran(kube: Kube) -> dict[str, Any]:
    def running() -> Any:
        pod = kube.get("v1", "Pod", POD, NAMESPACE)
        statuses = pod.get("status", {}).get("containerStatuses") or []
        if statuses and statuses[0].get("state", {}).get("running"):
            return pod
        events = kube.core.list_namespaced_event(
            NAMESPACE, field_selector=f"involvedObject.name={POD}"
        ).items
        return NotYet({"phase": pod["status"].get("phase"), "events": [e.message for e in events]})

    pod: dict[str, Any] = wait_for(running, timeout=180, what=f"Pod {NAMESPACE}/{POD} running")
    return pod


def container_saw(kube: Kube) -> dict[str, str]:
    def printed() -> Any:
        log = kube.core.read_namespaced_pod_log(POD, NAMESPACE)
        return log if "DRASIL_DEVICE_" in log else NotYet(log)

    log: str = wait_for(printed, timeout=60, what=f"the log of {NAMESPACE}/{POD}")
    return dict(line.split("=", 1) for line in log.splitlines() if "=" in line)


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def report(kube: Kube, cluster: Cluster, node: Node) -> str:
    pod = kube.get("v1", "Pod", POD, NAMESPACE)
    claim_name = pod["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
    claim = kube.get(RESOURCE, "ResourceClaim", claim_name, NAMESPACE)
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    uuid = "?"
    slices = kube.resource(RESOURCE, "ResourceSlice").get(
        field_selector=f"spec.nodeName={node.name}"
    )
    for s in slices.items:
        for d in s.to_dict()["spec"].get("devices") or []:
            if d["name"] == result["device"]:
                uuid = d["attributes"]["uuid"]["string"]
    saw = container_saw(kube)
    variable = device_variable(result["device"])
    shown = (variable, f"{variable}_{SHOWN_SETTING}")
    seen = ", ".join(f"{k}={saw[k]}" for k in shown if k in saw)
    rows = [
        ["POD", "CLAIM", "DEVICE", "UUID", "THE CONTAINER SAW"],
        [f"{NAMESPACE}/{POD}", claim_name, f"{result['pool']}/{result['device']}", uuid, seen],
    ]
    ok = visible_uuids(saw) == [uuid]
    verdict = (
        "The container got exactly the allocated GPU (kubelet -> drasil -> CDI -> containerd)."
        if ok
        else "MISMATCH: the container did not see the allocated GPU."
    )
    run = shlex.quote(str(cluster.run_dir))
    lines = [
        "",
        table(rows),
        "",
        verdict,
        "",
        "The cluster keeps running. Explore it:",
        f"  export KUBECONFIG={shlex.quote(str(cluster.kubeconfig))}",
        f"  alias kubectl={shlex.quote(str(cluster.bin('kubectl')))}   # {versions.KUBERNETES}",
        "  kubectl get nodes -o wide",
        "  kubectl get resourceslices -o wide   # the 8 simulated H100s drasil published",
        f"  kubectl get resourceclaims -n {NAMESPACE} -o yaml",
        f"  kubectl logs -n {NAMESPACE} {POD}",
        f"  kubectl exec -n {NAMESPACE} {POD} -- env",
        f"  ls {node.cdi_dir}   # the CDI spec containerd read",
        f"  .venv/bin/drasil fault inject gpu-3 --plugins-dir {node.plugins_dir}",
        "  kubectl get resourceslices -o yaml | grep -B2 -A3 taints   # gpu-3 tainted",
        f"  .venv/bin/drasil explain -n {NAMESPACE} <claim>   # what filters the devices",
        f"  less {cluster.logs_dir}/kubelet.log   # and containerd.log, drasil-plugin.log",
        "Stop it (every process, mount, cgroup and the bridge):",
        f"  .venv/bin/python -m e2e.cluster down --run-dir {run}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(
        prog="python -m e2e.demo",
        description="Start a local cluster with a real node running drasil (simulated "
        "8x H100) and a Pod that gets a GPU; leaves the cluster running.",
    ).parse_args(argv)
    try:
        cluster = start_cluster()
        node = cluster.node
        assert node is not None
        kube = Kube(cluster.kubeconfig)
        say(f"creating DeviceClass {DRIVER} and Pod {NAMESPACE}/{POD} with a GPU claim")
        apply_objects(kube, node)
        wait_ran(kube)
        print(report(kube, cluster, node))
    except (BuildError, ImageError, ClusterError, NodeError) as e:
        say(f"failed: {e}")
        return 1
    except AssertionError as e:  # a wait_for timeout says what it waited for
        say(f"failed: {e}")
        return 1
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

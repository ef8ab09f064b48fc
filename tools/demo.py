"""`python -m tools.demo` (what `make demo` runs): drasil installed the way users install
it, on a real local node, end to end.

1. Builds what is missing: Kubernetes, etcd, containerd, runc, CNI plugins, the pause
   and busybox images (cached under `<cache>/e2e/<version>/`), and drasil's image from
   the Dockerfile (`tools.image`, buildah; cached by its inputs). Minutes only once.
2. Starts a local cluster with a real node (control plane, containerd, kubelet); a
   demo cluster that is still running is reused. The harness's own plugin process
   (which the node tests use) stops: the chart's DaemonSet serves the node instead.
3. Imports the image into the node's containerd and runs `helm upgrade --install` of
   charts/drasil (release `drasil`, namespace `drasil-system`): the kubelet plugin
   DaemonSet (simulated 8x H100), the controller Deployment, the DeviceClasses and the
   admission policy. Prints the release's name and status.
4. In namespace `drasil-demo`, a Pod whose ResourceClaimTemplate asks for one GPU of
   the chart's class gpu.drasil.dev; prints Pod -> claim -> device -> UUID -> what the
   container saw.
5. A Pod whose claim asks for a GPU no node has (productName "NVIDIA B300"): waits
   for the controller's `Unsatisfiable` Event on the claim and prints it, then what
   `kubectl drasil explain` says about the claim.

The cluster stays up; the output says how to explore and stop it.
"""

from __future__ import annotations

import argparse
import functools
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml
from kubernetes.client.exceptions import ApiException

from e2e.harness import paths, versions
from e2e.harness.binaries import BuildError
from e2e.harness.chart import CHART, LocalNode, helm, local_node_values
from e2e.harness.cluster import Cluster, ClusterError
from e2e.harness.cluster.host import free_ports
from e2e.harness.cluster.node import Node, NodeError
from e2e.harness.kube import RESOURCE, Kube, NotYet, gone, wait_for
from e2e.harness.node_images import ImageError
from e2e.harness.pods import device_variable, visible_uuids
from tools.image import ImageBuildError, LocalImage, build_image, import_image

NAMESPACE = "drasil-demo"
RELEASE = "drasil"
RELEASE_NAMESPACE = "drasil-system"
POD = "gpu-demo"
TEMPLATE = "one-gpu"
PENDING_POD = "gpu-pending"
PENDING_CLAIM = "no-such-gpu"
MISSING_PRODUCT = "NVIDIA B300"
GPU_CLASS = "gpu.drasil.dev"  # the chart's DeviceClass for whole GPUs
SHOWN_SETTING = "SHARING_STRATEGY"
HOST_PLUGIN = "drasil-plugin"  # the harness's plugin process (e2e.harness.cluster.node)
TIMEOUT = 180


STARTED = time.monotonic()


def say(msg: str) -> None:
    print(f"demo [{time.monotonic() - STARTED:5.1f}s]: {msg}", file=sys.stderr, flush=True)


# ---- the cluster ----------------------------------------------------------------------


def running_demo_cluster() -> Cluster | None:
    """The newest run started by a previous demo whose control plane, containerd and
    kubelet are healthy (its plugin process was stopped on purpose)."""
    latest = Cluster.latest()
    if latest is None or not latest.state().get("demo") or latest.node is None:
        return None
    components = [c for c in latest.status().components if c.name != HOST_PLUGIN]
    return latest if components and all(c.alive and c.healthy for c in components) else None


def start_cluster() -> Cluster:
    reused = running_demo_cluster()
    if reused is not None:
        say(f"reusing the demo cluster that is still running ({reused.run_dir})")
        return reused
    cluster = Cluster(out=sys.stderr)
    say(f"starting a cluster with a node in {cluster.run_dir} (the first run builds: minutes)")
    started = time.monotonic()
    cluster.up(with_node=True)
    cluster.save_state(demo=True, demo_ports=free_ports(4))
    say(f"cluster and node up in {time.monotonic() - started:.1f}s")
    return cluster


def make_way_for_the_chart(node: Node) -> threading.Thread | None:
    """Stop the harness's own plugin process: the chart's DaemonSet serves the same
    driver (gpu.drasil.dev) on the node and takes over its ResourceSlices. It shuts
    down gracefully for seconds: the returned thread waits for that meanwhile."""
    if not node.plugin.running():
        return None
    say(f"stopping the harness's own {HOST_PLUGIN} process: the chart's DaemonSet takes over")
    stopping = threading.Thread(target=node.plugin.stop, name="stop-host-plugin")
    stopping.start()
    return stopping


# ---- helm install -----------------------------------------------------------------------


def chart_values(cluster: Cluster, node: Node, image: LocalImage) -> dict[str, Any]:
    here = LocalNode(node.name, node.registrar_dir, node.plugins_dir, node.cdi_dir)
    ports = cluster.state()["demo_ports"]
    values = local_node_values(
        here,
        kubeconfig=cluster.kubeconfig,
        repository=image.repository,
        tag=image.tag,
        ports=ports,
    )
    values["simulatedProfile"] = "h100-80gb:8"
    values["logFormat"] = "text"
    values["controller"]["explainAfterSeconds"] = 2  # the chart's default is 10
    return values


def adopt_classes(kube: Kube) -> None:
    """An older demo made gpu.drasil.dev itself; helm refuses to take over objects it
    did not make, so such a class goes (no claim of the demo is left using it)."""
    try:
        existing = kube.get(RESOURCE, "DeviceClass", GPU_CLASS)
    except ApiException as e:
        if e.status == 404:
            return
        raise
    labels = existing["metadata"].get("labels") or {}
    if labels.get("app.kubernetes.io/managed-by") != "Helm":
        kube.delete(RESOURCE, "DeviceClass", GPU_CLASS)


def helm_install(cluster: Cluster, values: dict[str, Any]) -> str:
    """`helm upgrade --install --wait`; returns what `helm status` says."""
    values_file = cluster.run_dir / "demo-values.yaml"
    values_file.write_text(yaml.safe_dump(values, sort_keys=False))
    kubeconfig = f"--kubeconfig={cluster.kubeconfig}"
    common = [kubeconfig, f"--namespace={RELEASE_NAMESPACE}"]
    say(f"helm upgrade --install {RELEASE} {CHART.relative_to(paths.CHECKOUT)} -f {values_file}")
    helm(
        "upgrade",
        "--install",
        RELEASE,
        str(CHART),
        "-f",
        str(values_file),
        "--create-namespace",
        "--wait",
        f"--timeout={TIMEOUT}s",
        *common,
        timeout=TIMEOUT + 60,
    )
    return helm("status", RELEASE, *common).stdout


def release_summary(status: str) -> str:
    """The NAME .. REVISION lines of `helm status` (the notes follow them)."""
    head = []
    for line in status.splitlines():
        if not line.strip() or line.startswith(("RESOURCES", "TEST SUITE", "NOTES")):
            break
        head.append(f"  {line}")
    return "\n".join(head)


def wait_chart_serves(kube: Kube, node: Node) -> None:
    def published() -> Any:
        items = (
            kube.resource(RESOURCE, "ResourceSlice")
            .get(field_selector=f"spec.driver={GPU_CLASS},spec.nodeName={node.name}")
            .items
        )
        devices = [d["name"] for s in items for d in s.spec.devices or []]
        return len(devices) == 8 or NotYet({"devices": devices})

    wait_for(published, timeout=TIMEOUT, what="the chart's plugin to publish 8 GPUs")


# ---- the Pods ---------------------------------------------------------------------------


def ensure_namespace(kube: Kube) -> None:
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


def remove_previous(kube: Kube) -> None:
    """A previous demo's Pods and claims in a reused cluster."""
    for name in (POD, PENDING_POD):
        kube.delete("v1", "Pod", name, NAMESPACE)
    for name in (POD, PENDING_POD):
        wait_for(
            functools.partial(gone, kube, "v1", "Pod", name, NAMESPACE),
            timeout=120,
            what=f"the previous Pod {NAMESPACE}/{name} deleted",
        )
    kube.delete(RESOURCE, "ResourceClaimTemplate", TEMPLATE, NAMESPACE)
    kube.delete(RESOURCE, "ResourceClaim", PENDING_CLAIM, NAMESPACE)


def demo_pod(node: Node, name: str, claim: dict[str, str], command: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node.name},
            "dnsPolicy": "Default",
            "terminationGracePeriodSeconds": 5,
            "containers": [
                {
                    "name": "app",
                    "image": versions.TEST_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["sh", "-c", command],
                    "resources": {"claims": [{"name": "gpu"}]},
                }
            ],
            "resourceClaims": [{"name": "gpu", **claim}],
        },
    }


def create_gpu_pod(kube: Kube, node: Node) -> None:
    devices = {"requests": [{"name": "gpu", "exactly": {"deviceClassName": GPU_CLASS}}]}
    kube.create(
        {
            "apiVersion": RESOURCE,
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": TEMPLATE},
            "spec": {"spec": {"devices": devices}},
        },
        NAMESPACE,
    )
    command = "env | grep -E '^(NVIDIA|DRASIL)_' | sort; trap 'exit 0' TERM; sleep 86400 & wait"
    pod = demo_pod(node, POD, {"resourceClaimTemplateName": TEMPLATE}, command)
    kube.create(pod, NAMESPACE)


def create_pending_pod(kube: Kube, node: Node) -> None:
    """A claim for a product no node has, and a Pod that waits for it."""
    selector = f'device.attributes["{GPU_CLASS}"].productName == "{MISSING_PRODUCT}"'
    request = {
        "name": "gpu",
        "exactly": {"deviceClassName": GPU_CLASS, "selectors": [{"cel": {"expression": selector}}]},
    }
    kube.create(
        {
            "apiVersion": RESOURCE,
            "kind": "ResourceClaim",
            "metadata": {"name": PENDING_CLAIM},
            "spec": {"devices": {"requests": [request]}},
        },
        NAMESPACE,
    )
    pod = demo_pod(node, PENDING_POD, {"resourceClaimName": PENDING_CLAIM}, "true")
    kube.create(pod, NAMESPACE)


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

    pod: dict[str, Any] = wait_for(running, timeout=TIMEOUT, what=f"Pod {NAMESPACE}/{POD} running")
    return pod


def container_saw(kube: Kube) -> dict[str, str]:
    def printed() -> Any:
        log = kube.core.read_namespaced_pod_log(POD, NAMESPACE)
        return log if "DRASIL_DEVICE_" in log else NotYet(log)

    log: str = wait_for(printed, timeout=60, what=f"the log of {NAMESPACE}/{POD}")
    return dict(line.split("=", 1) for line in log.splitlines() if "=" in line)


def unsatisfiable_event(kube: Kube) -> str:
    """The controller's Unsatisfiable Event on the pending claim: its message."""

    def posted() -> Any:
        events = kube.core.list_namespaced_event(
            NAMESPACE,
            field_selector=(
                f"involvedObject.kind=ResourceClaim,involvedObject.name={PENDING_CLAIM},"
                "reason=Unsatisfiable"
            ),
        ).items
        return events[-1] if events else NotYet("no Unsatisfiable Event on the claim yet")

    event = wait_for(posted, timeout=90, what=f"the controller's Event on {PENDING_CLAIM}")
    source = event.reporting_component or (event.source.component if event.source else "")
    return f"{event.type} {event.reason} (from {source}): {event.message}"


def kubectl_drasil_explain(cluster: Cluster) -> tuple[str, str]:
    """`kubectl drasil explain` as a user runs it: kubectl finds the kubectl-drasil
    plugin (installed with drasil, here in .venv/bin) on PATH."""
    venv_bin = Path(sys.executable).parent
    env = {
        **os.environ,
        "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}",
        "KUBECONFIG": str(cluster.kubeconfig),
    }
    argv = ["kubectl", "drasil", "explain", "-n", NAMESPACE, PENDING_CLAIM]
    done = subprocess.run(
        [str(cluster.bin("kubectl")), *argv[1:]],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    return shlex.join(argv), (done.stdout + done.stderr).rstrip()


# ---- the report -------------------------------------------------------------------------


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def device_uuid(kube: Kube, node: Node, device: str) -> str:
    slices = kube.resource(RESOURCE, "ResourceSlice").get(
        field_selector=f"spec.nodeName={node.name},spec.driver={GPU_CLASS}"
    )
    for s in slices.items:
        for d in s.to_dict()["spec"].get("devices") or []:
            if d["name"] == device:
                return str(d["attributes"]["uuid"]["string"])
    return "?"


def gpu_report(kube: Kube, node: Node) -> list[str]:
    pod = kube.get("v1", "Pod", POD, NAMESPACE)
    claim_name = pod["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
    claim = kube.get(RESOURCE, "ResourceClaim", claim_name, NAMESPACE)
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    uuid = device_uuid(kube, node, result["device"])
    saw = container_saw(kube)
    variable = device_variable(result["device"])
    shown = (variable, f"{variable}_{SHOWN_SETTING}")
    seen = ", ".join(f"{k}={saw[k]}" for k in shown if k in saw)
    rows = [
        ["POD", "CLAIM", "DEVICE", "UUID", "THE CONTAINER SAW"],
        [f"{NAMESPACE}/{POD}", claim_name, f"{result['pool']}/{result['device']}", uuid, seen],
    ]
    verdict = (
        "The container got exactly the allocated GPU (kubelet -> drasil -> CDI -> containerd)."
        if visible_uuids(saw) == [uuid]
        else "MISMATCH: the container did not see the allocated GPU."
    )
    return [table(rows), "", verdict]


def explore(cluster: Cluster, node: Node) -> list[str]:
    run = shlex.quote(str(cluster.run_dir))
    release = f"-n {RELEASE_NAMESPACE}"
    return [
        "The cluster keeps running. Explore it:",
        f"  export KUBECONFIG={shlex.quote(str(cluster.kubeconfig))}",
        f"  export PATH={shlex.quote(str(cluster.bin('kubectl').parent))}:"
        f"{shlex.quote(str(Path(sys.executable).parent))}:$PATH   # kubectl, kubectl-drasil",
        f"  kubectl get pods {release} -o wide   # the chart's plugin and controller",
        "  kubectl get resourceslices -o wide   # the 8 simulated H100s drasil published",
        f"  kubectl get resourceclaims -n {NAMESPACE} -o yaml",
        f"  kubectl get events -n {NAMESPACE} --field-selector reason=Unsatisfiable",
        f"  kubectl drasil explain -n {NAMESPACE} {PENDING_CLAIM}",
        f"  kubectl logs {release} -l app.kubernetes.io/component=controller",
        f"  kubectl exec -n {NAMESPACE} {POD} -- env",
        f"  ls {node.cdi_dir}   # the CDI spec containerd read",
        f"  less {cluster.logs_dir}/kubelet.log   # and containerd.log",
        "Stop it (every process, mount, cgroup and the bridge):",
        f"  .venv/bin/python -m tools.cluster down --run-dir {run}",
    ]


# ---- main -------------------------------------------------------------------------------


def install(cluster: Cluster, node: Node, kube: Kube) -> str:
    image = build_image(out=sys.stderr)
    stopping = make_way_for_the_chart(node)
    say(f"importing {image.name} into the node's containerd")
    import_image(image, ctr=node.bin("ctr"), address=node.containerd_socket)
    if stopping is not None:
        stopping.join()
    adopt_classes(kube)
    status = helm_install(cluster, chart_values(cluster, node, image))
    wait_chart_serves(kube, node)
    return status


def demo(cluster: Cluster, node: Node) -> str:
    kube = Kube(cluster.kubeconfig)
    status = install(cluster, node, kube)
    ensure_namespace(kube)
    remove_previous(kube)
    say(f"Pod {NAMESPACE}/{POD} with a claim for one GPU of {GPU_CLASS}")
    create_gpu_pod(kube, node)
    say(f"Pod {NAMESPACE}/{PENDING_POD} with claim {PENDING_CLAIM} ({MISSING_PRODUCT})")
    create_pending_pod(kube, node)
    wait_ran(kube)
    gpu = gpu_report(kube, node)
    say("waiting for the controller's Unsatisfiable Event on the pending claim")
    event = unsatisfiable_event(kube)
    command, explained = kubectl_drasil_explain(cluster)
    return "\n".join(
        [
            "",
            f"Helm release {RELEASE} (chart {CHART.relative_to(paths.CHECKOUT)}):",
            release_summary(status),
            "",
            *gpu,
            "",
            f"Pending: Pod {NAMESPACE}/{PENDING_POD}, claim {PENDING_CLAIM} asks for "
            f'productName "{MISSING_PRODUCT}". The controller says:',
            f"  {event}",
            "",
            f"$ {command}",
            explained,
            "",
            *explore(cluster, node),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(
        prog="python -m tools.demo",
        description="Install drasil with helm (the image from the Dockerfile) on a local "
        "cluster with a real node (simulated 8x H100): a Pod gets a GPU, a claim that "
        "cannot be satisfied gets the controller's explanation. Leaves the cluster running.",
    ).parse_args(argv)
    try:
        cluster = start_cluster()
        node = cluster.node
        assert node is not None
        print(demo(cluster, node))
    except (BuildError, ImageError, ImageBuildError, ClusterError, NodeError) as e:
        say(f"failed: {e}")
        return 1
    except AssertionError as e:  # a wait_for timeout or a failed helm says what it was
        say(f"failed: {e}")
        return 1
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

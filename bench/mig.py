"""Prepare+unprepare latency of a dynamic MIG claim beside a whole-GPU claim.

Setup as in ``bench.prepare``: the local control plane (or DRASIL_E2E_KUBECONFIG), a
Node, the plugin process, here in ``--mig-mode dynamic`` with one simulated H100, and
claims whose allocation is written into their status as kube-scheduler writes it.

Measured over the plugin's socket (this process's gRPC client), sequentially:

- ``whole_gpu``: a claim for ``gpu-0``; its prepare makes sure MIG mode is off;
- ``mig_1g``: a claim for the 1g.10gb placement at 0; its prepare switches MIG mode on
  and creates the GPU and compute instance, its unprepare destroys them;
- ``mig_3g_pair``: two claims for both 3g.40gb placements, prepared in one call.

The simulated NVML keeps its state in a file (as a GPU keeps it in the driver), so
the figures include that I/O but none of a real GPU's own time to cut an instance
(hundreds of milliseconds on real hardware); they measure drasil's part.
"""

from __future__ import annotations

import json
import os
import platform
import secrets
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from kubernetes import client

from bench.prepare import cluster_kubeconfig
from bench.stats import percentile
from e2e.harness.kube import Kube
from e2e.harness.pluginproc import DRIVER, ClaimId, KubeletClient, PluginProcess

RUN = secrets.token_hex(3)
NODE = f"bench-mig-{RUN}"
NAMESPACE = f"bench-mig-{RUN}"
ROUNDS = 100


def make_claim(kube: Kube, name: str, devices: list[str]) -> ClaimId:
    """A claim allocated to ``devices`` of the bench node."""
    requests = [
        {"name": f"r{i}", "exactly": {"deviceClassName": DRIVER}} for i in range(len(devices))
    ]
    created = kube.create(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": {"devices": {"requests": requests}},
        },
        NAMESPACE,
    )
    results = [
        {"request": f"r{i}", "driver": DRIVER, "pool": NODE, "device": device}
        for i, device in enumerate(devices)
    ]
    kube.resource("resource.k8s.io/v1", "ResourceClaim").status.patch(
        body={"status": {"allocation": {"devices": {"results": results}}}},
        name=name,
        namespace=NAMESPACE,
        content_type="application/merge-patch+json",
    )
    return ClaimId(namespace=NAMESPACE, name=name, uid=created["metadata"]["uid"])


def pairs(kubelet: KubeletClient, claims: list[ClaimId], rounds: int) -> dict[str, float]:
    prep, unprep = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        prepared = kubelet.prepare(claims).claims
        t1 = time.perf_counter()
        assert all(prepared[c.uid].error == "" for c in claims), prepared
        unprepared = kubelet.unprepare(claims).claims
        t2 = time.perf_counter()
        assert all(unprepared[c.uid].error == "" for c in claims), unprepared
        prep.append(t1 - t0)
        unprep.append(t2 - t1)
    ms = 1000.0
    pair = [p + u for p, u in zip(prep, unprep, strict=True)]
    return {
        "prepare_p50_ms": statistics.median(prep) * ms,
        "prepare_p99_ms": percentile(prep, 99) * ms,
        "unprepare_p50_ms": statistics.median(unprep) * ms,
        "unprepare_p99_ms": percentile(unprep, 99) * ms,
        "pair_p50_ms": statistics.median(pair) * ms,
        "pair_p99_ms": percentile(pair, 99) * ms,
    }


def measure(
    kubeconfig: Path, root: Path, *, rounds: int, plugin_kubeconfig: Path | None = None
) -> dict[str, Any]:
    """The figures; setup runs with ``kubeconfig``, the plugin with ``plugin_kubeconfig``
    (a token with the chart's RBAC in the e2e smoke) when given."""
    kube = Kube(kubeconfig)
    kube.make_node(NODE)
    kube.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=NAMESPACE)))
    plugin = PluginProcess(
        root=root,
        kubeconfig=plugin_kubeconfig or kubeconfig,
        node_name=NODE,
        profile="h100-80gb:1",
        env={"MIG_MODE": "dynamic"},
    )
    plugin.start()
    try:
        kubelet = KubeletClient(plugin)
        whole = make_claim(kube, "whole", ["gpu-0"])
        small = make_claim(kube, "mig-1g", ["gpu-0-mig-1g10gb-at-0"])
        halves = [
            make_claim(kube, f"mig-3g-{start}", [f"gpu-0-mig-3g40gb-at-{start}"])
            for start in (0, 4)
        ]
        return {
            "rounds": rounds,
            "whole_gpu": pairs(kubelet, [whole], rounds),
            "mig_1g": pairs(kubelet, [small], rounds),
            "mig_3g_pair": pairs(kubelet, halves, rounds),
        }
    finally:
        plugin.stop()
        kube.delete("v1", "Namespace", NAMESPACE)
        kube.delete("v1", "Node", NODE)


def run(
    *,
    rounds: int = ROUNDS,
    kubeconfig: Path | None = None,
    plugin_kubeconfig: Path | None = None,
) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="drasil-bench-mig-"))
    try:
        if kubeconfig is not None:
            result = measure(kubeconfig, root, rounds=rounds, plugin_kubeconfig=plugin_kubeconfig)
        else:
            with cluster_kubeconfig() as own:
                result = measure(own, root, rounds=rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version()}
    return result


def main() -> None:
    result = run()
    out = Path(__file__).parent / "results" / "mig.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""Prepare/unprepare latency and throughput of the kubelet plugin over its real socket.

Setup: the local control plane (or DRASIL_E2E_KUBECONFIG), a Node, the plugin process
with a simulated 64-GPU node, and ResourceClaims allocated one device each. The
allocation is written into the claims' status the way kube-scheduler writes it, so
setup does not dominate the run; the plugin reads the claims from the API server on
every cold prepare, as it does for real Pods.

Measured: p50/p99 of a one-device claim's prepare, unprepare and the pair (sequential),
then claims/s with 1, 8 and 32 claims in flight, and the plugin's RSS.

The calls come from `drasil-kubelet-client` (bench/kubeletclient, Go, built and cached
by e2e.build): grpc-go over one connection, as kubelet makes them, so the figures are
the plugin's as kubelet sees them. The same runs with this process's Python gRPC client
follow under "python_client": on a small machine that client's own CPU time is a
good part of what it measures.
"""

from __future__ import annotations

import json
import os
import platform
import secrets
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kubernetes import client

from e2e import binaries
from e2e.cluster import Cluster
from e2e.kube import Kube
from e2e.pluginproc import DRIVER, ClaimId, KubeletClient, PluginProcess

# Unique per run, so the benchmark can run against a cluster that is already in use.
RUN = secrets.token_hex(3)
NODE = f"bench-node-{RUN}"
NAMESPACE = f"bench-{RUN}"
GPUS = 64
LATENCY_ROUNDS = 300
THROUGHPUT_SECONDS = 5.0


@contextmanager
def cluster_kubeconfig() -> Iterator[Path]:
    existing = os.environ.get("DRASIL_E2E_KUBECONFIG")
    if existing:
        yield Path(existing)
        return
    cluster = Cluster()
    cluster.up()
    try:
        yield cluster.kubeconfig
    finally:
        cluster.down()


def make_claims(kube: Kube, count: int) -> list[ClaimId]:
    """Claims allocated to gpu-0..gpu-<count-1> of the bench node."""
    kube.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=NAMESPACE)))
    res = kube.resource("resource.k8s.io/v1", "ResourceClaim")
    claims = []
    for i in range(count):
        created = kube.create(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": f"c{i}"},
                "spec": {
                    "devices": {
                        "requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]
                    }
                },
            },
            NAMESPACE,
        )
        status: dict[str, Any] = {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": f"gpu-{i}"}
                    ]
                }
            }
        }
        res.status.patch(
            body={"status": status},
            name=f"c{i}",
            namespace=NAMESPACE,
            content_type="application/merge-patch+json",
        )
        claims.append(ClaimId(namespace=NAMESPACE, name=f"c{i}", uid=created["metadata"]["uid"]))
    return claims


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def latency(kubelet: KubeletClient, claim: ClaimId) -> dict[str, float]:
    prep, unprep, pair = [], [], []
    for _ in range(LATENCY_ROUNDS):
        t0 = time.perf_counter()
        assert kubelet.prepare([claim]).claims[claim.uid].error == ""
        t1 = time.perf_counter()
        assert kubelet.unprepare([claim]).claims[claim.uid].error == ""
        t2 = time.perf_counter()
        prep.append(t1 - t0)
        unprep.append(t2 - t1)
        pair.append(t2 - t0)
    ms = 1000.0
    return {
        "prepare_p50_ms": statistics.median(prep) * ms,
        "prepare_p99_ms": percentile(prep, 0.99) * ms,
        "unprepare_p50_ms": statistics.median(unprep) * ms,
        "unprepare_p99_ms": percentile(unprep, 0.99) * ms,
        "pair_p50_ms": statistics.median(pair) * ms,
        "pair_p99_ms": percentile(pair, 0.99) * ms,
    }


def throughput(kubelet: KubeletClient, claims: list[ClaimId], inflight: int) -> float:
    """Claims prepared+unprepared per second with ``inflight`` workers."""
    done = [0] * inflight
    stop = time.perf_counter() + THROUGHPUT_SECONDS

    def worker(n: int) -> None:
        mine = claims[n::inflight]
        while time.perf_counter() < stop:
            for claim in mine:
                kubelet.prepare([claim])
                kubelet.unprepare([claim])
                done[n] += 1

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(inflight)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done) / (time.perf_counter() - start)


def kubelet_client(plugin: PluginProcess, claims: list[ClaimId]) -> dict[str, Any]:
    """The same runs from the Go client, in one process: its JSON."""
    binary = binaries.ensure_binaries(["drasil-kubelet-client"])["drasil-kubelet-client"]
    done = subprocess.run(
        [
            str(binary),
            f"-socket={plugin.dra_socket}",
            "-claims=" + ",".join(f"{c.namespace}/{c.name}/{c.uid}" for c in claims),
            f"-rounds={LATENCY_ROUNDS}",
            f"-seconds={THROUGHPUT_SECONDS}",
            "-inflight=1,8,32",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"drasil-kubelet-client failed: {done.stderr.strip()}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def run() -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="drasil-bench-"))
    try:
        with cluster_kubeconfig() as kubeconfig:
            kube = Kube(kubeconfig)
            kube.make_node(NODE)
            plugin = PluginProcess(
                root=root, kubeconfig=kubeconfig, node_name=NODE, profile=f"h100-80gb:{GPUS}"
            )
            plugin.start()
            try:
                claims = make_claims(kube, 32)
                result: dict[str, Any] = kubelet_client(plugin, claims)
                kubelet = KubeletClient(plugin)
                result["python_client"] = {
                    "latency": latency(kubelet, claims[0]),
                    "throughput_claims_per_s": {
                        str(n): throughput(kubelet, claims, n) for n in (1, 8, 32)
                    },
                }
                assert plugin.proc is not None
                result["plugin_rss_mib"] = rss_mib(plugin.proc.pid)
            finally:
                plugin.stop()
                kube.delete("v1", "Namespace", NAMESPACE)
                kube.delete("v1", "Node", NODE)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version()}
    return result


def main() -> None:
    result = run()
    out = Path(__file__).parent / "results" / "prepare.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

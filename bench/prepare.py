"""Prepare/unprepare latency and throughput of drasil's kubelet plugin beside a reference.

Setup: the local control plane (or DRASIL_E2E_KUBECONFIG), a Node, and two drivers on it
(``bench.drivers``): drasil's plugin with 64 simulated GPUs and Kubernetes' own e2e DRA
test driver with 64 devices and its API rate limit lifted. Each gets 32 ResourceClaims
allocated one of its devices; the allocation is written into the claims' status the way
kube-scheduler writes it, so setup does not dominate the run. Both drivers read each
claim from the API server on a cold prepare, as they do for real Pods.

Measured, for each driver: p50/p99 of a one-device claim's prepare, unprepare and the
pair (sequential), claims/s with 1, 8 and 32 claims in flight, and the process's RSS;
then the ratios drasil/reference. The calls come from `drasil-kubelet-client`
(bench/kubeletclient, Go, grpc-go over one connection, as kubelet makes them). The
machine is shared, so the drivers take turns (``ROUNDS`` rounds, interleaved) and each
figure is the median over the rounds; the load average before and after is recorded.

"prepared_scaling": the prepare and the pair of one claim, through drasil's Preparer
in this process (no gRPC, no API server), with 1, 100 and 1,000 other claims already
prepared in the checkpoint: whether a checkpoint write costs more on a full node.
``python -m bench.prepare --scaling-only`` reruns this part alone, into the same JSON.

"python_client": the drasil runs again from this process's Python gRPC client; on a
small machine that client's own CPU time is a good part of what it measures.

"grpc_floor": the Go client against a no-op servicer on drasil's own gRPC server code:
what a pair costs in Python gRPC before a claim is read or a file written.
``bench/results/prepare-profile.txt``: cProfile of pairs through a Preparer in this
process with the claim read from the API server (no gRPC), top functions by own time.
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import platform
import pstats
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kubernetes import client

from bench.drivers import Drasil, DriverUnderTest, Reference
from bench.stats import percentile
from drasil.api.checkpoint import PreparedDevice
from drasil.api.kubelet.dra.v1 import dra_pb2 as v1
from drasil.api.kubelet.dra.v1 import dra_pb2_grpc as v1_grpc
from drasil.driver.cdi.claimspecs import spec_path
from drasil.driver.checkpoint import CHECKPOINT_DIR, CheckpointStore
from drasil.driver.claims.plan import ClaimRef
from drasil.driver.kubeapi import KubeApi, load_api_client
from drasil.driver.nvidia.driveredits import NodeEdits, control_edits
from drasil.driver.nvidia.driverfiles import DriverRoot
from drasil.driver.nvidia.nodedevices import DiscoveryResult, discover
from drasil.driver.simulated.nvml import simulated_library
from drasil.kubeletplugin.dra.prepare import Preparer
from drasil.kubeletplugin.sockets import UnixSocketServer
from e2e.harness import binaries
from e2e.harness.cluster import Cluster
from e2e.harness.driverroot import build_fake_root
from e2e.harness.kube import Kube
from e2e.harness.pluginproc import DRIVER, ClaimId, KubeletClient

# Unique per run, so the benchmark can run against a cluster that is already in use.
RUN = secrets.token_hex(3)
NODE = f"bench-node-{RUN}"
NAMESPACE = f"bench-{RUN}"
GPUS = 64
CLAIMS = 32
LATENCY_ROUNDS = 300
THROUGHPUT_SECONDS = 5.0
INFLIGHT = (1, 8, 32)
ROUNDS = 3
PREPARED_LEVELS = (1, 100, 1000)
SCALING_ROUNDS = 300
PROFILE_PAIRS = 500
PROFILE_PATH = Path(__file__).parent / "results" / "prepare-profile.txt"


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


def make_claims(kube: Kube, driver: DriverUnderTest, count: int) -> list[ClaimId]:
    """Claims ``<label>-<i>`` allocated to the driver's devices 0..count-1 on the node."""
    res = kube.resource("resource.k8s.io/v1", "ResourceClaim")
    claims = []
    for i in range(count):
        name = f"{driver.label}-{i}"
        created = kube.create(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": name},
                "spec": {
                    "devices": {
                        "requests": [{"name": "gpu", "exactly": {"deviceClassName": driver.driver}}]
                    }
                },
            },
            NAMESPACE,
        )
        result = {
            "request": "gpu",
            "driver": driver.driver,
            "pool": NODE,
            "device": driver.device(i),
        }
        res.status.patch(
            body={"status": {"allocation": {"devices": {"results": [result]}}}},
            name=name,
            namespace=NAMESPACE,
            content_type="application/merge-patch+json",
        )
        claims.append(ClaimId(namespace=NAMESPACE, name=name, uid=created["metadata"]["uid"]))
    return claims


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
    return summary(prep=prep, unprep=unprep, pair=pair)


def summary(*, prep: list[float], unprep: list[float], pair: list[float]) -> dict[str, float]:
    ms = 1000.0
    return {
        "prepare_p50_ms": statistics.median(prep) * ms,
        "prepare_p99_ms": percentile(prep, 99) * ms,
        "unprepare_p50_ms": statistics.median(unprep) * ms,
        "unprepare_p99_ms": percentile(unprep, 99) * ms,
        "pair_p50_ms": statistics.median(pair) * ms,
        "pair_p99_ms": percentile(pair, 99) * ms,
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


def kubelet_client(socket: Path, claims: list[ClaimId]) -> dict[str, Any]:
    """The latency and throughput runs from the Go client against ``socket``: its JSON."""
    binary = binaries.ensure_binaries(["drasil-kubelet-client"])["drasil-kubelet-client"]
    done = subprocess.run(
        [
            str(binary),
            f"-socket={socket}",
            "-claims=" + ",".join(f"{c.namespace}/{c.name}/{c.uid}" for c in claims),
            f"-rounds={LATENCY_ROUNDS}",
            f"-seconds={THROUGHPUT_SECONDS}",
            "-inflight=" + ",".join(str(n) for n in INFLIGHT),
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


def median_of(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the rounds (same keys as one round)."""
    first = rounds[0]
    return {
        key: median_of([r[key] for r in rounds])
        if isinstance(first[key], dict)
        else statistics.median(r[key] for r in rounds)
        for key in first
    }


def interleaved(
    drivers: list[DriverUnderTest], claims: Mapping[str, list[ClaimId]]
) -> dict[str, Any]:
    """``ROUNDS`` turns of each driver in alternation; per driver its rounds and medians."""
    rounds: dict[str, list[dict[str, Any]]] = {d.label: [] for d in drivers}
    for _ in range(ROUNDS):
        for d in drivers:
            rounds[d.label].append(kubelet_client(d.dra_socket, claims[d.label]))
    return {
        d.label: {
            **median_of(rounds[d.label]),
            "rss_mib": rss_mib(d.pid),
            "driver": d.driver,
            "rounds": rounds[d.label],
        }
        for d in drivers
    }


def ratios(ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> dict[str, float]:
    """drasil/reference: below 1 is better for times and RSS, above 1 for claims/s."""
    out = {
        "pair_p50": ours["latency"]["pair_p50_ms"] / theirs["latency"]["pair_p50_ms"],
        "pair_p99": ours["latency"]["pair_p99_ms"] / theirs["latency"]["pair_p99_ms"],
        "rss": ours["rss_mib"] / theirs["rss_mib"],
    }
    for n in INFLIGHT:
        out[f"claims_per_s_{n}"] = (
            ours["throughput_claims_per_s"][str(n)] / theirs["throughput_claims_per_s"][str(n)]
        )
    return out


# ---- prepare cost with many claims already prepared --------------------------------


class _OneClaim:
    """A ClaimReader that answers one claim from memory."""

    def __init__(self, claim: Mapping[str, Any]) -> None:
        self.claim = claim

    def get_claim(
        self, namespace: str, name: str, *, cached: bool = False
    ) -> Mapping[str, Any] | None:
        return self.claim


def _filler(store: CheckpointStore, cdi_root: Path, count: int) -> None:
    """``count`` completed claims of another pool's devices: records of realistic size,
    and a CDI spec file each (so that a listing of the CDI dir would cost what it does
    on a full node)."""
    for i in range(count):
        uid = f"00000000-0000-4000-8000-{i:012d}"
        device = PreparedDevice(
            request_names=("gpu",),
            pool_name="elsewhere",
            device_name=f"gpu-{i}",
            cdi_device_ids=(f"k8s.gpu.drasil.dev/claim={uid}-gpu-{i}",),
        )
        store.mark_started(uid, namespace="bench", name=f"filler-{i}", devices=[device])
        store.mark_completed(uid, [device])
        spec_path(cdi_root, driver=DRIVER, claim_uid=uid).write_text("{}")


def _measured_claim(node: str, *, uid: str) -> tuple[DiscoveryResult, ClaimRef, dict[str, Any]]:
    """One simulated H100 on ``node`` and a claim allocated its gpu-0, as the in-process
    measurements prepare it."""
    found = discover(simulated_library("h100-80gb:1", node_name=node), node_name=node)
    ref = ClaimRef(namespace="bench", name="measured", uid=uid)
    result = {"request": "gpu", "driver": DRIVER, "pool": node, "device": "gpu-0"}
    claim = {
        "metadata": {"namespace": "bench", "name": "measured", "uid": uid},
        "status": {"allocation": {"devices": {"results": [result]}}},
    }
    return found, ref, claim


def prepared_scaling() -> dict[str, dict[str, float]]:
    """Prepare and pair of one claim with 1, 100 and 1,000 claims already prepared."""
    node = "scaling-node"
    found, ref, claim = _measured_claim(node, uid="11111111-1111-4111-8111-111111111111")
    out = {}
    for level in PREPARED_LEVELS:
        root = Path(tempfile.mkdtemp(prefix="drasil-bench-scaling-"))
        try:
            (root / "state").mkdir()
            (root / "cdi").mkdir()
            store = CheckpointStore(root / "state" / CHECKPOINT_DIR)
            store.load()
            _filler(store, root / "cdi", level)
            # What the filler wrote is otherwise written back by the kernel during the
            # measurement; a node's earlier claims were written back long ago.
            os.sync()
            preparer = Preparer(
                driver=DRIVER,
                pool=node,
                devices={d.name: d for d in found.devices},
                claims=_OneClaim(claim),
                store=store,
                cdi_root=root / "cdi",
                state_dir=root / "state",
            )
            out[str(level)] = _pairs(preparer, ref)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return out


def _written() -> int:
    """Bytes this process has passed to write(2) so far (``wchar`` of /proc/self/io)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise RuntimeError("no wchar in /proc/self/io")


def _pairs(preparer: Preparer, ref: ClaimRef) -> dict[str, float]:
    prep, unprep, pair = [], [], []
    written = _written()
    for _ in range(SCALING_ROUNDS):
        t0 = time.perf_counter()
        assert preparer.prepare(ref).error == ""
        t1 = time.perf_counter()
        assert preparer.unprepare(ref) == ""
        t2 = time.perf_counter()
        prep.append(t1 - t0)
        unprep.append(t2 - t1)
        pair.append(t2 - t0)
    # Checkpoint, metadata and CDI spec bytes together: what grows if a write copies
    # the other claims' records.
    per_pair = (_written() - written) / SCALING_ROUNDS
    return {**summary(prep=prep, unprep=unprep, pair=pair), "bytes_written_per_pair": per_pair}


# ---- what the driver's files add to a pair ----------------------------------------------

DRIVER_FILES_ROUNDS = 3
HOOK = "/var/lib/kubelet/plugins/gpu.drasil.dev/nvidia-cdi-hook"


def driver_files_cost() -> dict[str, Any]:
    """The in-process pair without and with the driver's files in the spec (a fake
    Debian driver root: its libraries, firmware, utilities, socket and four hooks),
    interleaved, so the difference is what the larger spec and the folder check cost."""
    node = "driver-files-node"
    uid = "22222222-2222-4222-8222-222222222222"
    found, ref, claim = _measured_claim(node, uid=uid)
    root = Path(tempfile.mkdtemp(prefix="drasil-bench-files-"))
    try:
        fake = build_fake_root(root / "driver", layout="debian")
        driver = DriverRoot(host="/run/nvidia/driver", local=fake.root)
        variants = {
            "without": None,
            "with": NodeEdits(control=control_edits(()), root=driver, hook_path=HOOK),
        }
        preparers = {}
        for label, edits in variants.items():
            (root / label / "state").mkdir(parents=True)
            (root / label / "cdi").mkdir()
            store = CheckpointStore(root / label / "state" / CHECKPOINT_DIR)
            store.load()
            preparers[label] = Preparer(
                driver=DRIVER,
                pool=node,
                devices={d.name: d for d in found.devices},
                claims=_OneClaim(claim),
                store=store,
                cdi_root=root / label / "cdi",
                state_dir=root / label / "state",
                node_edits=edits,
            )
        rounds: dict[str, list[dict[str, float]]] = {label: [] for label in variants}
        for _ in range(DRIVER_FILES_ROUNDS):
            for label, preparer in preparers.items():
                rounds[label].append(_pairs(preparer, ref))
        out: dict[str, Any] = {label: median_of(r) for label, r in rounds.items()}
        for label, preparer in preparers.items():
            assert preparer.prepare(ref).error == ""
            out[label]["spec_bytes"] = (
                spec_path(root / label / "cdi", driver=DRIVER, claim_uid=uid).stat().st_size
            )
        out["mounts"] = len(variants["with"].current().mounts) if variants["with"] else 0
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ---- what a pair costs before drasil does anything, and where drasil's time goes ------


class _NoOp(v1_grpc.DRAPluginServicer):
    """Answers each claim with one device and does nothing else."""

    def NodePrepareResources(
        self, request: v1.NodePrepareResourcesRequest, context: Any
    ) -> v1.NodePrepareResourcesResponse:
        response = v1.NodePrepareResourcesResponse()
        for claim in request.claims:
            response.claims[claim.uid].devices.add(
                request_names=["gpu"],
                pool_name=NODE,
                device_name="gpu-0",
                cdi_device_ids=[f"{DRIVER}/claim={claim.uid}-gpu-0"],
            )
        return response

    def NodeUnprepareResources(
        self, request: v1.NodeUnprepareResourcesRequest, context: Any
    ) -> v1.NodeUnprepareResourcesResponse:
        response = v1.NodeUnprepareResourcesResponse()
        for claim in request.claims:
            response.claims[claim.uid].error = ""
        return response


def grpc_floor(root: Path) -> dict[str, Any]:
    """The same client against a no-op servicer on drasil's own gRPC server code (the
    plugin's ``UnixSocketServer``, in this process): the cost of a pair in Python gRPC
    before any claim is read or any file written."""
    socket = root / "floor" / "dra.sock"
    server = UnixSocketServer(socket, lambda s: v1_grpc.add_DRAPluginServicer_to_server(_NoOp(), s))
    server.start()
    try:
        claims = [ClaimId(namespace="floor", name=f"c{i}", uid=f"f-{i}") for i in range(CLAIMS)]
        return kubelet_client(socket, claims)
    finally:
        server.stop()


def preparer_profile(kubeconfig: Path, claim: ClaimId, root: Path) -> str:
    """``PROFILE_PAIRS`` pairs of one claim through a Preparer in this process, reading
    the claim from the API server as the plugin does (no gRPC): cProfile's top
    functions by their own time, as text."""
    found = discover(simulated_library(f"h100-80gb:{GPUS}", node_name=NODE), node_name=NODE)
    (root / "state").mkdir(parents=True)
    (root / "cdi").mkdir()
    store = CheckpointStore(root / "state" / CHECKPOINT_DIR)
    store.load()
    preparer = Preparer(
        driver=DRIVER,
        pool=NODE,
        devices={d.name: d for d in found.devices},
        claims=KubeApi(load_api_client(str(kubeconfig))),
        store=store,
        cdi_root=root / "cdi",
        state_dir=root / "state",
    )
    ref = ClaimRef(namespace=claim.namespace, name=claim.name, uid=claim.uid)
    profile = cProfile.Profile()
    started = time.perf_counter(), time.process_time()
    profile.enable()
    for _ in range(PROFILE_PAIRS):
        assert preparer.prepare(ref).error == ""
        assert preparer.unprepare(ref) == ""
    profile.disable()
    wall, cpu = time.perf_counter() - started[0], time.process_time() - started[1]
    out = io.StringIO()
    out.write(
        f"{PROFILE_PAIRS} prepare+unprepare pairs of one claim through the Preparer in one "
        "thread, the claim read from the API server, no gRPC; under cProfile "
        f"(which slows Python calls down): {wall / PROFILE_PAIRS * 1000:.2f} ms wall and "
        f"{cpu / PROFILE_PAIRS * 1000:.2f} ms CPU a pair\n"
    )
    stats = pstats.Stats(profile, stream=out)
    stats.strip_dirs().sort_stats("tottime").print_stats(30)
    return out.getvalue()


# ---- the run -------------------------------------------------------------------------


def python_client(drasil: Drasil, claims: list[ClaimId]) -> dict[str, Any]:
    assert drasil.plugin is not None
    kubelet = KubeletClient(drasil.plugin)
    try:
        return {
            "latency": latency(kubelet, claims[0]),
            "throughput_claims_per_s": {str(n): throughput(kubelet, claims, n) for n in INFLIGHT},
        }
    finally:
        kubelet.close()


def measure(kube: Kube, kubeconfig: Path, root: Path) -> dict[str, Any]:
    """Both drivers side by side, then the gRPC floor and the Preparer's profile.

    ``kube`` creates the claims; the drivers use ``kubeconfig``. Inside ``bench_node``.
    """
    drasil = Drasil(root / "drasil", kubeconfig, NODE, GPUS)
    reference = Reference(root / "reference", kubeconfig, NODE, GPUS)
    drivers: list[DriverUnderTest] = [drasil, reference]
    try:
        for d in drivers:
            d.start()
        claims = {d.label: make_claims(kube, d, CLAIMS) for d in drivers}
        result: dict[str, Any] = {"drivers": interleaved(drivers, claims)}
        result["drivers"]["drasil"]["python_client"] = python_client(drasil, claims["drasil"])
    finally:
        for d in drivers:
            d.stop()
    result["grpc_floor"] = grpc_floor(root)
    PROFILE_PATH.write_text(preparer_profile(kubeconfig, claims["drasil"][0], root / "profile"))
    return result


@contextmanager
def bench_node(kube: Kube) -> Iterator[None]:
    """The benchmark's Node and namespace, deleted afterwards."""
    kube.make_node(NODE)
    kube.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=NAMESPACE)))
    try:
        yield
    finally:
        kube.delete("v1", "Namespace", NAMESPACE)
        kube.delete("v1", "Node", NODE)


def run() -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="drasil-bench-"))
    load_before = os.getloadavg()
    try:
        with cluster_kubeconfig() as kubeconfig:
            kube = Kube(kubeconfig)
            with bench_node(kube):
                result = measure(kube, kubeconfig, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result["ratios_drasil_to_reference"] = ratios(
        result["drivers"]["drasil"], result["drivers"]["reference"]
    )
    result["prepared_scaling"] = prepared_scaling()
    result["driver_files"] = driver_files_cost()
    result["machine"] = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "loadavg_before": list(load_before),
        "loadavg_after": list(os.getloadavg()),
    }
    result["parameters"] = {
        "gpus": GPUS,
        "claims": CLAIMS,
        "latency_rounds": LATENCY_ROUNDS,
        "throughput_seconds": THROUGHPUT_SECONDS,
        "interleaved_rounds": ROUNDS,
    }
    return result


def table(result: Mapping[str, Any]) -> str:
    """The side-by-side figures and the ratios, for the terminal."""
    ours, theirs = result["drivers"]["drasil"], result["drivers"]["reference"]
    ratio = result["ratios_drasil_to_reference"]
    rows = [
        (
            "pair p50 (ms)",
            ours["latency"]["pair_p50_ms"],
            theirs["latency"]["pair_p50_ms"],
            ratio["pair_p50"],
        ),
        (
            "pair p99 (ms)",
            ours["latency"]["pair_p99_ms"],
            theirs["latency"]["pair_p99_ms"],
            ratio["pair_p99"],
        ),
        *(
            (
                f"claims/s, {n} in flight",
                ours["throughput_claims_per_s"][str(n)],
                theirs["throughput_claims_per_s"][str(n)],
                ratio[f"claims_per_s_{n}"],
            )
            for n in INFLIGHT
        ),
        ("RSS (MiB)", ours["rss_mib"], theirs["rss_mib"], ratio["rss"]),
    ]
    lines = [f"{'':26}{'drasil':>10}{'reference':>11}{'ratio':>8}"]
    lines += [f"{name:26}{a:10.2f}{b:11.2f}{r:8.2f}" for name, a, b, r in rows]
    floor = result.get("grpc_floor")
    if floor:
        lines.append(
            "gRPC floor (a no-op servicer on drasil's server code, same client): pair p50 "
            f"{floor['latency']['pair_p50_ms']:.2f} ms, claims/s "
            + " / ".join(f"{floor['throughput_claims_per_s'][str(n)]:.0f}" for n in INFLIGHT)
            + f" at {' / '.join(str(n) for n in INFLIGHT)} in flight"
        )
    lines.append("prepare with N claims already prepared (in-process Preparer):")
    for level, figures in result["prepared_scaling"].items():
        lines.append(
            f"  N={level:>5}: prepare p50 {figures['prepare_p50_ms']:.3f} ms, "
            f"pair p50 {figures['pair_p50_ms']:.3f} ms, p99 {figures['pair_p99_ms']:.3f} ms, "
            f"{figures['bytes_written_per_pair']:.0f} bytes written a pair"
        )
    files = result.get("driver_files")
    if files:
        without, with_ = files["without"], files["with"]
        lines.append(
            f"the driver's files in the spec ({files['mounts']} mounts, 4 hooks; in-process): "
            f"pair p50 {without['pair_p50_ms']:.3f} -> {with_['pair_p50_ms']:.3f} ms, "
            f"p99 {without['pair_p99_ms']:.3f} -> {with_['pair_p99_ms']:.3f} ms, "
            f"spec {without['spec_bytes']} -> {with_['spec_bytes']} bytes"
        )
    load = result["machine"]
    lines.append(f"load average before {load['loadavg_before']}, after {load['loadavg_after']}")
    lines.append(f"where the Preparer's time goes: {PROFILE_PATH}")
    return "\n".join(lines)


def scaling_only(out: Path) -> None:
    """``--scaling-only``: rerun "prepared_scaling" alone (no cluster, no reference) and
    replace that part of an earlier run's JSON, marked with when and under what load."""
    load_before = os.getloadavg()
    scaling = prepared_scaling()
    result = json.loads(out.read_text()) if out.exists() else {}
    result["prepared_scaling"] = scaling
    result["prepared_scaling_run"] = {
        "separately": True,
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "loadavg_before": list(load_before),
        "loadavg_after": list(os.getloadavg()),
    }
    out.write_text(json.dumps(result, indent=2) + "\n")
    for level, figures in scaling.items():
        print(
            f"N={level:>5}: prepare p50 {figures['prepare_p50_ms']:.3f} ms, "
            f"p99 {figures['prepare_p99_ms']:.3f} ms; pair p50 {figures['pair_p50_ms']:.3f} ms; "
            f"{figures['bytes_written_per_pair']:.0f} bytes written a pair"
        )


def main() -> None:
    out = Path(__file__).parent / "results" / "prepare.json"
    out.parent.mkdir(exist_ok=True)
    if "--scaling-only" in sys.argv[1:]:
        scaling_only(out)
        return
    result = run()
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()

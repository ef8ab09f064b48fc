"""A burst of MPS shares: 64 consumable shares of 8 GPUs prepared at once, then unprepared.

Setup as in ``bench.mig``: the local control plane (or DRASIL_E2E_KUBECONFIG), a Node,
the plugin process with a simulated profile of 8 H100s in ``--gpu-sharing consumable``
(``GPU_SHARING=consumable``), whose MPS control daemons are processes of the simulated
backend's stand-in (``drasil.driver.simulated.mpsstandin``), no Pods. A DeviceClass of
the shareable GPUs, and 64 ResourceClaims each asking it for a share of memory (the GPU's
memory over its shares: 10Gi of an 80 GB H100 for 8 a GPU), allocated as kube-scheduler
allocates a share, written into the claim's status: the GPU, a ``shareID`` and the
``consumedCapacity``. Shares go to the GPUs in turn, so each GPU gets 8.

Measured through `drasil-kubelet-client -burst` (bench/kubeletclient, grpc-go over one
connection, as kubelet calls): all 64 prepared at once (a NodePrepareResources call of
one claim each, concurrently, kubelet's 45 s timeout on each), then, once all returned,
all 64 unprepared at once. Each phase's failed calls (a gRPC error, or an error for the
claim), its wall time, p50/p99/max of one call, the first error texts.

``goal_met``: every prepare within one kubelet call timeout (the whole prepare burst in
45 s of wall time) and no call failed. Alongside: how many GPUs had a stand-in daemon at
once during the run (``daemon_gpus_peak``, polled; one daemon a GPU is expected), and
the stand-in processes of this run still running after the unprepare burst
(``daemons_left``, expected none), and the tmpfs mounts of the daemons left
(``mounts_left``); the warnings and errors of the plugin's log, and the daemons it says
it started and stopped. ``code``: the checkout and commit whose drasil was measured.

``python -m bench.mps --shares 16 --gpus 2`` runs a smaller burst.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import secrets
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client

import drasil.driver
from bench.prepare import cluster_kubeconfig
from drasil.driver.simulated import mpsstandin
from drasil.driver.simulated.gpucatalog import PROFILES
from drasil.driver.simulated.gpus import simulated_gpus
from drasil.kubeletplugin.vendors.nvidia.mps.daemons import DaemonProgram, MpsDaemons
from e2e.harness import binaries
from e2e.harness.kube import RESOURCE, Kube
from e2e.harness.pluginproc import DRIVER, ClaimId, PluginProcess

RUN = secrets.token_hex(3)
NODE = f"bench-mps-{RUN}"
NAMESPACE = f"bench-mps-{RUN}"
SHARED_CLASS = f"bench-mps-{RUN}.{DRIVER}"
MODEL = "h100-80gb"
SHARES = 64
GPUS = 8
CALL_TIMEOUT_S = 45.0  # kubelet's, for each NodePrepareResources call
ATTRS = f'device.attributes["{DRIVER}"]'
STANDIN = mpsstandin.__name__
GPU_ENV = "DRASIL_MPS_GPU"  # what the plugin sets in each daemon's environment
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
POLL_S = 0.1
LOG_LINES_KEPT = 10


@dataclass(frozen=True)
class Share:
    claim: ClaimId
    device: str
    share_id: str


def share_memory_gib(shares: int, gpus: int) -> int:
    """Each share's memory: the GPU's whole GiB over its shares (10 for 8 of an H100)."""
    if shares < 1 or gpus < 1:
        raise ValueError(f"{shares} shares of {gpus} GPUs: both must be at least 1")
    per_gpu = math.ceil(shares / gpus)
    gib = PROFILES[MODEL].memory_mib // 1024 // per_gpu
    if gib < 1:
        raise ValueError(f"{per_gpu} shares a GPU: less than 1Gi each")
    return gib


def shared_class() -> dict[str, Any]:
    """The GPUs published for sharing (as e2e/test_node_sharing.py's class selects them)."""
    expression = (
        f'device.driver == "{DRIVER}" && {ATTRS}.type == "gpu" && device.allowMultipleAllocations'
    )
    return {
        "apiVersion": RESOURCE,
        "kind": "DeviceClass",
        "metadata": {"name": SHARED_CLASS},
        "spec": {"selectors": [{"cel": {"expression": expression}}]},
    }


def make_share(kube: Kube, name: str, device: str, memory: str) -> Share:
    """A claim for ``memory`` of a shared GPU, allocated a share of ``device``: the
    result with a ``shareID`` and the ``consumedCapacity`` kube-scheduler writes."""
    request = {
        "name": "gpu",
        "exactly": {
            "deviceClassName": SHARED_CLASS,
            "capacity": {"requests": {"memory": memory}},
        },
    }
    created = kube.create(
        {
            "apiVersion": RESOURCE,
            "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": {"devices": {"requests": [request]}},
        },
        NAMESPACE,
    )
    share_id = str(uuid.uuid4())
    result = {
        "request": "gpu",
        "driver": DRIVER,
        "pool": NODE,
        "device": device,
        "shareID": share_id,
        "consumedCapacity": {"memory": memory},
    }
    kube.resource(RESOURCE, "ResourceClaim").status.patch(
        body={"status": {"allocation": {"devices": {"results": [result]}}}},
        name=name,
        namespace=NAMESPACE,
        content_type="application/merge-patch+json",
    )
    claim = ClaimId(namespace=NAMESPACE, name=name, uid=created["metadata"]["uid"])
    return Share(claim=claim, device=device, share_id=share_id)


def burst(socket: Path, claims: list[ClaimId]) -> dict[str, Any]:
    """``drasil-kubelet-client -burst`` against ``socket``: its JSON."""
    binary = binaries.ensure_binaries(["drasil-kubelet-client"])["drasil-kubelet-client"]
    done = subprocess.run(
        [
            str(binary),
            f"-socket={socket}",
            "-claims=" + ",".join(f"{c.namespace}/{c.name}/{c.uid}" for c in claims),
            "-burst",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=4 * CALL_TIMEOUT_S + 60,
    )
    if done.returncode != 0:
        raise RuntimeError(f"drasil-kubelet-client failed: {done.stderr.strip()}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


# ---- the stand-in daemons of this run ---------------------------------------------------


@dataclass(frozen=True)
class StandIn:
    """A stand-in process of this run: a daemon (``-d``/``-f``) or a control command."""

    pid: int
    gpu: str
    daemon: bool


def standins(root: Path) -> list[StandIn]:
    """Processes running the MPS stand-in for this run's GPUs: its module on the command
    line, ``DRASIL_MPS_GPU`` in the environment and the pipe directory under ``root``."""
    found = []
    under = str(root.resolve())
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if STANDIN.encode() not in argv:
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue  # gone meanwhile
        if state in ("Z", "X"):
            continue
        env = dict(item.decode(errors="replace").split("=", 1) for item in environ if b"=" in item)
        pipe = env.get(PIPE_ENV, "")
        if GPU_ENV not in env or not (pipe == under or pipe.startswith(under + "/")):
            continue
        daemon = b"-d" in argv or b"-f" in argv
        found.append(StandIn(pid=int(entry.name), gpu=env[GPU_ENV], daemon=daemon))
    return found


@contextmanager
def polling(sample: Callable[[], int]) -> Iterator[list[int]]:
    """``sample()`` every ``POLL_S`` in a thread while the block runs; the samples."""
    samples: list[int] = []
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            samples.append(sample())
            stop.wait(POLL_S)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join()


def mounts_under(root: Path) -> list[str]:
    """Mount points under ``root`` in this process's mount table (the daemons' tmpfs)."""
    under = str(root.resolve())
    points = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    return [p for p in points if p.startswith(under + "/")]


def log_problems(log: Path) -> dict[str, Any]:
    """The plugin log's warnings and errors: how many of each, and the first few; and how
    many daemons it says it started and stopped."""
    counts = {"warning": 0, "error": 0}
    daemons = {"MPS daemon started": 0, "MPS daemon stopped": 0}
    first: list[str] = []
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            entry = {"level": "error" if "Traceback" in line else "", "msg": line}
        if not isinstance(entry, dict):
            continue
        if entry.get("msg") in daemons:
            daemons[entry["msg"]] += 1
        level = str(entry.get("level", ""))
        if level in ("warning", "error", "critical"):
            counts["error" if level == "critical" else level] += 1
            if len(first) < LOG_LINES_KEPT:
                first.append(line[:500])
    return {
        "warnings": counts["warning"],
        "errors": counts["error"],
        "first": first,
        "daemons_started": daemons["MPS daemon started"],
        "daemons_stopped": daemons["MPS daemon stopped"],
    }


# ---- the run ----------------------------------------------------------------------------


def measure(
    kubeconfig: Path,
    root: Path,
    *,
    shares: int,
    gpus: int,
    plugin_kubeconfig: Path | None = None,
) -> dict[str, Any]:
    """The figures; setup runs with ``kubeconfig``, the plugin with ``plugin_kubeconfig``
    (a token with the chart's RBAC in the e2e smoke) when given."""
    memory = f"{share_memory_gib(shares, gpus)}Gi"
    kube = Kube(kubeconfig)
    kube.make_node(NODE)
    kube.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=NAMESPACE)))
    kube.create(shared_class())
    plugin = PluginProcess(
        root=root,
        kubeconfig=plugin_kubeconfig or kubeconfig,
        node_name=NODE,
        profile=f"{MODEL}:{gpus}",
        env={"GPU_SHARING": "consumable"},
    )
    ours = {g.uuid for g in simulated_gpus(plugin.profile, node_name=NODE)}
    plugin.start()
    try:
        made = [make_share(kube, f"share-{i}", f"gpu-{i % gpus}", memory) for i in range(shares)]

        def daemon_gpus() -> int:
            return len({s.gpu for s in standins(root) if s.daemon and s.gpu in ours})

        started = time.perf_counter()
        with polling(daemon_gpus) as samples:
            figures = burst(plugin.dra_socket, [s.claim for s in made])
        elapsed = time.perf_counter() - started
        left = standins(root)
        mounts = mounts_under(root)
        result: dict[str, Any] = {
            "shares": shares,
            "gpus": gpus,
            "profile": plugin.profile,
            "share_memory": memory,
            "allocation_example": {
                "device": made[0].device,
                "shareID": made[0].share_id,
                "consumedCapacity": {"memory": memory},
            },
            "client": figures,
            "goal_met": (
                figures["prepare_wall_ms"] <= CALL_TIMEOUT_S * 1000
                and figures["failed_prepares"] == 0
                and figures["failed_unprepares"] == 0
            ),
            "daemon_gpus_peak": max(samples, default=0),
            "daemons_left": len(left),
            "daemons_left_pids": [s.pid for s in left],
            "mounts_left": len(mounts),
            "client_run_s": elapsed,
        }
    finally:
        plugin.stop()
        # Daemons outlive the plugin by design; a run that left some ends them here.
        MpsDaemons(plugin.state_dir, program=DaemonProgram.for_backend("simulated")).sweep(keep=())
        kube.delete("v1", "Namespace", NAMESPACE)
        kube.delete("v1", "Node", NODE)
        kube.delete(RESOURCE, "DeviceClass", SHARED_CLASS)
    result["plugin_log"] = log_problems(plugin.log_path)
    return result


def code_measured() -> dict[str, Any]:
    """The checkout whose drasil code this process imports, and its commit."""
    checkout = Path(next(iter(drasil.driver.__path__))).resolve().parent
    commit = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    changed = subprocess.run(
        ["git", "-C", str(checkout), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.split("\n")
    return {
        "checkout": str(checkout),
        "commit": commit,
        "changed_files": sorted(line[3:] for line in changed if line.strip()),
    }


def run(
    *,
    shares: int = SHARES,
    gpus: int = GPUS,
    kubeconfig: Path | None = None,
    plugin_kubeconfig: Path | None = None,
) -> dict[str, Any]:
    # Short: the daemons' control sockets live under it (108 bytes at most a path).
    root = Path(tempfile.mkdtemp(prefix="drasil-bench-mps-"))
    load_before = os.getloadavg()
    try:
        if kubeconfig is not None:
            result = measure(
                kubeconfig, root, shares=shares, gpus=gpus, plugin_kubeconfig=plugin_kubeconfig
            )
        else:
            with cluster_kubeconfig() as own:
                result = measure(own, root, shares=shares, gpus=gpus)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result["code"] = code_measured()
    result["machine"] = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "loadavg_before": list(load_before),
        "loadavg_after": list(os.getloadavg()),
    }
    return result


def summary(result: dict[str, Any]) -> str:
    figures = result["client"]
    return (
        f"{result['shares']} shares of {result['gpus']} GPUs: prepares "
        f"{figures['prepare_wall_ms'] / 1000:.1f} s wall (p50 {figures['prepare_p50_ms']:.0f} "
        f"ms, p99 {figures['prepare_p99_ms']:.0f} ms), {figures['failed_prepares']} failed; "
        f"unprepares {figures['unprepare_wall_ms'] / 1000:.1f} s wall (p50 "
        f"{figures['unprepare_p50_ms']:.0f} ms, p99 {figures['unprepare_p99_ms']:.0f} ms), "
        f"{figures['failed_unprepares']} failed; {result['daemons_left']} daemons left; "
        f"goal met: {result['goal_met']}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.mps", description=__doc__)
    parser.add_argument("--shares", type=int, default=SHARES, help="claims, one share each")
    parser.add_argument("--gpus", type=int, default=GPUS, help="simulated H100s shared")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).parent / "results" / "mps.json",
        help="where the JSON goes",
    )
    args = parser.parse_args(argv)
    result = run(shares=args.shares, gpus=args.gpus)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(summary(result))


if __name__ == "__main__":
    main()

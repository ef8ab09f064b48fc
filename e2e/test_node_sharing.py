"""GPU sharing on the real node: prioritized lists, and consumable shares with MPS.

The first test runs on the node as the harness starts it (whole GPUs, exclusive). The
others restart its plugin with ``--gpu-sharing consumable`` (module fixture, put back
afterwards): its eight simulated H100s are then published with
``allowMultipleAllocations`` and a memory and compute capacity, and each share a
Pod gets is enforced by the GPU's MPS daemon (a stand-in process on the simulated
backend, with the real daemon's lifecycle).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from bench import mps as mps_bench
from drasil.driver.simulated import mpsstandin
from e2e.harness import versions
from e2e.harness.cluster.node import Node
from e2e.harness.kube import RESOURCE, Kube, NotYet, wait_for
from e2e.harness.pluginproc import DRIVER, checkpoint_gpus
from e2e.harness.pods import (
    checkpoint,
    container_env,
    delete_pod,
    device_uuid,
    events,
    pod,
    template,
    wait_running,
)

GPUS = 8
SHARED_CLASS = f"shared-node-e2e.{DRIVER}"
CONFIG_API = "resource.drasil.dev/v1beta1"
# The env, then what the MPS pipe directory holds (the daemon's files, if mounted).
COMMAND = (
    "env | sort; ls /tmp/nvidia-mps 2>/dev/null | sed 's/^/PIPE:/'; "
    "trap 'exit 0' TERM; sleep 3600 & wait"
)
ATTRS = f'device.attributes["{DRIVER}"]'


def _pod(
    kube: Kube,
    ns: str,
    node: Node,
    *,
    requests: list[dict[str, Any]],
    config: list[dict[str, Any]] | None = None,
) -> str:
    name = template(kube, ns, requests=requests, configs=config)
    return pod(kube, ns, node, template_name=name, command=COMMAND)


def _time_slicing(request: str, interval: str) -> dict[str, Any]:
    parameters = {
        "apiVersion": CONFIG_API,
        "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": interval}},
    }
    return {"requests": [request], "opaque": {"driver": DRIVER, "parameters": parameters}}


def test_a_prioritized_list_gets_the_config_of_the_alternative_taken(
    kube: Kube, ns: str, node: Node
) -> None:
    """firstAvailable [H200, H100] on an H100-only node: the H100 alternative's config."""
    requests = [
        {
            "name": "gpu",
            "firstAvailable": [
                {
                    "name": "h200",
                    "deviceClassName": DRIVER,
                    "selectors": [{"cel": {"expression": f'{ATTRS}.productName == "NVIDIA H200"'}}],
                },
                {
                    "name": "h100",
                    "deviceClassName": DRIVER,
                    "selectors": [
                        {"cel": {"expression": f'{ATTRS}.productName.startsWith("NVIDIA H100")'}}
                    ],
                },
            ],
        }
    ]
    config = [_time_slicing("gpu/h200", "Short"), _time_slicing("gpu/h100", "Long")]
    name = _pod(kube, ns, node, requests=requests, config=config)
    wait_running(kube, ns, name)
    env = container_env(kube, ns, name)
    intervals = {k: v for k, v in env.items() if k.endswith("_TIMESLICE_INTERVAL")}
    assert list(intervals.values()) == ["Long"], env


# ---- MPS on a GPU allocated whole (the node as the harness starts it) ------------------


def _claim_object(kube: Kube, ns: str, config: dict[str, Any]) -> str:
    name = f"mps-{os.urandom(3).hex()}"
    devices = {
        "requests": [
            {
                "name": "mps-gpu",
                "exactly": {
                    "deviceClassName": DRIVER,
                    "selectors": [{"cel": {"expression": f"{ATTRS}.minor == 1"}}],
                },
            }
        ],
        "config": [{"requests": ["mps-gpu"], "opaque": {"driver": DRIVER, "parameters": config}}],
    }
    claim = {"apiVersion": RESOURCE, "kind": "ResourceClaim", "metadata": {"name": name}}
    kube.create({**claim, "spec": {"devices": devices}}, ns)
    return name


def _probe_pod(kube: Kube, ns: str, node: Node, claim: str, containers: list[str]) -> str:
    """A Pod of the probe image whose containers (each holding an MPS client) use the
    claim's request "mps-gpu"; its name."""
    name = f"mps-{os.urandom(3).hex()}"
    spec = {
        "nodeSelector": {"kubernetes.io/hostname": node.name},
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 1,
        "containers": [
            {
                "name": container,
                "image": versions.PROBE_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["sh", "-c", f"env | sort; {HOLD}"],
                "resources": {"claims": [{"name": "gpu", "request": "mps-gpu"}]},
            }
            for container in containers
        ],
        "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
    }
    kube.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}, ns)
    return name


def test_an_mps_gpu_allocated_whole_serves_every_container_of_its_claim(
    kube: Kube, ns: str, node: Node
) -> None:
    """NVIDIA's gpu-test-mps and gpu-test3 in drasil's kinds: one claim's GPU shared with
    MPS by two containers of one Pod and by a second Pod, all clients of one daemon that
    holds the config's limits; unprepare stops it and puts the compute mode back."""
    config = {
        "apiVersion": CONFIG_API,
        "kind": "GpuConfig",
        "sharing": {
            "strategy": "MPS",
            "mps": {"defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "10Gi"},
        },
    }
    claim = _claim_object(kube, ns, config)
    first = _probe_pod(kube, ns, node, claim, ["mps-ctr0", "mps-ctr1"])
    second = _probe_pod(kube, ns, node, claim, ["mps-ctr0"])
    for name in (first, second):
        wait_running(kube, ns, name)
    gpu = device_uuid(kube, node, "gpu-1")
    for name, container in ((first, "mps-ctr0"), (first, "mps-ctr1"), (second, "mps-ctr0")):
        log = _said(kube, ns, name, "MPS:", container=container)
        assert "MPS: connected memory=10240M threads=50.0" in log, log
        assert f"DRASIL_DEVICE_GPU_1={gpu}" in log, log
        assert "DRASIL_DEVICE_GPU_1_SHARING_STRATEGY=MPS" in log, log
    (pid,) = _daemon_pids(node)
    pipe = Path(checkpoint_gpus(node.plugin.state_dir)[gpu]["mps"]["pipeDir"])
    assert int(mpsstandin.control(pipe, "get_client_count")) == 3  # one daemon, three clients
    assert _compute_mode(node, gpu) == 3  # EXCLUSIVE_PROCESS while its daemon runs

    for name in (first, second):
        delete_pod(kube, ns, name)
    kube.delete(RESOURCE, "ResourceClaim", claim, ns)
    wait_for(
        lambda: True if not _alive(pid) else NotYet(pid),
        timeout=60,
        what="the claim's MPS daemon stopped at its unprepare",
    )
    assert _compute_mode(node, gpu) == 0
    assert gpu not in checkpoint_gpus(node.plugin.state_dir)


# ---- consumable shares ------------------------------------------------------------------


@pytest.fixture(scope="module")
def consumable(node: Node, kube: Kube) -> Iterator[Node]:
    shared_class = {
        "apiVersion": RESOURCE,
        "kind": "DeviceClass",
        "metadata": {"name": SHARED_CLASS},
        "spec": {
            "selectors": [
                {
                    "cel": {
                        "expression": f'device.driver == "{DRIVER}" && {ATTRS}.type == "gpu" '
                        "&& device.allowMultipleAllocations"
                    }
                }
            ]
        },
    }
    kube.delete(RESOURCE, "DeviceClass", SHARED_CLASS)
    kube.create(shared_class)
    node.restart_plugin_with({"GPU_SHARING": "consumable"}, published=GPUS)
    yield node
    node.restart_plugin_with({"GPU_SHARING": None}, published=GPUS)
    kube.delete(RESOURCE, "DeviceClass", SHARED_CLASS)


def _share(memory: str) -> list[dict[str, Any]]:
    return [
        {
            "name": "gpu",
            "exactly": {
                "deviceClassName": SHARED_CLASS,
                "selectors": [{"cel": {"expression": f"{ATTRS}.minor == 0"}}],
                "capacity": {"requests": {"memory": memory}},
            },
        }
    ]


def _claim(kube: Kube, ns: str, pod: str) -> dict[str, Any]:
    for item in kube.resource(RESOURCE, "ResourceClaim").get(namespace=ns).items:
        claim = dict(item.to_dict())
        if pod in [o.get("name") for o in claim["metadata"].get("ownerReferences") or []]:
            return claim
    raise AssertionError(f"no claim of Pod {pod}")


def _daemon_pids(node: Node) -> list[int]:
    gpus = checkpoint_gpus(node.plugin.state_dir)
    return [g["mps"]["pid"] for g in gpus.values() if g.get("mps")]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_four_20gi_shares_fit_one_h100_a_fifth_waits_and_the_daemon_goes_with_them(
    kube: Kube, ns: str, consumable: Node, kubeconfig: Any
) -> None:
    # One at a time: kube-scheduler v1.37.1 sometimes finds no capacity left for a share
    # Pod scheduled while another share of the same device is still being allocated,
    # and then leaves it unschedulable until some unrelated event (seen in CI: the
    # second of four created at once waited 2 minutes). The fifth below is the test.
    pods = []
    for _ in range(4):
        pods.append(_pod(kube, ns, consumable, requests=_share("20Gi")))
        wait_running(kube, ns, pods[-1])
    claims = [_claim(kube, ns, name) for name in pods]
    results = [c["status"]["allocation"]["devices"]["results"][0] for c in claims]
    assert {r["device"] for r in results} == {"gpu-0"}
    assert len({r["shareID"] for r in results}) == 4
    for name in pods:
        env = container_env(kube, ns, name)
        assert env["DRASIL_DEVICE_GPU_0"].startswith("GPU-"), env
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20480M", env
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25", env
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps", env
        log = kube.core.read_namespaced_pod_log(name, ns, container="c")
        assert "PIPE:" in log, log  # the daemon's pipe directory is mounted, not empty
    (pid,) = _daemon_pids(consumable)
    assert _alive(pid)

    fifth = _pod(kube, ns, consumable, requests=_share("20Gi"))

    def tried() -> Any:
        said = events(kube, ns, fifth)
        return said if any("FailedScheduling" in e for e in said) else NotYet(said)

    wait_for(tried, timeout=60, what=f"Pod {fifth} tried by the scheduler")
    explained = subprocess.run(
        [
            sys.executable,
            "-m",
            "drasil.driver.cli",
            "explain",
            f"--kubeconfig={kubeconfig}",
            f"--driver-name={DRIVER}",
            f"{ns}/{_claim(kube, ns, fifth)['metadata']['name']}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert "memory" in explained.stdout, explained.stdout + explained.stderr
    assert "20Gi" in explained.stdout, explained.stdout
    delete_pod(kube, ns, fifth)

    for name in pods:
        delete_pod(kube, ns, name)
    wait_for(
        lambda: True if not _alive(pid) else NotYet(pid),
        timeout=60,
        what="the MPS daemon stopped after the last share",
    )
    assert _daemon_pids(consumable) == []
    assert not any(c.get("namespace") == ns for c in checkpoint(consumable).values())


# ---- MPS as a CUDA client meets it: the daemon's /dev/shm and pipe, its limits --------

HOLD = "mps-client --hold"
# A client that dropped its limits, and what it can do to the pipe directory.
BARE = (
    "env -u CUDA_MPS_PINNED_DEVICE_MEM_LIMIT -u CUDA_MPS_ACTIVE_THREAD_PERCENTAGE mps-client; "
    "touch /tmp/nvidia-mps/x 2>/dev/null && echo PIPE-WRITABLE || echo PIPE-READONLY; "
    "trap 'exit 0' TERM; sleep 3600 & wait"
)


def _mps_pod(
    kube: Kube,
    ns: str,
    node: Node,
    name: str,
    command: str,
    *,
    user: int | None = None,
    own_shm: bool = False,
) -> str:
    """A Pod of the probe image (it has ``mps-client``) with one 20Gi share of gpu-0."""
    container: dict[str, Any] = {
        "name": "c",
        "image": versions.PROBE_IMAGE,
        "imagePullPolicy": "Never",
        "command": ["sh", "-c", command],
        "resources": {"claims": [{"name": "gpu"}]},
    }
    spec: dict[str, Any] = {
        "nodeSelector": {"kubernetes.io/hostname": node.name},
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 1,
        "containers": [container],
        "resourceClaims": [
            {
                "name": "gpu",
                "resourceClaimTemplateName": template(kube, ns, requests=_share("20Gi")),
            }
        ],
    }
    if user is not None:
        container["securityContext"] = {"runAsUser": user, "runAsGroup": user}
    if own_shm:
        container["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
        spec["volumes"] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    kube.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}, ns)
    return name


def _said(kube: Kube, ns: str, name: str, text: str, *, container: str = "c") -> str:
    def printed() -> Any:
        try:  # a container not started yet has no log to read
            log = kube.core.read_namespaced_pod_log(name, ns, container=container) or ""
        except ApiException as err:
            return NotYet(str(err))
        return log if text in log else NotYet(log)

    log: str = wait_for(printed, timeout=60, what=f"{text!r} in the log of {ns}/{name}")
    return log


def _compute_mode(node: Node, uuid: str) -> int:
    """The GPU's compute mode in the simulated backend's state file (0 when absent)."""
    path = node.plugin.gpu_state_file
    state = json.loads(path.read_text()) if path.exists() else {}
    return int(((state.get("gpus") or {}).get(uuid) or {}).get("computeMode", 0))


def test_an_mps_share_reaches_its_daemon_only_through_its_mounts_and_keeps_its_limits(
    kube: Kube, ns: str, consumable: Node
) -> None:
    gpu = device_uuid(kube, consumable, "gpu-0")
    before = _compute_mode(consumable, gpu)
    held = _mps_pod(kube, ns, consumable, "held", HOLD)
    wait_running(kube, ns, held)
    assert "MPS: connected memory=20480M threads=25.0" in _said(kube, ns, held, "MPS:")
    (pid,) = _daemon_pids(consumable)
    assert _compute_mode(consumable, gpu) == 3  # EXCLUSIVE_PROCESS while the daemon runs

    # The daemon holds the share's limits: a client that unsets its env gets no more.
    bare = _mps_pod(kube, ns, consumable, "bare", BARE)
    log = _said(kube, ns, bare, "PIPE-")
    assert "MPS: connected memory=20480M threads=25.0" in log, log
    assert "PIPE-READONLY" in log, log

    # Another user waits while root's clients are connected (no -multiuser-server).
    other = _mps_pod(kube, ns, consumable, "other", "mps-client; sleep 3600", user=1000)
    assert "uid 1000" in _said(kube, ns, other, "MPS: error")

    # A Pod with its own /dev/shm is refused at prepare, with the conflict named.
    shm = _mps_pod(kube, ns, consumable, "own-shm", "sleep 3600", own_shm=True)

    def refused() -> Any:
        said = events(kube, ns, shm)
        return said if any("mounts volume" in e for e in said) else NotYet(said)

    said = wait_for(refused, timeout=60, what="the Pod with its own /dev/shm refused")
    assert any('container "c" mounts volume "dshm" at /dev/shm' in e for e in said), said
    delete_pod(kube, ns, shm)

    # kill -9 of the plugin: the daemon and its connected client carry on.
    pipe = Path(checkpoint_gpus(consumable.plugin.state_dir)[gpu]["mps"]["pipeDir"])
    consumable.restart_plugin(kill=True)
    assert _daemon_pids(consumable) == [pid]
    assert _alive(pid)
    assert int(mpsstandin.control(pipe, "get_client_count")) >= 1
    assert "lost" not in kube.core.read_namespaced_pod_log(held, ns, container="c")

    for name in (held, bare, other):
        delete_pod(kube, ns, name)
    wait_for(
        lambda: True if not _alive(pid) else NotYet(pid),
        timeout=60,
        what="the MPS daemon stopped after the last share",
    )
    assert _compute_mode(consumable, gpu) == before


def test_the_mps_burst_benchmark_runs(kubeconfig: Path, plugin_kubeconfig: Path) -> None:
    """A smoke of ``make bench``'s MPS figure: a burst of 8 shares of 2 GPUs prepared and
    unprepared at once through the grpc-go client (the plugin with the chart's RBAC)."""
    result = mps_bench.run(
        shares=8, gpus=2, kubeconfig=kubeconfig, plugin_kubeconfig=plugin_kubeconfig
    )
    figures = result["client"]
    assert (figures["failed_prepares"], figures["failed_unprepares"]) == (0, 0), figures
    assert result["daemons_left"] == 0
    assert result["mounts_left"] == 0

"""Dynamic MIG against the real scheduler: placements allocated through shared counters.

A plugin in ``--mig-mode dynamic`` publishes one simulated H100: its counter set, the
whole GPU and every MIG placement. kube-scheduler allocates Pods' claims from them;
the test, acting as kubelet, prepares and unprepares them, and reads the simulated
GPU's MIG instances with ``drasil discover`` to see what prepare really cut.
"""

from __future__ import annotations

import json
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from bench import mig as mig_bench
from e2e.harness.kube import RESOURCE, Kube, NotYet, wait_for
from e2e.harness.pluginproc import (
    DRIVER,
    GPU_CLASS,
    ClaimId,
    KubeletClient,
    PluginProcess,
    lose_checkpoint,
)
from e2e.harness.pods import node_events, pod, template
from e2e.test_kubeletplugin import assert_clean, cdi_file, checkpoint_claims

PROFILE = "h100-80gb:1"
MIG_CLASS = f"mig-e2e.{DRIVER}"


@pytest.fixture(scope="module")
def classes(kube: Kube) -> Iterator[None]:
    yield from gpu_and_mig_classes(kube)


def gpu_and_mig_classes(kube: Kube) -> Iterator[None]:
    """DeviceClasses gpu.drasil.dev and MIG_CLASS, there while the generator runs."""
    mig_class: dict[str, Any] = {
        "apiVersion": RESOURCE,
        "kind": "DeviceClass",
        "metadata": {"name": MIG_CLASS},
        "spec": {
            "selectors": [
                {
                    "cel": {
                        "expression": f'device.driver == "{DRIVER}" && '
                        f'device.attributes["{DRIVER}"].type == "mig"'
                    }
                }
            ]
        },
    }
    names = (DRIVER, MIG_CLASS)
    for name, obj in zip(names, (GPU_CLASS, mig_class), strict=True):
        kube.delete(RESOURCE, "DeviceClass", name)
        kube.create(obj)
    yield
    for name in names:
        kube.delete(RESOURCE, "DeviceClass", name)


@pytest.fixture
def node(make_node: Callable[..., dict[str, Any]]) -> str:
    name = f"e2e-mig-{secrets.token_hex(3)}"
    make_node(name)
    return name


@pytest.fixture
def plugin(plugin_kubeconfig: Path, node: str) -> Iterator[PluginProcess]:
    root = Path(tempfile.mkdtemp(prefix="drasil-mig-"))  # short: socket paths
    proc = PluginProcess(
        root=root,
        kubeconfig=plugin_kubeconfig,
        node_name=node,
        profile=PROFILE,
        env={"MIG_MODE": "dynamic"},
    )
    proc.start()
    yield proc
    proc.stop()
    shutil.rmtree(root, ignore_errors=True)


def wait_partitions(kube: Kube, node: str) -> list[str]:
    """The node's published devices, once the counter set and placements are there."""

    def published() -> Any:
        slices = kube.resource(RESOURCE, "ResourceSlice").get(
            field_selector=f"spec.nodeName={node}"
        )
        specs = [dict(s.to_dict())["spec"] for s in slices.items]
        names = [d["name"] for s in specs for d in s.get("devices") or []]
        counters = [c for s in specs for c in s.get("sharedCounters") or []]
        return names if counters and "gpu-0-mig-3g40gb-at-4" in names else NotYet(names)

    names: list[str] = wait_for(published, timeout=60, what=f"MIG placements of {node}")
    return names


def claim_pod(kube: Kube, namespace: str, node: str, *, device_class: str, cel: str) -> str:
    """A Pod pinned to ``node`` whose claim (from a template) asks for one device."""
    request = {
        "name": "gpu",
        "exactly": {"deviceClassName": device_class, "selectors": [{"cel": {"expression": cel}}]},
    }
    return pod(kube, namespace, node, template_name=template(kube, namespace, requests=[request]))


def pod_claim(kube: Kube, namespace: str, pod: str) -> dict[str, Any] | None:
    for item in kube.resource(RESOURCE, "ResourceClaim").get(namespace=namespace).items:
        claim = dict(item.to_dict())
        owners = [o.get("name") for o in claim["metadata"].get("ownerReferences") or []]
        if pod in owners:
            return claim
    return None


def wait_allocated(kube: Kube, namespace: str, pod: str) -> tuple[ClaimId, str]:
    """The Pod's claim once allocated and reserved, and its device."""

    def allocated() -> Any:
        claim = pod_claim(kube, namespace, pod)
        status = (claim or {}).get("status") or {}
        if not (status.get("allocation") and status.get("reservedFor")):
            return NotYet(status)
        return claim

    claim = wait_for(allocated, timeout=60, what=f"claim of Pod {namespace}/{pod} allocated")
    meta = claim["metadata"]
    device = claim["status"]["allocation"]["devices"]["results"][0]["device"]
    return ClaimId(namespace=namespace, name=meta["name"], uid=meta["uid"]), device


def stays_pending(kube: Kube, namespace: str, pod: str) -> dict[str, Any]:
    """The Pod's claim after the scheduler has tried it: created, and not allocated."""

    def tried() -> Any:
        claim = pod_claim(kube, namespace, pod)
        events = kube.core.list_namespaced_event(
            namespace, field_selector=f"involvedObject.name={pod}"
        ).items
        tried_it = any(e.reason == "FailedScheduling" for e in events)
        return claim if claim is not None and tried_it else NotYet(claim)

    claim: dict[str, Any] = wait_for(tried, timeout=60, what=f"Pod {pod} tried by the scheduler")
    assert not (claim.get("status") or {}).get("allocation"), claim["status"]
    return claim


def delete_pod(kube: Kube, namespace: str, pod: str) -> None:
    kube.core.delete_namespaced_pod(pod, namespace, grace_period_seconds=0)

    def gone() -> Any:
        return True if pod_claim(kube, namespace, pod) is None else NotYet(pod)

    wait_for(gone, timeout=60, what=f"claim of Pod {pod} deleted")


def drasil(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "drasil.driver.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def instances(plugin: PluginProcess) -> list[str]:
    """The simulated GPU's MIG instances, as ``drasil discover`` lists them."""
    done = drasil(
        "discover",
        "--backend=simulated",
        f"--profile={PROFILE}",
        f"--node-name={plugin.node_name}",
        "--mig-mode=dynamic",
        f"--simulated-state={plugin.state_dir / 'simulated-gpus.json'}",
    )
    assert done.returncode == 0, done.stderr
    return [line for line in done.stdout.splitlines() if re.search(r"\bgi=\d+", line)]


def mig_uuid(plugin: PluginProcess, uid: str) -> str:
    spec = json.loads(cdi_file(plugin, uid).read_text())
    env = [e for d in spec["devices"] for e in d["containerEdits"].get("env") or []]
    uuids = [str(e).split("=", 1)[1] for e in env if str(e).split("=", 1)[1].startswith("MIG-")]
    assert len(uuids) == 1, env
    return uuids[0]


PROFILE_3G = f'device.attributes["{DRIVER}"].profile == "3g.40gb"'


def test_two_3g_placements_are_cut_a_1g_waits_and_the_whole_gpu_after_them(
    kube: Kube, namespace: str, node: str, classes: None, plugin: PluginProcess,
    kubeconfig: Path,
) -> None:  # fmt: skip
    names = wait_partitions(kube, node)
    assert {"gpu-0", "gpu-0-mig-3g40gb-at-0", "gpu-0-mig-3g40gb-at-4"} <= set(names)
    kubelet = KubeletClient(plugin)

    first, second = (
        claim_pod(kube, namespace, node, device_class=MIG_CLASS, cel=PROFILE_3G) for _ in range(2)
    )
    (ref_a, dev_a), (ref_b, dev_b) = (wait_allocated(kube, namespace, p) for p in (first, second))
    assert {dev_a, dev_b} == {"gpu-0-mig-3g40gb-at-0", "gpu-0-mig-3g40gb-at-4"}
    answers = kubelet.prepare([ref_a, ref_b]).claims
    assert answers[ref_a.uid].error == ""
    assert answers[ref_b.uid].error == ""
    uuid_a, uuid_b = mig_uuid(plugin, ref_a.uid), mig_uuid(plugin, ref_b.uid)
    assert uuid_a != uuid_b
    cut = instances(plugin)
    assert len(cut) == 2, cut
    assert all("3g.40gb" in line for line in cut), cut
    records = checkpoint_claims(plugin)
    assert {records[r.uid]["devices"][0]["mig"]["state"] for r in (ref_a, ref_b)} == {"Created"}

    # The two halves hold all eight memory slices: a 1g.10gb has no placement left. It
    # stays pending, and explain names the counters and the claims holding them.
    third = claim_pod(
        kube,
        namespace,
        node,
        device_class=MIG_CLASS,
        cel=f'device.attributes["{DRIVER}"].profile == "1g.10gb"',
    )
    pending = stays_pending(kube, namespace, third)
    explained = drasil(
        "explain",
        f"--kubeconfig={kubeconfig}",
        f"--driver-name={DRIVER}",
        f"{namespace}/{pending['metadata']['name']}",
    )
    text = explained.stdout + explained.stderr
    assert "placements of 1g.10gb need memory slices" in text, text
    assert ref_a.name in text, text
    assert ref_b.name in text, text
    delete_pod(kube, namespace, third)

    # The whole GPU consumes every counter: it waits until both MIG claims are gone.
    whole = claim_pod(kube, namespace, node, device_class=DRIVER, cel="true")
    stays_pending(kube, namespace, whole)
    for holder, ref in ((first, ref_a), (second, ref_b)):
        assert kubelet.unprepare([ref]).claims[ref.uid].error == ""
        delete_pod(kube, namespace, holder)
    assert instances(plugin) == []
    ref_w, dev_w = wait_allocated(kube, namespace, whole)
    assert dev_w == "gpu-0"
    assert kubelet.prepare([ref_w]).claims[ref_w.uid].error == ""
    assert instances(plugin) == []
    assert kubelet.unprepare([ref_w]).claims[ref_w.uid].error == ""
    assert checkpoint_claims(plugin) == {}


def test_orphan_instances_are_destroyed_at_start_and_said_in_an_event(
    kube: Kube, namespace: str, node: str, classes: None, plugin: PluginProcess,
) -> None:  # fmt: skip
    wait_partitions(kube, node)
    ref, _ = wait_allocated(
        kube,
        namespace,
        claim_pod(kube, namespace, node, device_class=MIG_CLASS, cel=PROFILE_3G),
    )
    kubelet = KubeletClient(plugin)
    assert kubelet.prepare([ref]).claims[ref.uid].error == ""
    assert len(instances(plugin)) == 1
    # The checkpoint is lost while the plugin is down; the instance is now nobody's.
    plugin.stop()
    lose_checkpoint(plugin.state_dir)
    cdi_file(plugin, ref.uid).unlink()
    plugin.start()
    assert instances(plugin) == []

    message = node_events(kube, node, "MigInstancesReconciled", timeout=30)[0]
    assert "3g.40gb" in message, message


def test_the_mig_benchmark_runs(kubeconfig: Path, plugin_kubeconfig: Path) -> None:
    """A smoke of ``make bench``'s MIG figures: two rounds of each claim kind (the
    plugin with the chart's RBAC, as everywhere in e2e)."""
    result = mig_bench.run(rounds=2, kubeconfig=kubeconfig, plugin_kubeconfig=plugin_kubeconfig)
    for kind in ("whole_gpu", "mig_1g", "mig_3g_pair"):
        assert result[kind]["pair_p50_ms"] > 0, result


# --- kill -9 at every step of a dynamic MIG prepare and unprepare -----------------------
# On the nvml backend (our C NVML below pynvml, as on a real node); the simulated
# backend's recovery from the same crash points is checked without a cluster, in a
# crashed child process, by tests/kubeletplugin/test_dynamic_mig.py.

MIG_PREPARE_CRASHES = [
    "prepare-after-started",  # recorded as creating, nothing cut yet
    "mig-after-gi",  # GPU instance made, no compute instance
    "mig-after-ci",  # both made, not recorded
    "prepare-after-mig",  # recorded, no CDI spec
    "prepare-after-cdi",
]
MIG_UNPREPARE_CRASHES = [
    "unprepare-after-cdi",  # spec gone, instance still there
    "mig-destroy-after-ci",  # compute instance gone, GPU instance left
    "unprepare-after-mig",  # instance gone, record still there
    "unprepare-after-removed",
]
BACKENDS = ["nvml"]


@pytest.fixture
def crash_root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="drasil-migc-"))  # short: socket paths
    yield root
    shutil.rmtree(root, ignore_errors=True)


def gpu_instances(plugin: PluginProcess) -> list[Any]:
    """The GPU instances of the node's GPU, as the GPU state file records them (the
    simulated backend's file, or the mock NVML's: the same format)."""
    if not plugin.gpu_state_file.exists():
        return []
    state = json.loads(plugin.gpu_state_file.read_text())
    return [i for gpu in (state.get("gpus") or {}).values() for i in gpu["gpuInstances"]]


def crash_plugin(root: Path, kubeconfig: Path, node: str, backend: str) -> PluginProcess:
    return PluginProcess(
        root=root,
        kubeconfig=kubeconfig,
        node_name=node,
        profile=PROFILE,
        env={"MIG_MODE": "dynamic"},
        backend=backend,
    )


def assert_nothing_cut(plugin: PluginProcess) -> None:
    assert gpu_instances(plugin) == []
    assert_clean(plugin)


@pytest.mark.parametrize("crash_at", MIG_PREPARE_CRASHES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_crash_during_a_mig_prepare_is_repaired_by_the_next_call(
    kube: Kube, namespace: str, node: str, classes: None, crash_root: Path,
    plugin_kubeconfig: Path, backend: str, crash_at: str,
) -> None:  # fmt: skip
    plugin = crash_plugin(crash_root, plugin_kubeconfig, node, backend)
    plugin.start(crash_at=crash_at)
    try:
        wait_partitions(kube, node)
        ref, _ = wait_allocated(
            kube,
            namespace,
            claim_pod(kube, namespace, node, device_class=MIG_CLASS, cel=PROFILE_3G),
        )
        kubelet = KubeletClient(plugin)
        with pytest.raises(grpc.RpcError):
            kubelet.prepare([ref], timeout=20)
        assert plugin.wait_exit() == 137
        plugin.start()  # what the DaemonSet does after the crash
        assert kubelet.prepare([ref]).claims[ref.uid].error == ""
        assert len(gpu_instances(plugin)) == 1, gpu_instances(plugin)
        assert checkpoint_claims(plugin)[ref.uid]["state"] == "PrepareCompleted"
        mig_uuid(plugin, ref.uid)
        assert kubelet.unprepare([ref]).claims[ref.uid].error == ""
        assert_nothing_cut(plugin)
    finally:
        plugin.stop()


@pytest.mark.parametrize("crash_at", MIG_UNPREPARE_CRASHES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_crash_during_a_mig_unprepare_is_repaired_by_the_next_call(
    kube: Kube, namespace: str, node: str, classes: None, crash_root: Path,
    plugin_kubeconfig: Path, backend: str, crash_at: str,
) -> None:  # fmt: skip
    plugin = crash_plugin(crash_root, plugin_kubeconfig, node, backend)
    plugin.start()
    try:
        wait_partitions(kube, node)
        ref, _ = wait_allocated(
            kube,
            namespace,
            claim_pod(kube, namespace, node, device_class=MIG_CLASS, cel=PROFILE_3G),
        )
        kubelet = KubeletClient(plugin)
        assert kubelet.prepare([ref]).claims[ref.uid].error == ""
        assert len(gpu_instances(plugin)) == 1
        plugin.stop()
        plugin.start(crash_at=crash_at)
        with pytest.raises(grpc.RpcError):
            kubelet.unprepare([ref], timeout=20)
        assert plugin.wait_exit() == 137
        plugin.start()
        assert kubelet.unprepare([ref]).claims[ref.uid].error == ""
        assert_nothing_cut(plugin)
    finally:
        plugin.stop()

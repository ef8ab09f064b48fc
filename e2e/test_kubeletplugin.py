"""The kubelet plugin against the real control plane, called over its sockets as kubelet.

The plugin process publishes its node's slices; kube-scheduler allocates a Pod's
claim from them; the test, acting as kubelet, prepares and unprepares it and checks
what a container runtime would read: the CDI file.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import pytest

from drasil.api.limits import allow_nesting
from drasil.kubeletplugin.gpucheck import cdicheck
from e2e.harness.cluster import Cluster
from e2e.harness.kube import RESOURCE, Kube, NotYet, wait_for
from e2e.harness.pluginproc import (
    DRIVER,
    GPU_CLASS,
    ClaimId,
    KubeletClient,
    PluginProcess,
    lose_checkpoint,
)
from e2e.harness.pluginproc import checkpoint_claims as stored_claims
from e2e.harness.pods import device_variable, template
from e2e.harness.procs import read_pid_file


@pytest.fixture(scope="module")
def gpu_class(kube: Kube) -> Iterator[str]:
    kube.delete(RESOURCE, "DeviceClass", DRIVER)
    kube.create(GPU_CLASS)
    yield DRIVER
    kube.delete(RESOURCE, "DeviceClass", DRIVER)


@pytest.fixture
def node(make_node: Callable[..., dict[str, Any]]) -> str:
    name = f"e2e-gpu-{secrets.token_hex(3)}"
    make_node(name)
    return name


@pytest.fixture
def node_root() -> Iterator[Path]:
    """A short root dir: unix socket paths must stay under ~105 bytes."""
    root = Path(tempfile.mkdtemp(prefix="drasil-e2e-"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def plugin(node_root: Path, plugin_kubeconfig: Path, node: str) -> Iterator[PluginProcess]:
    proc = PluginProcess(root=node_root, kubeconfig=plugin_kubeconfig, node_name=node)
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def cdi_validator() -> jsonschema.Draft7Validator:
    validator: jsonschema.Draft7Validator = cdicheck.schema_validator()
    return validator


def node_slices(kube: Kube, node: str) -> list[dict[str, Any]]:
    items = kube.resource(RESOURCE, "ResourceSlice").get(field_selector=f"spec.nodeName={node}")
    return [dict(i.to_dict()) for i in items.items]


def wait_published(kube: Kube, node: str, count: int = 8) -> list[dict[str, Any]]:
    def published() -> Any:
        slices = node_slices(kube, node)
        devices = [d for s in slices for d in s["spec"].get("devices") or []]
        return slices if len(devices) == count else NotYet(slices)

    result: list[dict[str, Any]] = wait_for(
        published, timeout=60, what=f"{count} devices published for {node}"
    )
    return result


def allocated_pod_claim(
    kube: Kube, namespace: str, node: str, *, config: dict[str, Any] | None = None
) -> tuple[ClaimId, dict[str, Any]]:
    """A Pod with a claim from a template, pinned to ``node``; returns the allocated claim."""
    name = template(kube, namespace, config=config)
    kube.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": node},
                "containers": [
                    {
                        "name": "c",
                        "image": "registry.invalid/none:1",
                        "resources": {"claims": [{"name": "gpu"}]},
                    }
                ],
                "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": name}],
            },
        },
        namespace,
    )

    def allocated() -> Any:
        claims = kube.resource(RESOURCE, "ResourceClaim").get(namespace=namespace).items
        for claim in claims:
            c = dict(claim.to_dict())
            owners = [o.get("name") for o in c["metadata"].get("ownerReferences") or []]
            if name not in owners:
                continue  # another Pod's claim in this namespace
            if c.get("status", {}).get("allocation") and c["status"].get("reservedFor"):
                return c
        return NotYet([dict(c.to_dict()).get("status") for c in claims])

    claim = wait_for(allocated, timeout=60, what=f"claim of Pod {namespace}/{name} allocated")
    meta = claim["metadata"]
    return ClaimId(namespace=namespace, name=meta["name"], uid=meta["uid"]), claim


def cdi_file(plugin: PluginProcess, uid: str) -> Path:
    return plugin.cdi_root / f"k8s.{DRIVER}-claim_{uid}.json"


def checkpoint_claims(plugin: PluginProcess) -> dict[str, Any]:
    return stored_claims(plugin.state_dir)


def assert_clean(plugin: PluginProcess) -> None:
    """Nothing left behind: no spec, no checkpoint entry, no temp file."""
    assert list(plugin.cdi_root.glob("*.json")) == []
    assert checkpoint_claims(plugin) == {}
    leftovers = [*plugin.cdi_root.glob("*.tmp"), *plugin.state_dir.glob("*.tmp")]
    assert leftovers == []


def test_slices_are_accepted_allocated_and_prepared(
    kube: Kube,
    namespace: str,
    node: str,
    gpu_class: str,
    plugin: PluginProcess,
    cdi_validator: jsonschema.Draft7Validator,
) -> None:
    slices = wait_published(kube, node)
    assert {s["spec"]["pool"]["name"] for s in slices} == {node}
    assert slices[0]["metadata"]["ownerReferences"][0]["kind"] == "Node"

    ref, claim = allocated_pod_claim(kube, namespace, node)
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert result["driver"] == DRIVER
    assert result["pool"] == node

    kubelet = KubeletClient(plugin)
    response = kubelet.prepare([ref])
    entry = response.claims[ref.uid]
    assert entry.error == ""
    (device,) = entry.devices
    assert device.device_name == result["device"]
    assert list(device.request_names) == ["gpu"]
    expected_id = f"k8s.{DRIVER}/claim={ref.uid}-{result['device']}"
    # The device, then the request's device metadata file (KEP-5304, docs/kubelet-plugin.md).
    metadata_id = f"k8s.{DRIVER}/claim={ref.uid}_gpu"
    assert list(device.cdi_device_ids) == [expected_id, metadata_id]

    spec = json.loads(cdi_file(plugin, ref.uid).read_text())
    cdi_validator.validate(spec)
    assert f"{spec['kind']}={spec['devices'][0]['name']}" == expected_id
    env = spec["devices"][0]["containerEdits"]["env"]
    assert any(e.startswith(f"{device_variable(result['device'])}=GPU-") for e in env)
    assert checkpoint_claims(plugin)[ref.uid]["state"] == "PrepareCompleted"

    # kubelet may call again (its own restart): same answer.
    again = kubelet.prepare([ref]).claims[ref.uid]
    assert list(again.devices[0].cdi_device_ids) == [expected_id, metadata_id]
    # v1beta1 speaks the same.
    beta = kubelet.prepare_v1beta1([ref]).claims[ref.uid]
    assert list(beta.devices[0].cdi_device_ids) == [expected_id, metadata_id]

    assert kubelet.unprepare([ref]).claims[ref.uid].error == ""
    assert_clean(plugin)
    assert kubelet.unprepare([ref]).claims[ref.uid].error == ""  # idempotent


def test_wiped_cdi_dir_is_rewritten_on_repeated_prepare(
    kube: Kube, namespace: str, node: str, gpu_class: str, plugin: PluginProcess
) -> None:
    wait_published(kube, node)
    ref, _ = allocated_pod_claim(kube, namespace, node)
    kubelet = KubeletClient(plugin)
    first = kubelet.prepare([ref]).claims[ref.uid]
    before = cdi_file(plugin, ref.uid).read_bytes()
    cdi_file(plugin, ref.uid).unlink()  # what a reboot does to /var/run/cdi (tmpfs)
    second = kubelet.prepare([ref]).claims[ref.uid]
    assert second.error == ""
    assert list(second.devices[0].cdi_device_ids) == list(first.devices[0].cdi_device_ids)
    assert cdi_file(plugin, ref.uid).read_bytes() == before


def test_config_errors_name_the_field(
    kube: Kube, namespace: str, node: str, gpu_class: str, plugin: PluginProcess
) -> None:
    wait_published(kube, node)
    bad = {"apiVersion": "resource.drasil.dev/v1beta1", "kind": "GpuConfig"}
    bad["sharing"] = {"strategy": "Foo"}  # type: ignore[assignment]
    ref, _ = allocated_pod_claim(kube, namespace, node, config=bad)
    entry = KubeletClient(plugin).prepare([ref]).claims[ref.uid]
    assert "sharing.strategy" in entry.error
    assert "Foo" in entry.error
    assert "TimeSlicing" in entry.error
    assert not cdi_file(plugin, ref.uid).exists()


def test_sharing_config_reaches_the_cdi_env(
    kube: Kube, namespace: str, node: str, gpu_class: str, plugin: PluginProcess
) -> None:
    wait_published(kube, node)
    config = {
        "apiVersion": "resource.drasil.dev/v1beta1",
        "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}},
    }
    ref, _ = allocated_pod_claim(kube, namespace, node, config=config)
    assert KubeletClient(plugin).prepare([ref]).claims[ref.uid].error == ""
    spec = json.loads(cdi_file(plugin, ref.uid).read_text())
    env = spec["devices"][0]["containerEdits"]["env"]
    variable = device_variable(spec["devices"][0]["name"].removeprefix(f"{ref.uid}-"))
    assert f"{variable}_SHARING_STRATEGY=TimeSlicing" in env
    assert f"{variable}_TIMESLICE_INTERVAL=Long" in env


def test_unknown_claim_gets_a_per_claim_error(plugin: PluginProcess) -> None:
    ghost = ClaimId(namespace="default", name="no-such-claim", uid="0000-ghost")
    entry = KubeletClient(plugin).prepare([ghost]).claims[ghost.uid]
    assert "not found" in entry.error


PREPARE_CRASHES = [
    "checkpoint-before-rename",  # the PrepareStarted write
    "prepare-after-started",
    "cdi-mid-write",
    "cdi-before-rename",
    "prepare-after-cdi",
    "prepare-after-completed",
]
UNPREPARE_CRASHES = ["cdi-before-remove", "unprepare-after-cdi"]


@pytest.mark.parametrize("crash_at", PREPARE_CRASHES)
def test_crash_during_prepare_is_repaired_by_the_next_call(
    kube: Kube, namespace: str, node: str, gpu_class: str, node_root: Path,
    plugin_kubeconfig: Path,
    crash_at: str,
) -> None:  # fmt: skip
    plugin = PluginProcess(root=node_root, kubeconfig=plugin_kubeconfig, node_name=node)
    plugin.start(crash_at=crash_at)
    try:
        wait_published(kube, node)
        ref, _ = allocated_pod_claim(kube, namespace, node)
        kubelet = KubeletClient(plugin)
        with pytest.raises(grpc.RpcError):
            kubelet.prepare([ref], timeout=20)
        assert plugin.wait_exit() == 137
        plugin.start()  # what the DaemonSet does after the crash
        entry = kubelet.prepare([ref]).claims[ref.uid]
        assert entry.error == ""
        assert cdi_file(plugin, ref.uid).exists()
        assert checkpoint_claims(plugin)[ref.uid]["state"] == "PrepareCompleted"
        assert kubelet.unprepare([ref]).claims[ref.uid].error == ""
        assert_clean(plugin)
    finally:
        plugin.stop()


@pytest.mark.parametrize("crash_at", UNPREPARE_CRASHES)
def test_crash_during_unprepare_is_repaired_by_the_next_call(
    kube: Kube, namespace: str, node: str, gpu_class: str, node_root: Path,
    plugin_kubeconfig: Path,
    crash_at: str,
) -> None:  # fmt: skip
    plugin = PluginProcess(root=node_root, kubeconfig=plugin_kubeconfig, node_name=node)
    plugin.start()
    try:
        wait_published(kube, node)
        ref, _ = allocated_pod_claim(kube, namespace, node)
        kubelet = KubeletClient(plugin)
        assert kubelet.prepare([ref]).claims[ref.uid].error == ""
        plugin.stop()
        plugin.start(crash_at=crash_at)
        with pytest.raises(grpc.RpcError):
            kubelet.unprepare([ref], timeout=20)
        assert plugin.wait_exit() == 137
        plugin.start()
        assert kubelet.unprepare([ref]).claims[ref.uid].error == ""
        assert_clean(plugin)
    finally:
        plugin.stop()


def test_claims_deleted_while_the_plugin_was_down_are_cleaned_up(
    kube: Kube, namespace: str, node: str, gpu_class: str, plugin: PluginProcess
) -> None:
    wait_published(kube, node)
    ref, _ = allocated_pod_claim(kube, namespace, node)
    assert KubeletClient(plugin).prepare([ref]).claims[ref.uid].error == ""
    plugin.kill()
    kube.core.delete_collection_namespaced_pod(namespace, grace_period_seconds=0)
    kube.delete(RESOURCE, "ResourceClaim", ref.name, namespace)
    wait_for(
        lambda: NotYet("claim still there") if _exists(kube, ref, namespace) else True,
        timeout=60,
        what=f"claim {ref.name} deleted",
    )
    plugin.start()  # the reconcile at start finds the stale entry
    wait_for(
        lambda: True if not checkpoint_claims(plugin) else NotYet(checkpoint_claims(plugin)),
        timeout=60,
        what="the stale checkpoint entry to be unprepared",
    )
    assert_clean(plugin)


def _exists(kube: Kube, ref: ClaimId, namespace: str) -> bool:
    claims = kube.resource(RESOURCE, "ResourceClaim").get(namespace=namespace).items
    return any(c.metadata.uid == ref.uid for c in claims)


def test_fault_taints_the_device_and_recovery_removes_the_taint(
    kube: Kube, node: str, plugin: PluginProcess
) -> None:
    from drasil.driver.health import FAULT_FILE, write_faults

    wait_published(kube, node)
    faults = plugin.state_dir / FAULT_FILE
    write_faults(faults, {"gpu-3": "injected by e2e"})

    def taints() -> dict[str, Any]:
        return {
            d["name"]: d.get("taints")
            for s in node_slices(kube, node)
            for d in s["spec"].get("devices") or []
        }

    tainted = wait_for(
        lambda: taints() if taints().get("gpu-3") else NotYet(taints()),
        timeout=30,
        what="gpu-3 tainted in the published slice",
    )
    assert tainted["gpu-3"][0]["key"] == f"{DRIVER}/unhealthy"
    assert tainted["gpu-3"][0]["effect"] == "NoSchedule"
    assert not tainted["gpu-2"]
    write_faults(faults, {})
    wait_for(
        lambda: True if not taints().get("gpu-3") else NotYet(taints()),
        timeout=30,
        what="the taint on gpu-3 removed after recovery",
    )


def test_deleted_registration_socket_comes_back(plugin: PluginProcess) -> None:
    plugin.reg_socket.unlink()
    info = wait_for(
        lambda: KubeletClient(plugin).get_info() if plugin.reg_socket.exists() else NotYet("gone"),
        timeout=10,
        what="the registration socket re-created",
    )
    assert info.name == DRIVER
    assert info.endpoint == str(plugin.dra_socket)
    assert list(info.supported_versions)[:2] == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]


def test_deleted_slices_are_published_again(kube: Kube, node: str, plugin: PluginProcess) -> None:
    # kubelet deletes its node's slices every time it starts; a human may too.
    for obj in wait_published(kube, node):
        kube.delete(RESOURCE, "ResourceSlice", obj["metadata"]["name"])
    slices = wait_published(kube, node)
    assert {s["spec"]["pool"]["name"] for s in slices} == {node}


# --- faults that are not the claims' ---------------------------------------------------


@contextlib.contextmanager
def api_server_hung(cluster: Cluster | None) -> Iterator[None]:
    """The session's own kube-apiserver SIGSTOPped: it accepts connections and never
    answers, like an API server wedged on etcd. SIGCONT afterwards, whatever happens."""
    assert cluster is not None, "needs the cluster this session started (not DRASIL_E2E_KUBECONFIG)"
    proc = read_pid_file(cluster.pid_file("kube-apiserver"))
    assert proc is not None, "kube-apiserver has no pid file"
    assert proc.alive(), "kube-apiserver is not running"
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(proc.pid, signal.SIGCONT)


def test_a_hung_api_server_costs_a_prepare_one_timeout_and_unprepare_nothing(
    kube: Kube,
    namespace: str,
    node: str,
    gpu_class: str,
    plugin: PluginProcess,
    cluster: Cluster | None,
) -> None:
    wait_published(kube, node)
    first, _ = allocated_pod_claim(kube, namespace, node)
    second, _ = allocated_pod_claim(kube, namespace, node)
    kubelet = KubeletClient(plugin)
    assert kubelet.prepare([first]).claims[first.uid].error == ""
    with api_server_hung(cluster), ThreadPoolExecutor(max_workers=1) as pool:
        # kubelet's own deadline (45 s): the answer must come within it.
        pending = pool.submit(KubeletClient(plugin).prepare, [second], timeout=45)
        # Deadlines shorter than one API timeout (20 s): a call that waited for the
        # API server would fail with DEADLINE_EXCEEDED.
        info = kubelet.get_info()
        unprepared = kubelet.unprepare([first], timeout=15).claims[first.uid].error
        answer = pending.result()

    assert info.name == DRIVER
    assert unprepared == ""
    error = answer.claims[second.uid].error
    assert error.startswith(f"prepare of ResourceClaim {namespace}/{second.name}: ")
    assert "did not answer within 20 s" in error
    assert plugin.running()
    # The API server is back: kubelet's retry prepares the claim.
    assert kubelet.prepare([second]).claims[second.uid].error == ""


def test_a_checkpoint_deleted_while_running_is_written_back(
    kube: Kube, namespace: str, node: str, gpu_class: str, plugin: PluginProcess
) -> None:
    wait_published(kube, node)
    ref, _ = allocated_pod_claim(kube, namespace, node)
    kubelet = KubeletClient(plugin)
    assert kubelet.prepare([ref]).claims[ref.uid].error == ""
    lose_checkpoint(plugin.state_dir)

    again = kubelet.prepare([ref]).claims[ref.uid]  # any call under the state lock

    assert again.error == ""
    assert checkpoint_claims(plugin)[ref.uid]["state"] == "PrepareCompleted"
    assert cdi_file(plugin, ref.uid).exists()


def test_a_checkpoint_deleted_while_stopped_is_rebuilt_from_the_cdi_specs(
    kube: Kube, namespace: str, node: str, gpu_class: str, plugin: PluginProcess
) -> None:
    wait_published(kube, node)
    ref, _ = allocated_pod_claim(kube, namespace, node)
    kubelet = KubeletClient(plugin)
    assert kubelet.prepare([ref]).claims[ref.uid].error == ""
    plugin.stop()
    lose_checkpoint(plugin.state_dir)

    plugin.start()

    # The spec survives the leaked-spec sweep: the claim is recorded again from it.
    assert cdi_file(plugin, ref.uid).exists()
    assert checkpoint_claims(plugin)[ref.uid]["namespace"] == namespace
    assert kubelet.prepare([ref]).claims[ref.uid].error == ""
    assert checkpoint_claims(plugin)[ref.uid]["state"] == "PrepareCompleted"


def test_a_full_cdi_dir_fails_only_that_claim(
    kube: Kube, namespace: str, node: str, gpu_class: str, plugin: PluginProcess
) -> None:
    wait_published(kube, node)
    first, _ = allocated_pod_claim(kube, namespace, node)
    second, _ = allocated_pod_claim(kube, namespace, node)
    kubelet = KubeletClient(plugin)
    assert kubelet.prepare([first]).claims[first.uid].error == ""
    # A tiny tmpfs over the CDI dir, filled up: what a full /var/run looks like.
    saved = {p.name: p.read_bytes() for p in plugin.cdi_root.glob("*.json")}
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(plugin.cdi_root)], check=True
    )
    try:
        for name, data in saved.items():
            (plugin.cdi_root / name).write_bytes(data)
        filler = plugin.cdi_root / "filler"
        with contextlib.suppress(OSError), filler.open("wb") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
        both = kubelet.prepare([first, second]).claims
    finally:
        subprocess.run(["umount", str(plugin.cdi_root)], check=True)

    assert both[first.uid].error == ""  # prepared before: answered from the checkpoint
    error = both[second.uid].error
    assert error.startswith(f"prepare of ResourceClaim {namespace}/{second.name}: ")
    assert "No space left on device" in error
    assert error.endswith("; kubelet retries the claim")


def test_a_claim_nested_thousands_deep_is_that_claims_error(
    kube: Kube, namespace: str, node: str, gpu_class: str, plugin: PluginProcess
) -> None:
    allow_nesting()  # this test's own client must encode the object, as a user's would
    deep: list[Any] = []
    for _ in range(3000):
        deep = [deep]
    config = {"apiVersion": "resource.drasil.dev/v1beta1", "kind": "GpuConfig", "x": deep}
    wait_published(kube, node)
    good, _ = allocated_pod_claim(kube, namespace, node)
    hostile, _ = allocated_pod_claim(kube, namespace, node, config=config)

    answers = KubeletClient(plugin).prepare([good, hostile]).claims

    assert answers[good.uid].error == ""
    assert "nested too deeply" in answers[hostile.uid].error
    assert plugin.running()

"""A ``migMode`` change under a prepared MIG claim, against the real scheduler.

The plugin runs in one MIG mode, a Pod's claim gets a MIG device and is prepared; the
plugin is restarted in the other mode over the same state dir and simulated GPU (what a
``helm upgrade --set migMode=…`` does to the node's plugin). The claim stays prepared
and keeps its instance, a second claim does not get that instance, and unprepare
cleans up what the first claim's record says was made. The test acts as kubelet.

The last test does it with the chart on the real node: ``helm install`` in dynamic
mode, a running Pod on a MIG device, ``helm upgrade --set migMode=static``; the Pod
keeps running, a second MIG Pod stays pending, and deleting the first destroys the
instance (kubelet unprepares it through the static plugin).
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from drasil.driver.nvidia.nvml import Placement
from drasil.driver.simulated.nvml import simulated_library
from e2e.harness.chart import CHART
from e2e.harness.cluster.node import Node
from e2e.harness.kube import RESOURCE, Kube, NotYet, wait_for
from e2e.harness.pluginproc import DRIVER, KubeletClient, PluginProcess
from e2e.harness.pods import node_events
from e2e.test_dynamic_mig import (
    MIG_CLASS,
    PROFILE,
    PROFILE_3G,
    claim_pod,
    delete_pod,
    gpu_and_mig_classes,
    instances,
    stays_pending,
    wait_allocated,
)
from e2e.test_install import _delete_pod as delete_and_unprepare
from e2e.test_install import _device_class as device_class_of
from e2e.test_install import _helm as run_helm
from e2e.test_install import _plugin_pods as plugin_pods
from e2e.test_install import _pod as read_pod
from e2e.test_install import _ready as ready
from e2e.test_install import _running_with_gpu as running_with_gpu
from e2e.test_install import _values as chart_values
from e2e.test_install import _workload as workload
from e2e.test_kubeletplugin import assert_clean
from tools.image import LocalImage, build_image, import_image

AT_4 = f'{PROFILE_3G} && device.attributes["{DRIVER}"].placementStart == 4'


@pytest.fixture(scope="module")
def mig_classes(kube: Kube) -> Iterator[None]:
    yield from gpu_and_mig_classes(kube)


@pytest.fixture
def mig_node(make_node: Callable[..., dict[str, Any]]) -> str:
    name = f"e2e-migmode-{secrets.token_hex(3)}"
    make_node(name)
    return name


@pytest.fixture
def plugin(plugin_kubeconfig: Path, mig_node: str) -> Iterator[PluginProcess]:
    """The node's plugin, not started: each test starts it in its first mode."""
    root = Path(tempfile.mkdtemp(prefix="drasil-mm-"))  # short: socket paths
    proc = PluginProcess(
        root=root, kubeconfig=plugin_kubeconfig, node_name=mig_node, profile=PROFILE
    )
    yield proc
    proc.stop()
    shutil.rmtree(root, ignore_errors=True)


def restart_in(plugin: PluginProcess, mig_mode: str) -> None:
    """What the rolled DaemonSet Pod does: the same node state, another mode."""
    if plugin.proc is not None:
        plugin.stop()
    plugin.env["MIG_MODE"] = mig_mode
    plugin.start()


def published(kube: Kube, node: str, wanted: Callable[[list[str]], bool]) -> list[str]:
    """The node's published device names, once ``wanted`` holds for them."""

    def names() -> Any:
        slices = kube.resource(RESOURCE, "ResourceSlice").get(
            field_selector=f"spec.nodeName={node}"
        )
        found = [
            d["name"] for s in slices.items for d in dict(s.to_dict())["spec"].get("devices") or []
        ]
        # In a dict: no device at all is an answer too, and wait_for wants it truthy.
        return {"devices": found} if wanted(found) else NotYet(found)

    result: dict[str, list[str]] = wait_for(names, timeout=60, what=f"devices of {node}")
    return result["devices"]


def node_event(kube: Kube, node: str) -> str:
    return node_events(kube, node, "MigInstancesReconciled", timeout=30)[0]


def operator_cuts_3g_at_4(plugin: PluginProcess) -> None:
    """A 3g.40gb at memory slice 4 made by hand (``nvidia-smi mig -cgi 9 -C``)."""
    plugin.state_dir.mkdir(parents=True, exist_ok=True)
    lib = simulated_library(PROFILE, node_name=plugin.node_name, state_file=plugin.gpu_state_file)
    lib.init()
    handle = lib.device_handle_by_index(0)
    lib.device_set_mig_mode(handle, True)
    made = lib.create_gpu_instance(handle, 9, Placement(start=4, size=4))
    lib.create_compute_instance(handle, made.gpu_instance_id)


def test_static_to_dynamic_keeps_the_operators_instance_for_its_claim(
    kube: Kube, namespace: str, mig_node: str, mig_classes: None, plugin: PluginProcess,
) -> None:  # fmt: skip
    operator_cuts_3g_at_4(plugin)
    restart_in(plugin, "static")
    published(kube, mig_node, lambda names: any(n.startswith("gpu-0-mig-3g40gb-") for n in names))
    kubelet = KubeletClient(plugin)
    first = claim_pod(kube, namespace, mig_node, device_class=MIG_CLASS, cel=PROFILE_3G)
    held, _ = wait_allocated(kube, namespace, first)
    assert kubelet.prepare([held]).claims[held.uid].error == ""

    restart_in(plugin, "dynamic")
    assert len(instances(plugin)) == 1  # the running workload keeps its MIG device
    message = node_event(kube, mig_node)
    assert "kept 1 MIG instance" in message, message
    assert held.name in message, message
    published(kube, mig_node, lambda names: "gpu-0-mig-3g40gb-at-4" in names)

    # The scheduler does not know the kept instance; prepare refuses its placement.
    second = claim_pod(kube, namespace, mig_node, device_class=MIG_CLASS, cel=AT_4)
    other, device = wait_allocated(kube, namespace, second)
    assert device == "gpu-0-mig-3g40gb-at-4"
    error = kubelet.prepare([other]).claims[other.uid].error
    assert held.name in error, error

    # Unprepare leaves the operator's instance; the waiting claim then gets it.
    assert kubelet.unprepare([held]).claims[held.uid].error == ""
    assert len(instances(plugin)) == 1
    delete_pod(kube, namespace, first)
    assert kubelet.prepare([other]).claims[other.uid].error == ""
    assert kubelet.unprepare([other]).claims[other.uid].error == ""
    assert instances(plugin) == []
    delete_pod(kube, namespace, second)
    assert_clean(plugin)


def test_dynamic_to_static_keeps_the_cut_instance_and_destroys_it_at_unprepare(
    kube: Kube, namespace: str, mig_node: str, mig_classes: None, plugin: PluginProcess,
) -> None:  # fmt: skip
    restart_in(plugin, "dynamic")
    published(kube, mig_node, lambda names: "gpu-0-mig-3g40gb-at-4" in names)
    kubelet = KubeletClient(plugin)
    first = claim_pod(kube, namespace, mig_node, device_class=MIG_CLASS, cel=AT_4)
    held, _ = wait_allocated(kube, namespace, first)
    assert kubelet.prepare([held]).claims[held.uid].error == ""
    assert len(instances(plugin)) == 1

    restart_in(plugin, "static")
    assert len(instances(plugin)) == 1
    message = node_event(kube, mig_node)
    assert held.name in message, message
    # The held instance is not offered as a static MIG device: a second 3g.40gb waits.
    names = published(kube, mig_node, lambda names: not any("-at-" in n for n in names))
    assert not any(n.startswith("gpu-0-mig-") for n in names), names
    second = claim_pod(kube, namespace, mig_node, device_class=MIG_CLASS, cel=PROFILE_3G)
    stays_pending(kube, namespace, second)

    # Unprepared in static mode, the instance drasil cut is destroyed all the same.
    assert kubelet.unprepare([held]).claims[held.uid].error == ""
    assert instances(plugin) == []
    delete_pod(kube, namespace, first)
    delete_pod(kube, namespace, second)
    assert_clean(plugin)


# ---- the chart: helm upgrade --set migMode ------------------------------------------

CHART_DRIVER = "gpu.install.drasil.dev"  # e2e/test_install.py's driver, beside the node's
CHART_MIG_CLASS = "mig-migmode.drasil.dev"


@pytest.fixture(scope="module")
def chart_image(node: Node) -> LocalImage:
    image = build_image()
    import_image(image, ctr=node.bin("ctr"), address=node.containerd_socket)
    return image


@pytest.fixture
def chart_mig_class(kube: Kube) -> Iterator[str]:
    selector = (
        f'device.driver == "{CHART_DRIVER}" && device.attributes["{CHART_DRIVER}"].type == "mig"'
    )
    yield from device_class_of(kube, CHART_MIG_CLASS, selector)


def chart_instances(node: Node) -> list[str]:
    """The chart plugin's simulated GPU's MIG instances (its state file on the host)."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "drasil.driver.cli",
            "discover",
            "--backend=simulated",
            f"--profile={PROFILE}",
            f"--node-name={node.name}",
            "--mig-mode=dynamic",
            f"--simulated-state={node.plugins_dir / CHART_DRIVER / 'simulated-gpus.json'}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return [line for line in done.stdout.splitlines() if " gi=" in line]


def test_helm_upgrade_to_static_keeps_a_running_pods_mig_device(
    kube: Kube, kubeconfig: Path, namespace: str, node: Node, chart_image: LocalImage,
    chart_mig_class: str, tmp_path: Path,
) -> None:  # fmt: skip
    release = f"mm{secrets.token_hex(2)}"
    values, _ = chart_values(node, chart_image, kubeconfig)
    values.update(simulatedProfile=PROFILE, migMode="dynamic")
    values["controller"]["enabled"] = False
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    common = [f"--namespace={namespace}", "--timeout=180s", "--wait"]
    run_helm(kubeconfig, "install", release, str(CHART), "-f", str(values_file), *common)
    try:
        (plugin,) = plugin_pods(kube, namespace, release)
        first = workload(kube, namespace, node, device_class=chart_mig_class)
        first_uuid = running_with_gpu(kube, namespace, first)
        assert first_uuid.startswith("MIG-")
        assert len(chart_instances(node)) == 1
        first_uid = read_pod(kube, namespace, first).metadata.uid

        run_helm(
            kubeconfig, "upgrade", release, str(CHART), "-f", str(values_file),
            "--set", "migMode=static", *common,
        )  # fmt: skip

        def rolled() -> Any:
            pods = plugin_pods(kube, namespace, release)
            fresh = [p for p in pods if p.metadata.uid != plugin.metadata.uid]
            done = len(pods) == 1 and fresh and ready(fresh[0])
            return done or NotYet([(p.metadata.name, p.status.phase) for p in pods])

        wait_for(rolled, timeout=180, what="the DaemonSet to roll to the static plugin")
        still = read_pod(kube, namespace, first)
        assert still.metadata.uid == first_uid
        assert still.status.phase == "Running"
        assert still.status.container_statuses[0].restart_count == 0
        assert len(chart_instances(node)) == 1  # the workload keeps its MIG device

        # The held instance is not offered in static mode: a second MIG Pod waits.
        second = workload(kube, namespace, node, device_class=chart_mig_class)
        stays_pending(kube, namespace, second)

        # Deleting the Pod unprepares its claim in static mode: the instance goes.
        delete_and_unprepare(kube, namespace, first)
        wait_for(
            lambda: chart_instances(node) == [] or NotYet(chart_instances(node)),
            timeout=60,
            what="the instance destroyed by the static plugin's unprepare",
        )
        delete_pod(kube, namespace, second)
    finally:
        run_helm(kubeconfig, "uninstall", release, f"--namespace={namespace}", "--wait")

"""Device-plugin mode on a real node: the local cluster's kubelet, through its classic
device-plugin API, advertises `drasil.dev/gpu` from drasil's plugin and hands GPUs to
Pods that ask for them in their limits; containerd resolves the plugin's static CDI spec.

The device plugin runs beside the node's DRA plugin for the same simulated GPUs (a
real node would run one or the other). A DeviceClass maps `drasil.dev/gpu` to DRA too,
as on a mixed cluster: kube-scheduler must use the device plugin on this node as long
as it advertises the resource, and DRA again once it is gone (test_node.py relies on
that; the fixture waits for it).

What is asserted is what an operator and a user see: `kubectl describe node`, the
Node's status, the Pod's env and events, the drasil CLI's fault injection.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.harness.cluster.node import Node
from e2e.harness.kube import RESOURCE, Kube, NotYet, wait_for
from e2e.harness.pluginproc import DRIVER, GPU_RESOURCE, PluginProcess
from e2e.harness.pods import (
    POD_TIMEOUT,
    container_env,
    delete_pod,
    device_uuids,
    events,
    pod,
    wait_running,
)
from e2e.harness.pods import visible_uuids as dra_visible_uuids

GPUS = 8  # the node's simulated profile, h100-80gb:8
DRA_CLASS = f"device-plugin-e2e.{DRIVER}"
GPU_SELECTOR = f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].type == "gpu"'
Kubectl = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture(scope="module")
def device_plugin(kube: Kube, node: Node) -> Iterator[PluginProcess]:
    """The node's plugin in device-plugin mode, registered, every GPU allocatable; and
    a DeviceClass that maps drasil.dev/gpu to the DRA plugin's devices as well. After
    the module it is stopped and the Node counts no drasil.dev/gpu as allocatable."""
    kube.delete(RESOURCE, "DeviceClass", DRA_CLASS)
    kube.create(
        {
            "apiVersion": RESOURCE,
            "kind": "DeviceClass",
            "metadata": {"name": DRA_CLASS},
            "spec": {
                "selectors": [{"cel": {"expression": GPU_SELECTOR}}],
                "extendedResourceName": GPU_RESOURCE,
            },
        }
    )
    fault(node, "clear")
    node.start_device_plugin()
    try:
        yield node.device_plugin
    finally:
        fault(node, "clear")
        node.stop_device_plugin()
        kube.delete(RESOURCE, "DeviceClass", DRA_CLASS)


@pytest.fixture
def ns(namespace: str, kube: Kube, device_plugin: PluginProcess) -> Iterator[str]:
    """The test's namespace; afterwards its Pods are deleted gracefully (kubelet frees
    their devices) and any fault a test injected is cleared."""
    yield namespace
    for item in kube.core.list_namespaced_pod(namespace).items:
        assert item.metadata is not None
        assert item.metadata.name is not None
        delete_pod(kube, namespace, item.metadata.name)


# -- helpers -------------------------------------------------------------------------


def fault(node: Node, action: str, device: str | None = None) -> str:
    """`drasil fault <action> [device]` against the device plugin's fault file, as an
    operator runs it on the node."""
    drasil = Path(sys.executable).parent / "drasil"
    argv = [str(drasil), "fault", action, *([device] if device else [])]
    argv += ["--plugins-dir", str(node.device_plugin.plugins_dir)]
    done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=30)
    assert done.returncode == 0, f"{' '.join(argv)}: {done.stderr}"
    return done.stdout


def described(kubectl: Kubectl, node: Node) -> dict[str, dict[str, str]]:
    """The Capacity and Allocatable sections of `kubectl describe node`, as dicts."""
    text = kubectl("describe", "node", node.name).stdout
    sections = {}
    for section in ("Capacity", "Allocatable"):
        match = re.search(rf"^{section}:\n((?:[ \t]+\S.*\n)+)", text, re.MULTILINE)
        assert match, f"no {section} section in `kubectl describe node`:\n{text}"
        lines = (line.strip().split(":", 1) for line in match.group(1).splitlines())
        sections[section] = {key.strip(): value.strip() for key, value in lines}
    return sections


def visible_uuids(env: dict[str, str]) -> list[str]:
    """What Allocate told the container (device-plugin mode sets the list)."""
    return env["NVIDIA_VISIBLE_DEVICES"].split(",")


def published_uuids(kube: Kube, node: Node) -> set[str]:
    return set(device_uuids(kube, node).values())


def no_claims(kube: Kube, namespace: str) -> list[str]:
    claims = kube.resource(RESOURCE, "ResourceClaim").get(namespace=namespace).items
    return [c.metadata.name for c in claims]


# -- tests ---------------------------------------------------------------------------


def test_node_advertises_every_gpu_in_capacity_and_allocatable(
    node: Node, kubectl: Kubectl, device_plugin: PluginProcess
) -> None:
    sections = described(kubectl, node)
    assert sections["Capacity"][GPU_RESOURCE] == str(GPUS)
    assert sections["Allocatable"][GPU_RESOURCE] == str(GPUS)
    kubelet_log = node.log("kubelet").read_text(errors="replace")
    assert re.search(
        r'"Got registration request from device plugin with resource".*'
        rf'resourceName="{re.escape(GPU_RESOURCE)}"',
        kubelet_log,
    ), "kubelet's log has no registration of drasil.dev/gpu"
    # The static CDI spec kubelet's Allocate answers point containerd at.
    assert (node.cdi_dir / f"k8s.{DRIVER}-device.json").is_file()


def test_pod_with_two_gpus_in_its_limits_sees_two_distinct_uuids(
    kube: Kube, ns: str, node: Node
) -> None:
    name = pod(kube, ns, node, limits={GPU_RESOURCE: 2})
    wait_running(kube, ns, name)
    env = container_env(kube, ns, name)
    uuids = visible_uuids(env)
    assert len(set(uuids)) == len(uuids) == 2, env["NVIDIA_VISIBLE_DEVICES"]
    assert set(uuids) <= published_uuids(kube, node)
    assert env["DRASIL_VISIBLE_DEVICES"] == env["NVIDIA_VISIBLE_DEVICES"]
    per_device = {k: v for k, v in env.items() if k.startswith("DRASIL_DEVICE_GPU_")}
    assert sorted(per_device.values()) == sorted(uuids)
    # Served by the device plugin, not DRA, although a DeviceClass maps the name: the
    # node advertises it, so kube-scheduler made no extended-resource claim.
    status = kube.get("v1", "Pod", name, ns)["status"]
    assert not status.get("extendedResourceClaimStatus"), status
    assert no_claims(kube, ns) == []
    # A second Pod gets the other GPUs.
    other = pod(kube, ns, node, limits={GPU_RESOURCE: 2})
    wait_running(kube, ns, other)
    assert not set(visible_uuids(container_env(kube, ns, other))) & set(uuids)


def test_fault_lowers_allocatable_until_the_device_recovers(
    kube: Kube, ns: str, node: Node, kubectl: Kubectl
) -> None:
    fault(node, "inject", "gpu-3")
    node.wait_extended_resource(GPU_RESOURCE, capacity=GPUS, allocatable=GPUS - 1)
    sections = described(kubectl, node)
    assert sections["Allocatable"][GPU_RESOURCE] == str(GPUS - 1)
    assert sections["Capacity"][GPU_RESOURCE] == str(GPUS)

    # A Pod that needs every GPU waits, and says why.
    name = pod(kube, ns, node, limits={GPU_RESOURCE: GPUS})

    def insufficient() -> Any:
        found = [e for e in events(kube, ns, name) if f"Insufficient {GPU_RESOURCE}" in e]
        return found or NotYet(events(kube, ns, name))

    wait_for(insufficient, timeout=60, what=f"FailedScheduling of {name} for {GPU_RESOURCE}")

    fault(node, "clear", "gpu-3")
    node.wait_extended_resource(GPU_RESOURCE, capacity=GPUS, allocatable=GPUS)
    wait_running(kube, ns, name)
    assert len(set(visible_uuids(container_env(kube, ns, name)))) == GPUS


def test_kubelet_restart_registers_again_and_keeps_device_health(
    kube: Kube, ns: str, node: Node
) -> None:
    running = pod(kube, ns, node, limits={GPU_RESOURCE: 1})
    wait_running(kube, ns, running)
    (kept,) = visible_uuids(container_env(kube, ns, running))
    fault(node, "inject", "gpu-5")
    node.wait_extended_resource(GPU_RESOURCE, allocatable=GPUS - 1)

    before = node.device_plugin.registrations()
    node.restart_kubelet()  # kubelet deletes every socket in device-plugins/ at start
    node.wait_registered(node.device_plugin, after=before)
    assert node.device_plugin.device_plugin_socket.is_socket()
    # The broken GPU is still reported unhealthy to the new kubelet.
    node.wait_extended_resource(GPU_RESOURCE, capacity=GPUS, allocatable=GPUS - 1)
    fault(node, "clear", "gpu-5")
    node.wait_extended_resource(GPU_RESOURCE, capacity=GPUS, allocatable=GPUS)

    status = wait_running(kube, ns, running)["status"]
    assert status["containerStatuses"][0]["restartCount"] == 0
    fresh = pod(kube, ns, node, limits={GPU_RESOURCE: 1})
    wait_running(kube, ns, fresh)
    (got,) = visible_uuids(container_env(kube, ns, fresh))
    assert got != kept
    assert got in published_uuids(kube, node)


def test_stopped_device_plugin_hands_the_resource_back_to_dra(
    kube: Kube, ns: str, node: Node, device_plugin: PluginProcess
) -> None:
    """Last in the module: once the plugin stops, the Node has no allocatable
    drasil.dev/gpu and the same Pod spec is served by DRA (an extended-resource claim)."""
    node.stop_device_plugin()
    try:
        name = pod(kube, ns, node, limits={GPU_RESOURCE: 1})
        wait_running(kube, ns, name)
        status = kube.get("v1", "Pod", name, ns)["status"]
        claim = status["extendedResourceClaimStatus"]["resourceClaimName"]
        env = container_env(kube, ns, name)
        (uuid,) = dra_visible_uuids(env)  # DRA's CDI spec names each device
        assert uuid in published_uuids(kube, node)
        delete_pod(kube, ns, name)
        wait_for(
            lambda: claim not in no_claims(kube, ns) or NotYet(no_claims(kube, ns)),
            timeout=POD_TIMEOUT,
            what=f"the extended-resource claim {claim} to be deleted with its Pod",
        )
    finally:
        node.start_device_plugin()

"""GPUs passed through to VMs on the real node: the chart's class, the scheduler's
counter, the node's container runtime and kubelet.

The module fixture restarts the node's plugin with ``--passthrough`` (and puts it
back): its eight simulated H100s are then published twice, as GPUs and as vfio
devices, each pair drawing one counter. The simulated backend's PCI tree
(``drasil.driver.simulated.pcikernel``) is where prepare binds a GPU's IOMMU group to
vfio-pci; the Pod's container gets the VFIO nodes from containerd through CDI.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.harness.chart import render
from e2e.harness.cluster.node import Node
from e2e.harness.kube import RESOURCE, Kube, NotYet, device_classes, wait_for
from e2e.harness.pluginproc import DRIVER
from e2e.harness.pods import (
    cdi_spec,
    delete_pod,
    drain_namespace,
    pod,
    template,
    wait_running,
)

GPUS = 8
VFIO_CLASS = "vfio.gpu.drasil.dev"
BUS_ID = "resource.kubernetes.io/pciBusID"
# What the VM's launcher would look at: the VFIO nodes, the PCI address it is told,
# and the claim's device metadata; then it stays up.
COMMAND = (
    "ls -l /dev/vfio | sed 's/^/NODE:/'; env | grep '^PCI_RESOURCE_' | sed 's/^/ENV:/'; "
    "cat /var/run/kubernetes.io/dra-device-attributes/*/*/*/*-metadata.json "
    "| sed 's/^/META:/'; trap 'exit 0' TERM; sleep 3600 & wait"
)


@pytest.fixture(scope="module")
def passthrough(node: Node, kube: Kube, gpu_class: str) -> Iterator[Node]:
    """The node's plugin with --passthrough, and the chart's vfio DeviceClass."""
    (rendered,) = [
        o
        for o in render(namespace="drasil")
        if o["kind"] == "DeviceClass" and o["metadata"]["name"] == VFIO_CLASS
    ]
    node.restart_plugin_with({"PASSTHROUGH": "true"}, published=2 * GPUS)
    try:
        with device_classes(kube, {VFIO_CLASS: rendered["spec"]}):
            yield node
    finally:
        node.restart_plugin_with({"PASSTHROUGH": None}, published=GPUS)


@pytest.fixture
def vms(namespace: str, kube: Kube, passthrough: Node) -> Iterator[str]:
    yield namespace
    drain_namespace(kube, passthrough, namespace)


def _bus_ids(kube: Kube, node: Node) -> dict[str, str]:
    """Device name -> PCI address, as published."""
    slices = kube.resource(RESOURCE, "ResourceSlice").get(
        field_selector=f"spec.nodeName={node.name},spec.driver={DRIVER}"
    )
    return {
        d["name"]: d["attributes"][BUS_ID]["string"]
        for s in slices.items
        for d in s.to_dict()["spec"].get("devices") or []
        if BUS_ID in d["attributes"]
    }


def _claim_pod(kube: Kube, ns: str, node: Node, device_class: str, bus_id: str) -> str:
    selector = f'device.attributes["resource.kubernetes.io"].pciBusID == "{bus_id}"'
    requests = [
        {
            "name": "gpu",
            "exactly": {
                "deviceClassName": device_class,
                "selectors": [{"cel": {"expression": selector}}],
            },
        }
    ]
    return pod(kube, ns, node, template_name=template(kube, ns, requests=requests), command=COMMAND)


def _claim_of(kube: Kube, ns: str, pod_name: str) -> dict[str, Any]:
    for item in kube.resource(RESOURCE, "ResourceClaim").get(namespace=ns).items:
        claim = dict(item.to_dict())
        if pod_name in [o.get("name") for o in claim["metadata"].get("ownerReferences") or []]:
            return claim
    raise AssertionError(f"no claim of Pod {pod_name}")


def _stays_pending(kube: Kube, ns: str, pod_name: str) -> dict[str, Any]:
    def tried() -> Any:
        events = kube.core.list_namespaced_event(
            ns, field_selector=f"involvedObject.name={pod_name}"
        ).items
        return True if any(e.reason == "FailedScheduling" for e in events) else NotYet(events)

    wait_for(tried, timeout=60, what=f"Pod {pod_name} tried by the scheduler")
    claim = _claim_of(kube, ns, pod_name)
    assert not (claim.get("status") or {}).get("allocation"), claim["status"]
    return claim


def _explain(kubeconfig: Path, ns: str, claim: dict[str, Any]) -> str:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "drasil.driver.cli",
            "explain",
            f"--kubeconfig={kubeconfig}",
            f"--driver-name={DRIVER}",
            f"{ns}/{claim['metadata']['name']}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return done.stdout + done.stderr


def _log(kube: Kube, ns: str, name: str) -> list[str]:
    def printed() -> Any:
        log = kube.core.read_namespaced_pod_log(name, ns, container="c", _request_timeout=30)
        return log if "META:" in log else NotYet(log)

    text: str = wait_for(printed, timeout=60, what=f"the log of {ns}/{name}")
    return text.splitlines()


def _drivers(node: Node, bus_id: str) -> tuple[str, str]:
    """The drivers of the GPU's function and of its audio function, in the simulated
    PCI tree (what the kernel would say)."""
    root = node.plugin.state_dir / "simulated-pci-sysfs" / "bus" / "pci" / "devices"
    return tuple(  # type: ignore[return-value]
        (root / f / "driver").resolve().name for f in (bus_id, bus_id[:-1] + "1")
    )


def test_a_vm_claim_gets_the_vfio_nodes_and_the_gpu_is_no_gpu_meanwhile(
    kube: Kube, vms: str, passthrough: Node, kubeconfig: Path
) -> None:
    node = passthrough
    bus_ids = _bus_ids(kube, node)
    vfio = sorted(n for n in bus_ids if n.startswith("vfio-"))
    assert len(vfio) == GPUS
    bus_id = bus_ids[vfio[0]]
    (gpu,) = [n for n, b in bus_ids.items() if b == bus_id and n.startswith("gpu-")]

    vm = _claim_pod(kube, vms, node, VFIO_CLASS, bus_id)
    wait_running(kube, vms, vm)
    lines = _log(kube, vms, vm)
    nodes = [line for line in lines if line.startswith("NODE:")]
    assert any(" 10, 196 " in n and n.endswith(" vfio") for n in nodes), nodes
    assert any(" 511, " in n and n.startswith("NODE:c") for n in nodes), nodes
    assert f"ENV:PCI_RESOURCE_GPU_DRASIL_DEV_GPU={bus_id}" in lines, lines
    meta = [json.loads(line.removeprefix("META:")) for line in lines if line.startswith("META:")]
    attributes = meta[0]["requests"][0]["devices"][0]["attributes"]
    assert attributes[BUS_ID] == {"string": bus_id}, meta
    assert _drivers(node, bus_id) == ("vfio-pci", "vfio-pci")
    held = _claim_of(kube, vms, vm)
    spec = json.loads(cdi_spec(node, held["metadata"]["uid"]).read_text())
    assert not spec.get("containerEdits"), spec  # none of the driver's files

    # The same GPU as a GPU: its counter is taken, and explain says by whom.
    waiting = _claim_pod(kube, vms, node, DRIVER, bus_id)
    claim = _stays_pending(kube, vms, waiting)
    text = _explain(kubeconfig, vms, claim)
    assert "passed through to a virtual machine" in text, text
    assert held["metadata"]["name"] in text, text
    assert gpu in text, text

    delete_pod(kube, vms, vm)
    wait_running(kube, vms, waiting)  # the GPU is a GPU again
    assert _drivers(node, bus_id) == ("nvidia", "snd_hda_intel")


def test_a_gpu_in_a_containers_claim_is_not_passed_through(
    kube: Kube, vms: str, passthrough: Node, kubeconfig: Path
) -> None:
    node = passthrough
    bus_ids = _bus_ids(kube, node)
    bus_id = sorted(b for n, b in bus_ids.items() if n.startswith("vfio-"))[1]
    container = _claim_pod(kube, vms, node, DRIVER, bus_id)
    wait_running(kube, vms, container)
    holder = _claim_of(kube, vms, container)

    vm = _claim_pod(kube, vms, node, VFIO_CLASS, bus_id)
    claim = _stays_pending(kube, vms, vm)
    text = _explain(kubeconfig, vms, claim)
    assert "which is in use as a GPU" in text, text
    assert holder["metadata"]["name"] in text, text
    assert _drivers(node, bus_id) == ("nvidia", "snd_hda_intel")

    delete_pod(kube, vms, container)
    wait_running(kube, vms, vm)
    assert _drivers(node, bus_id) == ("vfio-pci", "vfio-pci")


def test_a_shared_gpu_is_not_passed_through_while_a_share_is_held(
    kube: Kube, vms: str, passthrough: Node
) -> None:
    """Shares of one GPU draw its passthrough counter once, together: a VM waits for the
    last share to go, and the scheduler (not only the plugin) keeps it waiting."""
    node = passthrough
    node.restart_plugin_with({"GPU_SHARING": "consumable"}, published=2 * GPUS)
    shared = f"shared-passthrough.{DRIVER}"
    try:
        selector = f'device.driver == "{DRIVER}" && device.allowMultipleAllocations'
        with device_classes(kube, {shared: {"selectors": [{"cel": {"expression": selector}}]}}):
            bus_ids = _bus_ids(kube, node)
            bus_id = sorted(b for n, b in bus_ids.items() if n.startswith("vfio-"))[2]
            where = f'device.attributes["resource.kubernetes.io"].pciBusID == "{bus_id}"'
            share = {
                "name": "gpu",
                "exactly": {
                    "deviceClassName": shared,
                    "selectors": [{"cel": {"expression": where}}],
                    "capacity": {"requests": {"memory": "10Gi"}},
                },
            }
            names = [
                pod(kube, vms, node, template_name=template(kube, vms, requests=[share]))
                for _ in range(2)
            ]
            for name in names:
                wait_running(kube, vms, name)
            vm = _claim_pod(kube, vms, node, VFIO_CLASS, bus_id)
            _stays_pending(kube, vms, vm)
            assert _drivers(node, bus_id) == ("nvidia", "snd_hda_intel")
            delete_pod(kube, vms, names[0])
            _stays_pending(kube, vms, vm)  # one share is left
            delete_pod(kube, vms, names[1])
            wait_running(kube, vms, vm)
            assert _drivers(node, bus_id) == ("vfio-pci", "vfio-pci")
            delete_pod(kube, vms, vm)
    finally:
        drain_namespace(kube, node, vms)
        node.restart_plugin_with({"GPU_SHARING": None}, published=2 * GPUS)
